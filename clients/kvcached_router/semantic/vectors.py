"""``VectorIndex``: unit vectors by integer id, top-k by cosine, in one contiguous matrix.

Rows live in a preallocated float32 matrix (doubled when full); removing a row moves the last
row into its place, so the live rows are always ``[0, n)`` and a search is one pass over them.

A full float32 scan reads ``n * dim * 4`` bytes per query: 154 MB at 100k MiniLM vectors,
about 25 ms on a loaded 2-core host, more than the whole lookup budget. So above
``SearchConfig.exact_below`` rows the search runs in two stages: the Hamming distance between
sign-bit codes (48 bytes per 384-dim vector, kept beside the matrix) picks a shortlist, and
the shortlist is re-scored exactly. The similarities returned are always exact cosines; what
the first stage can miss is a neighbour whose signs disagree unusually much with the query's,
which near duplicates (the only candidates a threshold lets through) rarely do.
``bench/semantic_cache.py`` measures how often the two stages agree with the full scan.

Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SearchConfig:
    k: int = 8  # neighbours returned
    exact_below: int = 8192  # rows up to which the search is a full float32 scan
    shortlist: int = 256  # rows the sign-bit stage hands to the exact one
    initial_capacity: int = 1024

    def __post_init__(self) -> None:
        if self.k < 1 or self.shortlist < self.k or self.initial_capacity < 1 or self.exact_below < 0:
            raise ValueError("need k >= 1, shortlist >= k, initial_capacity >= 1, exact_below >= 0")


class VectorIndex:
    def __init__(self, dim: int, config: SearchConfig = SearchConfig()) -> None:
        if dim < 1:
            raise ValueError("dim must be positive")
        self.dim = dim
        self.config = config
        self._words = (dim + 63) // 64  # uint64 words per sign code
        self._n = 0
        self._vectors = np.zeros((config.initial_capacity, dim), dtype=np.float32)
        self._codes = np.zeros((self._words, config.initial_capacity), dtype=np.uint64)  # word-major
        self._ids = np.zeros(config.initial_capacity, dtype=np.int64)
        self._row: dict[int, int] = {}
        self._scratch: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self._n

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._row

    @property
    def capacity(self) -> int:
        return self._vectors.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held for vectors, sign codes and ids (the allocated capacity)."""
        return self._vectors.nbytes + self._codes.nbytes + self._ids.nbytes

    def row_of(self, entry_id: int) -> int:
        return self._row[entry_id]

    def id_at(self, row: int) -> int:
        return int(self._ids[row])

    def vector(self, entry_id: int) -> np.ndarray:
        return self._vectors[self._row[entry_id]].copy()

    def add(self, entry_id: int, vector: np.ndarray) -> int:
        """Store (or replace) ``entry_id``'s vector, normalised; returns its row."""
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise ValueError(f"vector has {v.shape[0]} components, the index holds {self.dim}")
        norm = float(np.linalg.norm(v))
        if not np.isfinite(norm) or norm == 0.0:
            raise ValueError("vector must be finite and non-zero")
        row = self._row.get(entry_id)
        if row is None:
            if self._n == self.capacity:
                self._grow()
            row = self._n
            self._n += 1
            self._row[entry_id] = row
            self._ids[row] = entry_id
        self._vectors[row] = v / norm
        self._codes[:, row] = self._code(self._vectors[row])
        return row

    def remove(self, entry_id: int) -> int | None:
        """Drop ``entry_id``; returns the row that moved into its place (the old last row), or
        None when nothing moved. Unknown ids raise KeyError."""
        row = self._row.pop(entry_id)
        last = self._n - 1
        self._n = last
        if row == last:
            return None
        self._vectors[row] = self._vectors[last]
        self._codes[:, row] = self._codes[:, last]
        moved = int(self._ids[last])
        self._ids[row] = moved
        self._row[moved] = row
        return last

    def search(self, query: np.ndarray, k: int | None = None, *, full_scan: bool | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the ``k`` most similar vectors and their cosines, most similar first.
        ``full_scan`` forces (True) or forbids (False) the full float32 scan; None: by size."""
        k = min(k or self.config.k, self._n)
        if k == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        q = np.asarray(query, dtype=np.float32).reshape(-1)
        q = q / max(float(np.linalg.norm(q)), 1e-12)
        if full_scan is None:
            full_scan = self._n <= max(self.config.exact_below, self.config.shortlist)
        if full_scan:
            rows = np.arange(self._n)
            sims = self._vectors[: self._n] @ q
        else:
            rows = self._shortlist(self._code(q), self.config.shortlist)
            sims = self._vectors[rows] @ q
        top = np.argpartition(sims, -k)[-k:] if k < sims.shape[0] else np.arange(sims.shape[0])
        top = top[np.argsort(-sims[top], kind="stable")]
        return rows[top], sims[top]

    def _shortlist(self, qcode: np.ndarray, size: int) -> np.ndarray:
        """Rows of the ``size`` smallest Hamming distances to ``qcode`` (ties by row order)."""
        n = self._n
        dist = self._buffer("dist", n, np.uint16)
        word = self._buffer("word", n, np.uint64)
        bits = self._buffer("bits", n, np.uint8)
        dist[:] = 0
        for j in range(self._words):
            np.bitwise_xor(self._codes[j, :n], qcode[j], out=word)
            np.bitwise_count(word, out=bits)
            np.add(dist, bits, out=dist, casting="unsafe")
        counts = np.cumsum(np.bincount(dist, minlength=self.dim + 1))
        cutoff = int(np.searchsorted(counts, size))  # the smallest distance reaching `size` rows
        closer = np.flatnonzero(dist < cutoff)
        at_cutoff = np.flatnonzero(dist == cutoff)[: size - closer.shape[0]]
        return np.concatenate((closer, at_cutoff))

    def _buffer(self, name: str, n: int, dtype: type) -> np.ndarray:
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n:
            buf = np.empty(self.capacity, dtype=dtype)
            self._scratch[name] = buf
        return buf[:n]

    def _code(self, v: np.ndarray) -> np.ndarray:
        bits = np.packbits(v > 0)
        padded = np.zeros(self._words * 8, dtype=np.uint8)
        padded[: bits.shape[0]] = bits
        return padded.view(np.uint64)

    def _grow(self) -> None:
        cap = self.capacity * 2
        vectors = np.zeros((cap, self.dim), dtype=np.float32)
        vectors[: self._n] = self._vectors[: self._n]
        codes = np.zeros((self._words, cap), dtype=np.uint64)
        codes[:, : self._n] = self._codes[:, : self._n]
        ids = np.zeros(cap, dtype=np.int64)
        ids[: self._n] = self._ids[: self._n]
        self._vectors, self._codes, self._ids = vectors, codes, ids
        self._scratch.clear()
