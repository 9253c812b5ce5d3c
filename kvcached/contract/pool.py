"""The pool handle: everything a client needs to map the daemon's pool (host shared memory or
CUDA IPC), as the daemon describes it and the wire carries it (``PoolHandle`` in the .proto;
:mod:`kvcached.contract.proto` converts, checking every field). Never pickled."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Every chunk's offset in the pool slab is a multiple of this (the packed pool's grain, see
#: kvcached.tiers.extents). A chunk is viewed as a tensor of the layout's dtype in place, and a
#: CUDA view at an offset that its element size does not divide fails ("storage offset must be
#: divisible by the element size"); 64 is a multiple of every element size a layout can name
#: (kvcached.contract.keys.DTYPE_SIZES), a CPU cache line (two chunks never share one, so writers of
#: neighbouring chunks do not contend) and keeps the 16-byte vector loads of GPU copy kernels
#: aligned. Chunks of every realistic layout (and of every test layout) are multiples of it, so
#: it costs no padding there.
BLOCK_ALIGN = 64


@dataclass(frozen=True)
class CudaIpc:
    """What a client needs to open a CUDA pool slab (the fields of torch's storage sharing)."""

    device_index: int  # in the daemon's numbering; clients match by device_uuid
    device_uuid: str
    handle: bytes  # the bare cudaIpcMemHandle_t (poolmap.cuda_mem_handle), not torch's wrapping of it
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class PoolHandle:
    """Everything a client needs to map the pool. Sent as protobuf fields, never pickled.

    The top-level fields describe slab 0 (the whole pool when it has one slab); ``slabs``
    lists every slab of a pool with several, slab 0 included."""

    kind: str  # "shm" (POSIX shared memory) or "cuda"
    name: str  # shm: the segment name under /dev/shm
    size_bytes: int  # the slab; every chunk is a run inside it
    align_bytes: int  # every chunk starts at a multiple of this
    generation: str
    cuda: CudaIpc | None = field(default=None)
    slabs: "tuple[PoolSlab, ...]" = ()

    @property
    def nbytes(self) -> int:
        return self.size_bytes

    def all_slabs(self) -> "tuple[PoolSlab, ...]":
        """Every slab with its base offset (a one-slab pool: itself at 0)."""
        if self.slabs:
            return self.slabs
        return (PoolSlab(0, self.cuda.device_uuid if self.cuda else "", self),)


@dataclass(frozen=True)
class PoolSlab:
    """One slab of a pool: its first global offset, the device it is on, and how to map it
    (a one-slab :class:`PoolHandle` whose offsets start at 0)."""

    base: int
    placement: str  # the device's UUID (CUDA) or "host:K" (host shared memory)
    handle: PoolHandle


def normal_placement(placement: str) -> str:
    """A device UUID as CUDA and NVML print it, either way: ``GPU-6f1c...`` or ``6f1c...``."""
    p = placement.strip().lower()
    return p[4:] if p.startswith("gpu-") else p
