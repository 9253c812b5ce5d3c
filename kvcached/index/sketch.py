"""A count-min sketch of how often evicted chunks were used: the eviction policy's memory.

When a chunk leaves the index its use count would be lost, and a chunk that comes back (the
next turn of a conversation, a document queried again) would start over as a one-hit chunk.
The sketch keeps an approximate count for every chunk hash it was told about, in a fixed
amount of memory: ``rows`` rows of ``width`` saturating 8-bit counters, one counter per row
chosen by bits of the chunk hash (already a keyed SHA-256, so uniformly spread; no further
hashing). A count is the minimum over the rows, so collisions can only inflate it, and
:meth:`record` uses the conservative update (raise each row only up to the new value), which
keeps that inflation small. It is a Bloom filter with counters: it answers "how often was this
seen" for chunks it no longer stores.

Aging: after ``width`` records every counter is halved, so old popularity fades and the
counters never saturate for good; ``width`` is therefore also "how many evictions it
remembers" (bench/trace_replay.py measured that forgetting sooner costs hit rate at small
capacities, where a chunk's next use comes many evictions later).

Not thread-safe: the index's caller holds the store lock.
"""

from __future__ import annotations

import numpy as np

from kvcached.keys import ChunkHash

#: Counters saturate here (8 bits).
MAX_COUNT = 255


class FrequencySketch:
    """Four rows of ``width`` 8-bit counters in one ``bytearray`` (indexing a bytearray is
    several times cheaper than indexing a numpy array from Python; numpy only halves it)."""

    __slots__ = ("_mask", "_recorded", "_shift", "_table", "width")

    ROWS = 4

    def __init__(self, width: int) -> None:
        if width < 64 or width & (width - 1) or width > 1 << 28:
            raise ValueError("the sketch width must be a power of two in 64..2**28")
        self.width = width
        self._shift = width.bit_length() - 1  # bits of the hash per row (4 x 28 <= 128)
        self._mask = width - 1
        self._table = bytearray(self.ROWS * width)
        self._recorded = 0

    @property
    def nbytes(self) -> int:
        return len(self._table)

    def estimate(self, h: ChunkHash) -> int:
        """The (over-)estimated count of ``h``; 0 if never recorded (or aged out)."""
        x = int.from_bytes(h[:16], "little")
        m, s, w, t = self._mask, self._shift, self.width, self._table
        return min(t[x & m], t[w + ((x >> s) & m)], t[2 * w + ((x >> 2 * s) & m)], t[3 * w + ((x >> 3 * s) & m)])

    def record(self, h: ChunkHash, count: int) -> None:
        """Remember that ``h`` was used ``count`` times (a chunk leaving the index): each row's
        counter rises to ``count`` if it is below (the conservative update)."""
        if count > MAX_COUNT:
            count = MAX_COUNT
        x = int.from_bytes(h[:16], "little")
        m, s, w, t = self._mask, self._shift, self.width, self._table
        for i in (x & m, w + ((x >> s) & m), 2 * w + ((x >> 2 * s) & m), 3 * w + ((x >> 3 * s) & m)):
            if t[i] < count:
                t[i] = count
        self._recorded += 1
        if self._recorded >= self.width:
            self._recorded = 0
            view = np.frombuffer(self._table, dtype=np.uint8)
            view >>= 1
            del view  # a live export would pin the bytearray's size
