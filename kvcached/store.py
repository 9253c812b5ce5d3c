"""The store: the one facade the service calls. One store = one trust domain.

Thread-safety contract
----------------------
Every public method takes the store's single lock for its whole duration, so
calls are linearisable and may come from any thread. Some methods do disk
I/O under that lock (``acquire`` when it promotes from NVMe, ``reserve``
when the write-back thread fell behind and it demotes to make room, ``commit``
in write-through mode, ``flush``, ``open``/rebuild), and ``reserve`` may wait
for the write-back thread (:mod:`kvcached.writeback`), releasing the lock while
it waits. The asyncio service therefore calls the store through
:meth:`run_inline` (which refuses anything that would block) or from a worker
thread, never blocking the event loop. ``lookup``, ``release`` and ``stats``
never touch the disk.

Ownership
---------
A lease receipt's chunks stay in the pool, unchanged, until the lease is
released, expires (``lease_ttl`` unless renewed) or its session is released.
Pool room of a reservation belongs to its writer until commit or abort; a
reservation that is neither committed nor aborted within
``reservation_ttl`` is aborted by :meth:`expire`, which the daemon calls
periodically (tests call it with a controlled clock).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from kvcached.config import RELOADABLE_FIELDS, StoreConfig
from kvcached.contract.errors import (
    ChunkNotCached,
    ClientKeysNotTrusted,
    InvalidKV,
    InvalidLayout,
    InvalidTokens,
    LeaseExpired,
    LimitReached,
    SessionNotOpen,
    StoreClosed,
    StoreDraining,
    StoreLocked,
    WouldBlock,
    shown,
    UnknownLayout,
    UnknownLease,
    UnknownReservation,
)
from kvcached.index import Node, PrefixIndex, make_policy
from kvcached.contract.events import MEDIUM_CPU, MEDIUM_GPU, KVCacheEvent
from kvcached.events import KvEventLog, snapshot_events
from kvcached.hashmemo import HashMemo
from kvcached.contract.keys import (CLIENT_KEYS, ChunkHash, ChunkHasher, KVLayout, LayoutId, Namespace, TokenInput,
                                    load_or_create_key, load_shared_key, normalize_tokens)
from kvcached.leases import Entry, LeaseId, ReservationId, SessionId, TimedTable
from kvcached.contract.locations import POOL
from kvcached.movement import Mover
from kvcached.promptshape import PromptShape
from kvcached.receipts import (
    CommitReceipt,
    EvictReceipt,
    LeaseReceipt,
    RebuildReport,
    ReservationReceipt,
    SessionReleaseReceipt,
)
from kvcached.rebuild import rebuild_index
from kvcached.reads import ReadPath
from kvcached.writes import WritePath
from kvcached.publish import RemotePublisher
from kvcached.remotefill import RemoteFill
from kvcached.stats import (
    SlabStats,
    Counters,
    EvictionStats,
    HashMemoStats,
    HitRateHistory,
    NvmeStats,
    PoolStats,
    RemoteTierStats,
    StoreStats,
)
from kvcached.tiers.nvme import NvmeTier
from kvcached.contract.pool import PoolHandle
from kvcached.contract.remote_format import mac_key
from kvcached.tiers.remote_redis import RemoteRedisTier
from kvcached.tiers.registry import make_pool
from kvcached.writeback import WriteBack

log = logging.getLogger(__name__)

DEFAULT_SESSION = SessionId("local")

T = TypeVar("T")


class Store:
    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the write-back thread and its waiters
        os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
        config.file_access.open_parent(config.state_dir)  # clients reach nvme/<domain> through it
        self._lockfile = _lock_state_dir(config.state_dir, config.domain)
        # A shared key file (every host of the domain has the same) or this daemon's own.
        domain_key = (load_shared_key(config.hash_key_file) if config.hash_key_file
                      else load_or_create_key(os.path.join(config.state_dir, "hash.key")))
        self._hasher = ChunkHasher(domain_key)
        self.remote: RemoteRedisTier | None = None
        self.remote_fill: RemoteFill | None = None
        self.publisher: RemotePublisher | None = None
        self.events: KvEventLog | None = None  # the KV event stream's source (kvcached.events)
        if config.remote is not None:  # hosts sharing it share the hash key: same hashes, same MAC key
            self.remote = RemoteRedisTier(dataclasses.replace(config.remote, domain=config.domain), mac_key(domain_key))
        self._memo = HashMemo(config.hash_memo_bytes)
        self._layouts: dict[LayoutId, tuple[KVLayout, ChunkHash]] = {}
        self.index = PrefixIndex(make_policy(config.eviction_policy, weight=config.eviction_weight,
                                             memory_chunks=config.eviction_memory_chunks,
                                             admission=config.eviction_admission))
        self.counters = Counters()
        self._by_layout: dict[LayoutId, list[int]] = {}
        self.hit_history = HitRateHistory()
        self.prompt_shape = PromptShape()  # where lookups stop matching (kvcachectl doctor)
        self._leases: TimedTable[tuple[Node, ...]] = TimedTable("lease")
        self.pool = make_pool(config)
        self.nvme: NvmeTier | None = None
        try:
            if config.nvme_bytes:
                self.nvme = NvmeTier(
                    os.path.join(config.state_dir, "nvme", config.domain),
                    config.nvme_bytes,
                    map_size=config.nvme_map_bytes,
                    access=config.file_access,
                )
            self._mover = Mover(config, self.index, self.pool, self.nvme, self.counters, self._layout, self._io_check)
            if self.remote is not None:
                self.remote_fill = RemoteFill(self.remote, self, in_place=self.pool.host_views)
            if self.remote is not None and config.remote_write != "off":
                self.publisher = RemotePublisher(self.remote, self._lock, self.index, self.pool, self._mover, clock,
                                                 max_queue=config.remote_queue_chunks,
                                                 max_bytes=config.remote_queue_bytes,
                                                 publish=config.remote_write == "async")
                self._mover.demote = self.publisher.offer_demoted
            self.reads = ReadPath(self.index, self.pool, self._mover, self.counters, lambda: self.config, self._unpin)
            self.writeback: WriteBack | None = None
            if self.nvme is not None:
                self.writeback = WriteBack(self._cond, lambda: self.config, self.index, self.pool, self.nvme,
                                           self._mover, self.counters, self._layout, clock)
            self.writes = WritePath(config, self.index, self.pool, self._mover, self.counters, self._layout, self._unpin,
                                    self._wait_room, self._write_through_nodes if self.writeback else None)
            self.rebuild_report: RebuildReport | None = None
            if self.nvme is not None:
                for layout in self.nvme.load_layouts().values():
                    self._add_layout(layout)
                self.rebuild_report = rebuild_index(self.index, self.nvme, self._layouts, clock())
            if config.kv_events:  # after the rebuild: the stream starts with a snapshot of it
                self.events = KvEventLog(lambda lid: self._layouts[lid][0], self._pool_medium(),
                                         snapshot=self._event_snapshot, max_pending=config.kv_events_pending)
                self.index.observer = self.events
                self.events.request_resync()
        except BaseException:
            self.pool.close()
            if self.nvme is not None:
                self.nvme.close()
            os.close(self._lockfile)
            raise
        self._closed = False
        self._draining = False
        # The thread running run_inline() (None otherwise): while it holds the lock, disk and
        # network I/O must not start on it. Per thread, not a flag: _remote_first reads it
        # before taking the lock, and a worker thread must not see the event loop's state.
        self._inline_thread: int | None = None
        if self.writeback is not None and config.writeback:
            self.writeback.start()
        if self.publisher is not None:
            self.publisher.start()

    # -- KV events ----------------------------------------------------------------

    def _pool_medium(self) -> str:
        return MEDIUM_GPU if self.config.device.startswith("cuda") else MEDIUM_CPU

    def _event_snapshot(self) -> list[KVCacheEvent]:
        """AllBlocksCleared and every chunk held, read under the lock (O(index); at start and
        on a resync only), after which the event stream goes on from this state."""
        with self._lock:
            events = snapshot_events(self.index.nodes(), lambda lid: self._layouts[lid][0], self._pool_medium())
            assert self.events is not None
            self.events.restarted()
            return events

    # -- layouts ------------------------------------------------------------------

    def register_layout(self, layout: KVLayout) -> LayoutId:
        """Make a layout usable; idempotent. Persisted so the NVMe tier survives restarts."""
        with self._lock:
            self._check_open()
            if layout.client_keys and not self.config.trust_client_keys:
                raise ClientKeysNotTrusted(
                    f"domain {self.config.domain!r} does not accept keys computed by clients "
                    f"({CLIENT_KEYS} = {layout.client_keys!r}); set trust_client_keys = true for this domain "
                    "if every client that can reach its socket is trusted to key chunks (see docs/sglang.md)"
                )
            if layout.chunk_bytes > self.pool.capacity_bytes:
                raise InvalidLayout(
                    f"a chunk of {layout.model} is {layout.chunk_bytes} bytes, larger than the whole pool "
                    f"of {self.pool.capacity_bytes} bytes; raise pool_bytes or lower chunk_tokens"
                )
            lid = layout.layout_id
            if lid not in self._layouts:
                self._add_layout(layout)
                if self.nvme is not None:
                    self.nvme.save_layout(layout)
            return lid

    def layout(self, layout_id: LayoutId) -> KVLayout:
        return self._layout(layout_id)[0]

    def _count_layout(self, layout_id: LayoutId, looked_up: int, hit: int) -> None:
        c = self._by_layout.get(layout_id)
        if c is None:
            c = self._by_layout[layout_id] = [0, 0]
        c[0] += looked_up
        c[1] += hit

    def tokens_by_layout(self) -> dict[LayoutId, tuple[int, int]]:
        """(tokens looked up, tokens hit) per layout since start: the per-model hit rate."""
        with self._lock:
            return {lid: (c[0], c[1]) for lid, c in self._by_layout.items()}

    def layouts(self) -> dict[LayoutId, KVLayout]:
        with self._lock:
            return {lid: lay for lid, (lay, _) in self._layouts.items()}

    def _add_layout(self, layout: KVLayout) -> None:
        root = self._hasher.root(Namespace(self.config.domain, layout))
        self._layouts[layout.layout_id] = (layout, root)
        self._rescale_policy()

    def _rescale_policy(self) -> None:
        """Tell the eviction policy how many chunks the pool holds: by the mean size of the
        chunks it holds now, or (empty) of the smallest registered layout's."""
        policy = self.index.policy
        pool = self.pool
        if pool.committed_chunks and pool.payload_bytes:
            chunk = pool.payload_bytes / pool.committed_chunks
        elif self._layouts:
            chunk = min(layout.chunk_bytes for layout, _ in self._layouts.values())
        else:
            return
        policy.set_scale(int(pool.capacity_bytes // max(chunk, 1)))

    def _layout(self, layout_id: LayoutId) -> tuple[KVLayout, ChunkHash]:
        try:
            return self._layouts[layout_id]
        except KeyError:
            raise UnknownLayout(f"layout {shown(layout_id)} is not registered; register it first") from None

    def hashes(self, layout_id: LayoutId, tokens: TokenInput) -> list[ChunkHash]:
        """Chunk hashes of every full chunk of ``tokens``. Validates both arguments."""
        return self._raw_hashes(layout_id, tokens)[1]

    def _raw_hashes(self, layout_id: LayoutId, tokens: TokenInput) -> tuple[bytes, list[ChunkHash]]:
        """:meth:`hashes`, with the tokens as uint32 little-endian bytes.

        Needs no store lock, and the request paths call it before taking the lock: normalising
        and hashing a new prompt (53-82 us p50 for an 8-chunk prompt in ``bench/writeback.py``
        under load; SHA-256 keeps the GIL for chunks under 2 KiB) would otherwise hold every
        other caller back for as long. The layout table is only ever
        added to, and the hash memo is safe to share without a lock (:mod:`kvcached.hashmemo`)."""
        layout, root = self._layout(layout_id)
        raw = normalize_tokens(tokens, layout.vocab_size)
        if len(raw) // 4 > self.config.max_prompt_tokens:
            raise InvalidTokens(f"{len(raw) // 4} tokens exceed max_prompt_tokens={self.config.max_prompt_tokens}")
        return raw, self._memo.chain(root, raw, layout.chunk_tokens * 4, self._hasher.chain_range)

    # -- read path ------------------------------------------------------------------

    def lookup(self, layout_id: LayoutId, tokens: TokenInput) -> int:
        """Cached prefix length in tokens, on any tier. Pins nothing, changes no recency."""
        raw, hashes = self._raw_hashes(layout_id, tokens)  # outside the lock (see _raw_hashes)
        with self._lock:
            self._check_open()
            layout = self._layouts[layout_id][0]
            n = len(self.index.match(hashes))
            self.prompt_shape.observe(layout_id, layout.chunk_tokens, raw, hashes, n)
            self.counters.lookups += 1
            self.counters.lookup_tokens += len(hashes) * layout.chunk_tokens
            self.counters.hit_tokens += n * layout.chunk_tokens
            self._count_layout(layout_id, len(hashes) * layout.chunk_tokens, n * layout.chunk_tokens)
            return n * layout.chunk_tokens

    def acquire(
        self,
        layout_id: LayoutId,
        tokens: TokenInput,
        session: SessionId = DEFAULT_SESSION,
        *,
        ttl: float | None = None,
        max_chunks: int | None = None,
        promote: bool = True,
        keep_empty: bool = True,
        placement: str = "",
    ) -> LeaseReceipt:
        """Pin the longest cached prefix and return where it lives.

        With ``promote`` (the default), NVMe-only chunks of the prefix are
        promoted into the pool first; if a chunk cannot be promoted (pool
        full of leased chunks, or its NVMe copy is corrupt) the lease covers
        only the prefix before it. Without ``promote`` they stay on NVMe,
        pinned (so not evicted) for the lease's life, and are reported with
        tier NVME for the caller to read from the LMDB file itself. A lease
        with zero chunks is still a valid lease (release it like any other),
        unless ``keep_empty`` is False: then no lease is made and the receipt's
        id is empty. With a remote tier, the chunks after the local prefix are looked for
        there first (:class:`kvcached.remotefill.RemoteFill`). ``placement`` is the reader's device (its UUID,
        or ``host:K``): chunks promoted or fetched for it go to that device's pool slab.
        """
        if self.remote is not None:  # whether or not the caller reads NVMe chunks itself
            self._remote_first(layout_id, tokens, placement)
        raw, hashes = self._raw_hashes(layout_id, tokens)  # outside the lock (see _raw_hashes)
        with self._lock:
            self._check_admitting()
            return self._acquire(layout_id, hashes, session, ttl, max_chunks, promote, keep_empty, raw,
                                 self.pool.slab_for(placement))

    def _acquire(self, layout_id: LayoutId, hashes: list[ChunkHash], session: SessionId, ttl: float | None,
                 max_chunks: int | None, promote: bool, keep_empty: bool, raw: bytes, slab: int = 0) -> LeaseReceipt:
        """:meth:`acquire` of already validated chunk hashes (lock held); ``raw`` the prompt's
        tokens as bytes, for the prompt-structure report."""
        layout = self._layouts[layout_id][0]
        self._check_lease_cap(session)
        if self._leases.ended(session):  # it ended while this call was on its way (client died)
            raise SessionNotOpen(f"session {shown(session)} ended while this call ran; open a new Session")
        now = self._clock()
        nodes, offsets = self.index.match_located(hashes if max_chunks is None else hashes[:max_chunks])
        in_pool = not offsets or min(offsets) >= 0
        # On the event loop, disk I/O (promotion, prefetch) must go to a worker thread; once
        # checked, nothing below the match needs promoting, so prefetch need not look again.
        checked = self._inline and self.nvme is not None and promote
        if checked and self.reads.needs_promotion(nodes, in_pool):
            raise WouldBlock
        if max_chunks is None:  # a capped match (no-cache, GetBytes) says nothing about where prompts diverge
            self.prompt_shape.observe(layout_id, layout.chunk_tokens, raw, hashes, len(nodes))
            self.index.requested(hashes, now)
        self.index.pin(nodes, now)
        self.index.note_path(nodes)
        try:
            if promote or self.nvme is None:
                matched = len(nodes)
                if not in_pool:
                    nodes = self.reads.ensure_in_pool(nodes, now, slab)
                    offsets = [n.pool_offset for n in nodes]
                if (nodes and len(nodes) == matched and self.nvme is not None and self.config.prefetch_distance
                        and not checked):
                    self.reads.prefetch(nodes[-1], now, slab)
        except BaseException:
            self._unpin(nodes, now)  # an I/O error must not leave pins behind
            raise
        entry: Entry[tuple[Node, ...]]
        if not nodes and not keep_empty:
            entry = Entry("", session, (), now, now)  # no lease: nothing to release
        else:
            entry = self._leases.add(session, tuple(nodes), ttl or self.config.lease_ttl, now)
        c = self.counters
        c.acquires += 1
        c.lookups += 1
        c.lookup_tokens += len(hashes) * layout.chunk_tokens
        c.hit_tokens += len(nodes) * layout.chunk_tokens
        self._count_layout(layout_id, len(hashes) * layout.chunk_tokens, len(nodes) * layout.chunk_tokens)
        c.acquired_tokens += len(nodes) * layout.chunk_tokens
        # Pinned, so prefetch's evictions cannot have moved them: the offsets still hold.
        return self.reads.receipt(entry, layout_id, layout, hashes[:len(nodes)], offsets)

    def _check_lease_cap(self, session: SessionId) -> None:
        cap = self.config.max_leases_per_session
        if self._leases.count(session) >= cap:
            raise LimitReached(f"session {session} already holds {cap} leases (max_leases_per_session); "
                               "release leases it no longer reads, or raise the limit")

    def run_inline(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a store call on the caller's thread only if it needs neither to wait for the
        lock nor to touch the disk; otherwise raise :class:`WouldBlock` with nothing changed.

        This is the event loop's fast path: most acquires, releases and lookups are pure
        in-memory work and finish in tens of microseconds, far less than a hop to a worker
        thread. Every I/O point checks ``_inline`` before it mutates anything.
        """
        if not self._lock.acquire(blocking=False):
            raise WouldBlock
        try:
            self._inline_thread = threading.get_ident()
            return fn(*args, **kw)
        finally:
            self._inline_thread = None
            self._lock.release()

    @property
    def _inline(self) -> bool:
        """Whether the calling thread is inside :meth:`run_inline` (safe to read without the lock)."""
        return self._inline_thread == threading.get_ident()

    def _io_check(self) -> None:
        if self._inline:
            raise WouldBlock

    def _write_through_nodes(self, nodes: Sequence[Node]) -> int:
        assert self.writeback is not None
        return self.writeback.write_nodes(nodes, demotion=False)

    def _wait_room(self, nbytes: int, slab: int = 0) -> None:
        """Before reserving ``nbytes`` in ``slab`` with less free: let the write-back thread make
        the room (bounded wait, lock released meanwhile); on the inline path, go to a worker thread."""
        wb = self.writeback
        if wb is None or not wb.running:
            return
        if self._inline:
            raise WouldBlock
        wb.wait_room(nbytes, self.config.writeback_wait, slab)

    def release(self, lease_id: LeaseId, session: SessionId | None = None) -> bool:
        """Drop a lease's pins. Idempotent: False if it was already released or expired.

        An id that was never granted raises :class:`UnknownLease`. With
        ``session`` given, a live lease of another session is left alone
        (returns False).
        """
        with self._lock:
            entry = self._leases.get(lease_id)
            if entry is None and self._leases.closed_reason(lease_id) is None:
                raise UnknownLease(f"no lease {shown(lease_id)} was ever granted here")
            if entry is None or (session is not None and entry.session != session):
                return False
            self._leases.remove(lease_id, "released")
            self._unpin(entry.payload, self._clock())
            self.counters.leases_released += 1
            return True

    def renew(self, lease_id: LeaseId, session: SessionId | None = None, *, ttl: float | None = None) -> float:
        """Extend a live lease; returns its new deadline."""
        with self._lock:
            entry = self._leases.get(lease_id)
            if entry is None or (session is not None and entry.session != session):
                if entry is None and self._leases.closed_reason(lease_id) == "expired":
                    raise LeaseExpired(f"lease {shown(lease_id)} already expired; acquire again")
                raise UnknownLease(f"no live lease {shown(lease_id)}")
            renewed = self._leases.renew(lease_id, ttl or self.config.lease_ttl, self._clock())
            assert renewed is not None
            return renewed.expires_at

    def release_many(self, lease_ids: Sequence[LeaseId], session: SessionId | None = None) -> int:
        """Batch :meth:`release`. Every id is checked first: one never-granted id raises
        :class:`UnknownLease` and releases nothing. Returns how many were live."""
        with self._lock:
            for lid in lease_ids:
                if self._leases.get(lid) is None and self._leases.closed_reason(lid) is None:
                    raise UnknownLease(f"no lease {shown(lid)} was ever granted here")
            return sum(self.release(lid, session) for lid in lease_ids)

    def renew_many(self, lease_ids: Sequence[LeaseId], session: SessionId | None = None, *,
                   ttl: float | None = None) -> float | None:
        """Batch :meth:`renew`, all or nothing. Returns the earliest new deadline (None if no ids)."""
        with self._lock:
            for lid in lease_ids:
                entry = self._leases.get(lid)
                if entry is None or (session is not None and entry.session != session):
                    self.renew(lid, session, ttl=ttl)  # raises the precise error
            deadlines = [self.renew(lid, session, ttl=ttl) for lid in lease_ids]
            return min(deadlines) if deadlines else None

    def read_chunk(self, receipt: LeaseReceipt, position: int) -> memoryview:
        """In-process read of a leased chunk (clients in other processes map the pool)."""
        with self._lock:
            if self._leases.get(receipt.lease_id) is None:
                raise UnknownLease(f"lease {receipt.lease_id} is not live")
            if not 0 <= position < len(receipt.offsets):
                raise InvalidKV(f"chunk {position} is outside the lease's {len(receipt.offsets)} chunks")
            h = receipt.chunk_hashes[position]
            if receipt.offsets[position] < 0 and self.nvme is not None:
                return self.nvme.read(h)
            return self.pool.read(h)

    # -- write path (two-phase; see kvcached.writes) -------------------------------------

    def reserve(
        self, layout_id: LayoutId, tokens: TokenInput, session: SessionId = DEFAULT_SESSION, *,
        ttl: float | None = None, store_nothing: bool = False, open_empty: bool = True, placement: str = "",
    ) -> ReservationReceipt:
        """Reserve pool room for the prompt's full chunks that are not cached yet
        (see :meth:`kvcached.writes.WritePath.reserve`). ``store_nothing`` (a no-store
        request) validates and reports what is cached but reserves nothing. With
        ``open_empty`` False a reservation of nothing is not opened (empty id). The room is
        in the pool slab of ``placement``, the writer's device (:meth:`PackedPool.slab_for`)."""
        hashes = self.hashes(layout_id, tokens)  # outside the lock (see _raw_hashes)
        with self._lock:
            self._check_admitting()
            return self._reserve(layout_id, hashes, session, ttl, store_nothing, open_empty, tokens=tokens,
                                 slab=self.pool.slab_for(placement))

    def _reserve(self, layout_id: LayoutId, hashes: list[ChunkHash], session: SessionId, ttl: float | None,
                 store_nothing: bool, open_empty: bool, touch: bool = True,
                 tokens: TokenInput | None = None, slab: int = 0) -> ReservationReceipt:
        cap = self.config.max_reservations_per_session
        if self.writes.reservations.count(session) >= cap:
            raise LimitReached(f"session {session} already holds {cap} open reservations "
                               "(max_reservations_per_session); commit or abort them, or raise the limit")
        if store_nothing:
            hashes = hashes[: len(self.index.match(hashes))]
        packed = None
        if self.events is not None and tokens is not None:  # BlockStored carries the chunks' token ids
            packed = normalize_tokens(tokens, self._layouts[layout_id][0].vocab_size)
        r = self.writes.reserve(layout_id, hashes, session, ttl or self.config.reservation_ttl, self._clock(),
                                open_empty=open_empty, touch=touch, tokens=packed, slab=slab)
        if self.writeback is not None:
            self.writeback.kick()
        return r

    def acquire_reserve(
        self, layout_id: LayoutId, tokens: TokenInput, session: SessionId = DEFAULT_SESSION, *,
        ttl: float | None = None, reservation_ttl: float | None = None, promote: bool = True,
        no_cache: bool = False, store_nothing: bool = False, placement: str = "",
    ) -> tuple[LeaseReceipt, ReservationReceipt]:
        """A request's first round trip: pin the cached prefix (as :meth:`acquire`) and reserve
        the prompt's uncached full chunks after it (as :meth:`reserve`), in one call.

        Neither half leaves anything to give back when it has nothing: a lease of no chunk and a
        reservation of no chunk have empty ids. The reservation is made first (it may wait for
        the write-back thread, with the lock released); the lease then pins the prefix the
        reservation found, which the reservation's own parent pin keeps in place. Both use the
        pool slab of ``placement``.
        """
        if self.remote is not None and not no_cache:
            self._remote_first(layout_id, tokens, placement)
        raw, hashes = self._raw_hashes(layout_id, tokens)  # outside the lock (see _raw_hashes)
        with self._lock:
            self._check_admitting()
            slab = self.pool.slab_for(placement)
            if self._inline and promote and self.nvme is not None:
                nodes, offsets = self.index.match_located(hashes)
                if self.reads.needs_promotion(nodes, not offsets or min(offsets) >= 0):
                    raise WouldBlock  # before anything changes
            self._check_lease_cap(session)
            # No touch: the lease below pins (and on release re-dates) the same prefix.
            r = self._reserve(layout_id, hashes, session, reservation_ttl, store_nothing, open_empty=False,
                              touch=no_cache, tokens=tokens, slab=slab)
            try:
                lease = self._acquire(layout_id, hashes, session, ttl, 0 if no_cache else None, promote, False, raw,
                                      slab)
            except BaseException:
                if r.opened:
                    self.writes.abort(r.reservation_id, self._clock())
                raise
            return lease, r

    def commit_release(self, reservation_id: ReservationId | None, lease_ids: Sequence[LeaseId],
                       session: SessionId | None = None, *, chunks: int | None = None) -> tuple[CommitReceipt | None, int]:
        """A request's last round trip: commit its reservation (if any) and release its leases.
        The leases are released even if the commit fails (the error is raised after)."""
        with self._lock:
            for lid in lease_ids:  # checked first, like release_many: a never-granted id changes nothing
                if self._leases.get(lid) is None and self._leases.closed_reason(lid) is None:
                    raise UnknownLease(f"no lease {shown(lid)} was ever granted here")
            try:
                commit = self.commit(reservation_id, session, chunks=chunks) if reservation_id else None
            except WouldBlock:  # nothing changed: the worker thread does it all again
                raise
            except BaseException:
                for lid in lease_ids:
                    self.release(lid, session)
                raise
            return commit, sum(self.release(lid, session) for lid in lease_ids)

    def write_reserved(self, reservation_id: ReservationId, position: int, data: bytes | memoryview) -> None:
        """In-process write of one reserved chunk (clients in other processes write the mapped pool)."""
        with self._lock:
            self.writes.write(reservation_id, position, data)

    def commit(self, reservation_id: ReservationId, session: SessionId | None = None, *,
               chunks: int | None = None) -> CommitReceipt:
        """Make the written chunks visible. ``chunks`` commits only the first N (the rest are aborted).
        With ``session`` (the service always passes the caller's), only that session's reservation."""
        return self._commit(reservation_id, session, chunks, publish=True)

    def _commit(self, reservation_id: ReservationId, session: SessionId | None, chunks: int | None, *,
                publish: bool) -> CommitReceipt:
        with self._lock:
            self._check_open()
            entry = self.writes.reservations.get(reservation_id) if self.publisher is not None else None
            r = self.writes.commit(reservation_id, chunks, self._clock(), session)
            if self.writeback is not None:
                self.writeback.kick()
            if publish and entry is not None and r.committed_chunks and self.publisher is not None:
                self.publisher.offer(entry.payload.hashes[: r.committed_chunks])
            return r

    def _remote_first(self, layout_id: LayoutId, tokens: TokenInput, placement: str = "") -> None:
        """Before an acquire: fill from the remote tier what the local tiers lack. On the event
        loop's inline path that would be network I/O under the lock: WouldBlock instead (the call
        moves to a worker thread), unless everything is cached locally anyway."""
        if self._inline:
            hashes = self.hashes(layout_id, tokens)
            with self._lock:
                if len(self.index.match(hashes)) < len(hashes):
                    raise WouldBlock
            return
        assert self.remote_fill is not None
        self.remote_fill.fill(layout_id, tokens, placement)

    # -- what a remote fill needs (kvcached.remotefill.FillTarget) ------------------------------

    def local_prefix(self, layout_id: LayoutId, hashes: Sequence[ChunkHash]) -> tuple[KVLayout, int]:
        """The layout, and how many leading ``hashes`` are cached here."""
        with self._lock:
            self._check_admitting()
            return self._layouts[layout_id][0], len(self.index.match(hashes))

    @staticmethod
    def packed_tokens(layout: KVLayout, tokens: TokenInput) -> bytes:
        return normalize_tokens(tokens, layout.vocab_size)

    def reserved_view(self, reservation_id: ReservationId, position: int) -> memoryview:
        """A writable view of one reserved chunk's pool run (host pools only), for an in-process
        writer that fills it in place; the writer must be done before the commit or abort."""
        with self._lock:
            return self.writes.reserved_view(reservation_id, position)

    def commit_filled(self, reservation_id: ReservationId, chunks: int | None) -> CommitReceipt:
        return self._commit(reservation_id, None, chunks, publish=False)  # it came from the remote

    def count_filled(self, chunks: int) -> None:
        with self._lock:
            self.counters.remote_filled_chunks += chunks

    def abort(self, reservation_id: ReservationId, session: SessionId | None = None) -> bool:
        """Free a reservation's pool room. Idempotent: False if it was already closed (or, with
        ``session``, belongs to another session); an id never issued raises :class:`UnknownReservation`."""
        with self._lock:
            return self.writes.abort(reservation_id, self._clock(), session)

    def abort_many(self, reservation_ids: Sequence[ReservationId], session: SessionId | None = None) -> int:
        """Batch :meth:`abort`; a never-issued id raises and aborts nothing."""
        with self._lock:
            table = self.writes.reservations
            for rid in reservation_ids:
                if table.get(rid) is None and table.closed_reason(rid) is None:
                    raise UnknownReservation(f"no reservation {shown(rid)} was ever made here")
            return sum(self.abort(rid, session) for rid in reservation_ids)

    def put(
        self,
        layout_id: LayoutId,
        tokens: TokenInput,
        chunk_data: Sequence[bytes | memoryview],
        session: SessionId = DEFAULT_SESSION,
        placement: str = "",
    ) -> CommitReceipt:
        """Reserve, write and commit in one call. ``chunk_data[i]`` is the payload of chunk i.

        Everything is validated before anything is reserved, so a bad
        payload changes no state.
        """
        with self._lock:
            hashes = self.hashes(layout_id, tokens)
            layout = self._layouts[layout_id][0]
            if len(chunk_data) != len(hashes):
                raise InvalidKV(f"{len(chunk_data)} chunk payloads for {len(hashes)} full chunks; send one per "
                                "full chunk (a partial last chunk is not cached)")
            for i, d in enumerate(chunk_data[: len(hashes)]):
                nbytes = memoryview(d).nbytes
                if nbytes != layout.chunk_bytes:
                    raise InvalidKV(f"chunk {i} payload is {nbytes} bytes; layout needs {layout.chunk_bytes}")
            r = self.reserve(layout_id, tokens, session, open_empty=False, placement=placement)
            if not r.opened:
                return CommitReceipt(r.reservation_id, 0, r.cached_tokens, r.durable_tokens, r.write_through)
            try:
                for loc in r.slots:
                    self.write_reserved(r.reservation_id, loc.position, chunk_data[loc.position])
            except BaseException:
                self.abort(r.reservation_id)
                raise
            return self.commit(r.reservation_id)

    # -- sessions, expiry ------------------------------------------------------------

    def release_session(self, session: SessionId, *, closed: bool = False) -> SessionReleaseReceipt:
        """Release every lease and abort every reservation of a session (its client went away).

        ``closed`` says the session is gone for good (the daemon's Session stream ended): a call
        in its name that was already on its way then gets :class:`SessionNotOpen` instead of
        pinning something only a TTL would give back. Without it the name stays usable (an
        in-process caller may release everything of a label and go on using it)."""
        if closed and session == DEFAULT_SESSION:
            raise ValueError("the default session cannot be closed")
        with self._lock:
            now = self._clock()
            leases = self._leases.end_session(session, closed=closed)
            for entry in leases:
                self._unpin(entry.payload, now)
            puts = self.writes.end_session(session, now, closed=closed)
            self.counters.leases_session_released += len(leases)
            if leases or puts:
                log.info("session %s ended: released %d leases, aborted %d reservations", session, len(leases), puts)
            return SessionReleaseReceipt(len(leases), puts)

    def expire(self) -> dict[str, int]:
        """Expire leases, reservations and chunks whose TTL ran out. Call periodically."""
        with self._lock:
            now = self._clock()
            self.hit_history.sample(now, self.counters.lookup_tokens, self.counters.hit_tokens)
            self._rescale_policy()
            leases = self._leases.pop_expired(now)
            for entry in leases:
                self._unpin(entry.payload, now)
            puts = self.writes.expire(now)
            chunks = 0
            horizon = now - self.config.cache_ttl
            while True:
                node = self.index.leaves.peek()
                if node is None or node.last_use > horizon:
                    break
                self._mover.drop(node)
                chunks += 1
            self.counters.leases_expired += len(leases)
            self.counters.ttl_expirations += chunks
            return {"leases": len(leases), "reservations": puts, "chunks": chunks}

    def _unpin(self, nodes: Sequence[Node], now: float) -> None:
        for node in self.index.unpin(nodes, now):
            self._mover.free_detached(node)

    # -- maintenance -------------------------------------------------------------------

    def evict(self, layout_id: LayoutId | None = None) -> EvictReceipt:
        """Drop every unpinned chunk (of one layout, or all), leaf-first. Pinned chunks and
        their prefixes stay."""
        with self._lock:
            if layout_id is not None:
                self._layout(layout_id)
            chunks = freed = 0
            keep: list[Node] = []
            while (node := self.index.leaves.pop()) is not None:
                if layout_id is not None and node.layout_id != layout_id:
                    keep.append(node)
                    continue
                freed += self._mover.drop(node)
                chunks += 1
            for node in keep:
                self.index.leaves.add(node)
            return EvictReceipt(chunks, freed)

    def evict_prefix(self, layout_id: LayoutId, tokens: TokenInput) -> EvictReceipt:
        """Drop every unpinned cached chunk of prompts that start with ``tokens`` (its full
        chunks): the prefix's last chunk and everything cached below it, leaf-first. Shorter
        prefixes stay; pinned chunks and their prefixes stay."""
        with self._lock:
            hashes = self.hashes(layout_id, tokens)
            if not hashes:
                raise InvalidTokens("a prefix to evict needs at least one full chunk of tokens")
            nodes = self.index.match(hashes)
            if len(nodes) < len(hashes):
                return EvictReceipt(0, 0)
            chunks = freed = 0
            for node in self.index.subtree(nodes[-1]):  # deepest first: children go before parents
                if node.refcount == 0 and node.children == 0:
                    freed += self._mover.drop(node)
                    chunks += 1
            return EvictReceipt(chunks, freed)

    def flush(self) -> int:
        """Write every pool-only chunk to NVMe, in batches of one transaction each (the write-back
        thread's batches, run here with the lock held); returns chunks written."""
        with self._lock:
            if self.writeback is None:
                return 0
            return self.writeback.write_nodes(list(self.index.nodes()))

    def _leased_bytes(self) -> int:
        """Pool bytes pinned by leases: one walk over the live leases (stats only)."""
        seen: set[int] = set()
        total = 0
        for entry in self._leases:
            for node in entry.payload:
                if id(node) not in seen and node.tiers & POOL:
                    seen.add(id(node))
                    total += self.pool.locate(node.hash)[1]
        return total

    def writeback_step(self, goal_bytes: int | None = None) -> int:
        """Run one write-back batch on this thread (see :meth:`kvcached.writeback.WriteBack.step`)."""
        with self._lock:
            return 0 if self.writeback is None else self.writeback.step(goal_bytes)

    def stats(self) -> StoreStats:
        with self._lock:
            leased = self.index.pinned_in_pool
            pool = self.pool
            pstats = PoolStats(
                pool.capacity_bytes, pool.used_bytes, pool.committed_chunks, pool.payload_bytes, pool.free_bytes,
                pool.largest_free, pool.free_runs, pool.reserved_bytes, pool.reserved_chunks,
                pool.committed_chunks - leased, leased, self._leased_bytes(), pool.generation,
                tuple(SlabStats(pool.placements[k], pool.slab_capacity(k), pool.slab_used_bytes(k),
                                pool.slab_free_bytes(k)) for k in range(pool.slabs)),
            )
            nstats, m = None, self._memo
            if self.nvme is not None:
                n = self.nvme
                nstats = NvmeStats(n.capacity_bytes, n.used_bytes, n.chunk_count, n.file_bytes(), n.map_size,
                                   n.readers(), n.admitting, n.map_grows)
            return StoreStats(
                self.config.domain, len(self._layouts), len(self.index), len(self._leases), len(self.writes.reservations),
                self._leases.sessions(), pstats, nstats, Counters(**vars(self.counters)),
                HashMemoStats(len(m), m.bytes, m.max_bytes, m.hit_chunks, m.missed_chunks),
                self._eviction_stats(),
                self._remote_stats(),
                self.prompt_shape.snapshot({lid: lay.model for lid, (lay, _) in self._layouts.items()}),
                {name: getattr(self.config, name) for name in RELOADABLE_FIELDS},
            )

    def _remote_stats(self) -> RemoteTierStats | None:
        if self.remote is None:
            return None
        r, p = self.remote.stats, self.publisher
        return RemoteTierStats(r.hits, r.misses, r.bytes_fetched, r.bytes_published, r.published, r.errors,
                               r.skipped_open, self.remote.breaker.state, r.breaker_opened, dict(r.refused),
                               len(p) if p is not None else 0, p.dropped if p is not None else 0,
                               r.demoted, r.refreshed, p.queued_bytes if p is not None else 0,
                               r.deadline_missed, r.skipped_busy)

    def _eviction_stats(self) -> EvictionStats:
        d = self.index.policy.describe()
        return EvictionStats(str(d["policy"]), str(d["admission"]), float(d.get("weight", 0.0)),
                             float(d.get("turnover_seconds", 0.0)), int(d.get("sketch_width", 0)),
                             int(d.get("switches", 0)))

    def reconfigure(self, **reloadable: Any) -> None:
        """Apply reloadable settings (SIGHUP): TTLs and per-session caps. Existing leases keep
        their deadlines; a session already over a lowered cap keeps what it holds."""
        with self._lock:
            self.config = dataclasses.replace(self.config, **reloadable)
            self.index.policy.set_weight(self.config.eviction_weight)

    def doctor_facts(self) -> dict[str, Any]:
        """What ``kvcachectl doctor`` judges: recent vs baseline hit rate, long-held leases,
        LMDB readers (stale slots are cleared here, and counted)."""
        with self._lock:
            now = self._clock()
            c = self.counters
            r5, n5 = self.hit_history.window(now, 300, c.lookup_tokens, c.hit_tokens)
            r60, n60 = self.hit_history.window(now, 3600, c.lookup_tokens, c.hit_tokens)
            ages = [now - e.created_at for e in self._leases]
            long_held = sum(1 for a in ages if a > 10 * self.config.lease_ttl)
            facts: dict[str, Any] = {
                "hit_rate_5m": r5, "lookup_tokens_5m": n5, "hit_rate_1h": r60, "lookup_tokens_1h": n60,
                "lease_ttl": self.config.lease_ttl, "leases_held_over_10x_ttl": long_held,
                "oldest_lease_age_s": max(ages, default=0.0), "device": self.config.device,
            }
            if self.config.device.startswith("cuda"):
                import torch

                free, total = torch.cuda.mem_get_info(torch.device(self.config.device))
                facts["gpu_free_bytes"], facts["gpu_total_bytes"] = free, total
            if self.nvme is not None:
                facts["lmdb_stale_readers_cleared"] = self.nvme.clear_stale_readers()
                facts["lmdb_readers"] = self.nvme.readers()
        if self.remote is not None:  # network round trips: outside the lock
            facts["remote"] = self.remote.doctor()
        return facts

    def pool_handle(self) -> PoolHandle:
        return self.pool.handle()

    def close(self) -> None:
        """Release everything and close the tiers. Pool-only chunks are lost unless flushed."""
        if self.writeback is not None:
            self.writeback.stop()  # outside the lock: it joins a thread that takes the lock
        if self.publisher is not None:
            self.publisher.stop()
        if self.remote is not None:
            self.remote.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.pool.close()
            if self.nvme is not None:
                self.nvme.close()
            os.close(self._lockfile)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    def _check_admitting(self) -> None:
        self._check_open()
        if self._draining:
            raise StoreDraining("kvcached is draining: no new leases or reservations; retry on another instance")

    def drain(self) -> tuple[int, int]:
        """Refuse new leases and reservations, write pool-only chunks to NVMe.

        Returns (chunks flushed, leases still active). Existing leases stay
        valid until released or expired; lookups keep working.
        """
        with self._lock:
            self._draining = True
            return self.flush(), len(self._leases)

    @property
    def draining(self) -> bool:
        return self._draining


def _lock_state_dir(state_dir: str, domain: str) -> int:
    """One store per (state dir, domain): a second daemon on the same LMDB file would
    corrupt nothing (LMDB locks) but would serve a diverging index. The kernel drops
    the lock when the holder dies, so a crash never leaves it stuck."""
    path = os.path.join(state_dir, f"{domain}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLocked(f"{state_dir} (domain {domain}) is in use by another kvcached process") from None
    return fd


__all__ = ["Store", "DEFAULT_SESSION", "ChunkNotCached"]
