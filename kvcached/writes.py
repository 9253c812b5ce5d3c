"""The write path: two-phase puts with one writer per chunk.

::

    reserve  -> pool room for the chunks not cached and not in flight;
                the deepest cached chunk (the parent) is pinned
    write    -> the writer fills its room (in place, through the mapped pool)
    commit   -> the runs become indexed chunks, in prompt order, under the parent
    abort    -> the runs go back to the pool's free space (also on expiry or session end)

The in-flight registry maps each reserved chunk hash to its reservation, so a
second writer of the same prompt learns the chunk is being written instead
of writing it twice. Pinning the parent keeps the whole cached prefix from
being dropped while the writer works (a node with a child is never a leaf,
and the pinned parent itself is never evictable), so commit can always link
the new chunks under it. The one exception is corruption: if the parent's
bytes turn out corrupt it is detached, and commit then refuses.

Not thread-safe; the store calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvcached.config import StoreConfig
from kvcached.contract.errors import InvalidKV, ReservationClosed, SessionNotOpen, UnknownReservation, shown
from kvcached.index import Node, PrefixIndex
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.leases import Entry, ReservationId, SessionId, TimedTable
from kvcached.contract.locations import NVME, POOL
from kvcached.movement import Mover
from kvcached.receipts import ChunkLocation, CommitReceipt, ReservationReceipt
from kvcached.stats import Counters
from kvcached.tiers.base import Slot
from kvcached.tiers.extents import round_up
from kvcached.tiers.packed import PackedPool


@dataclass
class PendingPut:
    layout_id: LayoutId
    parent: Node | None  # pinned until commit/abort
    hashes: list[ChunkHash]
    slots: list[Slot]
    first_position: int
    tokens: bytes | None = None  # the prompt's packed uint32 ids, kept only for the KV event stream


class WritePath:
    def __init__(
        self,
        config: StoreConfig,
        index: PrefixIndex,
        pool: PackedPool,
        mover: Mover,
        counters: Counters,
        layout_of: Callable[[LayoutId], tuple[KVLayout, ChunkHash]],
        unpin: Callable[[Sequence[Node], float], None],
        wait_room: Callable[[int, int], None] = lambda nbytes, slab: None,
        write_nvme: Callable[[Sequence[Node]], int] | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.pool = pool
        self.mover = mover
        self.counters = counters
        self._layout_of = layout_of
        self._unpin = unpin
        # Called before reserving when fewer bytes are free than the chunks need: waits (bounded)
        # for the write-back thread, or raises WouldBlock on the store's inline path.
        self._wait_room = wait_room
        self._write_nvme = write_nvme  # write-through: NVMe copies of committed nodes, batched
        self.reservations: TimedTable[PendingPut] = TimedTable("put")
        self.in_flight: dict[ChunkHash, ReservationId] = {}

    def plan(self, hashes: list[ChunkHash]) -> tuple[list[Node], list[ChunkHash], int]:
        """(cached prefix nodes, chunks to write, chunks in flight after them). Read-only."""
        cached = self.index.match(hashes)
        k = len(cached)
        todo: list[ChunkHash] = []
        in_flight = 0
        for h in hashes[k:]:
            if h in self.in_flight:
                in_flight = len(hashes) - k - len(todo)
                break
            todo.append(h)
        return cached, todo, in_flight

    def reserve(
        self, layout_id: LayoutId, hashes: list[ChunkHash], session: SessionId, ttl: float, now: float, *,
        open_empty: bool = True, touch: bool = True, tokens: bytes | None = None, slab: int = 0,
    ) -> ReservationReceipt:
        """Reserve pool room for the prompt's full chunks that are not cached yet. ``tokens``
        (the prompt's packed ids) travels with the reservation to the index's observer at commit.

        Chunks that another reservation is writing are reported as
        ``in_flight_tokens`` and not reserved, nor is anything after them
        (a chunk is only stored after its whole prefix). If the pool cannot
        make room for all of them (it is full of leased or reserved chunks),
        the reservation covers as many leading chunks as it could get and
        says how many it could not, and why: a full cache is never an error.
        With nothing reserved and ``open_empty`` False no reservation is
        opened (the receipt's id is empty: nothing to commit). ``touch`` False
        leaves the cached prefix's recency alone (the caller pins it anyway). The room is taken
        in pool slab ``slab`` (the writer's device), chunk by chunk, making room as it goes.

        (Reserving a prompt's chunks as one span where one free gap holds them all made this
        call's in-process cost 0.64x, but with write-back running a reader's acquire p99 went
        from 1.2-1.65x idle to 2.1-3.4x in bench/writeback.py, even with the puts paced to the
        same rate; not understood, so not done.)
        """
        layout = self._layout_of(layout_id)[0]
        cached, todo, in_flight = self.plan(hashes)
        need = len(todo) * round_up(layout.chunk_bytes)
        if todo and self.pool.slab_free_bytes(slab) < need:
            self._wait_room(need, slab)  # may release the lock: plan again
            cached, todo, in_flight = self.plan(hashes)
        if self.reservations.ended(session):  # it ended while this call ran (or waited, above)
            raise SessionNotOpen(f"session {shown(session)} ended while this call ran; open a new Session")
        k = len(cached)
        if in_flight:
            self.counters.in_flight_conflicts += 1
        ct = layout.chunk_tokens
        if not todo and not open_empty:  # nothing to write: no reservation, nothing pinned
            if touch:
                self.index.touch(cached, now)
            durable = next((i for i, node in enumerate(cached) if not node.tiers & NVME), k)
            return ReservationReceipt(ReservationId(""), session, layout_id, k * ct, in_flight * ct, (), now,
                                      self.pool.generation, durable * ct, self.write_through)
        if touch:
            self.index.touch(cached, now)
        parent = cached[-1] if cached else None
        if parent is not None:
            # Pin first: making room below must not evict the prefix we extend.
            self.index.pin([parent], now, touch=False)  # touched above if at all; a pin is no hit
        slots: list[Slot] = []
        refused = 0
        policy = self.index.policy
        try:
            for i, h in enumerate(todo):
                if policy.screens and not self.pool.can_admit(layout.chunk_bytes, slab):
                    victim = self.index.pool_lru.peek()
                    if victim is not None and not policy.admits(h, now, victim):
                        refused = len(todo) - i  # a chunk is only stored after its whole prefix
                        break
                if not self.mover.pool_room(layout.chunk_bytes, slab):
                    break
                slots.append(self.pool.reserve(layout.chunk_bytes, slab))
        except BaseException:  # WouldBlock on the inline path: give everything back
            for slot in slots:
                self.pool.abort(slot)
            if parent is not None:
                self._unpin([parent], now)
            raise
        missing = len(todo) - len(slots)
        reason = ""
        self.counters.admitted_chunks += len(slots)
        if refused:
            self.counters.refused_value_chunks += refused
            reason = (f"the admission policy kept {refused} chunks out: they rank below the cached chunks "
                      "they would evict (eviction_admission = frequency)")
        elif missing:
            self.counters.not_reserved_chunks += missing
            reason = (f"the pool has no room for {missing} more chunks of {layout.chunk_bytes} bytes: "
                      f"{self.pool.slab_used_bytes(slab)} of {self.pool.slab_capacity(slab)} bytes"
                      f"{f' of slab {slab}' if self.pool.slabs > 1 else ''} are leased, reserved or "
                      "could not be evicted")
        todo = todo[: len(slots)]
        durable = next((i for i, node in enumerate(cached) if not node.tiers & NVME), k)
        if not slots and not open_empty:
            if parent is not None:
                self._unpin([parent], now)
            return ReservationReceipt(
                ReservationId(""), session, layout_id, k * ct, in_flight * ct, (), now, self.pool.generation,
                durable * ct, self.write_through, missing * ct, reason)
        entry = self.reservations.add(session, PendingPut(layout_id, parent, todo, slots, k, tokens), ttl, now)
        for h in todo:
            self.in_flight[h] = ReservationId(entry.id)
        self.counters.reservations += 1
        locs = tuple(ChunkLocation(k + i, h, s.offset, s.nbytes) for i, (h, s) in enumerate(zip(todo, slots)))
        return ReservationReceipt(
            ReservationId(entry.id), session, layout_id, k * ct, in_flight * ct,
            locs, entry.expires_at, self.pool.generation, durable * ct, self.write_through, missing * ct, reason,
        )

    @property
    def write_through(self) -> bool:
        """Commits write NVMe before they return (configured, and there is an NVMe tier)."""
        return self.config.write_through and self.mover.nvme is not None

    def write(self, reservation_id: ReservationId, position: int, data: bytes | memoryview) -> None:
        self.pool.write(self._slot(reservation_id, position), data)

    def reserved_view(self, reservation_id: ReservationId, position: int) -> memoryview:
        """A writable view of one reserved chunk's run (host pools only: see ``pool.reserved_view``).
        Valid until the reservation is committed or aborted; the writer must be done by then."""
        return self.pool.reserved_view(self._slot(reservation_id, position))

    def _slot(self, reservation_id: ReservationId, position: int) -> Slot:
        pending = self.pending(reservation_id).payload
        i = position - pending.first_position
        if not 0 <= i < len(pending.slots):
            raise InvalidKV(f"chunk {position} is not part of reservation {shown(reservation_id)}")
        return pending.slots[i]

    def commit(self, reservation_id: ReservationId, chunks: int | None, now: float,
               session: SessionId | None = None) -> CommitReceipt:
        pending = self.pending(reservation_id, session).payload
        if self.write_through and pending.slots:
            self.mover.io_check()
        n = len(pending.slots) if chunks is None else chunks
        if not 0 <= n <= len(pending.slots):
            raise InvalidKV(f"cannot commit {n} chunks of a reservation of {len(pending.slots)}")
        self.reservations.remove(reservation_id, "committed")
        layout = self._layout_of(pending.layout_id)[0]
        parent = pending.parent
        if parent is not None and self.index.is_detached(parent):
            self.close(pending, now, committed=0)
            raise ReservationClosed("the cached prefix this put extends was dropped as corrupt; put again")
        self.pool.commit_run(pending.slots[:n], pending.hashes[:n])
        tokens = None
        if pending.tokens is not None:  # the committed chunks' own token ids
            tokens = pending.tokens[pending.first_position * layout.chunk_tokens * 4:
                                    (pending.first_position + n) * layout.chunk_tokens * 4]
        nodes = self.index.insert_chain(pending.hashes[:n], parent, pending.layout_id, POOL, now,
                                        [slot.offset for slot in pending.slots[:n]], tokens)
        if self.write_through and nodes:
            if self._write_nvme is not None:
                ok = self._write_nvme(nodes)
            else:
                ok = sum(self.mover.write_nvme(node, self.pool.read(node.hash)) for node in nodes)
            self.counters.write_through_writes += ok
            self.counters.write_through_failures += len(nodes) - ok
        self.close(pending, now, committed=n)
        self.counters.commits += 1
        self.counters.committed_chunks += n
        last = nodes[-1] if nodes else parent
        durable = _durable_chunks(last) if self.mover.nvme is not None else 0
        return CommitReceipt(reservation_id, n, (pending.first_position + n) * layout.chunk_tokens,
                             durable * layout.chunk_tokens, self.write_through)

    def abort(self, reservation_id: ReservationId, now: float, session: SessionId | None = None) -> bool:
        live = self.reservations.get(reservation_id)
        if live is not None and session is not None and live.session != session:
            return False  # another session's reservation: not ours to abort
        entry = self.reservations.remove(reservation_id, "aborted")
        if entry is None:
            if self.reservations.closed_reason(reservation_id) is None:
                raise UnknownReservation(f"no reservation {shown(reservation_id)} was ever made here")
            return False
        self.close(entry.payload, now, committed=0)
        self.counters.aborts += 1
        return True

    def end_session(self, session: SessionId, now: float, *, closed: bool = False) -> int:
        """Abort every reservation of ``session`` (see :meth:`TimedTable.end_session`)."""
        puts = self.reservations.end_session(session, closed=closed)
        for p in puts:
            self.close(p.payload, now, committed=0)
        return len(puts)

    def expire(self, now: float) -> int:
        puts = self.reservations.pop_expired(now)
        for p in puts:
            self.close(p.payload, now, committed=0)
        self.counters.reservations_expired += len(puts)
        return len(puts)

    def pending(self, reservation_id: ReservationId, session: SessionId | None = None) -> Entry[PendingPut]:
        """The live reservation; with ``session``, only if that session made it (another
        session's id reads as unknown, so ids cannot be probed across sessions)."""
        entry = self.reservations.get(reservation_id)
        if entry is not None and session is not None and entry.session != session:
            raise UnknownReservation(f"no reservation {shown(reservation_id)} in this session")
        if entry is None:
            why = self.reservations.closed_reason(reservation_id)
            if why is not None:
                raise ReservationClosed(f"reservation {shown(reservation_id)} was already {why}")
            raise UnknownReservation(f"no reservation {shown(reservation_id)}")
        return entry

    def close(self, pending: PendingPut, now: float, committed: int) -> None:
        """Return uncommitted runs, clear in-flight marks, unpin the parent."""
        for slot in pending.slots[committed:]:
            self.pool.abort(slot)
        for h in pending.hashes:
            self.in_flight.pop(h, None)
        if pending.parent is not None:
            self._unpin([pending.parent], now)


def _durable_chunks(last: Node | None) -> int:
    """How many chunks, from the prompt's first, have an NVMe copy, on the path ending at ``last``.

    One walk up the parent links: the shallowest chunk without an NVMe copy ends the durable
    prefix (a restart rebuilds the index from NVMe, so nothing below a gap is reachable)."""
    if last is None:
        return 0
    durable = last.depth + 1
    node: Node | None = last
    while node is not None:
        if not node.tiers & NVME:
            durable = node.depth
        node = node.parent
    return durable
