"""Mapping the daemon's pool into this process, once per pool generation.

The daemon sends a handle (kind, slabs, generation). A host pool ("shm") is mapped with mmap
from /dev/shm; a CUDA pool ("cuda") is opened by CUDA IPC on the GPU with the same UUID. Views
of either are zero-copy torch tensors. A new generation means the daemon restarted (or
re-created its pool): the old mappings are dropped and the new pool mapped.

A pool may have several slabs (one per GPU on a multi-GPU host). A chunk's offset names its
slab; each slab is mapped the first time a chunk in it is viewed, so a worker on GPU k that
only touches GPU k's slab opens nothing on the other GPUs (no CUDA context there). The slab
of this client's own ``placement`` is mapped at once, so that a pool this process cannot map
fails at start, not on the first request.
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any

from kvcached.contract.errors import KvcacheError
from kvcached.contract.keys import KVLayout
from kvcached.contract.pool import PoolHandle, PoolSlab, normal_placement
from kvcached.contract.poolmap import HostPoolMapping
from kvcached_client.errors import PoolMappingError

if TYPE_CHECKING:
    import torch


def _open(handle: PoolHandle) -> Any:
    """Map one slab (a one-slab handle): a HostPoolMapping or a CudaPoolMapping."""
    try:
        if handle.kind == "shm":
            return HostPoolMapping(handle, writable=True)
        if handle.kind == "cuda":
            from kvcached.contract.poolmap import CudaPoolMapping

            return CudaPoolMapping(handle)
        raise PoolMappingError(f"pool kind {handle.kind!r} is unknown to this client; use the bytes fallback")
    except (OSError, ValueError, RuntimeError, KvcacheError) as e:
        raise PoolMappingError(f"cannot map pool {handle.name}: {e}") from e


class PoolMap:
    """Thread-safe holder of the current pool's slab mappings.

    ``placement`` is this process's device (a GPU UUID, ``host:K`` or empty): its slab is
    mapped by :meth:`ensure`, the others on first use."""

    def __init__(self, placement: str = "") -> None:
        self._lock = threading.Lock()
        self.placement = placement
        self._handle: PoolHandle | None = None
        self._slabs: tuple[PoolSlab, ...] = ()
        self._bases: list[int] = []
        self._maps: dict[int, Any] = {}  # slab index -> HostPoolMapping or CudaPoolMapping
        self.maps = 0  # how many slabs were mapped (tests check "once per generation")

    @property
    def generation(self) -> str | None:
        return self._handle.generation if self._handle else None

    @property
    def slabs(self) -> int:
        return len(self._slabs)

    @property
    def mapped_slabs(self) -> list[int]:
        return sorted(self._maps)

    @property
    def device(self) -> "torch.device":
        """This process's own slab's device: its CUDA device, or the CPU (a host pool, or none
        mapped). Where chunks read from NVMe are put."""
        import torch

        m = self._maps.get(self._home())
        return m.device if m is not None and self._handle is not None and self._handle.kind == "cuda" \
            else torch.device("cpu")

    def _home(self) -> int:
        want = normal_placement(self.placement) if self.placement else ""
        for k, s in enumerate(self._slabs):
            if want and normal_placement(s.placement) == want:
                return k
        return 0

    def ensure(self, handle: PoolHandle) -> Any:
        """Map ``handle``'s pool (this process's slab now) unless its generation is mapped."""
        with self._lock:
            if self._handle is not None and self._handle.generation == handle.generation:
                return self._maps.get(self._home())
            self._close_locked()
            self._handle = handle
            self._slabs = handle.all_slabs()
            self._bases = [s.base for s in self._slabs]
            return self._map_locked(self._home())

    def _map_locked(self, k: int) -> Any:
        m = self._maps.get(k)
        if m is None:
            m = self._maps[k] = _open(self._slabs[k].handle)
            self.maps += 1
        return m

    def _slab(self, offset: int) -> tuple[Any, int]:
        """(mapping, offset within it) of a global offset, mapping its slab if need be."""
        k = bisect.bisect_right(self._bases, offset) - 1
        if k < 0:
            raise PoolMappingError("the pool is not mapped")
        m = self._maps.get(k)
        if m is None:
            with self._lock:
                if self._handle is None:
                    raise PoolMappingError("the pool is not mapped")
                m = self._map_locked(k)
        return m, offset - self._bases[k]

    def device_of(self, offset: int) -> "torch.device":
        """The device of the slab a chunk at ``offset`` is in (the CPU for a host pool)."""
        import torch

        m, _ = self._slab(offset)
        return m.device if getattr(m, "device", None) is not None else torch.device("cpu")

    def view(self, layout: KVLayout, offset: int, nbytes: int) -> "torch.Tensor":
        """A tensor [2, layers, kv_heads, chunk_tokens, head_dim] over pool bytes (no copy)."""
        from kvcached.contract.kv import chunk_view, torch_dtype

        if self._handle is None:
            raise PoolMappingError("the pool is not mapped")
        m, local = self._slab(offset)
        block = m.block(local, nbytes)
        if isinstance(block, memoryview):
            return chunk_view(layout, block)
        return block.view(torch_dtype(layout.dtype)).view(layout.chunk_shape)  # a CUDA slab slice

    def run_view(self, layout: KVLayout, offset: int, n: int) -> "torch.Tensor":
        """A tensor [n, 2, layers, kv_heads, chunk_tokens, head_dim] over ``n`` chunks laid back
        to back from ``offset`` (no copy): one view for a run of contiguous pool blocks. The
        run must lie in one slab (:func:`kvcached_client._core.pool_runs` splits runs there)."""
        from kvcached.contract.kv import torch_dtype

        nbytes = n * layout.chunk_bytes
        if self._handle is None:
            raise PoolMappingError("the pool is not mapped")
        m, local = self._slab(offset)
        block = m.block(local, nbytes)
        if isinstance(block, memoryview):
            import torch

            block = torch.frombuffer(block, dtype=torch.uint8)
        return block.view(torch_dtype(layout.dtype)).view((n, *layout.chunk_shape))

    def slab_bases(self) -> "list[int]":
        """The global offset where each slab starts (a run never crosses one)."""
        return list(self._bases)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps = {}
        self._handle = None
        self._slabs = ()
        self._bases = []
