"""Where prompts stop matching: the prompt-structure report behind ``kvcachectl doctor``.

For every lookup (``Lookup``, ``Acquire``, ``AcquireReserve``) that does not match all of a
prompt's whole chunks, the store tells :class:`PromptShape` the position of the first uncached
chunk. Per layout it keeps the distribution of that position, in buckets ``0``, ``1``, ``2-3``,
``4-7``, ``8-15``, ``16-31`` and ``32+`` (chunk indices).

A miss at chunk 0 alone does not say why. Prompts that are simply new (every user asks
something else) miss there, and so do prompts built from a template with a variable near the
start: ``"rewrite in ${tone} tone: ${text}"``, or a system prompt that opens with today's date.
Their first tokens, or the text after the variable, are the same in every prompt, but the
variable sits inside the first chunk, so no chunk hash is ever the same twice (hashes are
chained: a chunk's hash covers everything before it). To tell these apart, each observation
takes two probes, each the first :data:`LEAD_TOKENS` tokens of a chunk, and asks a small
sketch whether that probe was seen before at that position *ending a different chunk hash*:

- the *lead* probe, at the start of the diverging chunk: did another prompt begin this chunk
  the same way and then go elsewhere? (a template's head, or chance: many questions begin
  "What's the");
- the *after* probe, at the start of the next chunk: does the text after the divergence
  recur in other prompts behind a different chunk? (a variable inside an otherwise fixed
  prefix: the strong sign, chance rarely repeats a whole chunk boundary's tokens).

Each diverging lookup is then counted once, by the strongest thing found:

- ``shared_after``: the after probe was seen before behind another chunk;
- ``shared_lead``: the lead probe was seen before, ending another chunk;
- ``new``: neither (or their slots were overwritten since): a new prompt;
- ``repeat``: the lead probe was seen ending this very chunk: the same prompt looked up again
  without being stored in between (a Lookup before the Acquire of one request, a no-store
  request, a retry). Repeats are no evidence either way; :func:`judge` leaves them out.

The sketch is two direct-mapped tables per layout, one per probe, of :data:`SLOTS` slots, each
holding a 64-bit key of a probe (XXH3 of its tokens, seeded by its chunk position) and a 64-bit
fingerprint of the chunk hash it ended (16 bytes a slot, 128 KiB a layout, at most
:data:`MAX_LAYOUTS` layouts). A slot taken by another probe is simply overwritten, so the sketch
remembers roughly the last few thousand divergence points; an overwrite can only make a lookup
look newer, never invent a shared one. It keeps no token ids, only those hashes of four
of them, in memory only.

Counts are halved once a layout has seen :data:`HALVE_EVERY` observations since the last
halving, so the distribution follows the recent workload rather than the daemon's whole life.

Cost on the lookup path: a counter for a lookup that matched; two 16-byte slices, four hashes
and a few array reads and writes for one that did not (about a microsecond here, see the
README). Thread-safety: none of its own; the store calls it under its lock.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Mapping, Sequence

from xxhash import xxh3_64_intdigest

from kvcached.contract.keys import ChunkHash, LayoutId

#: Tokens at the start of a chunk that make a probe (half a chunk for chunks of fewer than 8).
LEAD_TOKENS = 4
#: Sketch slots per layout (a power of two).
SLOTS = 4096
#: Layouts tracked; lookups of further layouts are not observed.
MAX_LAYOUTS = 64
#: Observations of a layout after which its counts are halved.
HALVE_EVERY = 1 << 20
#: Bucket labels by index; a chunk position p falls in bucket min(p.bit_length(), 6).
BUCKETS = ("0", "1", "2-3", "4-7", "8-15", "16-31", "32+")
_BUCKET_OF = tuple(min(p.bit_length(), len(BUCKETS) - 1) for p in range(32))  # a table: min() costs more
KINDS = ("new", "shared_lead", "shared_after", "repeat")
_NEW, _SHARED_LEAD, _SHARED_AFTER, _REPEAT = range(4)  # indices into KINDS
_UNSEEN, _SAME_CHUNK, _OTHER_CHUNK = range(3)  # what a probe found
_U64 = (1 << 64) - 1

#: judge(): fewer distinct diverging lookups than this in every layout is "not enough yet".
MIN_DIVERGED = 200
#: judge(): warn when this share of a layout's distinct diverging lookups diverged at chunk 0-1
#: with the text after the divergence seen behind other chunks (the strong sign)...
WARN_AFTER_SHARE = 0.25
#: ...or this share with either probe seen (the lead alone is weaker: 33-41 % of the
#: fow-cache questions, all different, begin as an earlier one did in their first 4 tokens).
WARN_SHARED_SHARE = 0.5


@dataclass(frozen=True)
class LayoutShapeStats:
    """One layout's distribution, as the Stats RPC reports it (``prompt_shape[layout id]``)."""

    model: str
    chunk_tokens: int
    lead_tokens: int
    whole: int  # lookups that matched every whole chunk of the prompt
    short: int  # lookups of prompts shorter than one chunk (never cacheable)
    #: bucket label -> {kind: count} for KINDS: where the first uncached chunk was, and what was seen.
    first_uncached_chunk: dict[str, dict[str, int]]


