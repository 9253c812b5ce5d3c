"""Reading NVMe-tier chunks straight from the daemon's LMDB file.

When a lease is taken with ``read_nvme_directly``, chunks that live only on
NVMe are pinned there (the daemon will not evict them while the lease
lives) and this process reads them through its own read-only LMDB
environment: one short read transaction per chunk, the header and payload
CRCs checked, one copy into a new tensor. A chunk that fails its check is
never returned (:class:`CorruptChunkError`); the daemon drops it the next
time it reads it.

LMDB readers share the lock file with the daemon, so this needs read access
to the environment and write access to its ``lock.mdb`` (same user or group).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvcached.errors import CorruptChunk
from kvcached.keys import KVLayout
from kvcached.tiers.record import verified_payload
from kvcached_client.errors import KvcachedError, PoolMappingError

if TYPE_CHECKING:
    import torch


class CorruptChunkError(KvcachedError):
    """An NVMe chunk failed its checksum; it was not used."""


class NvmeReader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._env = None
        self._db = None
        self.path: str | None = None

    def open(self, path: str) -> None:
        import lmdb

        with self._lock:
            if self.path == path and self._env is not None:
                return
            self.close_locked()
            try:
                env = lmdb.open(path, readonly=True, lock=True, max_dbs=4, subdir=True, readahead=False)
                self._db = env.open_db(b"chunks", create=False)
            except lmdb.Error as e:
                raise PoolMappingError(f"cannot open the NVMe tier at {path}: {e}") from e
            self._env, self.path = env, path

    def read(self, layout: KVLayout, key: bytes) -> "torch.Tensor":
        """Chunk ``key`` as a new [2, layers, kv_heads, chunk_tokens, head_dim] tensor."""
        import numpy as np
        import torch

        from kvcached.kv import torch_dtype

        env = self._env
        if env is None:
            raise PoolMappingError("the NVMe tier is not open")
        out = torch.empty(layout.chunk_bytes, dtype=torch.uint8)
        with env.begin(db=self._db, buffers=True) as txn:
            value = txn.get(key)
            if value is None:
                raise CorruptChunkError(f"chunk {key.hex()} is not in the NVMe tier")
            try:
                out.numpy()[:] = np.frombuffer(verified_payload(value, key, layout.chunk_bytes), dtype=np.uint8)
            except CorruptChunk as e:
                raise CorruptChunkError(f"NVMe chunk {key.hex()}: {e}") from None
        return out.view(torch_dtype(layout.dtype)).view(layout.chunk_shape)

    def close_locked(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env = self._db = None
        self.path = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
