"""Host pool: POSIX shared-memory slabs, packed with chunks of any size.

This is the device pool on a host without a GPU (and in CI): the same packed
layout the CUDA pool uses, in ``/dev/shm``. Inference processes map the slab
once by name (:class:`HostPoolMapping`) and then read or write a chunk at the
byte offset a receipt names, with no copy through the daemon.

Space bookkeeping lives in :class:`kvcached.tiers.packed.PackedPool`; this
module only creates the segments and moves bytes in and out of them. A host
pool has one slab unless ``pool_slabs`` asks for more (``host:0`` ...): each is
its own segment, mapped separately, exactly as a multi-GPU pool has one slab
per GPU, so every placement rule runs on a machine without one.

Ownership: the daemon creates and unlinks the segment. A client mapping
outlives neither the segment's name (unlinked at close) nor its generation:
each pool gets a fresh random ``generation``, and a client that sees a new
generation must drop its old mapping and map again.

The segment is created with ``posix_fallocate`` so that the memory is
committed at start: a full ``/dev/shm`` fails loudly then, instead of
delivering SIGBUS to a client later.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from typing import Callable

from kvcached.contract.errors import TierFull
from kvcached.config import FileAccess
from kvcached.tiers.base import Slot
from kvcached.config import BLOCK_ALIGN
from kvcached.contract.pool import PoolHandle
from kvcached.contract.poolmap import SHM_DIR, populate_pages
from kvcached.tiers.packed import PackedPool

log = logging.getLogger(__name__)



class HostPool(PackedPool):
    def __init__(self, name_prefix: str, capacity_bytes: int, *, slabs: int = 1, prefault: bool = True,
                 access: FileAccess = FileAccess()) -> None:
        super().__init__([capacity_bytes] * slabs)
        self.generation = secrets.token_hex(8)
        self.name = f"{name_prefix}.{os.getpid()}.{self.generation}"
        self._names = [self.name] + [f"{self.name}-{k}" for k in range(1, slabs)]
        self._mmaps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._closed = False
        try:
            for k, name in enumerate(self._names):
                self._mmaps.append(self._create(os.path.join(SHM_DIR, name), self.slab_capacity(k), prefault, access))
                self._views.append(memoryview(self._mmaps[-1]))
        except BaseException:
            self.close()
            raise
        #: the background page-table fills of the daemon's own mappings (:func:`populate_pages`): the
        #: daemon writes its slots itself too (remote fills, promotions from NVMe, in-process puts)
        self.populating = [populate_pages(m, writable=True) for m in self._mmaps] if prefault else []

    @staticmethod
    def _create(path: str, size: int, prefault: bool, access: FileAccess) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            access.apply(fd, access.shared_mode)  # clients that may connect may map it
            os.ftruncate(fd, size)
            if prefault:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.unlink(path)
                    raise TierFull(
                        f"cannot allocate a {size} byte host pool in {SHM_DIR}: {e.strerror}; "
                        "lower --pool-bytes or enlarge /dev/shm"
                    ) from e
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def _span(self, offset: int, nbytes: int) -> memoryview:
        k, local = self.local(offset)
        return self._views[k][local : local + nbytes]

    def _write(self, offset: int, data: memoryview) -> None:
        self._span(offset, data.nbytes)[:] = data

    def _read(self, offset: int, nbytes: int) -> memoryview:
        return self._span(offset, nbytes)

    def _fill(self, offset: int, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        fill(self._span(offset, nbytes))  # straight into the run: one copy

    host_views = True

    def reserved_view(self, slot: Slot) -> memoryview:
        """Writable view of a reserved run (what an in-process writer fills)."""
        self._check_reserved(slot)
        return self._span(slot.offset, slot.nbytes)

    def handle(self) -> PoolHandle:
        return self._handle_of([PoolHandle("shm", name, self.slab_capacity(k), BLOCK_ALIGN, self.generation)
                                for k, name in enumerate(self._names)])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for view in self._views:
            view.release()
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:
                # Someone still holds a view of a chunk; the mapping goes with the last view.
                log.warning("host pool %s closed while views were still exported", self.name)
        for name in self._names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def remove_stale_segments(name_prefix: str) -> list[str]:
    """Unlink pools of ``name_prefix`` left by daemons that died without closing them.

    A segment's name carries its creator's pid; one whose pid no longer runs
    is unreachable memory (tmpfs keeps it until unlinked). Returns the names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - every Linux has /dev/shm
        return removed
    for name in names:
        if not name.startswith(name_prefix + "."):
            continue
        rest = name[len(name_prefix) + 1 :].split(".")  # pid, generation[-slab]
        if len(rest) != 2 or not rest[0].isdigit():
            continue
        pid = int(rest[0])
        if pid == os.getpid() or process_alive(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    if removed:
        log.warning("removed %d host pool segments left by dead daemons: %s", len(removed), ", ".join(removed))
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["HostPool", "remove_stale_segments"]
