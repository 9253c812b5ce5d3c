"""The tier contract: where chunk bytes live.

A tier stores opaque chunk payloads under their chunk hash. It knows nothing
of the prefix index, leases or eviction policy: the store decides *what* to
keep where; a tier only keeps it.

Writes are two-phase, so that nobody ever reads a half-written chunk::

    slot = tier.reserve(nbytes)      # space is set aside (TierFull if none)
    tier.write(slot, data)           # or: a client writes into its pool run in place
    tier.commit(slot, meta)          # now readable under meta.chunk_hash
    # ...or tier.abort(slot)         # space returned, nothing visible

Concurrency rules
-----------------
* Tiers are **not** internally synchronised. The store calls every method
  while holding its lock, so at most one thread is inside a tier at a time.
* A committed chunk is immutable until ``delete``. The store never deletes a
  pool chunk that a lease pins, so a client may read a leased block without
  any lock.
* ``read`` returns a view that is valid until the chunk is deleted or the tier
  closed. Callers that outlive the store lock must copy it (or hold a pin).
* A failure inside ``commit`` leaves the slot uncommitted; the caller aborts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterator

from kvcached.contract.keys import ChunkHash
from kvcached.contract.record import ChunkMeta
from kvcached.contract.locations import TierId


@dataclass(frozen=True)
class Slot:
    """Space reserved in a tier. For the pool, ``offset`` is the byte offset in the slab."""

    tier: TierId
    slot_id: int
    offset: int
    nbytes: int


class Tier(abc.ABC):
    tier_id: TierId

    @abc.abstractmethod
    def reserve(self, nbytes: int) -> Slot:
        """Set aside room for one chunk. Raises :class:`~kvcached.contract.errors.TierFull`."""

    @abc.abstractmethod
    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        """Copy ``data`` (exactly ``slot.nbytes``) into a reserved slot."""

    @abc.abstractmethod
    def commit(self, slot: Slot, meta: ChunkMeta) -> None:
        """Make the slot's bytes readable under ``meta.chunk_hash``."""

    @abc.abstractmethod
    def abort(self, slot: Slot) -> None:
        """Return a reserved, uncommitted slot. Idempotent."""

    @abc.abstractmethod
    def read(self, h: ChunkHash) -> memoryview:
        """The committed payload. Raises ChunkNotCached or CorruptChunk."""

    @abc.abstractmethod
    def delete(self, h: ChunkHash) -> bool:
        """Forget a committed chunk; False if it was not there."""

    @abc.abstractmethod
    def __contains__(self, h: ChunkHash) -> bool: ...

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes of committed and reserved chunks, as counted against capacity."""

    def can_admit(self, nbytes: int) -> bool:
        """Whether ``reserve(nbytes)`` would succeed without evicting anything."""
        return self.used_bytes + nbytes <= self.capacity_bytes

    def scan(self) -> Iterator[ChunkMeta]:
        """Every committed chunk's metadata (persistent tiers only)."""
        return iter(())

    @abc.abstractmethod
    def close(self) -> None: ...
