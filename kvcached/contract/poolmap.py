"""A client's mapping of the daemon's pool, from its :class:`~kvcached.contract.pool.PoolHandle`:
host shared memory by name (:class:`HostPoolMapping`) or a GPU slab by CUDA IPC
(:class:`CudaPoolMapping`). The daemon maps its own host pool with the same page-table fill
(:func:`populate_pages`) and checks its CUDA slab with the same alignment rule."""

from __future__ import annotations

import mmap
import os
import threading
from typing import TYPE_CHECKING

from kvcached.contract.errors import Unavailable
from kvcached.contract.pool import BLOCK_ALIGN, PoolHandle

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"


#: madvise(2) advice values (linux/mman.h), not in Python's mmap module before 3.13
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23


def populate_pages(mm: mmap.mmap, writable: bool) -> threading.Thread:
    """Map every page of ``mm`` into this process now, on a background thread, instead of one page
    fault per 4 KiB the first time a copy touches it. The daemon allocated the pages
    (``posix_fallocate``); what is left is this process's page tables, and those faults were most
    of a first store's cost: measured, 96 MiB of chunks copied out of a CPU paged cache took 40 ms
    into freshly mapped pool pages and 17-19 ms into populated ones. ``madvise(MADV_POPULATE_WRITE)``
    (Linux 5.14) runs without the GIL; on an older kernel it fails and nothing changes. A copy
    racing it only takes the faults it would have taken anyway."""

    def run() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            buf = ctypes.c_char.from_buffer(mm)
            addr = ctypes.addressof(buf)
            del buf  # no exported buffer left: close() may unmap while this runs (madvise then fails)
            advice = _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ
            libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), ctypes.c_int(advice))
        except (OSError, ValueError, TypeError, AttributeError):  # a closed mapping, no libc: fine
            pass

    t = threading.Thread(target=run, daemon=True, name="kvcached-pool-populate")
    t.start()
    return t


class HostPoolMapping:
    """A client's mapping of a daemon's host pool, by name.

    Deliberately not :class:`multiprocessing.shared_memory.SharedMemory`: on
    Python < 3.13 attaching registers the segment with the resource tracker,
    which unlinks the daemon's pool when the *client* exits.
    """

    def __init__(self, handle: PoolHandle, *, writable: bool = True, populate: bool = True) -> None:
        if handle.kind != "shm":
            raise ValueError(f"HostPoolMapping maps 'shm' pools, not {handle.kind!r}")
        self.handle = handle
        path = os.path.join(SHM_DIR, handle.name)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != handle.nbytes:
                raise ValueError(f"pool {handle.name} is {size} bytes, handle says {handle.nbytes}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        #: the background page-table fill (:func:`populate_pages`), None when not started
        self.populating = populate_pages(self._mmap, writable) if populate and size else None

    def block(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.handle.nbytes:
            raise ValueError(f"chunk [{offset}, {offset + nbytes}) is outside the pool")
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass

    def __enter__(self) -> "HostPoolMapping":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()




class CudaUnavailable(Unavailable):
    """CUDA was asked for but cannot be used as configured."""


def device_uuid(dev: "torch.device") -> str:
    import torch

    return str(torch.cuda.get_device_properties(dev).uuid)


def check_slab_aligned(slab: "torch.Tensor") -> None:
    """Chunk offsets are multiples of BLOCK_ALIGN (kvcached.tiers.packed); so must the slab's base
    be, or a chunk cannot be viewed as its dtype. The caching allocator aligns to 512 bytes."""
    if slab.data_ptr() % BLOCK_ALIGN:
        raise ValueError(f"CUDA pool slab at {slab.data_ptr():#x} is not {BLOCK_ALIGN}-byte aligned")


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
