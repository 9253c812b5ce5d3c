"""Mapping the daemon's pool into this process, once per pool generation.

The daemon sends a handle (kind, name, block size, block count, generation).
A host pool ("shm") is mapped with mmap from /dev/shm; a CUDA pool ("cuda")
is opened by CUDA IPC on the GPU with the same UUID. Views of either are
zero-copy torch tensors. A new generation means the daemon restarted (or
re-created its pool): the old mapping is dropped and the new one mapped.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kvcached.errors import KvcacheError
from kvcached.keys import KVLayout
from kvcached.tiers.packed import PoolHandle
from kvcached.tiers.pool_shm import HostPoolMapping
from kvcached_client.errors import PoolMappingError

if TYPE_CHECKING:
    import torch


class PoolMap:
    """Thread-safe holder of the current mapping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapping: Any = None  # HostPoolMapping or CudaPoolMapping
        self.maps = 0  # how many times a pool was mapped (tests check "once per generation")

    @property
    def generation(self) -> str | None:
        return self._mapping.handle.generation if self._mapping else None

    @property
    def device(self) -> "torch.device":
        """Where the pool's memory is: its CUDA device, or the CPU (a host pool, or none mapped)."""
        import torch

        m = self._mapping
        return m.device if m is not None and m.handle.kind == "cuda" else torch.device("cpu")

    def ensure(self, handle: PoolHandle) -> HostPoolMapping:
        with self._lock:
            if self._mapping is not None and self._mapping.handle.generation == handle.generation:
                return self._mapping
            old, self._mapping = self._mapping, None
            if old is not None:
                old.close()
            try:
                if handle.kind == "shm":
                    self._mapping = HostPoolMapping(handle, writable=True)
                elif handle.kind == "cuda":
                    from kvcached.tiers.pool_cuda import CudaPoolMapping

                    self._mapping = CudaPoolMapping(handle)
                else:
                    raise PoolMappingError(f"pool kind {handle.kind!r} is unknown to this client; use the bytes fallback")
            except (OSError, ValueError, RuntimeError, KvcacheError) as e:
                raise PoolMappingError(f"cannot map pool {handle.name}: {e}") from e
            self.maps += 1
            return self._mapping

    def view(self, layout: KVLayout, offset: int, nbytes: int) -> "torch.Tensor":
        """A tensor [2, layers, kv_heads, chunk_tokens, head_dim] over pool bytes (no copy)."""
        from kvcached.kv import chunk_view, torch_dtype

        m = self._mapping
        if m is None:
            raise PoolMappingError("the pool is not mapped")
        block = m.block(offset, nbytes)
        if isinstance(block, memoryview):
            return chunk_view(layout, block)
        return block.view(torch_dtype(layout.dtype)).view(layout.chunk_shape)  # a CUDA slab slice

    def close(self) -> None:
        with self._lock:
            if self._mapping is not None:
                self._mapping.close()
                self._mapping = None
