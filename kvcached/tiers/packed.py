"""The packed pool: chunks of any size in one slab (host shared memory or CUDA).

A pool is one slab of ``capacity`` bytes, exported once (a shm name, or one
CUDA IPC handle). A chunk takes one contiguous run of it, at a multiple of
:data:`kvcached.config.BLOCK_ALIGN`, chosen by :class:`~kvcached.tiers.extents.
ExtentAllocator` (best fit with coalescing; the module says why by measurement).
Chunks of every layout share the slab, so a 4 KiB test chunk and a 40 MiB
Llama-3-70B chunk both waste at most the alignment. Offsets stay byte offsets:
what a lease receipt names is where a client views the chunk in place.

This base class owns the bookkeeping (which run is free, reserved or holds
which chunk); a subclass only moves bytes (``_write``, ``_read``, ``_fill``) and
says how a client maps the slab (``handle``).

A slot's id is its offset (unique while the run is reserved or committed).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

from kvcached.config import BLOCK_ALIGN
from kvcached.errors import ChunkNotCached, InternalInvariantError, InvalidKV, TierFull
from kvcached.keys import ChunkHash
from kvcached.locations import TierId
from kvcached.tiers.base import ChunkMeta, Slot, Tier
from kvcached.tiers.extents import ExtentAllocator


@dataclass(frozen=True)
class CudaIpc:
    """What a client needs to open a CUDA pool slab (the fields of torch's storage sharing)."""

    device_index: int  # in the daemon's numbering; clients match by device_uuid
    device_uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class PoolHandle:
    """Everything a client needs to map the pool. Sent as protobuf fields, never pickled."""

    kind: str  # "shm" (POSIX shared memory) or "cuda"
    name: str  # shm: the segment name under /dev/shm
    size_bytes: int  # the slab; every chunk is a run inside it
    align_bytes: int  # every chunk starts at a multiple of this
    generation: str
    cuda: CudaIpc | None = field(default=None)

    @property
    def nbytes(self) -> int:
        return self.size_bytes


class PackedPool(Tier):
    tier_id = TierId.POOL

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < BLOCK_ALIGN:
            raise ValueError(f"a pool needs at least {BLOCK_ALIGN} bytes")
        self._space = ExtentAllocator(capacity_bytes, BLOCK_ALIGN)
        self.size_bytes = self._space.capacity
        self._reserved: dict[int, int] = {}  # offset -> nbytes
        self._committed: dict[ChunkHash, tuple[int, int]] = {}  # hash -> (offset, nbytes)
        self._at: dict[int, ChunkHash] = {}  # offset -> committed hash
        self._payload = 0  # bytes of committed chunks (what holds KV)

    # -- bytes: what a backend implements ----------------------------------------------

    @abc.abstractmethod
    def _write(self, offset: int, data: memoryview) -> None:
        """Copy host bytes into the slab; done (visible to every reader) when it returns."""

    @abc.abstractmethod
    def _read(self, offset: int, nbytes: int) -> memoryview:
        """Host-readable bytes of the slab: a view for host memory, a copy for device memory."""

    @abc.abstractmethod
    def _fill(self, offset: int, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        """Let ``fill`` write ``nbytes`` host bytes that end up at ``offset``; done when it returns."""

    @abc.abstractmethod
    def handle(self) -> PoolHandle: ...

    # -- Tier ------------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> Slot:
        if nbytes <= 0 or nbytes > self.size_bytes:
            raise InvalidKV(f"a chunk of {nbytes} bytes does not fit a {self.size_bytes} byte pool")
        offset = self._space.alloc(nbytes)
        if offset is None:
            raise TierFull(f"pool: no free run of {nbytes} bytes ({self._space.free_bytes} bytes free in "
                           f"{self._space.gaps} gaps, the largest {self._space.largest_gap})")
        self._reserved[offset] = nbytes
        return Slot(TierId.POOL, offset, offset, nbytes)

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        self._check_reserved(slot)
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.nbytes:
            raise InvalidKV(f"chunk data is {mv.nbytes} bytes, the slot holds exactly {slot.nbytes}")
        self._write(slot.offset, mv)

    def write_with(self, slot: Slot, fill: Callable[[memoryview], None]) -> None:
        """Fill a reserved run from a producer that writes into a buffer (e.g. an NVMe read)."""
        self._check_reserved(slot)
        self._fill(slot.offset, slot.nbytes, fill)

    def commit(self, slot: Slot, meta: ChunkMeta) -> None:
        self._check_reserved(slot)
        if meta.chunk_hash in self._committed:
            raise InternalInvariantError(f"pool already holds chunk {meta.chunk_hash.hex()}")
        del self._reserved[slot.offset]
        self._committed[meta.chunk_hash] = (slot.offset, slot.nbytes)
        self._at[slot.offset] = meta.chunk_hash
        self._payload += slot.nbytes

    def abort(self, slot: Slot) -> None:
        if self._reserved.pop(slot.offset, None) is not None:
            self._space.free(slot.offset)

    def read(self, h: ChunkHash) -> memoryview:
        try:
            offset, nbytes = self._committed[h]
        except KeyError:
            raise ChunkNotCached(f"chunk {h.hex()} is not in the pool") from None
        return self._read(offset, nbytes)

    def delete(self, h: ChunkHash) -> bool:
        entry = self._committed.pop(h, None)
        if entry is None:
            return False
        offset, nbytes = entry
        del self._at[offset]
        self._payload -= nbytes
        self._space.free(offset)
        return True

    def __contains__(self, h: ChunkHash) -> bool:
        return h in self._committed

    @property
    def capacity_bytes(self) -> int:
        return self.size_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of committed and reserved runs (each rounded up to the alignment)."""
        return self._space.used_bytes

    def can_admit(self, nbytes: int) -> bool:
        return self._space.fits(nbytes)

    # -- pool specifics ------------------------------------------------------------------------

    def slot_of(self, h: ChunkHash) -> Slot:
        """Where a committed chunk lives, for lease receipts."""
        try:
            offset, nbytes = self._committed[h]
        except KeyError:
            raise ChunkNotCached(f"chunk {h.hex()} is not in the pool") from None
        return Slot(TierId.POOL, offset, offset, nbytes)

    def locate(self, h: ChunkHash) -> tuple[int, int]:
        """(offset, nbytes) of a committed chunk; KeyError if absent. The fast path of slot_of."""
        return self._committed[h]

    def victims_for(self, nbytes: int, evictable: Callable[[ChunkHash], bool]) -> list[ChunkHash] | None:
        """The committed chunks to evict so that a run of ``nbytes`` fits: the contiguous window
        that frees the fewest bytes (see :meth:`ExtentAllocator.window`), made only of free space
        and chunks ``evictable`` accepts. None if there is no such window."""
        at = self._at
        offsets = self._space.window(nbytes, lambda off: off in at and evictable(at[off]))
        return None if offsets is None else [at[off] for off in offsets]

    @property
    def free_bytes(self) -> int:
        return self._space.free_bytes

    @property
    def largest_free(self) -> int:
        return self._space.largest_gap

    @property
    def free_runs(self) -> int:
        return self._space.gaps

    @property
    def payload_bytes(self) -> int:
        """Bytes of committed chunk payloads: what actually holds KV."""
        return self._payload

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    @property
    def reserved_chunks(self) -> int:
        return len(self._reserved)

    @property
    def committed_chunks(self) -> int:
        return len(self._committed)

    def check(self) -> None:
        """Full consistency check (tests)."""
        self._space.check()
        if len(self._space) != len(self._reserved) + len(self._committed):
            raise InternalInvariantError("pool allocations and chunks disagree")

    def _check_reserved(self, slot: Slot) -> None:
        if slot.tier != TierId.POOL or self._reserved.get(slot.offset) != slot.nbytes:
            raise InternalInvariantError(f"pool run at {slot.offset} is not reserved for this write")
