"""Question: how many pool bytes actually hold KV, for real model geometries, with the packed
pool the daemon ships (``kvcached.tiers.extents.ExtentAllocator``, 64-byte grain, best fit with
coalescing, LRU eviction then the cheapest contiguous window) versus the old design (one chunk
per fixed 16 MiB block) and other packed designs (fixed pages, per-layout size-class segments),
side by side in one run?

Geometries: 128-token bf16 chunks of ``2 x layers x kv_heads x 128 x head_dim x 2`` bytes, each
computed from ``kvcached.contract.keys.KVLayout(...).chunk_bytes``: Llama-3-8B (16 MiB), Llama-3-70B TP1
(40 MiB), Llama-3-70B TP8 (5 MiB), Qwen2.5-0.5B (1.5 MiB), Qwen2.5-7B (7 MiB), Mistral-7B
(16 MiB) and a 4 KiB test layout.

Contenders, each replaying the same operations on a pool of the same capacity (1 GiB;
``--quick``: 256 MiB):

* ``fixed-16MiB``   the old design: the pool is 16 MiB blocks, a chunk takes one whole block;
                    a chunk over 16 MiB is refused (it can never be stored, usable 0).
* ``pages-64KiB``, ``pages-256KiB``, ``pages-2MiB``   a chunk takes a contiguous run of fixed
                    pages: the real ``ExtentAllocator(capacity, grain=page)``, so the same best
                    fit, coalescing and window rule, only a coarser grain.
* ``size-classes``  per-layout regions: the pool is 64 MiB segments; a free segment is given
                    to one layout when that layout first needs room and holds
                    ``floor(64 MiB / chunk)`` chunks of it (a chunk over 64 MiB would take
                    ``ceil(chunk / 64 MiB)`` consecutive whole segments; none of the geometries
                    here is that big); a segment whose last chunk leaves is free again, for any
                    layout. Its "window" (the fragmented case below) is the cheaper of: evicting
                    the least recently used chunk of the same layout (frees a slot of exactly
                    the right size), or emptying the run of segments that holds the fewest
                    live bytes.
* ``extents-64B``   what the daemon ships: ``ExtentAllocator(capacity, grain=64)``.

Eviction, the same rule for all, mirroring ``kvcached.movement.Mover.pool_room``: if the chunk
does not fit, evict least recently used chunks until ``free_bytes >= nbytes``; if it still does
not fit (free bytes are there but no free run is long enough: a fragmented pool), evict the
cheapest contiguous window (``ExtentAllocator.window``, as ``PackedPool.victims_for`` calls it;
the size-class analogue above); if nothing fits even then, the insert is refused. For fixed
blocks the LRU step ends as soon as one block is free, so they never need a window. Nothing is
pinned in this simulation, so every chunk is evictable.

Scenario A, one layout at a time: an empty pool is filled with chunks of that layout until the
next one does not fit. Metric: payload bytes / pool bytes. Target: >= 95 % for every geometry
for ``extents-64B`` (at the 1 GiB default; ``--quick``'s 256 MiB pool holds only six 40 MiB
chunks, 93.75 %).

Scenario B, mixed churn (``--seed``): N inserts (20,000; ``--quick``: 2,000) of chunks of the
7 layouts drawn with fixed weights (small layouts frequent, big ones occasional, see
``CHURN_WEIGHTS``). Before each insert, with probability 0.5, a recently inserted chunk is
re-touched (moved to the most recently used end if it is still in that contender's pool), so
the LRU order differs from insertion order: the target is drawn uniformly from the last W
inserts, W = the inserts that fill the pool once on average. The draws are made once, up
front, so every contender replays the very same operations. After every insert past the
warm-up (the first 20 %), payload / pool is sampled; reported: median, min, mean, and p5;
window evictions; bytes evicted per byte inserted (total, and by the window rule alone: the
window rule's cost in bytes evicted out of LRU order), and the re-touch hit rate (how often a
re-touched chunk was still cached: a cache-effectiveness proxy). Over a long run, total bytes
evicted approaches bytes inserted for every contender (what goes in must come out); the
contenders differ in how much of the pool holds KV meanwhile and in what is evicted early.
Target: >= 90 % of the pool holding KV after warm-up for ``extents-64B`` (median and min are
both checked and printed).

Reference rows (churn only, not designs on offer): ``ref:extents-64B-lru-only`` (the shipped
allocator without the window rule: evict in LRU order until a run fits), ``ref:extents-64B-
window-oldest-25%`` (the window rule restricted, through its ``evictable`` predicate, to the
least recently used quarter of the chunks, falling back to any chunk), and
``ref:ideal-bytes-only`` (no placement at all: LRU until the bytes fit; the bound).

Also measured: the cost of one ``ExtentAllocator.window`` call against the number of
allocations in the pool (it sorts every allocation and gap on each call).

Run:   .venv/bin/python bench/studies/pool_packing.py          (~5-10 s on a 2-core box)
       .venv/bin/python bench/studies/pool_packing.py --quick  (a few seconds; writes *.quick.json / *.quick.png)
Output: bench/results/pool_packing.json, bench/results/pool_packing.png
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench._common import bench_parser, finish, format_table, percentile, ratio, save_figure, subplots

from kvcached.contract.keys import KVLayout
from kvcached.tiers.extents import ExtentAllocator

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

BLOCK = 16 * MiB  # the old pool's fixed block
SEGMENT = 64 * MiB  # the size-class design's region
SHIPPED = "extents-64B"
LRU_ONLY = "ref:extents-64B-lru-only"
IDEAL = "ref:ideal-bytes-only"
OLDEST_WINDOW = "ref:extents-64B-window-oldest-25%"
BASELINE = "fixed-16MiB"
TARGET_A = 0.95
TARGET_B = 0.90
WARMUP_FRACTION = 0.2
RETOUCH_P = 0.5
SERIES_POINTS = 250  # utilisation samples kept per contender in the JSON / plot

#: (name, layout); chunk bytes come from KVLayout.chunk_bytes (128-token bf16 chunks).
GEOMETRIES: list[tuple[str, KVLayout]] = [
    ("Llama-3-8B", KVLayout("meta-llama/Meta-Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128)),
    ("Llama-3-70B-TP1", KVLayout("meta-llama/Meta-Llama-3-70B", num_layers=80, num_kv_heads=8, head_dim=128)),
    ("Llama-3-70B-TP8", KVLayout("meta-llama/Meta-Llama-3-70B", num_layers=80, num_kv_heads=1, head_dim=128)),
    ("Qwen2.5-0.5B", KVLayout("Qwen/Qwen2.5-0.5B", num_layers=24, num_kv_heads=2, head_dim=64)),
    ("Qwen2.5-7B", KVLayout("Qwen/Qwen2.5-7B", num_layers=28, num_kv_heads=4, head_dim=128)),
    ("Mistral-7B", KVLayout("mistralai/Mistral-7B-v0.1", num_layers=32, num_kv_heads=8, head_dim=128)),
    ("test-4KiB", KVLayout("test/tiny", num_layers=1, num_kv_heads=1, head_dim=8)),
]

#: Relative insert frequency in the mixed churn: small layouts frequent, big ones occasional.
CHURN_WEIGHTS = {
    "test-4KiB": 30,
    "Qwen2.5-0.5B": 25,
    "Llama-3-70B-TP8": 15,
    "Qwen2.5-7B": 12,
    "Llama-3-8B": 8,
    "Mistral-7B": 6,
    "Llama-3-70B-TP1": 4,
}


def fmt_bytes(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    if n >= KiB:
        return f"{n / KiB:g} KiB"
    return f"{n} B"


# -- contenders: placement only; eviction order lives in the driver below -----------------------


class ExtentSim:
    """The real ExtentAllocator at ``grain`` (64 B: the shipped pool; coarser: fixed pages)."""

    def __init__(self, name: str, capacity: int, grain: int) -> None:
        self.name = name
        self.capacity = capacity
        self.space = ExtentAllocator(capacity, grain)
        self.at: dict[int, int] = {}  # offset -> chunk id
        self.where: dict[int, tuple[int, int]] = {}  # chunk id -> (offset, nbytes)
        self.payload = 0
        self.window_s = 0.0
        self.window_calls = 0
        self.window_runs = 0  # allocations + gaps seen by window(), summed over calls

    def admissible(self, nbytes: int) -> bool:
        return nbytes <= self.space.capacity

    def place(self, cid: int, kind: int, nbytes: int) -> bool:
        off = self.space.alloc(nbytes)
        if off is None:
            return False
        self.at[off] = cid
        self.where[cid] = (off, nbytes)
        self.payload += nbytes
        return True

    def remove(self, cid: int) -> None:
        off, nbytes = self.where.pop(cid)
        del self.at[off]
        self.space.free(off)
        self.payload -= nbytes

    def free_bytes(self) -> int:
        return self.space.free_bytes

    def window(self, kind: int, nbytes: int, lru: OrderedDict) -> list[int] | None:
        at = self.at
        self.window_calls += 1
        self.window_runs += len(self.space) + self.space.gaps
        t0 = time.perf_counter()
        offsets = self.space.window(nbytes, lambda off: off in at)  # as PackedPool.victims_for
        self.window_s += time.perf_counter() - t0
        return None if offsets is None else [at[off] for off in offsets]


class FixedBlockSim:
    """The old pool: one chunk per 16 MiB block, lowest free block first; > 16 MiB refused."""

    def __init__(self, name: str, capacity: int, block: int = BLOCK) -> None:
        self.name = name
        self.capacity = capacity
        self.block = block
        self.free = list(range(capacity // block - 1, -1, -1))  # a stack: pop() gives the lowest
        self.where: dict[int, tuple[int, int]] = {}
        self.payload = 0
        self.window_s = 0.0
        self.window_calls = 0
        self.window_runs = 0

    def admissible(self, nbytes: int) -> bool:
        return nbytes <= self.block and bool(self.capacity // self.block)

    def place(self, cid: int, kind: int, nbytes: int) -> bool:
        if nbytes > self.block or not self.free:
            return False
        self.where[cid] = (self.free.pop(), nbytes)
        self.payload += nbytes
        return True

    def remove(self, cid: int) -> None:
        b, nbytes = self.where.pop(cid)
        self.free.append(b)
        self.payload -= nbytes

    def free_bytes(self) -> int:
        return len(self.free) * self.block

    def window(self, kind: int, nbytes: int, lru: OrderedDict) -> list[int] | None:
        return None  # a free block always fits once the LRU step freed one


class SizeClassSim:
    """Per-layout 64 MiB segments (see the module docstring for the model)."""

    def __init__(self, name: str, capacity: int, segment: int = SEGMENT) -> None:
        self.name = name
        self.capacity = capacity
        self.seg = segment
        self.nseg = capacity // segment
        self.owner: list[int | None] = [None] * self.nseg  # layout kind of each segment
        self.slots: list[int] = [0] * self.nseg  # chunk capacity of each used segment
        self.members: list[set[int]] = [set() for _ in range(self.nseg)]  # chunk ids in it
        self.open: dict[int, set[int]] = {}  # kind -> its segments with a free slot
        self.size_of: dict[int, int] = {}  # kind -> chunk bytes
        self.where: dict[int, tuple[int, int, int, int]] = {}  # cid -> (first seg, nsegs, kind, nbytes)
        self.free_segs = self.nseg
        self.payload = 0
        self._free_slot_bytes = 0  # bytes of free slots in used segments
        self.window_s = 0.0
        self.window_calls = 0
        self.window_runs = 0

    def admissible(self, nbytes: int) -> bool:
        return -(-nbytes // self.seg) <= self.nseg

    def place(self, cid: int, kind: int, nbytes: int) -> bool:
        self.size_of[kind] = nbytes
        if nbytes > self.seg:  # whole consecutive segments, first fit
            k = -(-nbytes // self.seg)
            run = 0
            for s in range(self.nseg):
                run = run + 1 if self.owner[s] is None else 0
                if run == k:
                    first = s - k + 1
                    for t in range(first, s + 1):
                        self.owner[t] = kind
                        self.slots[t] = 1
                        self.members[t].add(cid)
                    self.free_segs -= k
                    self.where[cid] = (first, k, kind, nbytes)
                    self.payload += nbytes
                    return True
            return False
        open_ = self.open.setdefault(kind, set())
        if open_:
            s = min(open_)
        else:
            if not self.free_segs:
                return False
            s = self.owner.index(None)
            self.owner[s] = kind
            self.slots[s] = self.seg // nbytes
            self.free_segs -= 1
            self._free_slot_bytes += self.slots[s] * nbytes
            open_.add(s)
        self.members[s].add(cid)
        if len(self.members[s]) == self.slots[s]:
            open_.discard(s)
        self._free_slot_bytes -= nbytes
        self.where[cid] = (s, 1, kind, nbytes)
        self.payload += nbytes
        return True

    def remove(self, cid: int) -> None:
        first, k, kind, nbytes = self.where.pop(cid)
        self.payload -= nbytes
        if k > 1 or nbytes > self.seg:
            for t in range(first, first + k):
                self.members[t].discard(cid)
                self.owner[t] = None
                self.slots[t] = 0
            self.free_segs += k
            return
        s = first
        self.members[s].discard(cid)
        self._free_slot_bytes += nbytes
        if not self.members[s]:  # the segment is free again, for any layout
            self._free_slot_bytes -= self.slots[s] * nbytes
            self.owner[s] = None
            self.slots[s] = 0
            self.free_segs += 1
            self.open[kind].discard(s)
        else:
            self.open[kind].add(s)

    def free_bytes(self) -> int:
        return self.free_segs * self.seg + self._free_slot_bytes

    def window(self, kind: int, nbytes: int, lru: OrderedDict) -> list[int] | None:
        t0 = time.perf_counter()
        self.window_calls += 1
        self.window_runs += self.nseg
        best: tuple[int, list[int]] | None = None
        if nbytes <= self.seg and kind in self.owner:
            for cid in lru:  # the least recently used chunk of this layout frees a slot that fits
                if self.where[cid][2] == kind:
                    best = (nbytes, [cid])
                    break
        k = -(-nbytes // self.seg)
        for first in range(self.nseg - k + 1):  # or empty the k segments holding the fewest bytes
            victims = set().union(*self.members[first:first + k])
            cost = sum(self.where[c][3] for c in victims)
            if best is None or cost < best[0]:
                best = (cost, sorted(victims))
        self.window_s += time.perf_counter() - t0
        return None if best is None else best[1]


class OldestWindowSim(ExtentSim):
    """Reference, a what-if of the shipped allocator: the same window rule, but only over chunks
    in the least recently used ``fraction`` of the LRU order (the ``evictable`` predicate that
    ``PackedPool.victims_for`` takes), falling back to any chunk if no such window exists."""

    def __init__(self, name: str, capacity: int, fraction: float) -> None:
        super().__init__(name, capacity, 64)
        self.fraction = fraction

    def window(self, kind: int, nbytes: int, lru: OrderedDict) -> list[int] | None:
        at = self.at
        old = set(itertools.islice(lru, int(len(lru) * self.fraction)))
        self.window_calls += 1
        self.window_runs += len(self.space) + self.space.gaps
        t0 = time.perf_counter()
        offsets = self.space.window(nbytes, lambda off: off in at and at[off] in old)
        if offsets is None:
            offsets = self.space.window(nbytes, lambda off: off in at)
        self.window_s += time.perf_counter() - t0
        return None if offsets is None else [at[off] for off in offsets]


class IdealSim:
    """Reference, not a design: bytes only, no placement (an unfragmentable pool): the most a
    pool of this capacity can hold under the same LRU order."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.where: dict[int, int] = {}
        self.payload = 0
        self.window_s = 0.0
        self.window_calls = 0
        self.window_runs = 0

    def admissible(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def place(self, cid: int, kind: int, nbytes: int) -> bool:
        if self.payload + nbytes > self.capacity:
            return False
        self.where[cid] = nbytes
        self.payload += nbytes
        return True

    def remove(self, cid: int) -> None:
        self.payload -= self.where.pop(cid)

    def free_bytes(self) -> int:
        return self.capacity - self.payload

    def window(self, kind: int, nbytes: int, lru: OrderedDict) -> list[int] | None:
        return None  # enough free bytes always fit


def make_contenders(capacity: int) -> list:
    return [
        FixedBlockSim(BASELINE, capacity),
        ExtentSim("pages-64KiB", capacity, 64 * KiB),
        ExtentSim("pages-256KiB", capacity, 256 * KiB),
        ExtentSim("pages-2MiB", capacity, 2 * MiB),
        SizeClassSim("size-classes", capacity),
        ExtentSim(SHIPPED, capacity, 64),
    ]


def make_references(capacity: int) -> list:
    """Churn-only reference rows: what the window rule costs, and the bound."""
    lru_only = ExtentSim(LRU_ONLY, capacity, 64)
    lru_only.lru_only = True  # no window: keep evicting in LRU order until a run fits
    return [lru_only, OldestWindowSim(OLDEST_WINDOW, capacity, 0.25), IdealSim(IDEAL, capacity)]


# -- the eviction driver: the pool_room rule, the same for every contender ---------------------


class Stats:
    def __init__(self) -> None:
        self.inserted_bytes = 0
        self.inserted = 0
        self.refused = 0
        self.refused_bytes = 0
        self.evicted_bytes = 0
        self.evicted = 0
        self.window_evictions = 0
        self.window_evicted_bytes = 0
        self.window_evicted = 0
        self.lru_evicted_bytes = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


def evict(sim, lru: OrderedDict, cid: int) -> int:
    nbytes = lru.pop(cid)
    sim.remove(cid)
    return nbytes


def insert(sim, lru: OrderedDict, cid: int, kind: int, nbytes: int, st: Stats) -> bool:
    """Mover.pool_room + reserve: LRU until enough bytes are free, then the cheapest window."""
    if not sim.admissible(nbytes):
        st.refused += 1
        st.refused_bytes += nbytes
        return False
    if not sim.place(cid, kind, nbytes):
        while sim.free_bytes() < nbytes and lru:
            victim = next(iter(lru))
            n = evict(sim, lru, victim)
            st.evicted += 1
            st.evicted_bytes += n
            st.lru_evicted_bytes += n
        while getattr(sim, "lru_only", False) and lru and not sim.place(cid, kind, nbytes):
            victim = next(iter(lru))
            n = evict(sim, lru, victim)
            st.evicted += 1
            st.evicted_bytes += n
            st.lru_evicted_bytes += n
        if cid not in sim.where and not sim.place(cid, kind, nbytes):
            victims = sim.window(kind, nbytes, lru)
            if victims is not None:
                st.window_evictions += 1
                for v in victims:
                    n = evict(sim, lru, v)
                    st.evicted += 1
                    st.evicted_bytes += n
                    st.window_evicted += 1
                    st.window_evicted_bytes += n
            if victims is None or not sim.place(cid, kind, nbytes):
                st.refused += 1
                st.refused_bytes += nbytes
                return False
    lru[cid] = nbytes
    st.inserted += 1
    st.inserted_bytes += nbytes
    return True


# -- scenario A: one layout at a time ------------------------------------------------------------


def scenario_fill(capacity: int) -> dict:
    out: dict = {}
    for name, layout in GEOMETRIES:
        nbytes = layout.chunk_bytes
        row = {}
        for sim in make_contenders(capacity):
            n = 0
            if sim.admissible(nbytes):
                while sim.place(n, 0, nbytes):
                    n += 1
            row[sim.name] = {"chunks": n, "payload_bytes": sim.payload, "utilisation": sim.payload / capacity}
        out[name] = {"chunk_bytes": nbytes, "contenders": row}
    return out


# -- scenario B: mixed churn ---------------------------------------------------------------------


def make_ops(n: int, capacity: int, seed: int) -> tuple[list[tuple[int, int]], int]:
    """(layout index, re-touch target chunk id or -1) per insert, and the re-touch window W."""
    rng = random.Random(seed)
    names = [g[0] for g in GEOMETRIES]
    weights = [CHURN_WEIGHTS[g] for g in names]
    sizes = [g[1].chunk_bytes for g in GEOMETRIES]
    mean = sum(w * s for w, s in zip(weights, sizes)) / sum(weights)
    window = max(8, round(capacity / mean))
    kinds = rng.choices(range(len(names)), weights=weights, k=n)
    ops = []
    for i, kind in enumerate(kinds):
        target = -1
        if i and rng.random() < RETOUCH_P:
            target = i - 1 - rng.randrange(min(window, i))
        ops.append((kind, target))
    return ops, window


def scenario_churn(capacity: int, n: int, seed: int) -> dict:
    ops, window = make_ops(n, capacity, seed)
    sizes = [g[1].chunk_bytes for g in GEOMETRIES]
    warm = int(n * WARMUP_FRACTION)
    step = max(1, n // SERIES_POINTS)
    res: dict = {}
    for sim in make_contenders(capacity) + make_references(capacity):
        lru: OrderedDict[int, int] = OrderedDict()
        st, st_warm = Stats(), None
        samples: list[float] = []
        series: list[tuple[int, float]] = []
        touches = hits = 0
        t0 = time.perf_counter()
        for cid, (kind, target) in enumerate(ops):
            if cid == warm:
                st_warm = Stats()
                st_warm.__dict__.update(st.as_dict())
            if target >= 0:
                touches += 1
                if target in lru:
                    lru.move_to_end(target)
                    hits += 1
            insert(sim, lru, cid, kind, sizes[kind], st)
            u = sim.payload / capacity
            if cid >= warm:
                samples.append(u)
            if cid % step == 0 or cid == n - 1:
                series.append((cid, round(u, 5)))
        wall = time.perf_counter() - t0
        after = {k: v - getattr(st_warm, k) for k, v in st.as_dict().items()} if st_warm else st.as_dict()
        xs = sorted(samples)
        res[sim.name] = {
            "utilisation_median": statistics.median(xs),
            "utilisation_min": xs[0],
            "utilisation_mean": sum(xs) / len(xs),
            "utilisation_p5": percentile(xs, 5),
            "window_evictions": after["window_evictions"],
            "evicted_per_inserted_byte": ratio(after["evicted_bytes"], after["inserted_bytes"]),
            "window_evicted_per_inserted_byte": ratio(after["window_evicted_bytes"], after["inserted_bytes"]),
            "refused_inserts": after["refused"],
            "refused_bytes": after["refused_bytes"],
            "retouch_hit_rate": ratio(hits, touches),
            "after_warmup": after,
            "whole_run": st.as_dict(),
            "live_chunks_at_end": len(lru),
            "window_calls": sim.window_calls,
            "window_seconds": sim.window_s,
            "window_mean_runs_scanned": ratio(sim.window_runs, sim.window_calls) if sim.window_calls else 0.0,
            "wall_seconds": wall,
            "series": series,
        }
    return {"inserts": n, "warmup_inserts": warm, "retouch_probability": RETOUCH_P, "retouch_window": window,
            "seed": seed, "weights": CHURN_WEIGHTS, "contenders": res}


# -- the window() call itself ---------------------------------------------------------------------


def window_cost(counts: list[int]) -> list[dict]:
    """ms per ExtentAllocator.window call in a pool of ``n`` 4 KiB allocations with every
    other one freed (n/2 allocations, n/2 gaps), asking for a 16 KiB run."""
    out = []
    for n in counts:
        a = ExtentAllocator(n * 4 * KiB, 64)
        offs = [a.alloc(4 * KiB) for _ in range(n)]
        for off in offs[::2]:
            a.free(off)
        live = set(offs[1::2])
        reps = max(1, 200_000 // n)
        t0 = time.perf_counter()
        for _ in range(reps):
            w = a.window(16 * KiB, lambda off: off in live)
        ms = (time.perf_counter() - t0) / reps * 1e3
        out.append({"allocations": len(a), "gaps": a.gaps, "ms_per_call": ms, "victims": len(w or [])})
    return out


# -- report ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    capacity = args.pool_mib * MiB
    fill = scenario_fill(capacity)
    churn = scenario_churn(capacity, args.inserts, args.seed)
    wc = window_cost([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000])
    names = [s.name for s in make_contenders(capacity)]
    ratios_a = {
        g: {c: (r if (r := ratio(v["contenders"][c]["utilisation"], v["contenders"][BASELINE]["utilisation"])) == r
                else None) for c in names}
        for g, v in fill.items()
    }
    base_b = churn["contenders"][BASELINE]
    ratios_b = {c: {"median": ratio(v["utilisation_median"], base_b["utilisation_median"]),
                    "min": ratio(v["utilisation_min"], base_b["utilisation_min"]),
                    "retouch_hit_rate": ratio(v["retouch_hit_rate"], base_b["retouch_hit_rate"])}
                for c, v in churn["contenders"].items()}
    shipped_a = {g: v["contenders"][SHIPPED]["utilisation"] for g, v in fill.items()}
    sb = churn["contenders"][SHIPPED]
    return {
        "pool_bytes": capacity,
        "contenders": names,
        "references": [s.name for s in make_references(capacity)],
        "geometries": {g: {"chunk_bytes": lay.chunk_bytes, "num_layers": lay.num_layers,
                           "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
                           "chunk_tokens": lay.chunk_tokens, "dtype": lay.dtype} for g, lay in GEOMETRIES},
        "scenario_a_fill": fill,
        "scenario_a_ratio_to_fixed": ratios_a,
        "scenario_b_churn": churn,
        "scenario_b_ratio_to_fixed": ratios_b,
        "window_call_cost": wc,
        "targets": {
            "a_min_utilisation": TARGET_A,
            "a_met": all(u >= TARGET_A for u in shipped_a.values()),
            "a_worst_geometry": min(shipped_a, key=shipped_a.get),
            "b_min_utilisation": TARGET_B,
            "b_median_met": sb["utilisation_median"] >= TARGET_B,
            "b_min_met": sb["utilisation_min"] >= TARGET_B,
        },
        "wall_seconds": time.perf_counter() - t0,
    }


def print_report(res: dict) -> None:
    names = res["contenders"]
    fill = res["scenario_a_fill"]
    print(f"pool {fmt_bytes(res['pool_bytes'])}; contenders: {', '.join(names)}\n")
    print("Scenario A: one layout fills the pool; payload bytes / pool bytes")
    rows = []
    for g, v in fill.items():
        rows.append([g, fmt_bytes(v["chunk_bytes"]), *(v["contenders"][c]["utilisation"] * 100 for c in names)])
    print(format_table(["geometry", "chunk", *(f"{c} %" for c in names)], rows))
    print("\nScenario A ratios to fixed-16MiB ('-': fixed-16MiB stores none)")
    rows = [[g, *(float("nan") if r[c] is None else r[c] for c in names[1:])]
            for g, r in res["scenario_a_ratio_to_fixed"].items()]
    print(format_table(["geometry", *(f"{c}/fixed" for c in names[1:])], rows))

    ch = res["scenario_b_churn"]
    print(f"\nScenario B: mixed churn, {ch['inserts']:,} inserts (seed {ch['seed']}), stats after the first "
          f"{ch['warmup_inserts']:,}; re-touch p={ch['retouch_probability']} within the last {ch['retouch_window']}")
    rows = []
    for c in names + res["references"]:
        r = ch["contenders"][c]
        rows.append([c, r["utilisation_median"] * 100, r["utilisation_min"] * 100, r["utilisation_p5"] * 100,
                     r["window_evictions"], r["evicted_per_inserted_byte"], r["window_evicted_per_inserted_byte"],
                     r["refused_inserts"], r["retouch_hit_rate"], res["scenario_b_ratio_to_fixed"][c]["median"],
                     r["window_seconds"] * 1e3 / max(1, r["window_calls"]), r["wall_seconds"]])
    print(format_table(["contender", "median %", "min %", "p5 %", "window evictions", "evicted B/B in",
                        "window-evicted B/B in", "refused", "retouch hits", "median/fixed", "ms/window",
                        "wall s"], rows))
    print("\nExtentAllocator.window cost (4 KiB allocations, every other freed)")
    print(format_table(["allocations", "gaps", "ms/call"],
                       [[f"{w['allocations']:,}", f"{w['gaps']:,}", w["ms_per_call"]] for w in res["window_call_cost"]]))
    t = res["targets"]
    worst = t["a_worst_geometry"]
    print(f"\ntarget A: {SHIPPED} >= {TARGET_A:.0%} for every geometry (worst {worst} "
          f"{fill[worst]['contenders'][SHIPPED]['utilisation']:.2%}) -> {'MET' if t['a_met'] else 'NOT MET'}")
    sb = ch["contenders"][SHIPPED]
    print(f"target B: {SHIPPED} >= {TARGET_B:.0%} after warm-up: median {sb['utilisation_median']:.2%} -> "
          f"{'MET' if t['b_median_met'] else 'NOT MET'}; min {sb['utilisation_min']:.2%} -> "
          f"{'MET' if t['b_min_met'] else 'NOT MET'}")
    print(f"wall {res['wall_seconds']:.1f} s")


def plot(res: dict, path: str) -> None:
    names = res["contenders"]
    colors = dict(zip(names, ["tab:gray", "tab:olive", "tab:orange", "tab:red", "tab:purple", "tab:blue"]))
    fig, (ax1, ax2) = subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [1.3, 1]})
    fill = res["scenario_a_fill"]
    geos = list(fill)
    w = 0.8 / len(names)
    for j, c in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * w for i in range(len(geos))]
        ax1.bar(xs, [fill[g]["contenders"][c]["utilisation"] * 100 for g in geos], w, label=c, color=colors[c])
    ax1.axhline(TARGET_A * 100, color="k", lw=0.8, ls=":", label=f"target {TARGET_A:.0%}")
    ax1.set_xticks(range(len(geos)))
    ax1.set_xticklabels([f"{g}\n{fmt_bytes(fill[g]['chunk_bytes'])}" for g in geos], fontsize=7.5)
    ax1.set_ylabel("pool bytes holding KV (%)")
    ax1.set_ylim(0, 122)
    ax1.set_yticks(range(0, 101, 20))
    ax1.set_title(f"A: one layout fills a {fmt_bytes(res['pool_bytes'])} pool")
    ax1.legend(fontsize=7, loc="upper center", ncol=4)
    ax1.grid(True, axis="y", alpha=0.3)

    ch = res["scenario_b_churn"]
    for c in names:
        s = ch["contenders"][c]["series"]
        ax2.plot([p[0] for p in s], [p[1] * 100 for p in s], lw=1, color=colors[c],
                 label=f"{c} (median {ch['contenders'][c]['utilisation_median']:.0%})")
    for c, style in zip(res["references"], ("--", "-.", ":")):
        s = ch["contenders"][c]["series"]
        ax2.plot([p[0] for p in s], [p[1] * 100 for p in s], lw=0.8, ls=style, color="k", alpha=0.6,
                 label=f"{c} (median {ch['contenders'][c]['utilisation_median']:.0%})")
    ax2.axvline(ch["warmup_inserts"], color="k", lw=0.8, ls="--", label="end of warm-up")
    ax2.axhline(TARGET_B * 100, color="k", lw=0.8, ls=":", label=f"target {TARGET_B:.0%}")
    ax2.set_xlabel("insert")
    ax2.set_ylabel("pool bytes holding KV (%)")
    ax2.set_ylim(0, 105)
    ax2.set_title(f"B: mixed churn of all 7 layouts, {ch['inserts']:,} inserts")
    ax2.legend(fontsize=6.5, loc="center", bbox_to_anchor=(0.5, 0.47), ncol=2)
    ax2.grid(True, alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "256 MiB pool, 2,000 churn inserts (a few seconds)")
    p.add_argument("--pool-mib", type=int, default=None, help="pool capacity in MiB (default 1024; --quick 256)")
    p.add_argument("--inserts", type=int, default=None, help="churn inserts (default 20,000; --quick 2,000)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    args.pool_mib = args.pool_mib or (256 if args.quick else 1024)
    args.inserts = args.inserts or (2_000 if args.quick else 20_000)
    res = run(args)
    finish("pool_packing", res, args, print_report, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
