"""A client's mapping of the daemon's pool, from its :class:`~kvcached.contract.pool.PoolHandle`:
host shared memory by name (:class:`HostPoolMapping`) or a GPU slab by CUDA IPC
(:class:`CudaPoolMapping`). The daemon maps its own host pool with the same page-table fill
(:func:`populate_pages`) and checks its CUDA slab with the same alignment rule."""

from __future__ import annotations

import functools
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


#: ``sizeof(cudaIpcMemHandle_t)``: what the pool handle carries on the wire
CUDA_MEM_HANDLE_BYTES = 64
_TORCH_CUDA_MALLOC = ord("c")  # c10's SHAREABLE_CUDA_MALLOC type byte
_TORCH_EXPANDABLE = ord("e")  # c10's SHAREABLE_CUDA_EXPANDABLE_SEGMENT type byte


def cuda_mem_handle(torch_handle: bytes) -> bytes:
    """The bare ``cudaIpcMemHandle_t`` inside the storage handle this process's torch exported.

    torch wraps the CUDA handle in a header of its own, ``[version][type][payload]`` (the version
    byte was 2 up to torch 2.12 and is 3 from 2.13, with the same ``'c'`` payload; torch before the
    header wrote the 64 bytes bare). The daemon sends the bare handle, which CUDA defines, so that
    a client on another torch than the daemon's can open it (:func:`torch_storage_handle` wraps it
    again for the client's torch): a vLLM or SGLang venv rarely has the daemon's torch.
    """
    if len(torch_handle) == CUDA_MEM_HANDLE_BYTES:
        return torch_handle
    if len(torch_handle) >= 2 and torch_handle[1] == _TORCH_EXPANDABLE:
        raise ValueError("the slab is an expandable segment, which CUDA IPC cannot share as one handle")
    if len(torch_handle) != CUDA_MEM_HANDLE_BYTES + 2 or torch_handle[1] != _TORCH_CUDA_MALLOC:
        raise ValueError(f"an unknown torch CUDA storage handle of {len(torch_handle)} bytes "
                         f"(header {torch_handle[:2].hex()})")
    return torch_handle[2:]


def torch_storage_handle(mem_handle: bytes, header_version: int | None) -> bytes:
    """``mem_handle`` (a bare ``cudaIpcMemHandle_t``) as the storage handle a torch whose exported
    handles carry ``header_version`` opens (None: a torch that writes them bare)."""
    if len(mem_handle) != CUDA_MEM_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC memory handle has {CUDA_MEM_HANDLE_BYTES} bytes, not {len(mem_handle)}")
    if header_version is None:
        return mem_handle
    return bytes([header_version, _TORCH_CUDA_MALLOC]) + mem_handle


@functools.cache
def local_handle_version(dev: "torch.device") -> int | None:
    """The header version of the CUDA storage handles this process's torch writes, read once from
    a handle it exports for a small tensor of its own (None: it writes them bare). Reading it is
    the only sure way: the version is torch's private format and has changed between releases."""
    import torch

    probe = torch.empty(1, dtype=torch.uint8, device=dev)
    handle = bytes(probe.untyped_storage()._share_cuda_()[1])
    return None if len(handle) == CUDA_MEM_HANDLE_BYTES else handle[0]


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
        handle_bytes = torch_storage_handle(ipc.handle, local_handle_version(self.device))
        storage = torch.UntypedStorage._new_shared_cuda(
            local[0], handle_bytes, ipc.size_bytes, ipc.offset_bytes, ipc.ref_counter_handle or None,
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
