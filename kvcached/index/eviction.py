"""Eviction order: the policy that ranks evictable chunks, and the queues kept in that order.

The index decides *which* chunks may leave (leaf-first, never pinned, see
:mod:`kvcached.index.trie`); the policy here decides in *which order*. A queue pops the member
with the lowest key; the key is computed when a member is pushed (on insert, use or release),
so a queue is a binary heap with lazy deletion. Membership is a bit on the node; a heap entry
is valid only while the node still has that bit *and* the ``last_use`` and ``hits`` it had
when the entry was pushed. Touching a member pushes a fresh entry; stale entries are skipped
on pop and the heap is compacted once they outnumber live ones, so every operation is
O(log n) amortised and no eviction ever rescans the index.

Why not an ``OrderedDict`` moved-to-end on touch: a node can become evictable long after its
last use (a parent whose last child was just evicted), and it must then queue by its real
rank, not at the young end.

Policies
--------
``lru``
    key = last use. What the engine did before; still the order of TTL expiry (``leaves``).

``adaptive`` (the default)
    The ``frequency`` key below, with its ``weight`` chosen online instead of fixed: miniature
    simulations (:mod:`kvcached.index.minisim`) replay the live requests, on a hash-sampled
    share of the chunks, through small caches at weights 0 (LRU), 0.5, 1 and 4, and every
    epoch the policy takes the weight whose cache hit best (by a 2 % margin), then re-ranks its
    queues under it. No feedback from the real cache's hit rate, so nothing to run away: if LRU
    would do best, the policy is LRU.

``frequency``
    key = last use + ``weight`` x tau x (hits - 1): recency, boosted by how many requests
    used the chunk. ``hits`` counts the acquires that matched it plus the commit that stored
    it, and survives eviction in a count-min sketch (:mod:`kvcached.index.sketch`), so a chunk
    that comes back resumes its count. tau is the time the workload takes to use as many
    chunks as the pool holds (``scale_chunks`` / measured chunk uses per second): one more
    hit keeps a chunk about one pool turnover longer than plain LRU would. Every chunk of a
    prompt's prefix gains a hit whenever any longer prompt through it is used, so a node's
    value grows with the requests that pass through it and a long single-request tail has
    ``hits == 1``: it is the first to go, while a shared system prompt or a document asked
    about many times stays. Counts and the sketch live in memory only: after a restart the
    chunks rebuilt from NVMe start at one hit again.

Why ``adaptive``, by measurement: no fixed weight is right everywhere. ``bench/trace_replay.py``
replays the three policies in the real engine on the Mooncake traces and five synthetic
workloads; ``frequency`` (weight 1) reaches 1.44x the LRU engine on the conversation trace at 1k
blocks and 1.41x on a scan, but 0.86x on agent sessions at 20 % of their blocks and 0.88x behind
a shared tool prefix at 5 % (once-hot context chunks keep their boost long after their session
ended). ``adaptive`` reaches 1.74x and 1.44x there and never less than 0.993x LRU anywhere; its
mini caches cost about 15 us per request (engine time 1.03-1.18x the LRU engine's).

Why the frequency key, by measurement. ``bench/sim/eviction_candidates.py`` replays the candidates on the
Mooncake FAST'25 traces (512-token blocks) with the engine's rules (prefix hits, leaf-first
eviction, the extended prefix pinned); ratios to the offline optimum (Belady's MIN with bypass)
at 1k / 10k blocks, conversation then synthetic:

=========================  ===========  ===========  ==================================
candidate                  conversation synthetic    note
=========================  ===========  ===========  ==================================
lru                        0.24 / 0.59  0.31 / 0.70  the old order
frequency, weight 1        0.35 / 0.64  0.33 / 0.72  kept: the best mean but one, never
                                                     more than 0.15 % below LRU anywhere
frequency, no sketch       0.24 / 0.61  0.33 / 0.71  counts forgotten on eviction
frequency, weight 0.5 / 2  0.29 / 0.64  0.34 / 0.72  no weight is best everywhere
                           0.40 / 0.59  0.33 / 0.71
frequency + doorkeeper     0.35 / 0.64  0.31 / 0.71  TinyLFU-style admission (option)
frequency, hill-climbed    0.40 / 0.63  0.32 / 0.72  gains only where one epoch is short
LFU (counts remembered)    0.41 / 0.51  0.31 / 0.69  collapses from 10k up (0.85x LRU at 30k)
GDSF (LFU with aging)      0.29 / 0.62  0.33 / 0.72
LRU-2                      0.27 / 0.60  0.29 / 0.73
hyperbolic (sampled, 32)   0.40 / 0.64  0.30 / 0.71  below LRU at synthetic 1k; needs 32
                                                     scores per eviction, no heap
oracle admission + LRU     0.36 / 0.89  0.41 / 0.84  knows which chunks come back
=========================  ===========  ===========  ==================================

* The sketch is what earns the gain at small capacities: a conversation's next turn comes
  hundreds of requests later, long after its chunks were evicted (without it, 0.24 at 1k).
* A key fixed at push time keeps the policy a heap: O(log n) per use, no sampling; in the
  engine it costs <= 1.1x LRU's time per request in ``bench/trace_replay.py``.
* Ranks stay as pushed while tau, and so the boost, is measured again every epoch: members
  pushed in different epochs are ranked on slightly different scales. Accepted, by
  measurement: re-ranking both queues at every change of the boost moved the default's hit
  rate by 0.989-1.032x (``frequency``: 0.984-1.069x) on the conversation trace at 1k and 10k
  blocks and on five synthetic workloads, inside the +-3 % by which the store's random hash
  key alone moves the default from run to run (the same replay of the shift workload at 68
  blocks: 0.386-0.409 over four runs). A change of *weight* (an ``adaptive`` switch) changes
  the scale by a factor, not a drift, and does re-rank.
* On agent sessions at 0.5 % and 1 % of their blocks (57 and 114), a request's context averages
  97 blocks, so a miss replaces most of the pool whatever the order: every policy reaches the
  same hit rate (1.00-1.02x LRU). Only admission could keep more, and the
  doorkeepers tried (this module's at weights 1 and 4; one on an LRFU key, half-lives of 0.5,
  2 and 8 turnovers) reached 0.57-1.04x LRU. The session a request continues is drawn
  uniformly there, and no online policy can expect more than 0.52x the offline optimum at 57
  blocks (``bench/workloads.py``, ``online_bound``): the optimum knows which session comes next.
* At 1k blocks nothing online comes near 0.7 of the optimum: even the oracle that admits exactly
  the chunks that will ever be used again reaches 0.36 / 0.41 under LRU. The optimum's edge
  there is knowing *when* a chunk returns. At 10k, admission is what is missing (the oracle
  reaches 0.89), but no signal seen at a chunk's first use predicts its reuse on the
  conversation trace (its parent's count, its distance from the prompt's end, the prompt's
  number of new chunks, the request's output length: 0.12-0.43 reuse probability, against 0.26
  overall).

Not thread-safe: the owning index's caller holds the store lock.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, Protocol, Sequence, TypeVar

from kvcached.config import ADMISSIONS, EVICTION_POLICIES, AdmissionName, EvictionPolicyName
from kvcached.index.minisim import MiniSims
from kvcached.index.sketch import FrequencySketch
from kvcached.contract.keys import ChunkHash

#: The policies' names (the first is the default); admissions: "always" stores every chunk a
#: reservation has room for, "frequency" is a doorkeeper.
POLICIES: tuple[EvictionPolicyName, ...] = EVICTION_POLICIES


class Queued(Protocol):
    hash: ChunkHash
    last_use: float
    hits: int
    qflags: int


N = TypeVar("N", bound=Queued)  # what a queue holds: the index's nodes


class EvictionPolicy(Protocol):
    """How the index ranks evictable chunks. Lower keys leave first."""

    name: EvictionPolicyName
    #: Whether :meth:`admits` can ever say no (the write path skips asking otherwise).
    screens: bool
    #: Whether :meth:`key` is the last use (queues then rank members without calling it).
    by_last_use: bool

    def key(self, node: Queued) -> float: ...

    def initial_hits(self, hashes: Sequence[ChunkHash]) -> list[int]:
        """``hits`` of each chunk being inserted (its remembered count, plus this use): one call
        for a prompt's chunks, as the index inserts them in one go."""
        ...

    def used(self, n: int, now: float) -> None:
        """``n`` chunks were used (matched by an acquire, or stored) at ``now``."""
        ...

    def forget(self, node: Queued) -> None:
        """``node`` leaves the index."""
        ...

    def admits(self, h: ChunkHash, now: float, victim: Queued) -> bool:
        """Whether a new chunk ``h`` is worth evicting ``victim`` (the next to go) for."""
        ...

    def requested(self, hashes: Sequence[ChunkHash], now: float) -> bool:
        """A request asked for a prompt of these chunk hashes (all of them, cached or not).
        True when the policy's keys changed scale: the queues must re-rank their members."""
        ...

    def set_scale(self, scale_chunks: int) -> None:
        """The pool now holds about ``scale_chunks`` chunks (the store calls this when the
        layouts or the mean chunk size change)."""
        ...

    def set_weight(self, weight: float) -> None:
        """``eviction_weight`` was reloaded (SIGHUP); a policy without a weight ignores it."""
        ...

    def describe(self) -> dict[str, float | int | str]:
        """What the policy is doing now, for stats: at least ``policy`` and ``admission``."""
        ...


