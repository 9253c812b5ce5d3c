"""CUDA pool: one slab of device memory per GPU, shared with clients by CUDA IPC.

``device = "cuda"`` gives every GPU the daemon sees a slab of its own (the default: a worker
on GPU k then keeps its chunks in GPU k's memory, see :mod:`kvcached.tiers.packed`);
``cuda:N`` or ``cuda:0,2`` names the GPUs. Each slab is a single plain ``cudaMalloc``-backed
allocation (a torch uint8
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
from kvcached.contract.errors import InvalidArgument, TierFull
from kvcached.contract.pool import CudaIpc, PoolHandle
from kvcached.contract.poolmap import CudaUnavailable, check_slab_aligned, cuda_mem_handle, device_uuid
from kvcached.tiers.packed import PackedPool

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def check_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise CudaUnavailable(
            "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments: such memory cannot be exported by CUDA IPC; "
            "unset it for the kvcached daemon"
        )


def resolve_device(device: str) -> "torch.device":
    """The first device of ``device`` (see :func:`resolve_devices`)."""
    return resolve_devices(device)[0]


def resolve_devices(device: str) -> "list[torch.device]":
    """The GPUs ``device`` names: ``cuda`` every visible one, ``cuda:N`` one, ``cuda:0,2`` a list."""
    import torch

    if not torch.cuda.is_available():
        raise CudaUnavailable(f"--device {device}: CUDA is not available here (torch {torch.__version__}); "
                              "use --device cpu for the host shared-memory pool")
    count = torch.cuda.device_count()
    if ":" not in device:
        return [torch.device("cuda", i) for i in range(count)]
    out = []
    for part in device.split(":", 1)[1].split(","):
        i = int(part)
        if i >= count:
            raise InvalidArgument(f"--device {device}: only {count} CUDA devices are visible")
        out.append(torch.device("cuda", i))
    return out


def default_pool_bytes(device: str, domains: int = 1) -> int:
    """Half of each device's free memory (the least free of them), split evenly among
    ``domains`` pools: the size of each GPU's slab."""
    import torch

    return min(torch.cuda.mem_get_info(d)[0] for d in resolve_devices(device)) // 2 // domains


def _exported(torch_handle: bytes) -> bytes:
    """The slab's bare CUDA IPC handle, or a clear start-up error naming this torch."""
    import torch

    try:
        return cuda_mem_handle(torch_handle)
    except ValueError as e:
        raise CudaUnavailable(f"cannot share the GPU pool with clients: {e} (torch {torch.__version__}); "
                              "use --device cpu, or report this torch version") from e


class _Slab:
    """One GPU's slab: the tensor, its exported handle, and pinned staging for daemon-side copies."""

    def __init__(self, dev: "torch.device", size: int, generation: str, staging_bytes: int) -> None:
        import torch

        self.device = dev
        try:
            self.tensor = torch.empty(size, dtype=torch.uint8, device=dev)
        except torch.cuda.OutOfMemoryError as e:
            raise TierFull(f"cannot allocate a {size} byte pool on {dev}: {e}; lower --pool-bytes") from e
        torch.cuda.synchronize(dev)
        check_slab_aligned(self.tensor)
        (dev_index, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle, ev_sync) = (
            self.tensor.untyped_storage()._share_cuda_()
        )
        self.name = f"cuda:{dev.index or 0}/{generation}"
        self.ipc = CudaIpc(
            device_index=int(dev_index),
            device_uuid=device_uuid(dev),
            handle=_exported(bytes(handle)),
            size_bytes=int(size_bytes),
            offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(rc_handle or b""),
            ref_counter_offset=int(rc_offset or 0),
            event_handle=bytes(ev_handle or b""),
            event_sync_required=bool(ev_sync),
        )
        # Pinned host bytes for daemon-side copies (promotion, the bytes fallback), grown on demand to
        # the largest chunk seen: chunks have no fixed size any more.
        self.staging = torch.empty(min(staging_bytes, size), dtype=torch.uint8, pin_memory=True)

    def stage(self, nbytes: int) -> "torch.Tensor":
        import torch

        if self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self.staging[:nbytes]


class CudaPool(PackedPool):
    def __init__(self, device: str, capacity_bytes: int, *, staging_bytes: int = 64 << 20) -> None:
        check_allocator()
        devices = resolve_devices(device)
        super().__init__([capacity_bytes] * len(devices), [device_uuid(d) for d in devices])
        self.device = devices[0]
        self.generation = secrets.token_hex(8)
        self._slabs = [_Slab(d, self.slab_capacity(k), self.generation, staging_bytes) for k, d in enumerate(devices)]
        self.name = self._slabs[0].name
        for s in self._slabs:
            log.info("CUDA pool: %d bytes on %s (%s)", s.tensor.numel(), s.device, s.ipc.device_uuid)

    def _write(self, offset: int, data: memoryview) -> None:
        import torch

        k, local = self.local(offset)
        slab, n = self._slabs[k], data.nbytes
        staging = slab.stage(n)
        staging.numpy()[:] = memoryview(data).cast("B")
        slab.tensor[local : local + n].copy_(staging, non_blocking=True)
        torch.cuda.synchronize(slab.device)

    def _read(self, offset: int, nbytes: int) -> memoryview:
        k, local = self.local(offset)
        return memoryview(self._slabs[k].tensor[local : local + nbytes].cpu().numpy())  # type: ignore[arg-type]  # an ndarray is a buffer (typeshed < 3.12 cannot say)

    def _fill(self, offset: int, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        import torch

        k, local = self.local(offset)
        slab = self._slabs[k]
        staging = slab.stage(nbytes)
        fill(memoryview(staging.numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer (typeshed < 3.12 cannot say)
        slab.tensor[local : local + nbytes].copy_(staging, non_blocking=True)
        torch.cuda.synchronize(slab.device)

    def handle(self) -> PoolHandle:
        return self._handle_of([PoolHandle("cuda", s.name, self.slab_capacity(k), BLOCK_ALIGN, self.generation, s.ipc)
                                for k, s in enumerate(self._slabs)])

    def close(self) -> None:
        self._slabs = []
