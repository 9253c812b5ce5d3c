"""Block bookkeeping shared by the device pools (host shared memory, CUDA).

A pool is one slab of ``num_blocks`` fixed-size blocks; one chunk occupies
one block. This base class owns which block is free, reserved or holds which
chunk; a subclass only moves bytes (``_write``, ``_read``, ``_fill``) and
says how a client maps the slab (``handle``).

Free blocks are handed out last-freed first (a stack), so recently touched
memory is reused while it is warm; a fresh pool hands out block 0 first.

Block ``b`` starts at ``b * block_bytes``; the block size is a multiple of
:data:`kvcached.config.BLOCK_ALIGN` (checked here, whoever builds the pool), so
with a slab base aligned at least that much every block can be viewed as any
layout dtype in place.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

from kvcached.config import check_block_bytes
from kvcached.errors import ChunkNotCached, InternalInvariantError, InvalidKV, TierFull
from kvcached.keys import ChunkHash
from kvcached.locations import TierId
from kvcached.tiers.base import ChunkMeta, Slot, Tier


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
    block_bytes: int
    num_blocks: int
    generation: str
    cuda: CudaIpc | None = field(default=None)

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks


class BlockPool(Tier):
    tier_id = TierId.POOL

    def __init__(self, block_bytes: int, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("pool needs a positive block count")
        check_block_bytes(block_bytes)
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._reserved: dict[int, int] = {}  # block -> nbytes
        self._committed: dict[ChunkHash, tuple[int, int]] = {}  # hash -> (block, nbytes)

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
        if nbytes > self.block_bytes:
            raise InvalidKV(f"chunk of {nbytes} bytes does not fit a {self.block_bytes} byte pool block")
        if not self._free:
            raise TierFull(f"pool: all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self._reserved[block] = nbytes
        return Slot(TierId.POOL, block, block * self.block_bytes, nbytes)

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        self._check_reserved(slot)
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.nbytes:
            raise InvalidKV(f"chunk data is {mv.nbytes} bytes, the slot holds exactly {slot.nbytes}")
        self._write(slot.offset, mv)

    def write_with(self, slot: Slot, fill: Callable[[memoryview], None]) -> None:
        """Fill a reserved block from a producer that writes into a buffer (e.g. an NVMe read)."""
        self._check_reserved(slot)
        self._fill(slot.offset, slot.nbytes, fill)

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
        return self._read(block * self.block_bytes, nbytes)

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

    # -- pool specifics ------------------------------------------------------------------------

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