class LruPolicy:
    """Least recently used first."""

    name: EvictionPolicyName = "lru"
    screens = False
    by_last_use = True

    def key(self, node: Queued) -> float:
        return node.last_use

    def initial_hits(self, hashes: Sequence[ChunkHash]) -> list[int]:
        return [1] * len(hashes)

    def used(self, n: int, now: float) -> None:
        pass

    def forget(self, node: Queued) -> None:
        pass

    def admits(self, h: ChunkHash, now: float, victim: Queued) -> bool:
        return True

    def requested(self, hashes: Sequence[ChunkHash], now: float) -> bool:
        return False

    def set_scale(self, scale_chunks: int) -> None:
        pass

    def set_weight(self, weight: float) -> None:
        pass

    def describe(self) -> dict[str, float | int | str]:
        return {"policy": self.name, "admission": "always"}


class FrequencyPolicy:
    """Frequency-boosted recency (see the module docstring).

    ``scale_chunks`` is how many chunks the pool holds (the store keeps it current);
    ``weight`` is how many pool turnovers one more hit is worth; ``memory_chunks`` is the
    sketch's width (evicted chunks remembered, and how often the counts are halved).
    """

    name: EvictionPolicyName = "frequency"
    by_last_use = False

    def __init__(self, *, weight: float = 1.0, scale_chunks: int = 1, memory_chunks: int = 1 << 22,
                 admission: AdmissionName = "always", epoch_uses: int = 0) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {admission!r}; one of {', '.join(ADMISSIONS)}")
        self.admission = admission
        self.screens = admission != "always"
        self.weight = float(weight)
        self.epoch_uses = int(epoch_uses)  # uses between two rate measurements; 0: a pool's worth (64..4096)
        self._fixed: float | None = None
        self.scale_chunks = max(int(scale_chunks), 1)
        self.sketch = FrequencySketch(memory_chunks)
        self._boost = 0.0  # seconds per extra hit: weight * tau; 0 (plain LRU) until the rate is known
        self._rate = 0.0  # chunk uses per second, smoothed
        self._epoch_start: float | None = None
        self._epoch_uses = 0

    def key(self, node: Queued) -> float:
        return node.last_use + self._boost * (node.hits - 1)

    def initial_hits(self, hashes: Sequence[ChunkHash]) -> list[int]:
        return [n + 1 for n in self.sketch.estimate_many(hashes)]

    def used(self, n: int, now: float) -> None:
        if self._epoch_start is None:
            self._epoch_start = now
            return
        self._epoch_uses += n
        if self._epoch_uses < (self.epoch_uses or min(4096, max(64, self.scale_chunks))):
            return
        span = now - self._epoch_start
        if span > 0:
            rate = self._epoch_uses / span
            self._rate = rate if not self._rate else 0.5 * self._rate + 0.5 * rate
            self._update_boost()
        self._epoch_start, self._epoch_uses = now, 0

    def _update_boost(self) -> None:
        if self._fixed is not None:
            self._boost = self.weight * self._fixed
        else:
            self._boost = self.weight * self.scale_chunks / self._rate if self._rate > 0 else 0.0

    def fix_turnover(self, seconds: float | None) -> None:
        """Pin tau instead of measuring it (None: measure again). For tests and replays that
        need an exact order."""
        self._fixed = None if seconds is None else float(seconds)
        self._update_boost()

    @property
    def boost(self) -> float:
        """Seconds of recency one more hit is worth now (weight x tau)."""
        return self._boost

    def set_scale(self, scale_chunks: int) -> None:
        self.scale_chunks = max(int(scale_chunks), 1)
        self._update_boost()

    def set_weight(self, weight: float) -> None:
        self.weight = float(weight)
        self._update_boost()

    def forget(self, node: Queued) -> None:
        self.sketch.record(node.hash, node.hits)

    def requested(self, hashes: Sequence[ChunkHash], now: float) -> bool:
        return False

    def admits(self, h: ChunkHash, now: float, victim: Queued) -> bool:
        """With ``admission="frequency"`` (a TinyLFU-style doorkeeper): only if the new chunk,
        used now with its remembered count, would rank above the victim. Otherwise always."""
        if self.admission == "always":
            return True
        return now + self._boost * self.sketch.estimate(h) >= self.key(victim)

    @property
    def turnover_seconds(self) -> float:
        """tau: the measured time to use ``scale_chunks`` chunks (0 until known)."""
        if self._fixed is not None:
            return self._fixed
        return self.scale_chunks / self._rate if self._rate > 0 else 0.0

    def describe(self) -> dict[str, float | int | str]:
        return {"policy": self.name, "admission": self.admission, "weight": self.weight,
                "scale_chunks": self.scale_chunks,
                "turnover_seconds": self.turnover_seconds, "sketch_width": self.sketch.width,
                "sketch_bytes": self.sketch.nbytes}


