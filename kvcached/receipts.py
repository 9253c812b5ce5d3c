"""Frozen receipts the store hands out. Plain data: safe to keep, log or translate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.locations import NVME, POOL
from kvcached.leases import LeaseId, ReservationId, SessionId


class ChunkLocation(NamedTuple):
    """Where chunk ``position`` of a prompt lives in the pool: ``nbytes`` at byte ``offset``.

    A NamedTuple rather than a frozen dataclass: a lease of an 8k-token prompt
    builds 64 of these, and a frozen dataclass costs ~4x as much to construct.
    Immutable all the same.
    """

    position: int
    chunk_hash: ChunkHash
    offset: int  # byte offset in the pool slab; -1 when the chunk is read from NVMe (tier NVME)
    nbytes: int
    tier: int = POOL  # kvcached.contract.locations.POOL or NVME


@dataclass(frozen=True)
class LeaseReceipt:
    """Proof of a lease. Every chunk it names stays in place, unchanged, until the lease is
    released, expires, or its session ends. Losing the receipt does not free the pins; the
    TTL or the session end does.

    Stored column-wise (hashes, offsets) because that is what the wire carries; ``chunks``
    builds per-chunk records on demand. An offset of -1 marks a chunk left on NVMe (a lease
    taken without promotion).
    """

    lease_id: LeaseId
    session_id: SessionId
    layout_id: LayoutId
    matched_tokens: int
    chunk_hashes: tuple[ChunkHash, ...]
    offsets: tuple[int, ...]  # byte offset of each chunk in the pool, -1 for NVMe-only chunks
    chunk_bytes: int
    expires_at: float
    pool_generation: str

    @property
    def chunks(self) -> tuple[ChunkLocation, ...]:
        n = self.chunk_bytes
        return tuple(
            ChunkLocation(i, h, off, n, POOL) if off >= 0 else ChunkLocation(i, h, -1, n, NVME)
            for i, (h, off) in enumerate(zip(self.chunk_hashes, self.offsets))
        )

    @property
    def all_in_pool(self) -> bool:
        return not self.offsets or min(self.offsets) >= 0


@dataclass(frozen=True)
class ReservationReceipt:
    """Blocks reserved for a put. Write chunk ``slots[i].position`` into ``slots[i]`` then
    commit. ``cached_tokens`` were already cached; ``in_flight_tokens`` after them are being
    written by another writer right now (retry later to get them)."""

    reservation_id: ReservationId
    session_id: SessionId
    layout_id: LayoutId
    cached_tokens: int
    in_flight_tokens: int
    slots: tuple[ChunkLocation, ...]
    expires_at: float
    pool_generation: str
    durable_tokens: int = 0  # of cached_tokens, the prefix with an NVMe copy
    write_through: bool = False  # the commit will write NVMe before it returns
    #: Full chunks after the reserved ones that nobody else is writing and that were still not
    #: reserved, and why ("" when none): a full cache stores what fits and says so.
    not_reserved_tokens: int = 0
    not_reserved_reason: str = ""

    @property
    def opened(self) -> bool:
        """Whether a reservation exists (to commit or abort); False when nothing was reserved and
        the caller asked for no empty reservation."""
        return bool(self.reservation_id)


@dataclass(frozen=True)
class CommitReceipt:
    """What a commit made true. ``durable_tokens`` is the prompt's prefix (from its first
    token) whose chunks all have a committed NVMe copy, so a restart of the daemon keeps them.
    In a write-through domain that should equal ``cached_tokens``; when it does not (full disk,
    full LMDB map), :attr:`durable` is False and the chunks past it live in the pool only."""

    reservation_id: ReservationId
    committed_chunks: int
    cached_tokens: int  # of the prompt, after this commit
    durable_tokens: int = 0
    write_through: bool = False

    @property
    def durable(self) -> bool:
        """Everything cached of the prompt would survive a restart."""
        return self.durable_tokens >= self.cached_tokens


@dataclass(frozen=True)
class EvictReceipt:
    chunks: int
    bytes: int


@dataclass(frozen=True)
class SessionReleaseReceipt:
    leases: int
    reservations: int


@dataclass(frozen=True)
class RebuildReport:
    chunks: int
    orphans_dropped: int
    corrupt_dropped: int
    unknown_layout_dropped: int
    seconds: float
