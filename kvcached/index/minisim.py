"""Miniature simulations: which eviction weight would this workload reward, measured online.

The ``frequency`` key is ``last use + weight x tau x (hits - 1)``. Weight 0 is LRU; a large
weight protects chunks that many requests used. No single weight is right everywhere: a
scan streaming past a hot set, or a conversation's next turn hundreds of requests later,
reward a large one; a working set that moves on (long agent sessions that end, a hot set
replaced) punishes it, because a once-hot chunk keeps its boost long after its last use. So
the ``adaptive`` policy does not fix the weight: it replays the live request stream through a
few small caches, one per candidate weight (0, i.e. LRU, included), and uses the weight whose
cache is hitting best.

This is the miniature-simulation method of Waldspurger et al., "Cache Modeling and
Optimization using Miniature Simulations" (USENIX ATC '17), built on SHARDS' spatial
sampling: a chunk takes part iff its hash falls in a fixed fraction ``rate`` of the hash space
(chunk hashes are keyed SHA-256, so uniform), and each mini cache holds ``rate`` x the pool's
chunks. Sampling by hash keeps every use of a sampled chunk, so each mini cache sees the same
reuse pattern as the real pool, scaled down. ``rate`` is chosen so a mini cache holds about
:data:`MINI_CHUNKS` chunks, sampling at most a sixteenth of the chunks (the cost bound: about
15 us per request on a 2-core box; an eighth bought no hit rate on the bench's workloads), so
memory and time are bounded whatever the pool's size.

How it avoids the failure of weight adaptation by feedback (ARC-style "more hits in this
ghost list, so move that way", measured here to run away to its bounds, and the hill climber
of Caffeine's W-TinyLFU, which needs a decaying step and restarts to stay put): it never
infers a direction from the *real* cache's hit rate, which every change of weight perturbs. It
compares the candidates *side by side on the same requests*, every epoch, and moves only when
another candidate's (exponentially smoothed) hit count beats the current one's by a margin.
If LRU's mini cache is best, the policy is LRU.

What the mini caches model: a block cache with the engine's prefix-hit rule (a sampled chunk
counts as a hit only if every earlier sampled chunk of the same request hit) and the same key
as the engine; every sampled chunk of a request is used, then the cache evicts down to its
size, a prompt's deeper chunks first among equal keys (the engine evicts leaf-first). They do
not model pins. Counts are the number of uses, never aged (as the engine's ``hits``: its
sketch ages only after millions of evictions); the counts of at most
:data:`SEEN_PER_CHUNK` x the mini cache's size sampled chunks are kept.

Not thread-safe: called with the store lock held.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from kvcached.contract.keys import ChunkHash

#: Chunks a mini cache holds (the sample rate follows from the pool's size).
MINI_CHUNKS = 1024
#: Never sample more than this share of chunks (bounds the cost on small pools).
MAX_RATE = 1 / 16
#: The candidate weights; 0 is LRU.
WEIGHTS: tuple[float, ...] = (0.0, 0.5, 1.0, 4.0)
#: Smoothing of each candidate's hits across epochs (the share of the past kept).
DECAY = 0.75
#: Switch only when a candidate beats the current weight's smoothed hits by this factor.
MARGIN = 1.02
#: Remember the use counts of at most this many sampled chunks per mini-cache chunk.
SEEN_PER_CHUNK = 32
_SPACE = 1 << 32


class _Mini:
    """One mini cache: members and a heap of (key, seq, hash, last use at push)."""

    __slots__ = ("weight", "members", "heap", "hits", "score")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.members: set[ChunkHash] = set()
        self.heap: list[tuple[float, int, ChunkHash, float]] = []
        self.hits = 0  # this epoch
        self.score = 0.0  # smoothed over epochs


class MiniSims:
    """Mini caches at :data:`WEIGHTS`, fed each request's chunk hashes; :attr:`weight` is the
    one to use. ``tau`` (seconds per pool turnover, passed to :meth:`observe`) is the real
    policy's."""

    def __init__(self, scale_chunks: int, weight: float, weights: Sequence[float] = WEIGHTS) -> None:
        self.sims = [_Mini(w) for w in weights]
        self.current = min(range(len(self.sims)), key=lambda i: abs(self.sims[i].weight - weight))
        self._seen: dict[ChunkHash, list[float]] = {}  # sampled hash -> [last use, uses]
        self._seq = itertools.count()
        self.epochs = 0
        self.switches = 0
        self._epoch_left = 0
        self.resize(scale_chunks)

    def resize(self, scale_chunks: int) -> None:
        """The pool now holds ``scale_chunks`` chunks: rescale the sample (mini caches keep what
        they hold; the next uses trim them)."""
        scale = max(int(scale_chunks), 1)
        self.rate = min(MAX_RATE, MINI_CHUNKS / scale)
        # A hash is sampled iff its first 4 bytes, read big-endian, are below rate x 2^32:
        # comparing the whole hash with these 4 bytes says exactly that (bytes compare
        # lexicographically), with no slicing or conversion per hash.
        self._threshold = min(int(self.rate * _SPACE), _SPACE - 1).to_bytes(4, "big")
        self.capacity = max(1, int(round(scale * self.rate)))
        self.epoch_uses = max(256, 2 * self.capacity)
        if not self._epoch_left:
            self._epoch_left = self.epoch_uses

    @property
    def weight(self) -> float:
        return self.sims[self.current].weight

    def sample(self, hashes: Sequence[ChunkHash]) -> list[ChunkHash]:
        """The hashes of ``hashes`` that fall in the sample, in order."""
        t = self._threshold
        return [h for h in hashes if h < t]

    def observe(self, hashes: Sequence[ChunkHash], now: float, tau: float) -> bool:
        """Replay one request (its whole prompt's chunk hashes, in order) through every mini
        cache. Returns True when the epoch ended and :attr:`weight` changed."""
        sampled = self.sample(hashes)
        if not sampled:
            return False
        seen = self._seen
        counts = []
        for h in sampled:
            e = seen.get(h)
            if e is None:
                seen[h] = e = [now, 0.0]
            e[0] = now
            e[1] += 1.0
            counts.append(e[1])
        cap, seq = self.capacity, self._seq
        for sim in self.sims:
            members, heap = sim.members, sim.heap
            hit = 0
            for h in sampled:
                if h not in members:
                    break
                hit += 1
            sim.hits += hit
            boost = sim.weight * tau
            # Deepest first: among equal keys the earlier push leaves first, so a prompt's tail
            # goes before its prefix, as the engine's leaf-first eviction has it.
            for h, c in zip(reversed(sampled), reversed(counts)):
                heapq.heappush(heap, (now + boost * (c - 1.0), next(seq), h, now))
                members.add(h)
            while len(members) > cap:
                _, _, h, at = heapq.heappop(heap)
                if h in members and seen[h][0] == at:  # a live entry: the member's latest push
                    members.discard(h)
            if len(heap) > 4 * cap + 64:
                self._compact(sim)
        self._epoch_left -= len(sampled)
        return self._epoch_left <= 0 and self._end_epoch()

    def _end_epoch(self) -> bool:
        self._epoch_left = self.epoch_uses
        self.epochs += 1
        for sim in self.sims:
            sim.score = DECAY * sim.score + sim.hits
            sim.hits = 0
        if len(self._seen) > SEEN_PER_CHUNK * self.capacity:
            self._prune()
        cur = self.sims[self.current]
        best = max(range(len(self.sims)), key=lambda i: self.sims[i].score)
        if best != self.current and self.sims[best].score > MARGIN * cur.score + 1.0:
            self.current = best
            self.switches += 1
            return True
        return False

    def _prune(self) -> None:
        """Bound the remembered counts: forget sampled chunks that no mini cache holds, those used
        once first (the engine's sketch forgets too, but only after its width of evictions)."""
        live: set[ChunkHash] = set()
        for sim in self.sims:
            live |= sim.members
        seen = self._seen
        for h in [h for h, e in seen.items() if e[1] < 2.0 and h not in live]:
            del seen[h]
        if len(seen) > SEEN_PER_CHUNK * self.capacity // 2:
            for h in [h for h in seen if h not in live]:
                del seen[h]

    def _compact(self, sim: _Mini) -> None:
        seen = self._seen
        sim.heap = [e for e in sim.heap if e[2] in sim.members and seen[e[2]][0] == e[3]]
        heapq.heapify(sim.heap)

    def describe(self) -> dict[str, float | int | str]:
        return {"sample_rate": self.rate, "mini_chunks": self.capacity, "epochs": self.epochs,
                "switches": self.switches,
                "scores": ",".join(f"{s.weight:g}:{s.score:.0f}" for s in self.sims)}