class AdaptivePolicy(FrequencyPolicy):
    """The ``frequency`` key with its weight chosen online by miniature simulations
    (:mod:`kvcached.index.minisim`): every epoch, the weight whose mini cache hit best on the
    same requests, LRU (weight 0) among the candidates. It starts as LRU and moves only on
    evidence (``weight`` is ignored: starting at 1 cost up to 0.9 % against LRU on the agent
    workloads before the first switch, starting at 0 nothing measurable anywhere)."""

    name: EvictionPolicyName = "adaptive"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.sims = MiniSims(self.scale_chunks, 0.0)
        super().set_weight(self.sims.weight)

    def requested(self, hashes: Sequence[ChunkHash], now: float) -> bool:
        if not self.sims.observe(hashes, now, self.turnover_seconds):
            return False
        super().set_weight(self.sims.weight)
        return True

    def set_scale(self, scale_chunks: int) -> None:
        super().set_scale(scale_chunks)
        self.sims.resize(self.scale_chunks)

    def set_weight(self, weight: float) -> None:
        """A reloaded ``eviction_weight`` does not override the measured choice."""

    def describe(self) -> dict[str, float | int | str]:
        return {**super().describe(), **self.sims.describe()}


def make_policy(name: EvictionPolicyName, *, weight: float = 1.0, scale_chunks: int = 1,
                memory_chunks: int = 1 << 22, admission: AdmissionName = "always") -> LruPolicy | FrequencyPolicy:
    if name == "lru":
        if admission != "always":
            raise ValueError("admission control needs the frequency policy (it ranks by remembered counts)")
        return LruPolicy()
    if name in ("frequency", "adaptive"):
        cls = AdaptivePolicy if name == "adaptive" else FrequencyPolicy
        return cls(weight=weight, scale_chunks=scale_chunks, memory_chunks=memory_chunks, admission=admission)
    raise ValueError(f"unknown eviction policy {name!r}; one of {', '.join(POLICIES)}")


