"""Reading NVMe-tier chunks straight from the daemon's LMDB file.

When a lease is taken with ``read_nvme_directly``, chunks that live only on
NVMe are pinned there (the daemon will not evict them while the lease
lives) and this process reads them through its own read-only LMDB
environment: one short read transaction per chunk, header and payload CRCs
checked while copying (one pass). A chunk that fails its check is never
returned (:class:`CorruptChunkError`); the daemon drops it the next time it
reads it.

py-lmdb allows one environment per file per process, so every client in a
process shares one, reference-counted (:func:`_acquire_env`).

The daemon grows its map when the file fills it. This process maps far more
than any tier (:data:`READER_MAP_BYTES`), so that is normally invisible; if
the file ever outgrows even that, LMDB refuses new reads with
``MapResizedError`` and the reader adopts the daemon's size and reads again.
Adopting is a resize, which must not run under any open transaction of this
process (it unmaps them), so reads and the resize share a
:class:`~kvcached.contract.lmdbgate.TxnGate`, one per environment.

LMDB readers share the lock file with the daemon, so this needs read access
to the environment and write access to its ``lock.mdb`` (same user or group).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from kvcached.contract.errors import CorruptChunk
from kvcached.contract.keys import KVLayout
from kvcached.contract.lmdbgate import TxnGate
from kvcached.contract.record import copy_verified
from kvcached_client.errors import KvcachedError, PoolMappingError

if TYPE_CHECKING:
    import torch


class CorruptChunkError(KvcachedError):
    """An NVMe chunk failed its checksum; it was not used."""


#: Address space a reader maps for the daemon's LMDB file (see _acquire_env).
READER_MAP_BYTES = 1 << 40

_ENVS: dict[str, list[Any]] = {}  # real path -> [env, db, refcount, gate]
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: str) -> tuple[Any, Any, TxnGate]:
    import lmdb

    if not path:
        raise PoolMappingError("the daemon has no NVMe tier to read from")
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(real)
        if entry is None:
            try:
                # map_size: a read-only environment maps only what it is told (default 10 MiB) or
                # what the file held at open; once the daemon grows the file past that, every read
                # fails with MapResizedError. Address space is cheap and the mapping is read-only
                # and shared, so map far beyond any tier size once.
                env = lmdb.open(real, readonly=True, lock=True, max_dbs=4, subdir=True, readahead=False,
                                map_size=READER_MAP_BYTES)
                db = env.open_db(b"chunks", create=False)
            except lmdb.Error as e:
                raise PoolMappingError(f"cannot open the NVMe tier at {path}: {e}") from e
            entry = _ENVS[real] = [env, db, 0, TxnGate()]
        entry[2] += 1
        return entry[0], entry[1], entry[3]


def _release_env(path: str) -> None:
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(real)
        if entry is not None:
            entry[2] -= 1
            if entry[2] == 0:
                entry[0].close()
                del _ENVS[real]


class NvmeReader:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._env: Any = None
        self._db: Any = None
        self._gate: TxnGate | None = None
        self.path: str | None = None

    def open(self, path: str) -> None:
        with self._lock:
            if self.path == path and self._env is not None:
                return
            self._close_locked()
            self._env, self._db, self._gate = _acquire_env(path)
            self.path = path

    def read_into(self, layout: KVLayout, key: bytes, out: "torch.Tensor") -> None:
        """Copy chunk ``key`` into ``out`` (a contiguous CPU tensor of the chunk's shape and dtype)."""
        import lmdb

        env, gate = self._env, self._gate
        if env is None or gate is None:
            raise PoolMappingError("the NVMe tier is not open")
        if not out.is_contiguous() or out.device.type != "cpu" or out.numel() * out.element_size() != layout.chunk_bytes:
            raise ValueError(f"out must be a contiguous CPU tensor of {layout.chunk_bytes} bytes")
        dest = memoryview(out.view(-1).view(dtype=_u8()).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        for attempt in (0, 1):
            try:
                with gate.txn(), env.begin(db=self._db, buffers=True) as txn:
                    value = txn.get(key)
                    if value is None:
                        raise CorruptChunkError(f"chunk {key.hex()} is not in the NVMe tier")
                    try:
                        copy_verified(value, key, dest)
                    except CorruptChunk as e:
                        raise CorruptChunkError(f"NVMe chunk {key.hex()}: {e}") from None
                return
            except lmdb.MapResizedError as e:
                if attempt:
                    raise PoolMappingError(f"the NVMe tier's map keeps growing under this reader: {e}") from e
                with gate.resize():  # no transaction of this process is open now
                    env.set_mapsize(0)  # 0: adopt the size the daemon set

    def read(self, layout: KVLayout, key: bytes) -> "torch.Tensor":
        """Chunk ``key`` as a new [2, layers, kv_heads, chunk_tokens, head_dim] tensor."""
        import torch

        from kvcached.contract.kv import torch_dtype

        out = torch.empty(layout.chunk_shape, dtype=torch_dtype(layout.dtype))
        self.read_into(layout, key, out)
        return out

    def _close_locked(self) -> None:
        if self.path is not None:
            _release_env(self.path)
        self._env = self._db = None
        self.path = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


def _u8() -> "torch.dtype":
    import torch

    return torch.uint8