class _Layout:
    """One layout's counts and sketch."""

    __slots__ = ("chunk_tokens", "probe_bytes", "counts", "whole", "short", "seen", "lead", "after")

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        # A probe as long as the chunk would only ever see chunks that are cached anyway.
        self.probe_bytes = 4 * min(LEAD_TOKENS, max(1, chunk_tokens // 2))
        self.counts = [[0] * len(KINDS) for _ in BUCKETS]
        self.whole = 0
        self.short = 0
        self.seen = 0  # observations since the last halving
        self.lead = (array("Q", bytes(8 * SLOTS)), array("Q", bytes(8 * SLOTS)))  # (keys, fingerprints)
        self.after = (array("Q", bytes(8 * SLOTS)), array("Q", bytes(8 * SLOTS)))

    @staticmethod
    def probe(table: tuple[array, array], key: int, fingerprint: int) -> int:
        """Look ``key`` up in ``table``, then remember it as ending ``fingerprint``: _UNSEEN,
        _SAME_CHUNK (there, ending this chunk) or _OTHER_CHUNK (there, ending another one)."""
        slot = key & (SLOTS - 1)
        keys, chunks = table
        if keys[slot] != key:
            keys[slot] = key
            chunks[slot] = fingerprint
            return _UNSEEN
        if chunks[slot] == fingerprint:
            return _SAME_CHUNK
        chunks[slot] = fingerprint
        return _OTHER_CHUNK

    def halve(self) -> None:
        for row in self.counts:
            for k in range(len(row)):
                row[k] //= 2
        self.whole //= 2
        self.short //= 2
        self.seen = 0


class PromptShape:
    """Per layout: where lookups stop matching, and whether the text around that point recurs."""

    def __init__(self) -> None:
        self._layouts: dict[LayoutId, _Layout] = {}

    def observe(self, layout_id: LayoutId, chunk_tokens: int, raw: bytes, hashes: Sequence[ChunkHash],
                matched: int) -> None:
        """Record one lookup: ``raw`` the prompt's tokens (uint32 little-endian), ``hashes`` its
        whole chunks' hashes, ``matched`` how many of them were cached."""
        shape = self._layouts.get(layout_id)
        if shape is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                return
            shape = self._layouts[layout_id] = _Layout(chunk_tokens)
        shape.seen += 1
        if shape.seen >= HALVE_EVERY:
            shape.halve()
        if not hashes:
            shape.short += 1
            return
        if matched >= len(hashes):
            shape.whole += 1
            return
        step = chunk_tokens * 4
        start = matched * step
        probe = shape.probe_bytes
        lead = shape.probe(shape.lead, xxh3_64_intdigest(raw[start: start + probe], matched),
                           hash(hashes[matched]) & _U64)
        if lead == _SAME_CHUNK:
            kind = _REPEAT
        else:
            kind = _SHARED_LEAD if lead == _OTHER_CHUNK else _NEW
            if matched + 1 < len(hashes):
                start += step
                after = shape.probe(shape.after, xxh3_64_intdigest(raw[start: start + probe], matched),
                                    hash(hashes[matched + 1]) & _U64)
                if after == _OTHER_CHUNK:
                    kind = _SHARED_AFTER
        shape.counts[_BUCKET_OF[matched] if matched < 32 else -1][kind] += 1

    def snapshot(self, models: Mapping[LayoutId, str]) -> dict[str, LayoutShapeStats]:
        """Every tracked layout's counts; ``models`` names each layout's model."""
        return {
            lid: LayoutShapeStats(
                models.get(lid, ""), s.chunk_tokens, s.probe_bytes // 4, s.whole, s.short,
                {label: dict(zip(KINDS, row)) for label, row in zip(BUCKETS, s.counts)},
            )
            for lid, s in self._layouts.items()
        }


# -- the doctor's verdict ------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeVerdict:
    verdict: str  # "ok" or "warn"
    detail: str


@dataclass(frozen=True)
class _Summary:
    layout_id: str
    model: str
    chunk_tokens: int
    distinct: int  # diverging lookups that were not repeats
    early: dict[str, int]  # kind -> of them at chunk 0-1
    busiest: str  # the bucket most of them fell in

    def share(self, *kinds: str) -> float:
        return sum(self.early.get(k, 0) for k in kinds) / self.distinct if self.distinct else 0.0


def _summarise(layout_id: str, s: Mapping) -> _Summary:
    buckets = s.get("first_uncached_chunk") or {}
    distinct = {b: sum(n for k, n in c.items() if k != "repeat") for b, c in buckets.items()}
    early = {k: sum((buckets.get(b) or {}).get(k, 0) for b in ("0", "1")) for k in KINDS}
    busiest = max(distinct, key=lambda b: distinct[b], default="0")
    return _Summary(layout_id, s.get("model", ""), s.get("chunk_tokens", 0), sum(distinct.values()), early, busiest)


def _templated(x: _Summary, after_share: float, shared_share: float) -> bool:
    return x.share("shared_after") >= after_share or x.share("shared_after", "shared_lead") >= shared_share


def judge(prompt_shape: Mapping[str, Mapping] | None, *, min_diverged: int = MIN_DIVERGED,
          after_share: float = WARN_AFTER_SHARE, shared_share: float = WARN_SHARED_SHARE) -> ShapeVerdict:
    """The doctor's verdict on a Stats ``prompt_shape`` (a dict per layout id, as JSON carries it).

    Judges the layouts with at least ``min_diverged`` distinct diverging lookups. Warns when in
    one of them, of those lookups, at least ``after_share`` diverged at chunk 0 or 1 with the
    text after the divergence recurring behind other chunks, or at least ``shared_share`` with
    either probe seen before: the template case. Prompts that diverge early with nothing seen
    before (new prompts) and prompts that diverge later (after a shared system prompt) pass."""
    summaries = [_summarise(lid, s) for lid, s in (prompt_shape or {}).items()]
    judged = [x for x in summaries if x.distinct >= min_diverged]
    if not judged:
        most = max((x.distinct for x in summaries), default=0)
        return ShapeVerdict("ok", f"not enough lookups yet: {most} diverging lookups in the busiest layout, "
                                  f"{min_diverged} needed to say where prompts stop matching")
    flagged = [x for x in judged if _templated(x, after_share, shared_share)]
    worst = max(flagged or judged, key=lambda x: x.share("shared_after", "shared_lead"))
    name = f"{worst.model or worst.layout_id} ({worst.chunk_tokens}-token chunks)"
    after, lead = worst.share("shared_after"), worst.share("shared_lead")
    seen = f"{after:.0%} go on with text other prompts have after a different chunk, {lead:.0%} begin it as others did"
    if flagged:
        return ShapeVerdict("warn", f"prompts diverge at chunk 0–1: of {worst.distinct} diverging lookups of {name}, "
                            f"{seen}: a template variable near the start defeats prefix reuse; move variables to "
                            "the end of the prompt (and keep the shared head whole chunks long)")
    new = worst.share("new")
    why = (f"{new:.0%} diverge at chunk 0–1 with nothing seen before (new prompts, not a template)"
           if new >= 0.5 else f"most diverge at chunk {worst.busiest}")
    return ShapeVerdict("ok", f"{worst.distinct} diverging lookups of {name}: {why}; at chunk 0–1 {seen}")