class EvictionQueue(Generic[N]):
    """Evictable members in ``key`` order (None: last use). Not thread-safe."""

    __slots__ = ("_bit", "_heap", "_key", "_live", "_seq")

    def __init__(self, bit: int, key: Callable[[N], float] | None = None) -> None:
        self._bit = bit
        self._key = key
        self._heap: list[tuple[float, int, N, float, int]] = []
        self._live = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._live

    def __contains__(self, node: N) -> bool:
        return bool(node.qflags & self._bit)

    def key(self, node: N) -> float:
        """The rank ``node`` would have if pushed now (lower leaves first)."""
        return node.last_use if self._key is None else self._key(node)

    def add(self, node: N) -> None:
        """Make ``node`` a member (no-op if it already is)."""
        if node.qflags & self._bit:
            return
        node.qflags |= self._bit
        self._live += 1
        self._push(node)

    def discard(self, node: N) -> None:
        if node.qflags & self._bit:
            node.qflags &= ~self._bit
            self._live -= 1

    def touched(self, node: N) -> None:
        """Call after changing a member's ``last_use`` or ``hits``: re-queues it at its new rank."""
        if node.qflags & self._bit:
            self._push(node)

    def peek(self) -> N | None:
        """The member to evict first, or None. Does not remove it."""
        heap = self._heap
        bit = self._bit
        while heap:
            _, _, node, last_use, hits = heap[0]
            if node.qflags & bit and node.last_use == last_use and node.hits == hits:
                return node
            heapq.heappop(heap)
        return None

    def pop(self) -> N | None:
        node = self.peek()
        if node is not None:
            heapq.heappop(self._heap)
            self.discard(node)
        return node

    def rekey(self) -> None:
        """Rank every member by its key *now* (after the policy's scale changed): O(members)."""
        if self._key is None:
            return  # ranked by last use: nothing changed scale
        key = self._key
        self._heap = [(key(n), seq, n, lu, h) for (_, seq, n, lu, h) in self._live_entries()]
        heapq.heapify(self._heap)

    def _push(self, node: N) -> None:
        key = node.last_use if self._key is None else self._key(node)
        heapq.heappush(self._heap, (key, next(self._seq), node, node.last_use, node.hits))
        if len(self._heap) > 2 * self._live + 1024:
            self._compact()

    def _compact(self) -> None:
        self._heap = self._live_entries()
        heapq.heapify(self._heap)

    def _live_entries(self) -> list[tuple[float, int, N, float, int]]:
        """The heap's valid entries, one per member: the newest push holds the current rank."""
        best: dict[int, tuple[float, int, N, float, int]] = {}
        bit = self._bit
        for entry in self._heap:
            node = entry[2]
            if node.qflags & bit and node.last_use == entry[3] and node.hits == entry[4]:
                old = best.get(id(node))
                if old is None or entry[1] > old[1]:
                    best[id(node)] = entry
        return list(best.values())
