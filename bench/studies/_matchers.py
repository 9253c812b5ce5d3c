"""The pieces of ``bench/studies/matchers.py``: its workload, the exact reference it is scored against,
the four kinds of matcher it compares, and the scoring. Not a benchmark itself (see
``matchers.py`` for the question and the method); imported by it and by
``tests/bench/test_matchers.py``.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from datasketch import MinHash, MinHashLSH
from rbloom import Bloom
from bench.trace_replay import BLOCK, Request  # the trace's 512-token blocks and its request record

from kvcached.index import PrefixIndex, make_policy
from kvcached.contract.keys import ChunkHash, ChunkHasher, KVLayout, Namespace, normalize_tokens
from kvcached.contract.locations import TierId

CHUNK_TOKENS = 128  # the daemon's default chunk
VOCAB = 128_256  # Llama-3's vocabulary
TRACE_SEEDS = {"conversation": 1, "synthetic": 2}
LAYOUT = KVLayout("meta-llama/Llama-3-8B@bench", num_layers=32, num_kv_heads=8, head_dim=128,
                  dtype="bfloat16", chunk_tokens=CHUNK_TOKENS)
HASH_KEY = bytes(range(32))
SHINGLE = 3
NUM_PERM = 128
LSH_THRESHOLD = 0.9  # datasketch's default

_U64 = np.uint64


# -- tokens ---------------------------------------------------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def block_tokens(seed: int, hash_ids: Sequence[int]) -> np.ndarray:
    """The fixed pseudo-random tokens of each block id: shape (len(hash_ids), 512), uint32."""
    ids = np.asarray(hash_ids, dtype=np.uint64)[:, None]
    x = (_U64(seed) << _U64(40)) ^ (ids << _U64(9)) ^ np.arange(BLOCK, dtype=np.uint64)[None, :]
    return (_splitmix64(x) % _U64(VOCAB)).astype(np.uint32)


def prompt_tokens(seed: int, req: Request) -> np.ndarray:
    return block_tokens(seed, req.ids).ravel()[: req.input_length]


def load_trace(trace_dir: str, name: str, limit: int) -> list[Request]:
    out: list[Request] = []
    with open(os.path.join(trace_dir, f"{name}_trace.jsonl")) as f:
        for line in f:
            if line.strip():
                out.append(Request(json.loads(line)))
                if len(out) >= limit:
                    break
    return out


# -- the truth ------------------------------------------------------------------------------------


class ContentIndex:
    """The exact reference: which chunks are cached, by their token contents.

    Chunk i of a prompt is cached when some stored prompt had the same tokens in chunks 0..i.
    Each distinct chunk gets an id; ``_ids`` maps (parent id, the chunk's token bytes) to it, and
    a dict compares keys byte for byte, so unlike any hash of the tokens it cannot be fooled.
    """

    ROOT = -1

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.chunk_tokens = chunk_tokens
        self._ids: dict[tuple[int, bytes], int] = {}
        self.parents: list[int] = []

    def __len__(self) -> int:
        return len(self.parents)

    def _chunks(self, tokens: np.ndarray) -> Iterable[bytes]:
        raw = np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()
        step = self.chunk_tokens * 4
        return (raw[o : o + step] for o in range(0, len(raw) // step * step, step))

    def add(self, tokens: np.ndarray) -> tuple[list[int], int]:
        """Store the prompt's full chunks; returns their ids and how many were already stored."""
        ids: list[int] = []
        known = 0
        parent = self.ROOT
        for chunk in self._chunks(tokens):
            key = (parent, chunk)
            cid = self._ids.get(key)
            if cid is None:
                cid = len(self.parents)
                self._ids[key] = cid
                self.parents.append(parent)
            elif len(ids) == known:
                known += 1
            ids.append(cid)
            parent = cid
        return ids, known

    def cached_prefix(self, tokens: np.ndarray) -> int:
        n = 0
        parent = self.ROOT
        for chunk in self._chunks(tokens):
            cid = self._ids.get((parent, chunk))
            if cid is None:
                break
            n += 1
            parent = cid
        return n


# -- contenders -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredPrompt:
    """One cached prompt, as every contender's build sees it."""

    tokens: np.ndarray
    hashes: list[ChunkHash]  # every full chunk's chained hash
    ids: list[int]  # every full chunk's id in the ContentIndex
    known: int  # leading chunks that an earlier prompt had already stored


class ChainHashes:
    """The daemon's chunk hashes: ``ChunkHasher.chain`` over ``normalize_tokens``, as ``Store.hashes``."""

    def __init__(self, layout: KVLayout = LAYOUT, key: bytes = HASH_KEY, domain: str = "bench") -> None:
        self.hasher = ChunkHasher(key)
        self.root = self.hasher.root(Namespace(domain, layout))
        self.chunk_tokens = layout.chunk_tokens

    def __call__(self, tokens: np.ndarray) -> list[ChunkHash]:
        return self.hasher.chain(self.root, normalize_tokens(tokens), self.chunk_tokens)


def store_prompts(prompts: Iterable[np.ndarray], ref: ContentIndex, hashes: ChainHashes) -> list[StoredPrompt]:
    """Cache ``prompts`` in order in the reference; what each contender's build is given."""
    out = []
    for toks in prompts:
        ids, known = ref.add(toks)
        out.append(StoredPrompt(toks, hashes(toks), ids, known))
    return out


def _walk(hashes: Sequence[ChunkHash], present: Callable[[ChunkHash], bool]) -> int:
    n = 0
    for h in hashes:
        if not present(h):
            break
        n += 1
    return n


class TrieMatcher:
    name = "kvcached trie"

    def __init__(self, hashes: ChainHashes) -> None:
        self.prepare = hashes
        self.index = PrefixIndex(make_policy("frequency"))  # the store's default policy (its sketch is fixed cost)

    def build(self, prompts: Iterable[StoredPrompt]) -> None:
        now = 0.0
        step = LAYOUT.chunk_bytes
        for p in prompts:
            parent = self.index.get(p.hashes[p.known - 1]) if p.known else None
            new = p.hashes[p.known :]
            if new:
                now += 1.0
                offsets = [(len(self.index) + i) * step for i in range(len(new))]
                self.index.insert_chain(new, parent, LAYOUT.layout_id, TierId.POOL, now, offsets)

    def probe(self, hashes: list[ChunkHash]) -> int:
        return len(self.index.match(hashes))

    def chunks(self) -> int:
        return len(self.index)


class SetMatcher:
    name = "chained-hash set"

    def __init__(self, hashes: ChainHashes) -> None:
        self.prepare = hashes
        self.keys: set[ChunkHash] = set()

    def build(self, prompts: Iterable[StoredPrompt]) -> None:
        for p in prompts:
            self.keys.update(p.hashes[p.known :])

    def probe(self, hashes: list[ChunkHash]) -> int:
        return _walk(hashes, self.keys.__contains__)

    def chunks(self) -> int:
        return len(self.keys)


class BloomMatcher:
    """Sized for ``expected`` chunks at ``rate``: what an operator would size it for is the cache's
    capacity; here the cache holds exactly that many."""

    def __init__(self, hashes: ChainHashes, expected: int, rate: float) -> None:
        self.name = f"Bloom {rate * 100:g} %"
        self.rate = rate
        self.prepare = hashes
        self.bloom = Bloom(max(1, expected), rate)
        self.added = 0

    def build(self, prompts: Iterable[StoredPrompt]) -> None:
        for p in prompts:
            new = p.hashes[p.known :]
            self.bloom.update(new)
            self.added += len(new)

    def probe(self, hashes: list[ChunkHash]) -> int:
        return _walk(hashes, self.bloom.__contains__)

    def chunks(self) -> int:
        return self.added

    def bytes_per_chunk(self) -> float:
        return self.bloom.size_in_bits / 8 / max(1, self.added)


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser (datasketch applies it before its affine permutations)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def shingle_hashes(chunks: np.ndarray, k: int = SHINGLE) -> np.ndarray:
    """32-bit hash of every k-token shingle inside each chunk: (n_chunks, chunk_tokens - k + 1).

    The k token ids (each < 2**21) are packed into one 63-bit integer, so distinct shingles only
    share a hash by a 32-bit collision, then mixed down to 32 bits."""
    t = chunks.astype(np.uint64)
    width = t.shape[1] - k + 1
    packed = np.zeros((t.shape[0], width), dtype=np.uint64)
    for i in range(k):
        packed |= t[:, i : i + width] << _U64(21 * i)
    return (_splitmix64(packed) >> _U64(32)).astype(np.uint32)


class ChunkSketcher:
    """datasketch MinHash values (scheme ``affine32``) of each chunk's shingles, vectorised."""

    def __init__(self, num_perm: int = NUM_PERM, seed: int = 1, chunk_tokens: int = CHUNK_TOKENS) -> None:
        proto = MinHash(num_perm=num_perm, seed=seed, scheme="affine32")
        self.a, self.b = (np.asarray(x, dtype=np.uint32) for x in proto.permutations)
        self._a, self._b = self.a[:, None, None], self.b[:, None, None]
        self.permutations = proto.permutations
        self.chunk_tokens = chunk_tokens

    def sketch(self, tokens: np.ndarray, start: int, end: int) -> np.ndarray:
        """MinHash values of full chunks ``start``..``end - 1``: shape (n, num_perm), uint32."""
        c = self.chunk_tokens
        out = np.empty((end - start, len(self.a)), dtype=np.uint32)
        for lo in range(start, end, 32):  # temporaries of 32 chunks x permutations x shingles: ~2 MB
            hi = min(end, lo + 32)
            hv = fmix32(shingle_hashes(np.asarray(tokens[lo * c : hi * c], dtype=np.uint32).reshape(hi - lo, c)))
            permuted = hv[None, :, :] * self._a
            permuted += self._b
            out[lo - start : hi - start] = permuted.min(axis=2).T  # min over the contiguous axis: faster
        return out

    def minhash(self, values: np.ndarray) -> MinHash:
        return MinHash(hashvalues=values, permutations=self.permutations, scheme="affine32")


class MinHashMatcher:
    """A trie whose edges match by similarity: chunk i matches when the LSH returns a cached
    chunk, similar by its shingles, whose parent matched chunk i - 1."""

    name = "MinHash-LSH"

    def __init__(self, sketcher: ChunkSketcher, threshold: float = LSH_THRESHOLD) -> None:
        self.sketcher = sketcher
        self.lsh = MinHashLSH(threshold=threshold, num_perm=len(sketcher.a))
        self.parents = array("q")  # chunk id -> parent id (-1: a first chunk)
        self.threshold = threshold

    def build(self, prompts: Iterable[StoredPrompt]) -> None:
        for p in prompts:
            n = len(p.ids)
            if p.known == n:
                continue
            values = self.sketcher.sketch(p.tokens, p.known, n)
            for row, i in zip(values, range(p.known, n)):
                cid = p.ids[i]
                assert cid == len(self.parents), "chunks arrive in id order"
                self.parents.append(p.ids[i - 1] if i else ContentIndex.ROOT)
                self.lsh.insert(cid, self.sketcher.minhash(row), check_duplication=False)

    def prepare(self, tokens: np.ndarray) -> np.ndarray:
        """The sketch of every full chunk (as the hash contenders hash every full chunk)."""
        return self.sketcher.sketch(tokens, 0, len(tokens) // self.sketcher.chunk_tokens)

    def probe(self, sketches: np.ndarray) -> int:
        frontier = {ContentIndex.ROOT}
        matched = 0
        for row in sketches:
            found = {k for k in self.lsh.query(self.sketcher.minhash(row)) if self.parents[k] in frontier}
            if not found:
                break
            frontier = found
            matched += 1
        return matched

    def chunks(self) -> int:
        return len(self.parents)


# -- lookups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lookup:
    kind: str  # "conversation", "synthetic" (trace requests) or a variant's kind
    tokens: np.ndarray
    truth: int  # chunks truly cached (ContentIndex)
    detail: float = -1.0  # one_token_edit: where the edit falls, as a fraction of the full chunks


@dataclass(frozen=True)
class Variant:
    kind: str  # "one_token_edit", "reordered" or "new_suffix"
    tokens: np.ndarray
    source: int  # index of the cached prompt it was made from
    position: int  # token where it first differs from the source: the edit, the first swapped section, the suffix


def make_variants(cached: Sequence[np.ndarray], count: int, rng: np.random.Generator,
                  chunk_tokens: int = CHUNK_TOKENS, section_tokens: int = BLOCK) -> list[Variant]:
    """``count`` edited copies of each kind, of cached prompts drawn uniformly: one token changed
    at a uniform position of the full chunks; two sections (``section_tokens``: the trace's
    blocks) swapped; 1-4 chunks of new tokens appended."""
    out: list[Variant] = []
    with_chunk = [i for i, t in enumerate(cached) if len(t) >= chunk_tokens]
    with_sections = [i for i, t in enumerate(cached) if len(t) // section_tokens >= 2]
    for _ in range(count):
        src = with_chunk[int(rng.integers(len(with_chunk)))]
        toks = cached[src]
        pos = int(rng.integers(len(toks) // chunk_tokens * chunk_tokens))
        edited = toks.copy()
        edited[pos] = (int(edited[pos]) + 1 + int(rng.integers(VOCAB - 1))) % VOCAB  # any other token
        out.append(Variant("one_token_edit", edited, src, pos))
    for _ in range(count):
        src = with_sections[int(rng.integers(len(with_sections)))]
        toks, n = cached[src], section_tokens
        i, j = sorted(int(x) for x in rng.choice(len(cached[src]) // n, size=2, replace=False))
        swapped = toks.copy()
        swapped[i * n : (i + 1) * n] = toks[j * n : (j + 1) * n]
        swapped[j * n : (j + 1) * n] = toks[i * n : (i + 1) * n]
        out.append(Variant("reordered", swapped, src, i * n))
    for _ in range(count):
        src = with_chunk[int(rng.integers(len(with_chunk)))]
        suffix = rng.integers(VOCAB, size=int(rng.integers(1, 5)) * chunk_tokens, dtype=np.uint32)
        out.append(Variant("new_suffix", np.concatenate([cached[src], suffix]), src, len(cached[src])))
    return out


@dataclass(frozen=True)
class Workload:
    stored: list[StoredPrompt]
    lookups: list[Lookup]
    reference: ContentIndex
    shape: dict


def build_workload(trace_dir: str, warm: dict[str, int], lookups: dict[str, int], variants: int, seed: int,
                   hashes: ChainHashes) -> Workload:
    """Cache the first ``warm[name]`` requests of each trace; look up the next ``lookups[name]``
    and ``variants`` edited copies of cached prompts per kind, each with its true cached prefix."""
    ref = ContentIndex(CHUNK_TOKENS)
    cached: list[np.ndarray] = []
    pending: list[tuple[str, np.ndarray]] = []
    for name, w in warm.items():
        seed_of_trace = TRACE_SEEDS[name]
        reqs = load_trace(trace_dir, name, w + lookups.get(name, 0))
        cached += [prompt_tokens(seed_of_trace, r) for r in reqs[:w]]
        pending += [(name, prompt_tokens(seed_of_trace, r)) for r in reqs[w:]]
    stored = store_prompts(cached, ref, hashes)
    out = [Lookup(k, t, ref.cached_prefix(t)) for k, t in pending]
    for v in make_variants(cached, variants, np.random.default_rng(seed)):
        full = len(cached[v.source]) // CHUNK_TOKENS * CHUNK_TOKENS
        out.append(Lookup(v.kind, v.tokens, ref.cached_prefix(v.tokens),
                          v.position / full if v.kind == "one_token_edit" else -1.0))
    kinds = list(dict.fromkeys(x.kind for x in out))
    shape = {
        "chunk_tokens": CHUNK_TOKENS, "vocab": VOCAB, "cached_prompts": dict(warm),
        "cached_chunks": len(ref), "trace_lookups": dict(lookups), "variants_per_kind": variants,
        "lookups_by_kind": {k: sum(1 for x in out if x.kind == k) for k in kinds},
        "true_chunks_by_kind": {k: sum(x.truth for x in out if x.kind == k) for k in kinds},
    }
    return Workload(stored, out, ref, shape)


# -- scoring ------------------------------------------------------------------------------------


def score(claims: Sequence[int], truths: Sequence[int]) -> dict:
    """Precision and recall of claimed cached prefixes (chunks) against the true ones."""
    if len(claims) != len(truths):
        raise ValueError("one claim per lookup")
    n = len(claims)
    hit = sum(min(c, t) for c, t in zip(claims, truths))
    claimed, true = sum(claims), sum(truths)
    return {
        "lookups": n,
        "exact": sum(c == t for c, t in zip(claims, truths)) / n if n else float("nan"),
        "safe": sum(c <= t for c, t in zip(claims, truths)) / n if n else float("nan"),
        "chunk_precision": hit / claimed if claimed else 1.0,
        "recall": hit / true if true else 1.0,
        "claimed_chunks": claimed,
        "true_chunks": true,
        "over_claimed_chunks": sum(max(0, c - t) for c, t in zip(claims, truths)),
        "over_claimed_lookups": sum(c > t for c, t in zip(claims, truths)),
        "under_claimed_lookups": sum(c < t for c, t in zip(claims, truths)),
    }


def score_by_kind(lookups: Sequence[Lookup], claims: Sequence[int]) -> dict:
    out = {"all": score(claims, [x.truth for x in lookups])}
    for kind in dict.fromkeys(x.kind for x in lookups):
        idx = [i for i, x in enumerate(lookups) if x.kind == kind]
        out[kind] = score([claims[i] for i in idx], [lookups[i].truth for i in idx])
    return out


