"""Memo of chunk-hash runs: a repeated prefix costs a byte comparison, not SHA-256.

The keyed chain of :mod:`kvcached.contract.keys` is most of an in-process acquire
(about 50 µs of 75 µs for an 8k-token prompt here), and the prompts that hit
the cache are by definition prompts the daemon has hashed before. This memo
remembers *runs*: consecutive chunks hashed together, stored as

    (parent hash, tokens of the run's first chunk) -> Run(tokens of all its chunks, their hashes)

A walk looks up the run that starts at the current chunk, compares the
prompt's next bytes with the run's tokens in one ``startswith`` (a memcmp, no
copy), takes the hashes of the whole chunks that agree, and continues from
there. A conversation that grows by a turn reuses the old run and adds one
for the new chunks; a prompt that diverges inside a run takes the run's
hashes up to the divergence and starts a new run there.

Why it cannot change an answer: a run is only ever entered at a chunk whose
parent hash and exact token bytes it was keyed by, and only the chunks whose
token bytes compare equal are taken, so every hash it returns is the one the
chain would compute for the same parent and tokens. The parent hash covers
the namespace (trust domain + layout) and the whole prefix, so runs of one
namespace are never reached from another. Each :class:`~kvcached.store.Store`
(one trust domain) has its own memo, so a domain cannot learn from timing
what another domain hashed.

Memory is bounded by ``max_bytes`` (token bytes plus a per-run overhead
estimate) with two generations: new runs and runs that were just used go in
the young generation; when it holds half the budget the old generation is
dropped and the young one becomes old. A run used at least once per
half-budget of new runs therefore stays; a flood of one-off prompts only
costs the memo's own hit rate.

What it keeps: the token ids of recently hashed prompts, in the daemon's memory only (never
on disk; the index itself keeps only hashes). A deployment that must not hold prompt text in
memory beyond a request sets ``hash_memo_bytes = 0``.

Thread-safety: safe to share between threads without a lock. Values are a
pure function of their keys, so a race can lose an entry or count its bytes
twice (corrected at the next generation swap), never return a wrong hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvcached.contract.keys import ChunkHash

#: Bytes a run costs beyond its token bytes and the key's first-chunk bytes: the Run, the key
#: tuple, two bytes-object headers and the dict slot, plus per chunk a 16-byte hash object and
#: its tuple slot. Calibrated with tracemalloc (tests/test_hashmemo.py checks it).
_RUN_OVERHEAD = 280
_HASH_OVERHEAD = 57


@dataclass(frozen=True, slots=True)
class Run:
    tokens: bytes  # the token bytes of every chunk of the run, in order
    hashes: tuple[ChunkHash, ...]  # one per chunk


#: ``bytes``, under a name the class's ``bytes`` property does not hide from annotations.
Bytes = bytes


def _cost(key: tuple[ChunkHash, bytes], run: Run) -> int:
    return len(run.tokens) + len(key[1]) + _RUN_OVERHEAD + _HASH_OVERHEAD * len(run.hashes)


HashRange = Callable[[ChunkHash, bytes, int, int, int], list[ChunkHash]]
"""``(parent, tokens, start_chunk, end_chunk, step) -> hashes``: the real chain over a range."""


class HashMemo:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._young: dict[tuple[ChunkHash, bytes], Run] = {}
        self._old: dict[tuple[ChunkHash, bytes], Run] = {}
        self._young_bytes = 0
        self._old_bytes = 0
        self.hit_chunks = 0
        self.missed_chunks = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    @property
    def bytes(self) -> int:
        return self._young_bytes + self._old_bytes

    def chain(self, root: ChunkHash, tokens: Bytes, step: int, compute: HashRange) -> list[ChunkHash]:
        """Hashes of every full ``step``-byte chunk of ``tokens`` under ``root``.

        ``compute`` is the real chain; it is called once, for the chunks after
        the last one the memo could answer, and what it returns is remembered.
        """
        n = len(tokens) // step
        out: list[ChunkHash] = []
        prev, i = root, 0
        if self.max_bytes:
            while i < n:
                off = i * step
                run = self._find((prev, tokens[off:off + step]))
                if run is None:
                    break
                k = _common_chunks(tokens, off, n * step, run.tokens, step)
                out.extend(run.hashes[:k])
                prev, i = out[-1], i + k  # diverged inside the run? then another may start here
        self.hit_chunks += i
        if i < n:
            rest = compute(prev, tokens, i, n, step)
            self.missed_chunks += n - i
            if self.max_bytes:
                self._add((prev, tokens[i * step:i * step + step]), Run(tokens[i * step:n * step], tuple(rest)))
            out.extend(rest)
        return out

    def _find(self, key: tuple[ChunkHash, Bytes]) -> Run | None:
        run = self._young.get(key)
        if run is None:
            run = self._old.pop(key, None)
            if run is not None:  # used again: keep it through the next swap
                self._old_bytes -= _cost(key, run)
                self._add(key, run)
        return run

    def _add(self, key: tuple[ChunkHash, Bytes], run: Run) -> None:
        cost = _cost(key, run)
        if cost > self.max_bytes // 2:
            return  # a single run larger than a generation would evict everything for itself
        if self._young_bytes + cost > self.max_bytes // 2:
            self._old, self._young = self._young, {}
            self._old_bytes, self._young_bytes = self._young_bytes, 0
        old = self._young.get(key)
        self._young[key] = run
        self._young_bytes += cost - (_cost(key, old) if old is not None else 0)


def _common_chunks(tokens: bytes, off: int, end: int, run_tokens: bytes, step: int) -> int:
    """How many whole chunks of ``tokens[off:end]`` equal the start of ``run_tokens`` (≥ 1
    when the first chunk is known to match). Comparisons are memcmp on zero-copy views."""
    avail = min(end - off, len(run_tokens)) // step
    view = memoryview(tokens)
    if run_tokens.startswith(view[off:off + avail * step]):
        return avail
    lo, hi = 1, avail - 1  # lo chunks match; more than hi do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if run_tokens.startswith(view[off:off + mid * step]):
            lo = mid
        else:
            hi = mid - 1
    return lo

