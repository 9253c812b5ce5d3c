"""The packed pool: chunks of any size in slabs (host shared memory or CUDA), one per device.

A pool is one or more slabs, each exported once (a shm name, or one CUDA IPC
handle). On a host with several GPUs the daemon keeps one slab on each, so a
worker on GPU k writes and reads chunks in GPU k's memory (no cross-GPU copy,
no second CUDA context); a chunk is placed in the slab of the device its
writer names (its *placement*, see :meth:`PackedPool.slab_for`). Offsets are
global: slab k covers ``[base_k, base_k + size_k)`` of one address space, so a
receipt's offset names its slab too, and no run crosses a slab's end.

A chunk takes one contiguous run of a slab, at a multiple of
:data:`kvcached.config.BLOCK_ALIGN`, chosen by :class:`~kvcached.tiers.extents.
ExtentAllocator` (best fit with coalescing; the module says why by measurement).
Chunks of every layout share the slab, so a 4 KiB test chunk and a 40 MiB
Llama-3-70B chunk both waste at most the alignment. Offsets stay byte offsets:
what a lease receipt names is where a client views the chunk in place.

This base class owns the bookkeeping (which run is free, reserved or holds
which chunk); a subclass only moves bytes (``_write``, ``_read``, ``_fill``) and
says how a client maps the slab (``handle``).

A slot's id is its offset (unique while the run is reserved or committed).

How a reader on GPU j reads a chunk that lives on GPU k (a chunk placed before that worker
said where it runs, or written by an engine on another GPU): its client opens slab k by CUDA
IPC on device k, which must be visible to it (``CUDA_VISIBLE_DEVICES``); the copy then goes
over NVLink or PCIe peer access and the process holds a CUDA context on device k too. A
process that cannot see device k fails that load open (the blocks are recomputed).
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
from typing import Callable, Sequence

from kvcached.config import BLOCK_ALIGN
from kvcached.contract.errors import ChunkNotCached, InternalInvariantError, InvalidKV, TierFull
from kvcached.contract.keys import ChunkHash
from kvcached.contract.locations import TierId
from kvcached.contract.pool import PoolHandle, PoolSlab, normal_placement
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.base import Slot, Tier
from kvcached.tiers.extents import ExtentAllocator


class PackedPool(Tier):
    """Space bookkeeping over one or more slabs (see the module docstring).

    ``capacity_bytes`` is one size per slab (an int: one slab); ``placements`` names the
    device of each (defaults ``host:0`` ...). Every method that finds room takes the slab it
    is for; a caller picks it with :meth:`slab_for`."""

    tier_id = TierId.POOL

    def __init__(self, capacity_bytes: int | list[int], placements: list[str] | None = None) -> None:
        sizes = [capacity_bytes] if isinstance(capacity_bytes, int) else list(capacity_bytes)
        if not sizes or min(sizes) < BLOCK_ALIGN:
            raise ValueError(f"a pool needs at least one slab of at least {BLOCK_ALIGN} bytes")
        self._spaces = [ExtentAllocator(n, BLOCK_ALIGN) for n in sizes]
        self._bases = []
        base = 0
        for sp in self._spaces:
            self._bases.append(base)
            base += sp.capacity
        self.size_bytes = base
        self.placements = list(placements) if placements else [f"host:{k}" for k in range(len(sizes))]
        if len(self.placements) != len(sizes):
            raise ValueError(f"{len(sizes)} slabs but {len(self.placements)} placements")
        self._slab_of_placement = {normal_placement(p): k for k, p in enumerate(self.placements)}
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

    #: Whether :meth:`reserved_view` works: the pool is host memory this process can write.
    host_views: bool = False
    #: A new random value per pool: clients holding offsets from an older pool must not use them.
    generation: str
    #: What the pool's memory is called (its shared-memory name, or its device), for logs.
    name: str

    def reserved_view(self, slot: Slot) -> memoryview:
        """Writable view of a reserved run, for an in-process writer that fills it in place (a
        socket read); only where :attr:`host_views`. Valid until the slot is committed or aborted."""
        raise NotImplementedError(f"{type(self).__name__} has no host view of its slots")

    # -- Tier ------------------------------------------------------------------------------

    def reserve(self, nbytes: int, slab: int = 0) -> Slot:
        space = self._spaces[slab]
        if nbytes <= 0 or nbytes > space.capacity:
            raise InvalidKV(f"a chunk of {nbytes} bytes does not fit a {space.capacity} byte pool slab")
        local = space.alloc(nbytes)
        if local is None:
            raise TierFull(f"pool slab {slab}: no free run of {nbytes} bytes ({space.free_bytes} bytes free in "
                           f"{space.gaps} gaps, the largest {space.largest_gap})")
        offset = self._bases[slab] + local
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
        self.commit_run((slot,), (meta.chunk_hash,))

    def commit_run(self, slots: Sequence[Slot], hashes: Sequence[ChunkHash]) -> None:
        """:meth:`commit` of ``slots[i]`` as chunk ``hashes[i]``, for a reservation's chunks in one
        go (the pool keeps only the hash of a chunk's meta). All are checked before any changes."""
        reserved, committed = self._reserved, self._committed
        if len(slots) != len(hashes):
            raise InternalInvariantError(f"{len(slots)} slots for {len(hashes)} chunks")
        for slot, h in zip(slots, hashes):
            if slot.tier != TierId.POOL or reserved.get(slot.offset) != slot.nbytes:
                raise InternalInvariantError(f"pool run at {slot.offset} is not reserved for this write")
            if h in committed:
                raise InternalInvariantError(f"pool already holds chunk {h.hex()}")
        if len(set(hashes)) != len(hashes):
            raise InternalInvariantError("a reservation names one chunk twice")
        at = self._at
        for slot, h in zip(slots, hashes):
            del reserved[slot.offset]
            committed[h] = (slot.offset, slot.nbytes)
            at[slot.offset] = h
            self._payload += slot.nbytes

    def abort(self, slot: Slot) -> None:
        if self._reserved.pop(slot.offset, None) is not None:
            self._free(slot.offset)

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
        self._free(offset)
        return True

    def __contains__(self, h: ChunkHash) -> bool:
        return h in self._committed

    @property
    def capacity_bytes(self) -> int:
        return self.size_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of committed and reserved runs (each rounded up to the alignment)."""
        return sum(sp.used_bytes for sp in self._spaces)

    def can_admit(self, nbytes: int, slab: int = 0) -> bool:
        return self._spaces[slab].fits(nbytes)

    # -- slabs -----------------------------------------------------------------------------------

    @property
    def slabs(self) -> int:
        return len(self._spaces)

    def slab_of(self, offset: int) -> int:
        """The slab a global offset lies in."""
        return bisect.bisect_right(self._bases, offset) - 1

    def local(self, offset: int) -> tuple[int, int]:
        """(slab, offset within it) of a global offset: what a backend's byte movers use."""
        k = self.slab_of(offset)
        return k, offset - self._bases[k]

    def slab_for(self, placement: str) -> int:
        """The slab for a chunk whose writer (or reader, for a promotion) runs on ``placement``:
        that device's slab; for an empty or unknown placement (a host-memory client, a GPU the
        daemon has no slab on) the slab with the most free bytes."""
        if len(self._spaces) == 1:
            return 0
        k = self._slab_of_placement.get(normal_placement(placement)) if placement else None
        if k is not None:
            return k
        return max(range(len(self._spaces)), key=lambda i: self._spaces[i].free_bytes)

    def slab_capacity(self, slab: int) -> int:
        return self._spaces[slab].capacity

    def slab_free_bytes(self, slab: int) -> int:
        return self._spaces[slab].free_bytes

    def slab_used_bytes(self, slab: int) -> int:
        return self._spaces[slab].used_bytes

    def _free(self, offset: int) -> None:
        k, local = self.local(offset)
        self._spaces[k].free(local)

    def _handle_of(self, slabs: list[PoolHandle]) -> PoolHandle:
        """The pool's handle from each slab's own (one-slab) handle: slab 0's, listing every slab
        with its base and device when there are several (what ``handle`` returns)."""
        if len(slabs) == 1:
            return slabs[0]
        return dataclasses.replace(slabs[0], slabs=tuple(
            PoolSlab(self._bases[k], self.placements[k], h) for k, h in enumerate(slabs)))

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

    def victims_for(self, nbytes: int, evictable: Callable[[ChunkHash], bool], slab: int = 0) -> list[ChunkHash] | None:
        """The committed chunks to evict so that a run of ``nbytes`` fits in ``slab``: the
        contiguous window that frees the fewest bytes (see :meth:`ExtentAllocator.window`), made
        only of free space and chunks ``evictable`` accepts. None if there is no such window."""
        at, base = self._at, self._bases[slab]
        offsets = self._spaces[slab].window(nbytes, lambda off: off + base in at and evictable(at[off + base]))
        return None if offsets is None else [at[off + base] for off in offsets]

    @property
    def free_bytes(self) -> int:
        return sum(sp.free_bytes for sp in self._spaces)

    @property
    def largest_free(self) -> int:
        return max(sp.largest_gap for sp in self._spaces)

    @property
    def free_runs(self) -> int:
        return sum(sp.gaps for sp in self._spaces)

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
        for sp in self._spaces:
            sp.check()
        if sum(len(sp) for sp in self._spaces) != len(self._reserved) + len(self._committed):
            raise InternalInvariantError("pool allocations and chunks disagree")

    def _check_reserved(self, slot: Slot) -> None:
        if slot.tier != TierId.POOL or self._reserved.get(slot.offset) != slot.nbytes:
            raise InternalInvariantError(f"pool run at {slot.offset} is not reserved for this write")
