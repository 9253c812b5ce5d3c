"""Free-space bookkeeping of the packed pool: aligned extents, best fit, coalescing.

One allocator covers one pool slab; a chunk takes one contiguous, aligned run of it (a client
views it as one tensor in place, so it cannot be scattered). This module only
answers "where do ``n`` bytes go" and "which allocations, if freed, would make
room for ``n`` contiguous bytes"; it knows nothing of chunks, tiers or pins.

Why extents at a 64-byte grain, not pages or size classes (measured by
``bench/studies/pool_packing.py``, one run, all real geometries and a mixed churn):

* **Per-chunk waste** is the run rounded up to the grain. Real chunks are
  multiples of 4 KiB (a 128-token bf16 chunk of any model), test layouts are
  256 B. Pages of 64-256 KiB waste up to 94 % of a 4 KiB chunk; a 64-byte
  grain wastes nothing on any of them.
* **Metadata** does not grow with a small grain: an extent allocator keeps one
  record per allocation and per free gap, not one bit per page, so a 1 GiB
  pool of 40 MiB chunks and one of 4 KiB chunks cost the same per chunk.
* **Size classes** (a slab region per layout) waste whole regions when the
  layout mix shifts; best fit over one address space with coalescing let the
  mixed churn keep >= 90 % of the pool holding KV (see the bench's JSON).

Fragmentation is bounded by three rules: best fit (the smallest gap that
fits, lowest address on ties), immediate coalescing of neighbouring gaps, and
:meth:`ExtentAllocator.window` for the eviction path: when freeing in LRU
order has made enough bytes free but no gap is long enough, the store evicts
the cheapest contiguous window (fewest allocated bytes) instead of evicting
further down the LRU order.

Not thread-safe; the pool's caller (the store) holds its lock.
"""

from __future__ import annotations

import bisect
from typing import Callable

from kvcached.contract.errors import InternalInvariantError

#: Allocation grain: every chunk starts at a multiple of it (see kvcached.config.BLOCK_ALIGN).
GRAIN = 64


def round_up(n: int, grain: int = GRAIN) -> int:
    return -(-n // grain) * grain


class ExtentAllocator:
    """Allocations of aligned runs in ``[0, capacity)``; offsets are byte offsets."""

    __slots__ = ("capacity", "grain", "_alloc", "_free_start", "_free_end", "_by_size", "_free_bytes")

    def __init__(self, capacity: int, grain: int = GRAIN) -> None:
        if grain <= 0 or capacity < grain:
            raise ValueError(f"an extent allocator needs capacity >= grain > 0, got {capacity} and {grain}")
        self.grain = grain
        self.capacity = capacity // grain * grain
        self._alloc: dict[int, int] = {}  # offset -> allocated (rounded) size
        self._free_start: dict[int, int] = {}  # gap start -> length
        self._free_end: dict[int, int] = {}  # gap end -> start
        self._by_size: list[tuple[int, int]] = []  # (length, start), sorted: best fit by bisect
        self._free_bytes = 0
        self._add_gap(0, self.capacity)

    # -- queries ---------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def used_bytes(self) -> int:
        return self.capacity - self._free_bytes

    @property
    def largest_gap(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def gaps(self) -> int:
        return len(self._by_size)

    def __len__(self) -> int:
        return len(self._alloc)

    def size_of(self, offset: int) -> int:
        return self._alloc[offset]

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`alloc` of ``nbytes`` would succeed now."""
        return self.largest_gap >= round_up(nbytes, self.grain)

    # -- alloc / free ------------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new run of ``nbytes`` (rounded up to the grain), or None if no gap fits."""
        if nbytes <= 0:
            raise ValueError("an allocation needs a positive size")
        size = round_up(nbytes, self.grain)
        i = bisect.bisect_left(self._by_size, (size, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._remove_gap(start, length, i)
        if length > size:
            self._add_gap(start + size, length - size)
        self._alloc[start] = size
        return start

    def free(self, offset: int) -> int:
        """Return the run at ``offset``; merges it with the gaps beside it. Returns its size."""
        size = self._alloc.pop(offset, None)
        if size is None:
            raise InternalInvariantError(f"pool offset {offset} is not allocated")
        start, end = offset, offset + size
        before = self._free_end.get(start)
        if before is not None:
            self._remove_gap(before, start - before)
            start = before
        after = self._free_start.get(end)
        if after is not None:
            self._remove_gap(end, after)
            end += after
        self._add_gap(start, end - start)
        return size

    # -- eviction support ------------------------------------------------------------

    def window(self, nbytes: int, evictable: Callable[[int], bool]) -> list[int] | None:
        """The allocations to free for a gap of ``nbytes``: the contiguous window made only of
        gaps and allocations for which ``evictable(offset)`` holds, that frees the fewest
        allocated bytes (then the lowest address). None if no such window exists.

        O(n log n) in allocations: the store calls it only when evicting in LRU order did not
        make a long enough gap (a fragmented pool), not on every reservation.
        """
        need = round_up(nbytes, self.grain)
        runs = sorted([(off, size, True) for off, size in self._alloc.items()]
                      + [(s, n, False) for s, n in self._free_start.items()])
        best: tuple[int, int, int, int] | None = None  # (cost, start, first index, last index)
        lo = 0
        span = cost = 0
        for hi, (off, size, used) in enumerate(runs):
            if used and not evictable(off):
                lo, span, cost = hi + 1, 0, 0
                continue
            span += size
            cost += size if used else 0
            while span - runs[lo][1] >= need:  # drop from the left while it still fits
                span -= runs[lo][1]
                cost -= runs[lo][1] if runs[lo][2] else 0
                lo += 1
            if span >= need and (best is None or cost < best[0]):
                best = (cost, runs[lo][0], lo, hi)
        if best is None:
            return None
        _, _, first, last = best
        return [off for off, _size, used in runs[first : last + 1] if used]

    def check(self) -> None:
        """Full consistency check (tests): gaps and allocations tile the slab, gaps never touch."""
        pieces = sorted([(o, s) for o, s in self._alloc.items()] + list(self._free_start.items()))
        pos = 0
        for off, size in pieces:
            if off != pos or size <= 0 or off % self.grain:
                raise InternalInvariantError(f"extent at {off} (+{size}) breaks the tiling at {pos}")
            pos += size
        if pos != self.capacity:
            raise InternalInvariantError(f"extents cover {pos} of {self.capacity} bytes")
        for start, length in self._free_start.items():
            if start + length in self._free_start:
                raise InternalInvariantError(f"gaps at {start} and {start + length} were not merged")
        if sum(self._free_start.values()) != self._free_bytes or len(self._by_size) != len(self._free_start):
            raise InternalInvariantError("free-byte accounting is off")

    # -- internals -----------------------------------------------------------------

    def _add_gap(self, start: int, length: int) -> None:
        self._free_start[start] = length
        self._free_end[start + length] = start
        bisect.insort(self._by_size, (length, start))
        self._free_bytes += length

    def _remove_gap(self, start: int, length: int, index: int | None = None) -> None:
        del self._free_start[start]
        del self._free_end[start + length]
        if index is None:
            index = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[index]
        self._free_bytes -= length
