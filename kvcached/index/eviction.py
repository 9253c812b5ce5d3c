"""Exact-LRU eviction queues, kept up to date incrementally.

A queue holds the nodes that are currently evictable for one purpose, ordered
by ``(last_use, insertion sequence)``. It is a binary heap with lazy
deletion: membership is a bit on the node, and a heap entry is valid only
while the node still has that bit *and* the same ``last_use`` it had when the
entry was pushed. Touching a member pushes a fresh entry; stale entries are
skipped on pop and the heap is compacted once they outnumber live ones, so
every operation is O(log n) amortised and no eviction ever rescans the index.

Why not an ``OrderedDict`` moved-to-end on touch: a node can become evictable
long after its last use (a parent whose last child was just evicted), and it
must then queue by its real last use, not at the young end.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol


class Queued(Protocol):
    last_use: float
    qflags: int


class EvictionQueue:
    """Not thread-safe: the owning index's caller holds the store lock."""

    __slots__ = ("_bit", "_heap", "_live", "_seq")

    def __init__(self, bit: int) -> None:
        self._bit = bit
        self._heap: list[tuple[float, int, Queued]] = []
        self._live = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._live

    def __contains__(self, node: Queued) -> bool:
        return bool(node.qflags & self._bit)

    def add(self, node: Queued) -> None:
        """Make ``node`` a member (no-op if it already is)."""
        if node.qflags & self._bit:
            return
        node.qflags |= self._bit
        self._live += 1
        self._push(node)

    def discard(self, node: Queued) -> None:
        if node.qflags & self._bit:
            node.qflags &= ~self._bit
            self._live -= 1

    def touched(self, node: Queued) -> None:
        """Call after changing a member's ``last_use``: re-queues it at its new age."""
        if node.qflags & self._bit:
            self._push(node)

    def peek(self) -> Queued | None:
        """The least recently used member, or None. Does not remove it."""
        heap = self._heap
        while heap:
            last_use, _, node = heap[0]
            if node.qflags & self._bit and node.last_use == last_use:
                return node
            heapq.heappop(heap)
        return None

    def pop(self) -> Queued | None:
        node = self.peek()
        if node is not None:
            heapq.heappop(self._heap)
            self.discard(node)
        return node

    def _push(self, node: Queued) -> None:
        heapq.heappush(self._heap, (node.last_use, next(self._seq), node))
        if len(self._heap) > 2 * self._live + 1024:
            self._compact()

    def _compact(self) -> None:
        best: dict[int, tuple[float, int, Queued]] = {}
        for entry in self._heap:
            last_use, _, node = entry
            if node.qflags & self._bit and node.last_use == last_use:
                best.setdefault(id(node), entry)
        self._heap = list(best.values())
        heapq.heapify(self._heap)
