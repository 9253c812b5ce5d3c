"""Question: on the Mooncake FAST'25 traces (conversation, synthetic), how close to the offline
optimum does each candidate eviction / admission policy for a prefix (KV) block cache come, at
capacities of 1k, 10k, 30k and 50k blocks, and does any beat the engine's default
(frequency-boosted recency, beta = 1) where it matters most, at 1k and 10k blocks?

Workload: ../shared/traces/mooncake-fast25/{conversation,synthetic}_trace.jsonl (override the
directory with KVCACHED_TRACES): one request per line, ``hash_ids`` are prefix block ids of
512-token blocks. Only the ``input_length // 512`` FULL blocks of a request count (the engine
only caches full chunks). The hit of a request is the longest prefix of its full blocks that is
cached; hit rate = sum of hits / sum of full blocks. No engine code runs here: every contender
is a small simulator, so a policy can be judged before it is built.

The cache simulated for every online contender is prefix-closed, as the engine's index is: a
block is held only together with its parent, so only leaves (cached blocks with no cached
child) can be evicted, and the block the request is about to extend (its parent) is pinned.
Per request: count the hit prefix, touch the hit blocks, then insert the missing blocks in
order, each evicting the policy's lowest-keyed leaf when the cache is full. A block the policy
refuses to admit (or a full cache with no evictable leaf) ends the request's insertions, since
its descendants could not be held without it. "Clock" is the number of block accesses so far,
unless said otherwise; C is the capacity in blocks.

Contenders (each replayed at every capacity):

* ``optimum``  Belady's MIN with bypass on the flat stream of full blocks (evict the block
  whose next use is farthest away; do not admit a block used later than every cached one),
  counted with the prefix-hit rule. MIN with bypass maximises *flat* hits (a block present
  when accessed, wherever it sits in the request); every contender's hits are flat hits (its
  cache is prefix-closed, so a cached block of a request always lies in the hit prefix), and
  MIN's own hits are all prefix hits: an ancestor is always used again before its descendant,
  so MIN never evicts it first nor admits the descendant after bypassing it, i.e. the blocks it
  holds that have a future use form a prefix-closed set. So the prefix-counted optimum equals
  the flat one (both are in the JSON, ``optimum`` and ``optimum_flat``) and is a true upper
  bound for every contender, the oracle included.
* ``lru``  least recently used leaf first (key = request index of the last access).
* ``frequency_beta{0.5,1,2}``  frequency-boosted recency, the engine's policy: key =
  clock + beta * C * (hits - 1), hits = accesses of the block so far, remembered after the
  block is evicted (the engine keeps them in a count-min sketch; here an exact dict, i.e. a
  sketch without collisions or aging). beta = 1 is the engine's default.
* ``frequency_no_memory``  the same with beta = 1, but a block's count is forgotten when it is
  evicted (a re-fetched block starts over at one hit).
* ``gdsf``  GreedyDual-Size-Frequency with unit sizes, i.e. LFU aged by inflation: key = L +
  hits, L = the key of the last victim; counts remembered after eviction.
* ``lfu``  pure LFU (key = hits, ties to the least recently used), counts remembered.
* ``lru2``  LRU-K flavoured: key = t_last - kappa * (t_last - t_prev), a block seen once gets
  t_last - gamma * C; kappa = 0.5, gamma = 4 (the best of a grid kappa in {0.5,1,2} x gamma in
  {0.5,1,2,4} on both traces at 1k/10k/50k).
* ``hyperbolic``  hyperbolic caching (Blankstein et al., ATC'17), sampled: on each eviction
  K = 32 leaves are drawn at random (fixed seed) and the one with the lowest
  hits / (t - t_first + c0) * c0 / (t - t_last + c0) is evicted; t = request index, t_first /
  t_last = the block's first / last request, c0 = 1000 requests. This recency-weighted form
  with c0 = 1000 was the best of c0 in {10, 100, 1000} x {plain hyperbolic, recency-weighted}
  on both traces at 1k/10k/50k (plain c0 = 1000 was 0.01 better only at 1k on conversation).
  Counts and times are remembered after eviction. The slowest contender (K scores per
  eviction), but it still replays every capacity.
* ``frequency_doorkeeper``  ``frequency_beta1`` plus admission: a missing block is refused
  when its would-be key (clock + C * its remembered count) is below the victim's key.
* ``frequency_adaptive``  ``frequency`` with beta hill-climbed online: every epoch of 20 * C
  accesses beta is multiplied (or divided) by 1.5, the direction reversed when the epoch's hit
  rate fell below the previous epoch's; beta starts at 1, clamped to [1/16, 16]. From 10k blocks
  up an epoch (>= 200k accesses) is about as long as a trace (276k / 118k full blocks), so beta
  moves at most once (conversation, 10k) and it is otherwise ``frequency_beta1``.
* ``oracle_admission_lru``  LRU that admits only blocks that will be accessed again (it reads
  the future): an upper bound on what an admission filter alone could add to LRU. Not online;
  excluded from ``best_online``.

Output: per trace and capacity, each contender's hit rate, its ratio to the optimum and to LRU;
a table per trace (contender rows x capacity columns of ratio to optimum); ``best_online`` =
the best contender that is neither the optimum nor an oracle. Everything is deterministic
(fixed seed for the sampled contender).

Run:   .venv/bin/python bench/sim/eviction_candidates.py          (~2-3 min on a 2-core box)
       .venv/bin/python bench/sim/eviction_candidates.py --quick  (seconds; first 800 requests of
                                                               each trace, capacities 100 and
                                                               1000; writes *.quick.json/.png)
       --out DIR writes elsewhere.
Output: bench/results/eviction_candidates.json, bench/results/eviction_candidates.png
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench._common import REPO_ROOT, RESULTS_DIR, TRACE_DIR, finish, format_table
TRACES = ("conversation", "synthetic")
BLOCK = 512
CAPACITIES = (1_000, 10_000, 30_000, 50_000)
QUICK_CAPACITIES = (100, 1_000)
QUICK_REQUESTS = 800
SEED = 1
ENGINE_DEFAULT = "frequency_beta1"

Block = int
Request = list  # the full-block ids of one request, in prefix order


def load_trace(name: str, limit: int | None = None) -> list[Request]:
    """The full-block id lists of a trace's requests, in arrival order."""
    out: list[Request] = []
    with open(os.path.join(TRACE_DIR, f"{name}_trace.jsonl")) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(list(d["hash_ids"][: int(d["input_length"]) // BLOCK]))
                if limit and len(out) >= limit:
                    break
    return out


def trace_stats(reqs: list[Request]) -> dict:
    distinct = {b for r in reqs for b in r}
    return {
        "requests": len(reqs),
        "full_blocks": sum(len(r) for r in reqs),
        "distinct_full_block_ids": len(distinct),
    }


# -- the offline optimum ---------------------------------------------------------------------


def belady_min(reqs: list[Request], cap: int) -> tuple[float, float]:
    """Belady's MIN with bypass on the flat block stream; returns (prefix hit rate, flat hit rate).

    The cache holds any blocks (not prefix-closed). On a miss with a full cache the cached block
    whose next use is farthest is evicted, unless the missing block's own next use is farther
    still (then it is not admitted: bypass). A block never used again gets a next use beyond the
    stream, distinct per position, so such blocks are the first to go and are never admitted
    over a block that has a future. Lazy max-heap of (-next use, block).
    """
    stream = [b for r in reqs for b in r]
    n = len(stream)
    nxt = [0] * n
    last: dict[Block, int] = {}
    for i in range(n - 1, -1, -1):
        b = stream[i]
        nxt[i] = last.get(b, n + 1 + i)
        last[b] = i
    cache: dict[Block, int] = {}  # block -> its next use
    heap: list[tuple[int, Block]] = []
    prefix_hits = flat_hits = total = 0
    i = 0
    for r in reqs:
        in_prefix = True
        for b in r:
            nu = nxt[i]
            i += 1
            if b in cache:
                flat_hits += 1
                if in_prefix:
                    prefix_hits += 1
                cache[b] = nu
                heapq.heappush(heap, (-nu, b))
                continue
            in_prefix = False
            if len(cache) < cap:
                cache[b] = nu
                heapq.heappush(heap, (-nu, b))
                continue
            while cache.get(heap[0][1]) != -heap[0][0]:  # drop stale entries
                heapq.heappop(heap)
            far, victim = heap[0]
            if -far > nu:
                heapq.heappop(heap)
                del cache[victim]
                cache[b] = nu
                heapq.heappush(heap, (-nu, b))
        total += len(r)
    return prefix_hits / total, flat_hits / total


# -- the shared prefix-closed cache simulator ------------------------------------------------


class Policy:
    """What a contender decides. The simulator calls, per request: :meth:`request` once (with
    the request's blocks and its hit count), :meth:`hit` for each hit block, then for each
    missing block :meth:`admit` (only when the cache is full, with the chosen victim's key),
    :meth:`evicted` for the victim and :meth:`insert`. ``hit`` and ``insert`` return the block's
    key; the leaf with the lowest key is evicted. A ``sampled`` policy instead has its victim
    chosen among ``samples`` random leaves by the lowest :meth:`score` (keys unused)."""

    sampled = False
    samples = 0

    def __init__(self, cap: int, reqs: list[Request]) -> None:
        self.cap = cap

    def request(self, blocks: Request, hits: int) -> None:
        pass

    def hit(self, b: Block) -> float:
        raise NotImplementedError

    def insert(self, b: Block) -> float:
        return self.hit(b)

    def admit(self, b: Block, victim_key: float) -> bool:
        return True

    def evicted(self, b: Block, key: float) -> None:
        pass

    def score(self, b: Block) -> float:
        raise NotImplementedError

    def extra(self) -> dict:
        """Anything worth reporting about the run (e.g. adapted parameters)."""
        return {}


class _HeapLeaves:
    """Exact victim choice: a lazy min-heap of (key, seq, block). An entry is live while the
    block is cached, has that key and no cached child; stale entries are dropped when they
    reach the top. Every key change and every block that becomes a leaf pushes an entry."""

    def __init__(self, key: dict, kids: dict) -> None:
        self.key, self.kids = key, kids
        self.heap: list = []
        self.seq = 0

    def update(self, b: Block, k: float) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (k, self.seq, b))

    add_leaf = update

    def not_leaf(self, b: Block) -> None:
        pass

    def remove(self, b: Block) -> None:
        pass

    def _top(self) -> Block | None:
        heap, key, kids = self.heap, self.key, self.kids
        while heap:
            k, _, b = heap[0]
            if key.get(b) == k and kids[b] == 0:
                return b
            heapq.heappop(heap)
        return None

    def pick(self, pinned: Block | None) -> Block | None:
        v = self._top()
        if v is not None and v == pinned:  # the block being extended: take the next leaf
            entry = heapq.heappop(self.heap)
            v = self._top()
            heapq.heappush(self.heap, entry)
        return v


class _SampledLeaves:
    """Sampled victim choice: an array of the current leaves; ``samples`` draws with
    replacement (seeded), the pinned parent skipped, the lowest ``policy.score`` evicted."""

    def __init__(self, policy: Policy, seed: int) -> None:
        self.policy = policy
        self.rng = random.Random(seed)
        self.leaves: list[Block] = []
        self.pos: dict[Block, int] = {}

    def update(self, b: Block, k: float) -> None:
        pass

    def add_leaf(self, b: Block, k: float) -> None:
        if b not in self.pos:
            self.pos[b] = len(self.leaves)
            self.leaves.append(b)

    def not_leaf(self, b: Block) -> None:
        i = self.pos.pop(b, None)
        if i is None:
            return
        last = self.leaves.pop()
        if i < len(self.leaves):
            self.leaves[i] = last
            self.pos[last] = i

    remove = not_leaf

    def pick(self, pinned: Block | None) -> Block | None:
        leaves, draw, score = self.leaves, self.rng.randrange, self.policy.score
        best, best_score = None, math.inf
        for _ in range(self.policy.samples):
            x = leaves[draw(len(leaves))]
            if x == pinned:
                continue
            s = score(x)
            if s < best_score:
                best, best_score = x, s
        return best


def replay(reqs: list[Request], cap: int, policy: Policy, seed: int = SEED) -> float:
    """Hit rate of ``policy`` on a prefix-closed, leaf-first cache of ``cap`` blocks."""
    key: dict[Block, float] = {}  # cached block -> the policy's key
    parent: dict[Block, Block | None] = {}
    kids: dict[Block, int] = {}  # cached block -> number of cached children
    leaves = _SampledLeaves(policy, seed) if policy.sampled else _HeapLeaves(key, kids)
    hits = total = 0
    for r in reqs:
        h = 0
        for b in r:
            if b not in key:
                break
            h += 1
        hits += h
        total += len(r)
        policy.request(r, h)
        for j in range(h):
            b = r[j]
            k = key[b] = policy.hit(b)
            leaves.update(b, k)
        par = r[h - 1] if h else None
        for j in range(h, len(r)):
            b = r[j]
            if len(key) >= cap:
                v = leaves.pick(par)
                if v is None or not policy.admit(b, key[v]):
                    break  # no evictable leaf, or refused: its descendants cannot be held either
                policy.evicted(v, key.pop(v))
                leaves.remove(v)
                del kids[v]
                p = parent.pop(v)
                if p is not None:
                    kids[p] -= 1
                    if kids[p] == 0:
                        leaves.add_leaf(p, key[p])
            k = key[b] = policy.insert(b)
            parent[b] = par
            kids[b] = 0
            if par is not None:
                if kids[par] == 0:
                    leaves.not_leaf(par)
                kids[par] += 1
            leaves.add_leaf(b, k)
            par = b
    return hits / total if total else 0.0


# -- the contenders ----------------------------------------------------------------------------


class LRU(Policy):
    """Least recently used leaf first: key = index of the request that last accessed the block."""

    def __init__(self, cap: int, reqs: list[Request]) -> None:
        super().__init__(cap, reqs)
        self.t = 0

    def request(self, blocks: Request, hits: int) -> None:
        self.t += 1

    def hit(self, b: Block) -> float:
        return self.t


class OracleAdmissionLRU(LRU):
    """LRU that admits a missing block only if the trace accesses it again later (reads the
    future): what a perfect admission filter alone would add to LRU."""

    def __init__(self, cap: int, reqs: list[Request]) -> None:
        super().__init__(cap, reqs)
        self.remaining: dict[Block, int] = {}
        for r in reqs:
            for b in r:
                self.remaining[b] = self.remaining.get(b, 0) + 1

    def request(self, blocks: Request, hits: int) -> None:
        super().request(blocks, hits)
        for b in blocks:
            self.remaining[b] -= 1

    def admit(self, b: Block, victim_key: float) -> bool:
        return self.remaining[b] > 0


class Frequency(Policy):
    """Frequency-boosted recency (the engine's policy): key = clock + beta * C * (hits - 1).

    ``clock`` counts block accesses; ``hits`` counts the block's accesses so far, including
    this one. With ``memory`` the counts survive eviction (the engine's sketch, here exact), so a
    block that comes back resumes its count; without, an evicted block's count is dropped. A
    block used once more is worth staying ``beta * C`` accesses longer than one used once.
    """

    def __init__(self, cap: int, reqs: list[Request], beta: float = 1.0, memory: bool = True) -> None:
        super().__init__(cap, reqs)
        self.beta = beta
        self.memory = memory
        self.clock = 0
        self.count: dict[Block, int] = {}

    def request(self, blocks: Request, hits: int) -> None:
        self.clock += len(blocks)

    def _key(self, n: int) -> float:
        return self.clock + self.beta * self.cap * (n - 1)

    def hit(self, b: Block) -> float:
        n = self.count[b] = self.count.get(b, 0) + 1
        return self._key(n)

    def evicted(self, b: Block, key: float) -> None:
        if not self.memory:
            self.count.pop(b, None)


class FrequencyDoorkeeper(Frequency):
    """``Frequency`` plus admission: refuse a missing block whose would-be key is below the
    victim's key (it would be the next victim anyway)."""

    def admit(self, b: Block, victim_key: float) -> bool:
        return self._key(self.count.get(b, 0) + 1) >= victim_key


class FrequencyAdaptive(Frequency):
    """``Frequency`` whose beta is tuned online by hill climbing: at the end of every epoch of
    ``epoch * C`` accesses, beta is moved by a factor ``step`` in the current direction, and the
    direction is reversed when the epoch's hit rate fell below the previous epoch's."""

    def __init__(self, cap: int, reqs: list[Request], beta: float = 1.0, epoch: float = 20,
                 step: float = 1.5, beta_min: float = 1 / 16, beta_max: float = 16) -> None:
        super().__init__(cap, reqs, beta=beta)
        self.epoch = epoch * cap
        self.next_epoch = self.epoch
        self.step, self.beta_min, self.beta_max = step, beta_min, beta_max
        self.epoch_hits = self.epoch_blocks = 0
        self.prev_rate: float | None = None
        self.up = True
        self.betas: list[float] = []

    def request(self, blocks: Request, hits: int) -> None:
        super().request(blocks, hits)
        self.epoch_hits += hits
        self.epoch_blocks += len(blocks)
        if self.clock < self.next_epoch:
            return
        self.next_epoch += self.epoch
        rate = self.epoch_hits / max(self.epoch_blocks, 1)
        self.epoch_hits = self.epoch_blocks = 0
        if self.prev_rate is not None and rate < self.prev_rate:
            self.up = not self.up
        self.prev_rate = rate
        factor = self.step if self.up else 1 / self.step
        self.beta = min(max(self.beta * factor, self.beta_min), self.beta_max)
        self.betas.append(round(self.beta, 3))

    def extra(self) -> dict:
        return {"epochs": len(self.betas), "final_beta": self.beta, "betas": self.betas}


class GDSF(Policy):
    """GreedyDual-Size-Frequency with unit sizes (LFU aged by inflation): key = L + hits, where
    L rises to each victim's key, so old counts lose against fresh ones. Counts survive eviction."""

    def __init__(self, cap: int, reqs: list[Request]) -> None:
        super().__init__(cap, reqs)
        self.inflation = 0.0
        self.count: dict[Block, int] = {}

    def hit(self, b: Block) -> float:
        n = self.count[b] = self.count.get(b, 0) + 1
        return self.inflation + n

    def evicted(self, b: Block, key: float) -> None:
        self.inflation = max(self.inflation, key)


class LFU(Policy):
    """Pure least frequently used: key = hits, ties to the least recently used (the request
    index, scaled below 1, is added). Counts survive eviction, and nothing ages."""

    def __init__(self, cap: int, reqs: list[Request]) -> None:
        super().__init__(cap, reqs)
        self.t = 0
        self.tie = 1.0 / (len(reqs) + 1)
        self.count: dict[Block, int] = {}

    def request(self, blocks: Request, hits: int) -> None:
        self.t += 1

    def hit(self, b: Block) -> float:
        n = self.count[b] = self.count.get(b, 0) + 1
        return n + self.t * self.tie


class LRU2(Policy):
    """LRU-K flavour with K = 2: key = t_last - kappa * (t_last - t_prev), i.e. recency pushed
    back by the block's last reuse interval; a block seen once gets t_last - gamma * C. ``t`` is
    the access clock; both times survive eviction."""

    def __init__(self, cap: int, reqs: list[Request], kappa: float = 0.5, gamma: float = 4.0) -> None:
        super().__init__(cap, reqs)
        self.kappa, self.gamma = kappa, gamma
        self.clock = 0
        self.last: dict[Block, int] = {}
        self.gap: dict[Block, int] = {}

    def request(self, blocks: Request, hits: int) -> None:
        self.clock += len(blocks)

    def hit(self, b: Block) -> float:
        t = self.clock
        prev = self.last.get(b)
        self.last[b] = t
        if prev is None:
            return t - self.gamma * self.cap
        gap = self.gap[b] = t - prev
        return t - self.kappa * gap


class Hyperbolic(Policy):
    """Hyperbolic caching, sampled: evict the sampled leaf with the lowest
    hits / (t - t_first + c0), i.e. the lowest access rate over the block's lifetime (t = request
    index, t_first = the block's first request). With ``recency`` the rate is further weighted
    by c0 / (t - t_last + c0), so a block idle for c0 requests counts half. Counts and times
    survive eviction; every block of a request is counted when the request arrives."""

    sampled = True

    def __init__(self, cap: int, reqs: list[Request], samples: int = 32, c0: float = 1000,
                 recency: bool = True) -> None:
        super().__init__(cap, reqs)
        self.samples, self.c0, self.recency = samples, c0, recency
        self.t = 0
        self.count: dict[Block, int] = {}
        self.first: dict[Block, int] = {}
        self.last: dict[Block, int] = {}

    def request(self, blocks: Request, hits: int) -> None:
        self.t += 1
        count, first, last, t = self.count, self.first, self.last, self.t
        for b in blocks:
            count[b] = count.get(b, 0) + 1
            first.setdefault(b, t)
            last[b] = t

    def hit(self, b: Block) -> float:
        return 0.0

    def score(self, b: Block) -> float:
        t, c0 = self.t, self.c0
        rate = self.count[b] / (t - self.first[b] + c0)
        return rate * c0 / (t - self.last[b] + c0) if self.recency else rate


#: name -> (factory(cap, reqs) -> Policy, is an oracle, one-line description)
CONTENDERS: dict[str, tuple[Callable[[int, list[Request]], Policy], bool, str]] = {
    "lru": (LRU, False, "least recently used leaf first"),
    "frequency_beta0.5": (lambda c, r: Frequency(c, r, beta=0.5), False,
                          "clock + 0.5*C*(hits-1), counts remembered"),
    "frequency_beta1": (lambda c, r: Frequency(c, r, beta=1.0), False,
                        "clock + C*(hits-1), counts remembered (engine default)"),
    "frequency_beta2": (lambda c, r: Frequency(c, r, beta=2.0), False,
                        "clock + 2*C*(hits-1), counts remembered"),
    "frequency_no_memory": (lambda c, r: Frequency(c, r, beta=1.0, memory=False), False,
                            "clock + C*(hits-1), counts forgotten on eviction"),
    "gdsf": (GDSF, False, "L + hits, L = last victim's key; counts remembered"),
    "lfu": (LFU, False, "hits, ties to LRU; counts remembered"),
    "lru2": (lambda c, r: LRU2(c, r, kappa=0.5, gamma=4.0), False,
             "t_last - 0.5*(t_last - t_prev); once-seen: t_last - 4*C"),
    "hyperbolic": (lambda c, r: Hyperbolic(c, r, samples=32, c0=1000, recency=True), False,
                   "lowest hits/(t-t_first+1000) * 1000/(t-t_last+1000) of 32 sampled leaves"),
    "frequency_doorkeeper": (FrequencyDoorkeeper, False,
                             "frequency_beta1 + refuse a block whose key < victim's key"),
    "frequency_adaptive": (FrequencyAdaptive, False,
                           "frequency, beta hill-climbed per epoch of 20*C accesses"),
    "oracle_admission_lru": (OracleAdmissionLRU, True,
                             "LRU admitting only blocks used again (reads the future)"),
}


# -- the run -----------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run(args: argparse.Namespace) -> dict:
    caps = QUICK_CAPACITIES if args.quick else CAPACITIES
    limit = args.quick_requests if args.quick else args.limit
    names = [n for n in CONTENDERS if not args.only or n in args.only.split(",")]
    if "lru" not in names:
        names.insert(0, "lru")  # the over_lru denominator
    out: dict = {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "trace_dir": os.path.relpath(TRACE_DIR, REPO_ROOT),  # repo-relative: no machine path in results
        "seed": SEED,
        "engine_default": ENGINE_DEFAULT,
        "descriptions": {n: CONTENDERS[n][2] for n in names},
        "oracles": [n for n in names if CONTENDERS[n][1]],
        "traces": {},
        "best_online": {},
    }
    t_all = time.perf_counter()
    for name in TRACES:
        reqs = load_trace(name, limit)
        stats = trace_stats(reqs)
        print(f"{name}: {stats['requests']:,} requests, {stats['full_blocks']:,} full blocks, "
              f"{stats['distinct_full_block_ids']:,} distinct", flush=True)
        optimum: dict[str, float] = {}
        optimum_flat: dict[str, float] = {}
        contenders: dict[str, dict] = {n: {} for n in names}
        extras: dict[str, dict] = {}
        seconds: dict[str, float] = {"optimum": 0.0, **{n: 0.0 for n in names}}
        for cap in caps:
            c = str(cap)
            t0 = time.perf_counter()
            optimum[c], optimum_flat[c] = belady_min(reqs, cap)
            seconds["optimum"] += time.perf_counter() - t0
            rates: dict[str, float] = {}
            for n in names:
                t0 = time.perf_counter()
                policy = CONTENDERS[n][0](cap, reqs)
                rates[n] = replay(reqs, cap, policy)
                dt = time.perf_counter() - t0
                seconds[n] += dt
                if policy.extra():
                    extras.setdefault(n, {})[c] = policy.extra()
                contenders[n][c] = {
                    "hit_rate": rates[n],
                    "over_optimum": _ratio(rates[n], optimum[c]),
                    "over_lru": None,  # filled in below
                    "seconds": round(dt, 3),
                }
            for n in names:
                contenders[n][c]["over_lru"] = _ratio(rates[n], rates["lru"])
            online = [n for n in names if not CONTENDERS[n][1]]
            best = max(online, key=lambda n: rates[n])
            out["best_online"].setdefault(name, {})[c] = {
                "name": best,
                "hit_rate": rates[best],
                "over_optimum": _ratio(rates[best], optimum[c]),
                "over_engine_default": _ratio(rates[best], rates[ENGINE_DEFAULT])
                if ENGINE_DEFAULT in rates else None,
            }
            print(f"  C={cap:>6}: optimum {optimum[c]:.4f} (flat {optimum_flat[c]:.4f}), "
                  f"lru {rates['lru']:.4f}, best online {best} {rates[best]:.4f} "
                  f"({time.perf_counter() - t_all:.0f} s)", flush=True)
        out["traces"][name] = {
            "stats": stats,
            "capacities": list(caps),
            "optimum": optimum,
            "optimum_flat": optimum_flat,
            "contenders": contenders,
            "extra": extras,
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
        }
    out["wall_seconds"] = time.perf_counter() - t_all
    return out


def print_report(res: dict) -> None:
    for name, t in res["traces"].items():
        caps = [str(c) for c in t["capacities"]]
        s = t["stats"]
        print(f"\n{name}: {s['requests']:,} requests, {s['full_blocks']:,} full blocks "
              f"({s['distinct_full_block_ids']:,} distinct); hit rate / optimum")
        rows = [["optimum (hit rate)", *(t["optimum"][c] for c in caps), ""],
                ["optimum, flat hits", *(t["optimum_flat"][c] for c in caps), ""]]
        for n, by_cap in t["contenders"].items():
            rows.append([n, *(by_cap[c]["over_optimum"] for c in caps), t["seconds"][n]])
        print(format_table(["contender", *(f"C={c}" for c in caps), "s (all C)"], rows))
        best = res["best_online"][name]
        print("  best online: " + ", ".join(
            f"C={c} {best[c]['name']} ({best[c]['over_optimum']:.3f})" for c in caps))
    print(f"\nwall {res['wall_seconds']:.0f} s")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(res["traces"].items())
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 5.2), squeeze=False)
    names = list(next(iter(res["traces"].values()))["contenders"])
    cmap = plt.get_cmap("tab10")
    markers = "os^vDPX*<>ph"
    styles = {n: (cmap(i % 10), "--" if n in res["oracles"] else "-", markers[i % len(markers)])
              for i, n in enumerate(names)}
    for ax, (name, t) in zip(axes[0], traces):
        caps = t["capacities"]
        for n in names:
            color, ls, marker = styles[n]
            lw = 2.6 if n == res["engine_default"] else 1.2
            ax.plot(caps, [t["contenders"][n][str(c)]["over_optimum"] for c in caps], ls, marker=marker,
                    ms=4, color=color, lw=lw, label=n + (" (engine default)" if n == res["engine_default"] else ""))
        ax.axhline(1.0, color="black", lw=0.8, ls=":", label="optimum (Belady MIN, prefix hits)")
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([f"{c // 1000}k" if c >= 1000 else str(c) for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("cache capacity (512-token blocks)")
        ax.set_ylabel("hit rate / optimum")
        ax.set_title(f"{name}")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Mooncake FAST'25: eviction / admission candidates vs Belady MIN"
                 + (" (quick)" if res.get("quick") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"first {QUICK_REQUESTS} requests of each trace, capacities 100/1000 (seconds)")
    p.add_argument("--quick-requests", type=int, default=QUICK_REQUESTS,
                   help=f"requests per trace with --quick (default {QUICK_REQUESTS})")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests of each trace")
    p.add_argument("--only", default=None, help="comma-separated contenders to run (lru is always added)")
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
    args = p.parse_args(argv)
    finish("eviction_candidates", run(args), args, print_report, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
