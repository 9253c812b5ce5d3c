"""Random operation sequences against the store, checked against a reference model.

The model tracks what the store must guarantee, not how it evicts: which leases and
reservations are live (so every node's refcount is known exactly), and what bytes each
chunk must hold (a chunk's payload is a function of its whole prefix). After every
step: refcounts equal the model's, no leased chunk has been evicted or changed, every
indexed chunk has its whole prefix, pool blocks free + reserved + cached = capacity,
and the NVMe tier holds exactly the chunks the index says it holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvcached.config import StoreConfig
from kvcached.contract.errors import ReservationClosed, TierFull
from kvcached.leases import SessionId
from kvcached.contract.locations import TierId
from kvcached.store import Store
from kvcached.contract.record import HEADER_SIZE
from tests.conftest import TINY, FakeClock

CT = TINY.chunk_tokens
SESSIONS = [SessionId("s0"), SessionId("s1"), SessionId("s2")]

# A prompt is a tuple of chunk symbols; symbol k becomes CT tokens of value k.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple)


def tokens(p: tuple[int, ...], tail: int = 0) -> list[int]:
    return [s for s in p for _ in range(CT)] + [7] * tail


def chunk_payload(prefix: tuple[int, ...]) -> bytes:
    seed = hashlib.blake2b(repr(prefix).encode(), digest_size=16).digest()
    return (seed * (TINY.chunk_bytes // 16 + 1))[: TINY.chunk_bytes]


class StoreMachine(RuleBasedStateMachine):
    write_through = False
    #: Every eviction policy must keep the same guarantees; the subclasses below run the others.
    policy = "frequency"
    admission = "always"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvc-stateful-")
        self.clock = FakeClock()
        self.store = Store(
            StoreConfig(
                state_dir=self.dir,
                pool_bytes=TINY.chunk_bytes * 6,
                nvme_bytes=(TINY.chunk_bytes + HEADER_SIZE) * 8,
                write_through=self.write_through,
                cache_ttl=50,
                lease_ttl=20,
                reservation_ttl=20,
                writeback=False,  # no thread: the writeback rule runs its batches in step with the rest
                eviction_policy=self.policy,
                eviction_admission=self.admission,
            ),
            clock=self.clock,
        )
        if self.policy == "frequency":
            # One more hit is worth 10 s of recency from the start (measured, it would take a
            # pool's worth of uses (at least 64) to be known): the order really differs from LRU here.
            self.store.index.policy.fix_turnover(10.0)
        self.lid = self.store.register_layout(TINY)
        self.leases: dict[str, tuple[SessionId, tuple[bytes, ...], tuple[int, ...]]] = {}
        self.puts: dict[str, tuple[SessionId, bytes | None, tuple[int, ...]]] = {}
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    def _learn(self, p: tuple[int, ...]) -> None:
        for i, h in enumerate(self.store.hashes(self.lid, tokens(p))):
            self.prefix_of[h] = p[: i + 1]

    leases_b = Bundle("leases")
    puts_b = Bundle("puts")

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules ----------------------------------------------------------------------

    @rule(p=prompts, tail=st.integers(0, CT - 1), session=st.sampled_from(SESSIONS))
    def put(self, p, tail, session):
        self._learn(p)
        data = [chunk_payload(p[: i + 1]) for i in range(len(p))]
        before = self._state()
        r = self.store.put(self.lid, tokens(p, tail), data, session)
        if not r.reservation_id:  # all cached, or everything pinned: then put() changed nothing
            event("put stored nothing")
            after = self._state()
            assert after == before, {k: (v, after[k]) for k, v in before.items() if after[k] != v}

    def _state(self) -> dict:
        """What a put that stored nothing must leave as it was: every indexed chunk (tiers, pins),
        both tiers' stats, the open leases and reservations, the chunks in flight, and every
        counter but ``in_flight_conflicts``, ``not_reserved_chunks`` and ``refused_value_chunks``
        (the put may have met another writer's chunks in flight, found no room, or been refused
        by the admission policy, and that is counted)."""
        s = self.store
        counters = dataclasses.replace(s.counters, in_flight_conflicts=0, not_reserved_chunks=0,
                                       refused_value_chunks=0)
        return {
            "index": sorted((n.hash, n.tiers, n.refcount, n.pool_offset) for n in s.index.nodes()),
            "pool": s.stats().pool, "nvme": s.stats().nvme,
            "pool_blocks": ((s.pool.free_bytes // TINY.chunk_bytes), s.pool.reserved_chunks, s.pool.committed_chunks),
            "leases": sorted(e.id for e in s._leases), "reservations": sorted(e.id for e in s.writes.reservations),
            "in_flight": dict(s.writes.in_flight), "counters": counters,
        }

    @rule(target=puts_b, p=prompts, session=st.sampled_from(SESSIONS))
    def reserve(self, p, session):
        self._learn(p)
        try:
            r = self.store.reserve(self.lid, tokens(p), session)
        except TierFull:
            return "none"
        parent = self.store.index.match(self.store.hashes(self.lid, tokens(p)))
        self.puts[r.reservation_id] = (session, parent[-1].hash if r.cached_tokens else None, p)
        assert parent and len(parent) * CT == r.cached_tokens or r.cached_tokens == 0
        for loc in r.slots:
            assert loc.position * CT >= r.cached_tokens
        return r.reservation_id

    @rule(rid=consumes(puts_b), n=st.integers(0, 4))
    def commit(self, rid, n):
        if rid not in self.puts:
            return
        _, _, p = self.puts[rid]
        entry = self.store.writes.reservations.get(rid)
        slots = entry.payload.slots
        first = entry.payload.first_position
        for i in range(min(n, len(slots))):
            self.store.write_reserved(rid, first + i, chunk_payload(p[: first + i + 1]))
        try:
            self.store.commit(rid, chunks=min(n, len(slots)))
        except ReservationClosed:
            pass
        del self.puts[rid]

    @rule(rid=consumes(puts_b))
    def abort(self, rid):
        if rid in self.puts:
            assert self.store.abort(rid) is True
            del self.puts[rid]

    @rule(target=leases_b, p=prompts, session=st.sampled_from(SESSIONS))
    def acquire(self, p, session):
        r = self.store.acquire(self.lid, tokens(p), session)
        self.leases[r.lease_id] = (session, tuple(c.chunk_hash for c in r.chunks), p)
        return r.lease_id

    @rule(lid=leases_b)
    def release(self, lid):
        released = self.store.release(lid)
        assert released == (lid in self.leases)
        self.leases.pop(lid, None)

    @rule(session=st.sampled_from(SESSIONS))
    def end_session(self, session):
        rec = self.store.release_session(session)
        mine_l = [k for k, v in self.leases.items() if v[0] == session]
        mine_p = [k for k, v in self.puts.items() if v[0] == session]
        assert (rec.leases, rec.reservations) == (len(mine_l), len(mine_p))
        for k in mine_l:
            del self.leases[k]
        for k in mine_p:
            del self.puts[k]

    @rule(dt=st.sampled_from([1, 5, 15, 30]))
    def time_passes(self, dt):
        self.clock.advance(dt)
        self.store.expire()
        now = self.clock.t
        for k in [k for k in self.leases if self.store._leases.get(k) is None]:
            del self.leases[k]
        for k in [k for k in self.puts if self.store.writes.reservations.get(k) is None]:
            del self.puts[k]
        assert all(self.store._leases.get(k).expires_at > now for k in self.leases)

    @rule()
    def evict_all(self):
        self.store.evict()
        pinned = {h for _, hs, _ in self.leases.values() for h in hs}
        assert {n.hash for n in self.store.index.nodes()} >= pinned

    @rule()
    def flush(self):
        self.store.flush()

    @rule(goal=st.sampled_from([None, TINY.chunk_bytes * 3, TINY.chunk_bytes * 6]))
    def writeback(self, goal):
        self.store.writeback_step(goal)

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def refcounts_match_the_model(self):
        want: dict[bytes, int] = {}
        for _, hashes, _ in self.leases.values():
            for h in hashes:
                want[h] = want.get(h, 0) + 1
        for _, parent, _ in self.puts.values():
            if parent is not None:
                want[parent] = want.get(parent, 0) + 1
        got = {n.hash: n.refcount for n in self.store.index.nodes() if n.refcount}
        assert got == want
        assert all(n.refcount >= 0 for n in self.store.index.nodes())

    @invariant()
    def leased_chunks_are_in_the_pool_with_their_bytes(self):
        for lease_id, (_, hashes, p) in self.leases.items():
            for i, h in enumerate(hashes):
                node = self.store.index.get(h)
                assert node is not None and node.tiers & TierId.POOL
                assert bytes(self.store.pool.read(h)) == chunk_payload(p[: i + 1])

    @invariant()
    def structure_is_consistent(self):
        self.store.index.check_invariants()  # whole prefixes, child counts, queue membership
        pool = self.store.pool
        in_pool = [n for n in self.store.index.nodes() if n.tiers & TierId.POOL]
        assert pool.committed_chunks == len(in_pool)
        for n in in_pool:  # what lease receipts name is where the pool holds the bytes
            assert n.pool_offset == pool.slot_of(n.hash).offset
        assert (pool.free_bytes // TINY.chunk_bytes) + pool.reserved_chunks + pool.committed_chunks == (pool.capacity_bytes // TINY.chunk_bytes)
        reserved = sum(len(self.store.writes.reservations.get(r).payload.slots) for r in self.puts)
        assert pool.reserved_chunks == reserved
        leased = sum(1 for n in self.store.index.nodes() if n.refcount and n.tiers & TierId.POOL)
        assert self.store.stats().pool.leased_chunks == leased
        nvme = self.store.nvme
        on_nvme = {n.hash for n in self.store.index.nodes() if n.tiers & TierId.NVME}
        assert nvme.chunk_count == len(on_nvme)
        assert nvme.used_bytes <= nvme.capacity_bytes

    @invariant()
    def every_indexed_chunk_holds_its_prefix_bytes(self):
        for node in self.store.index.nodes():
            want = chunk_payload(self.prefix_of[node.hash])
            if node.tiers & TierId.POOL:
                assert bytes(self.store.pool.read(node.hash)) == want
            if node.tiers & TierId.NVME:
                assert bytes(self.store.nvme.read(node.hash)) == want


TestStoreWriteBack = StoreMachine.TestCase
TestStoreWriteBack.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)


class WriteThroughMachine(StoreMachine):
    write_through = True


TestStoreWriteThrough = WriteThroughMachine.TestCase
TestStoreWriteThrough.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


class LruMachine(StoreMachine):
    policy = "lru"


TestStoreLru = LruMachine.TestCase
TestStoreLru.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)


class DoorkeeperMachine(StoreMachine):
    admission = "frequency"


TestStoreDoorkeeper = DoorkeeperMachine.TestCase
TestStoreDoorkeeper.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)
)
