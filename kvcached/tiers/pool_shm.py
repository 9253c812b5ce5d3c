"""Host pool: one POSIX shared-memory slab of fixed-size blocks.

This is the device pool on a host without a GPU (and in CI): the same block
layout the CUDA pool uses, in ``/dev/shm``. Inference processes map the slab
once by name (:class:`HostPoolMapping`) and then read or write a block at
``offset = block * block_bytes`` with no copy through the daemon.

One chunk occupies one block; a layout whose chunk is larger than the block
is refused when it is registered. Free blocks are handed out last-freed
first (a stack), so recently touched memory is reused while it is warm.

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
from dataclasses import dataclass

from kvcached.errors import ChunkNotCached, InternalInvariantError, InvalidKV, TierFull
from kvcached.keys import ChunkHash
from kvcached.locations import TierId
from kvcached.tiers.base import ChunkMeta, Slot, Tier

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class PoolHandle:
    """Everything a client needs to map the pool. Sent as protobuf fields, never pickled."""

    kind: str  # "shm" here; "cuda" for the GPU pool
    name: str
    block_bytes: int
    num_blocks: int
    generation: str

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks


class HostPool(Tier):
    tier_id = TierId.POOL

    def __init__(self, name_prefix: str, block_bytes: int, num_blocks: int, *, prefault: bool = True) -> None:
        if block_bytes <= 0 or num_blocks <= 0:
            raise ValueError("pool needs a positive block size and block count")
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.generation = secrets.token_hex(8)
        self.name = f"{name_prefix}.{os.getpid()}.{self.generation}"
        self._path = os.path.join(SHM_DIR, self.name)
        size = block_bytes * num_blocks
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            if prefault:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.unlink(self._path)
                    raise TierFull(
                        f"cannot allocate a {size} byte host pool in {SHM_DIR}: {e.strerror}; "
                        "lower --pool-bytes or enlarge /dev/shm"
                    ) from e
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._mmap)
        # Stack of free blocks: the lowest ids come out first on a fresh pool.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._reserved: dict[int, int] = {}  # block -> nbytes
        self._committed: dict[ChunkHash, tuple[int, int]] = {}  # hash -> (block, nbytes)
        self._closed = False

    # -- Tier ---------------------------------------------------------------------

    def reserve(self, nbytes: int) -> Slot:
        if nbytes > self.block_bytes:
            raise InvalidKV(f"chunk of {nbytes} bytes does not fit a {self.block_bytes} byte pool block")
        if not self._free:
            raise TierFull(f"host pool: all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self._reserved[block] = nbytes
        return Slot(TierId.POOL, block, block * self.block_bytes, nbytes)

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        self._check_reserved(slot)
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.nbytes:
            raise InvalidKV(f"chunk data is {mv.nbytes} bytes, the slot holds exactly {slot.nbytes}")
        self._view[slot.offset : slot.offset + slot.nbytes] = mv

    def commit(self, slot: Slot, meta: ChunkMeta) -> None:
        self._check_reserved(slot)
        if meta.chunk_hash in self._committed:
            raise InternalInvariantError(f"pool already holds chunk {meta.chunk_hash.hex()}")
        del self._reserved[slot.slot_id]
        self._committed[meta.chunk_hash] = (slot.slot_id, slot.nbytes)

    def abort(self, slot: Slot) -> None:
        if self._reserved.pop(slot.slot_id, None) is not None:
            self._free.append(slot.slot_id)

    def read(self, h: ChunkHash) -> memoryview:
        try:
            block, nbytes = self._committed[h]
        except KeyError:
            raise ChunkNotCached(f"chunk {h.hex()} is not in the pool") from None
        off = block * self.block_bytes
        return self._view[off : off + nbytes]

    def delete(self, h: ChunkHash) -> bool:
        entry = self._committed.pop(h, None)
        if entry is None:
            return False
        self._free.append(entry[0])
        return True

    def __contains__(self, h: ChunkHash) -> bool:
        return h in self._committed

    @property
    def capacity_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def used_bytes(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_bytes

    def can_admit(self, nbytes: int) -> bool:
        return nbytes <= self.block_bytes and bool(self._free)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view of a block; the mapping goes with the last view.
            log.warning("host pool %s closed while views were still exported", self.name)
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    # -- pool specifics -----------------------------------------------------------

    def slot_of(self, h: ChunkHash) -> Slot:
        """Where a committed chunk lives, for lease receipts."""
        try:
            block, nbytes = self._committed[h]
        except KeyError:
            raise ChunkNotCached(f"chunk {h.hex()} is not in the pool") from None
        return Slot(TierId.POOL, block, block * self.block_bytes, nbytes)

    def locate(self, h: ChunkHash) -> tuple[int, int]:
        """(block, nbytes) of a committed chunk; KeyError if absent. The fast path of slot_of."""
        return self._committed[h]

    def locate_many(self, hashes: list[ChunkHash]) -> list[tuple[int, int, int]]:
        """(block, offset, nbytes) of each committed chunk, for lease receipts."""
        committed, bb = self._committed, self.block_bytes
        return [(b, b * bb, n) for b, n in map(committed.__getitem__, hashes)]

    def reserved_view(self, slot: Slot) -> memoryview:
        """Writable view of a reserved block (what an in-process writer fills)."""
        self._check_reserved(slot)
        return self._view[slot.offset : slot.offset + slot.nbytes]

    def handle(self) -> PoolHandle:
        return PoolHandle("shm", self.name, self.block_bytes, self.num_blocks, self.generation)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def reserved_blocks(self) -> int:
        return len(self._reserved)

    @property
    def committed_blocks(self) -> int:
        return len(self._committed)

    def _check_reserved(self, slot: Slot) -> None:
        if slot.tier != TierId.POOL or self._reserved.get(slot.slot_id) != slot.nbytes:
            raise InternalInvariantError(f"pool block {slot.slot_id} is not reserved for this write")


def remove_stale_segments(name_prefix: str) -> list[str]:
    """Unlink pools of ``name_prefix`` left by daemons that died without closing them.

    A segment's name carries its creator's pid; one whose pid no longer runs
    is unreachable memory (tmpfs keeps it until unlinked). Returns the names removed.
    """
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - every Linux has /dev/shm
        return removed
    for name in names:
        if not name.startswith(name_prefix + "."):
            continue
        rest = name[len(name_prefix) + 1 :].split(".")
        if len(rest) != 2 or not rest[0].isdigit():
            continue
        pid = int(rest[0])
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    if removed:
        log.warning("removed %d host pool segments left by dead daemons: %s", len(removed), ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostPoolMapping:
    """A client's mapping of a daemon's host pool, by name.

    Deliberately not :class:`multiprocessing.shared_memory.SharedMemory`: on
    Python < 3.13 attaching registers the segment with the resource tracker,
    which unlinks the daemon's pool when the *client* exits.
    """

    def __init__(self, handle: PoolHandle, *, writable: bool = True) -> None:
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

    def block(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.handle.nbytes:
            raise ValueError(f"block [{offset}, {offset + nbytes}) is outside the pool")
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
