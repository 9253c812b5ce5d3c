"""A count-min sketch of how often evicted chunks were used: the eviction policy's memory.

When a chunk leaves the index its use count would be lost, and a chunk that comes back (the
next turn of a conversation, a document queried again) would start over as a one-hit chunk.
The sketch keeps an approximate count for every chunk hash it was told about, in a fixed
amount of memory: two rows of ``width`` saturating 8-bit counters, one counter per row chosen
by bits of the chunk hash (already a keyed SHA-256, so uniformly spread; no further hashing:
row i takes the i-th 32-bit word of the hash, masked to the width). Two rows, not the usual
four: this runs once per eviction and once per stored chunk, in Python, and halving it mattered
more than the collisions (a chunk never seen reads as seen with probability (n / width)^2 for n
remembered chunks). The store's default width, 2^22 (8 MiB), keeps them rare: replaying the
Mooncake conversation trace at 10k blocks, 2^20 / 2^21 / 2^22 reached 0.623 / 0.629 / 0.633 of
the optimum, where an exact memory (no collisions) reaches 0.636. A count is the minimum over
the rows, so collisions can only inflate it, and :meth:`record` uses the conservative update
(raise each row only up to the new value), which keeps that inflation small. It is a Bloom
filter with counters: it answers "how often was this seen" for chunks it no longer stores.

Aging: after ``width`` records every counter is halved, so old popularity fades and the
counters never saturate for good; ``width`` is therefore also "how many evictions it
remembers" (bench/trace_replay.py measured that forgetting sooner costs hit rate at small
capacities, where a chunk's next use comes many evictions later).

Not thread-safe: the index's caller holds the store lock.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from kvcached.contract.keys import ChunkHash

#: Counters saturate here (8 bits).
MAX_COUNT = 255
_TWO_WORDS = struct.Struct("<2I").unpack_from  # one row index from each 32-bit word of the hash


class FrequencySketch:
    """Two rows of ``width`` 8-bit counters in one ``bytearray`` (indexing a bytearray is
    several times cheaper than indexing a numpy array from Python; numpy only halves it)."""

    __slots__ = ("_mask", "_recorded", "_table", "width")

    ROWS = 2

    def __init__(self, width: int) -> None:
        if width < 64 or width & (width - 1) or width > 1 << 28:
            raise ValueError("the sketch width must be a power of two in 64..2**28")
        self.width = width
        self._mask = width - 1
        self._table = bytearray(self.ROWS * width)
        self._recorded = 0

    @property
    def nbytes(self) -> int:
        return len(self._table)

    def estimate(self, h: ChunkHash) -> int:
        """The (over-)estimated count of ``h``; 0 if never recorded (or aged out)."""
        a, b = _TWO_WORDS(h)
        t = self._table
        x, y = t[a & self._mask], t[self.width + (b & self._mask)]
        return x if x < y else y

    def estimate_many(self, hashes: Sequence[ChunkHash]) -> list[int]:
        """:meth:`estimate` of each of ``hashes`` (one call for a prompt's chunks)."""
        t, mask, width = self._table, self._mask, self.width
        out = []
        for h in hashes:
            a, b = _TWO_WORDS(h)
            x, y = t[a & mask], t[width + (b & mask)]
            out.append(x if x < y else y)
        return out

    def record(self, h: ChunkHash, count: int) -> None:
        """Remember that ``h`` was used ``count`` times (a chunk leaving the index): each row's
        counter rises to ``count`` if it is below (the conservative update)."""
        if count > MAX_COUNT:
            count = MAX_COUNT
        a, b = _TWO_WORDS(h)
        t = self._table
        i, j = a & self._mask, self.width + (b & self._mask)
        if t[i] < count:
            t[i] = count
        if t[j] < count:
            t[j] = count
        self._recorded += 1
        if self._recorded >= self.width:
            self._recorded = 0
            view = np.frombuffer(self._table, dtype=np.uint8)
            view >>= 1
            del view  # a live export would pin the bytearray's size
