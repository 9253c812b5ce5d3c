"""Mapping the daemon's pool into this process, once per pool generation.

The daemon sends a handle (kind, name, block size, block count, generation).
A host pool ("shm") is mapped with mmap from /dev/shm; views of it are
zero-copy torch tensors. A new generation means the daemon restarted (or
re-created its pool): the old mapping is dropped and the new one mapped.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvcached.keys import KVLayout
from kvcached.tiers.pool_shm import HostPoolMapping, PoolHandle
from kvcached_client.errors import PoolMappingError

if TYPE_CHECKING:
    import torch


class PoolMap:
    """Thread-safe holder of the current mapping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapping: HostPoolMapping | None = None
        self.maps = 0  # how many times a pool was mapped (tests check "once per generation")

    @property
    def generation(self) -> str | None:
        return self._mapping.handle.generation if self._mapping else None

    def ensure(self, handle: PoolHandle) -> HostPoolMapping:
        with self._lock:
            if self._mapping is not None and self._mapping.handle.generation == handle.generation:
                return self._mapping
            if handle.kind != "shm":
                raise PoolMappingError(f"pool kind {handle.kind!r} cannot be mapped by this client; use the bytes fallback")
            old, self._mapping = self._mapping, None
            if old is not None:
                old.close()
            try:
                self._mapping = HostPoolMapping(handle, writable=True)
            except OSError as e:
                raise PoolMappingError(f"cannot map pool {handle.name}: {e}") from e
            self.maps += 1
            return self._mapping

    def view(self, layout: KVLayout, offset: int, nbytes: int) -> "torch.Tensor":
        """A tensor [2, layers, kv_heads, chunk_tokens, head_dim] over pool bytes (no copy)."""
        from kvcached.kv import chunk_view

        m = self._mapping
        if m is None:
            raise PoolMappingError("the pool is not mapped")
        return chunk_view(layout, m.block(offset, nbytes))

    def close(self) -> None:
        with self._lock:
            if self._mapping is not None:
                self._mapping.close()
                self._mapping = None
