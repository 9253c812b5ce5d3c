"""CUDA pool: one slab of device memory per daemon, shared with clients by CUDA IPC.

The slab is a single plain ``cudaMalloc``-backed allocation (a torch uint8
tensor from the caching allocator, which hands a request this large its own
segment). Legacy CUDA IPC cannot export memory from expandable segments or
other virtual-memory (cuMem*) allocations, so the pool refuses to start when
``PYTORCH_CUDA_ALLOC_CONF`` enables expandable segments, with a message that
says so.

Export happens once, at start: the IPC handle, offset and size of the slab's
storage (torch's ``_share_cuda_``), the device UUID and a random generation
id. These travel as protobuf fields (see ``PoolHandle`` in the .proto), never
as a pickle. A client opens the slab once per generation and then views
chunks at offsets on its own device (matched by UUID, so differing
``CUDA_VISIBLE_DEVICES`` orderings do not matter).

Synchronisation: every daemon-side write (promotion from NVMe, the bytes
fallback) synchronises the device before it returns, and the store indexes
a chunk only after that, so no reader sees a half-written block. Client
writes are synchronised by the client before it commits (see
``kvcached_client``).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import TYPE_CHECKING, Callable

from kvcached.config import BLOCK_ALIGN
from kvcached.errors import InvalidArgument, TierFull, Unavailable
from kvcached.tiers.packed import CudaIpc, PackedPool, PoolHandle

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class CudaUnavailable(Unavailable):
    """CUDA was asked for but cannot be used as configured."""


def check_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise CudaUnavailable(
            "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments: such memory cannot be exported by CUDA IPC; "
            "unset it for the kvcached daemon"
        )


def resolve_device(device: str) -> "torch.device":
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailable(f"--device {device}: CUDA is not available here (torch {torch.__version__}); "
                              "use --device cpu for the host shared-memory pool")
    dev = torch.device(device if ":" in device else "cuda:0")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidArgument(f"--device {device}: only {torch.cuda.device_count()} CUDA devices are visible")
    return dev


def device_uuid(dev: "torch.device") -> str:
    import torch

    return str(torch.cuda.get_device_properties(dev).uuid)


def default_pool_bytes(device: str, domains: int = 1) -> int:
    """Half of the device's free memory (DESIGN.md section 8), split evenly among ``domains`` pools."""
    import torch

    free, _total = torch.cuda.mem_get_info(resolve_device(device))
    return free // 2 // domains


def check_slab_aligned(slab: "torch.Tensor") -> None:
    """Chunk offsets are multiples of BLOCK_ALIGN (kvcached.tiers.packed); so must the slab's base
    be, or a chunk cannot be viewed as its dtype. The caching allocator aligns to 512 bytes."""
    if slab.data_ptr() % BLOCK_ALIGN:
        raise ValueError(f"CUDA pool slab at {slab.data_ptr():#x} is not {BLOCK_ALIGN}-byte aligned")


class CudaPool(PackedPool):
    def __init__(self, device: str, capacity_bytes: int, *, staging_bytes: int = 64 << 20) -> None:
        import torch

        check_allocator()
        super().__init__(capacity_bytes)
        self.device = resolve_device(device)
        size = self.size_bytes
        try:
            self._slab = torch.empty(size, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as e:
            raise TierFull(f"cannot allocate a {size} byte pool on {self.device}: {e}; lower --pool-bytes") from e
        torch.cuda.synchronize(self.device)
        check_slab_aligned(self._slab)
        (dev_index, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle, ev_sync) = (
            self._slab.untyped_storage()._share_cuda_()
        )
        self.generation = secrets.token_hex(8)
        self.name = f"cuda:{self.device.index or 0}/{self.generation}"
        self._ipc = CudaIpc(
            device_index=int(dev_index),
            device_uuid=device_uuid(self.device),
            handle=bytes(handle),
            size_bytes=int(size_bytes),
            offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(rc_handle or b""),
            ref_counter_offset=int(rc_offset or 0),
            event_handle=bytes(ev_handle or b""),
            event_sync_required=bool(ev_sync),
        )
        # Pinned host bytes for daemon-side copies (promotion, the bytes fallback), grown on demand to
        # the largest chunk seen: chunks have no fixed size any more.
        self._staging = torch.empty(min(staging_bytes, size), dtype=torch.uint8, pin_memory=True)
        log.info("CUDA pool: %d bytes on %s (%s)", size, self.device, self._ipc.device_uuid)

    def _stage(self, nbytes: int) -> "torch.Tensor":
        import torch

        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes]

    def _write(self, offset: int, data: memoryview) -> None:
        import torch

        n = data.nbytes
        staging = self._stage(n)
        staging.numpy()[:] = memoryview(data).cast("B")
        self._slab[offset : offset + n].copy_(staging, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def _read(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._slab[offset : offset + nbytes].cpu().numpy())

    def _fill(self, offset: int, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        import torch

        staging = self._stage(nbytes)
        fill(memoryview(staging.numpy()))
        self._slab[offset : offset + nbytes].copy_(staging, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def handle(self) -> PoolHandle:
        return PoolHandle("cuda", self.name, self.size_bytes, BLOCK_ALIGN, self.generation, self._ipc)

    def close(self) -> None:
        self._slab = None  # type: ignore[assignment]
        self._staging = None  # type: ignore[assignment]


class CudaPoolMapping:
    """A client's view of the daemon's CUDA slab, opened once per generation."""

    def __init__(self, handle: PoolHandle) -> None:
        import torch

        ipc = handle.cuda
        if handle.kind != "cuda" or ipc is None:
            raise ValueError("CudaPoolMapping maps 'cuda' pools")
        if not torch.cuda.is_available():
            raise CudaUnavailable("the daemon's pool is in GPU memory but CUDA is not available in this process")
        local = [i for i in range(torch.cuda.device_count()) if device_uuid(torch.device("cuda", i)) == ipc.device_uuid]
        if not local:
            raise CudaUnavailable(
                f"the daemon's pool is on GPU {ipc.device_uuid}, which this process cannot see "
                "(check CUDA_VISIBLE_DEVICES); use the bytes fallback from another device"
            )
        self.handle = handle
        self.device = torch.device("cuda", local[0])
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            local[0], ipc.handle, ipc.size_bytes, ipc.offset_bytes, ipc.ref_counter_handle or None,
            ipc.ref_counter_offset, ipc.event_handle or None, ipc.event_sync_required,
        )
        self.slab = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (ipc.size_bytes,), (1,))
        if self.slab.numel() < handle.nbytes:
            raise ValueError(f"CUDA pool storage has {self.slab.numel()} bytes, the handle says {handle.nbytes}")
        check_slab_aligned(self.slab)

    def block(self, offset: int, nbytes: int) -> "torch.Tensor":
        if offset < 0 or nbytes < 0 or offset + nbytes > self.handle.nbytes:
            raise ValueError(f"chunk [{offset}, {offset + nbytes}) is outside the pool")
        return self.slab[offset : offset + nbytes]

    def close(self) -> None:
        self.slab = None  # type: ignore[assignment]
