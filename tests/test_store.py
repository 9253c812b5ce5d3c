from __future__ import annotations

import dataclasses

import pytest

from kvcached.contract.errors import (
    InvalidKV,
    InvalidLayout,
    InvalidTokens,
    LeaseExpired,
    ReservationClosed,
    SessionNotOpen,
    UnknownLayout,
    UnknownLease,
    UnknownReservation,
)
from kvcached.contract.keys import KVLayout, LayoutId
from kvcached.leases import SessionId
from kvcached.contract.locations import TierId
from tests.conftest import TINY, payload, prompt

CT = TINY.chunk_tokens


def put(store, lid, n_chunks, start=0, salt=0, session=SessionId("local")):
    toks = prompt(n_chunks, start)
    return toks, store.put(lid, toks, [payload(i, salt) for i in range(n_chunks)], session)


def snapshot(store):
    """Everything a bad request must leave unchanged."""
    s = store.stats()
    nodes = sorted((n.hash, n.refcount, n.tiers, n.last_use) for n in store.index.nodes())
    return (s.indexed_chunks, s.leases_active, s.reservations_active, s.pool.free_bytes,
            s.nvme.chunks if s.nvme else None, nodes)


# -- read path ---------------------------------------------------------------------


def test_put_then_acquire_reads_identical_bytes(store, lid):
    toks, c = put(store, lid, 5)
    assert c.committed_chunks == 5 and c.cached_tokens == 5 * CT
    assert store.lookup(lid, toks) == 5 * CT
    r = store.acquire(lid, toks + [1, 2])  # a trailing partial chunk is never cached
    assert r.matched_tokens == 5 * CT and len(r.chunks) == 5
    assert [bytes(store.read_chunk(r, i)) for i in range(5)] == [payload(i) for i in range(5)]
    assert [c.position for c in r.chunks] == list(range(5))
    assert r.pool_generation == store.pool.generation
    store.release(r.lease_id)
    store.index.check_invariants()


def test_shared_prefix_matches_exactly_that_half(store, lid):
    toks, _ = put(store, lid, 4)
    other = toks[: 2 * CT] + [999] * (2 * CT)
    assert store.lookup(lid, other) == 2 * CT
    assert store.lookup(lid, toks[: 2 * CT + 3]) == 2 * CT
    assert store.lookup(lid, [999] + toks[1:]) == 0


def test_lookup_pins_nothing_and_keeps_recency(store, lid):
    toks, _ = put(store, lid, 2)
    before = [(n.refcount, n.last_use) for n in store.index.nodes()]
    store.lookup(lid, toks)
    assert [(n.refcount, n.last_use) for n in store.index.nodes()] == before


def test_second_put_of_same_prompt_stores_nothing_new(store, lid):
    toks, _ = put(store, lid, 3)
    free = (store.pool.free_bytes // TINY.chunk_bytes)
    _, c = put(store, lid, 3)
    assert c.committed_chunks == 0 and c.cached_tokens == 3 * CT
    assert (store.pool.free_bytes // TINY.chunk_bytes) == free


def test_extending_a_cached_prompt_stores_only_the_new_chunks(store, lid):
    toks, _ = put(store, lid, 2)
    longer = prompt(4)
    r = store.reserve(lid, longer)
    assert r.cached_tokens == 2 * CT and [s.position for s in r.slots] == [2, 3]
    for s in r.slots:
        store.write_reserved(r.reservation_id, s.position, payload(s.position))
    store.commit(r.reservation_id)
    lease = store.acquire(lid, longer)
    assert [bytes(store.read_chunk(lease, i)) for i in range(4)] == [payload(i) for i in range(4)]


# -- leases ------------------------------------------------------------------------


def test_release_is_idempotent_and_unknown_lease_raises(store, lid):
    toks, _ = put(store, lid, 2)
    r = store.acquire(lid, toks)
    assert all(n.refcount == 1 for n in store.index.nodes())
    assert store.release(r.lease_id) is True
    assert store.release(r.lease_id) is False
    assert all(n.refcount == 0 for n in store.index.nodes())
    before = snapshot(store)
    with pytest.raises(UnknownLease):
        store.release("lease-0000000000000000")
    assert snapshot(store) == before


def test_foreign_session_cannot_release(store, lid):
    toks, _ = put(store, lid, 1)
    r = store.acquire(lid, toks, SessionId("a"))
    assert store.release(r.lease_id, SessionId("b")) is False
    assert store.stats().leases_active == 1
    assert store.release(r.lease_id, SessionId("a")) is True


def test_lease_ttl_expiry_and_renewal(store, lid, clock):
    toks, _ = put(store, lid, 2)
    a = store.acquire(lid, toks, ttl=10)
    b = store.acquire(lid, toks, ttl=10)
    clock.advance(8)
    assert store.renew(b.lease_id, ttl=10) == clock.t + 10
    clock.advance(3)  # a is past its 10 s, b was renewed to 18 s
    assert store.expire()["leases"] == 1
    assert all(n.refcount == 1 for n in store.index.nodes())
    with pytest.raises(LeaseExpired):
        store.renew(a.lease_id)
    assert store.release(a.lease_id) is False  # already gone, still idempotent
    clock.advance(10)
    assert store.expire()["leases"] == 1
    assert all(n.refcount == 0 for n in store.index.nodes())
    assert store.stats().counters.leases_expired == 2
    with pytest.raises(UnknownLease):
        store.renew("lease-nope")


def test_session_release_frees_leases_and_reservations(store, lid):
    toks, _ = put(store, lid, 2)
    s = SessionId("client-1")
    store.acquire(lid, toks, s)
    store.acquire(lid, toks, s)
    r = store.reserve(lid, prompt(4), s)
    assert len(r.slots) == 2
    free_before = (store.pool.free_bytes // TINY.chunk_bytes)
    rec = store.release_session(s)
    assert (rec.leases, rec.reservations) == (2, 1)
    assert all(n.refcount == 0 for n in store.index.nodes())
    assert (store.pool.free_bytes // TINY.chunk_bytes) == free_before + 2
    assert store.release_session(s) == type(rec)(0, 0)
    store.index.check_invariants()


def test_a_closed_session_pins_nothing_more(store, lid):
    """The daemon closes a session when its stream ends; a call in its name that was already on
    its way (the client died mid-RPC) is refused and leaves nothing pinned for a TTL to find."""
    toks, _ = put(store, lid, 2)
    s = SessionId("session-dead")
    store.acquire(lid, toks, s)
    store.reserve(lid, prompt(4), s)
    rec = store.release_session(s, closed=True)
    assert (rec.leases, rec.reservations) == (1, 1)
    before = snapshot(store)
    for call in (lambda: store.acquire(lid, toks, s), lambda: store.reserve(lid, prompt(4), s),
                 lambda: store.acquire_reserve(lid, prompt(4), s),
                 lambda: store.put(lid, prompt(2, start=500), [payload(i) for i in range(2)], s)):
        with pytest.raises(SessionNotOpen):
            call()
        assert snapshot(store) == before
    st = store.stats()
    assert (st.leases_active, st.reservations_active) == (0, 0)
    assert all(n.refcount == 0 for n in store.index.nodes())
    # Not closed: the label stays usable (in-process callers release everything and go on).
    store.release_session(SessionId("worker"))
    assert len(store.acquire(lid, toks, SessionId("worker")).chunks) == 2
    with pytest.raises(ValueError):
        store.release_session(SessionId("local"), closed=True)


# -- reservations --------------------------------------------------------------------


def test_commit_makes_chunks_visible_and_in_flight_writer_is_told(store, lid):
    toks = prompt(3)
    r1 = store.reserve(lid, toks, SessionId("w1"))
    assert len(r1.slots) == 3 and store.lookup(lid, toks) == 0
    r2 = store.reserve(lid, toks, SessionId("w2"))
    assert r2.slots == () and r2.in_flight_tokens == 3 * CT and r2.cached_tokens == 0
    for s in r1.slots:
        store.write_reserved(r1.reservation_id, s.position, payload(s.position))
    assert store.lookup(lid, toks) == 0  # written but not committed: invisible
    store.commit(r1.reservation_id)
    assert store.lookup(lid, toks) == 3 * CT
    store.abort(r2.reservation_id)
    r3 = store.reserve(lid, toks)
    assert r3.slots == () and r3.cached_tokens == 3 * CT and r3.in_flight_tokens == 0


def test_double_commit_and_unknown_reservation(store, lid):
    r = store.reserve(lid, prompt(1))
    store.write_reserved(r.reservation_id, 0, payload(0))
    store.commit(r.reservation_id)
    before = snapshot(store)
    with pytest.raises(ReservationClosed, match="already committed"):
        store.commit(r.reservation_id)
    assert store.abort(r.reservation_id) is False
    with pytest.raises(UnknownReservation):
        store.commit("put-0000")
    with pytest.raises(UnknownReservation):
        store.abort("put-0000")
    assert snapshot(store) == before


def test_abort_and_expiry_free_blocks(store, lid, clock):
    free = (store.pool.free_bytes // TINY.chunk_bytes)
    r = store.reserve(lid, prompt(3), ttl=5)
    assert (store.pool.free_bytes // TINY.chunk_bytes) == free - 3
    assert store.abort(r.reservation_id) is True
    assert (store.pool.free_bytes // TINY.chunk_bytes) == free and store.lookup(lid, prompt(3)) == 0
    r = store.reserve(lid, prompt(3), ttl=5)
    clock.advance(6)
    assert store.expire()["reservations"] == 1
    assert (store.pool.free_bytes // TINY.chunk_bytes) == free
    with pytest.raises(ReservationClosed, match="expired"):
        store.commit(r.reservation_id)
    assert store.reserve(lid, prompt(3)).slots  # no longer in flight


def test_partial_commit(store, lid):
    r = store.reserve(lid, prompt(4))
    for s in r.slots[:2]:
        store.write_reserved(r.reservation_id, s.position, payload(s.position))
    c = store.commit(r.reservation_id, chunks=2)
    assert c.committed_chunks == 2 and c.cached_tokens == 2 * CT
    assert store.lookup(lid, prompt(4)) == 2 * CT
    assert store.pool.committed_chunks == 2 and store.pool.reserved_chunks == 0


# -- eviction --------------------------------------------------------------------------


def test_pool_eviction_is_lru_leaf_first_without_nvme(make_store, clock):
    store = make_store(pool_blocks=4, nvme_chunks=None)
    lid = store.register_layout(TINY)
    a, _ = put(store, lid, 2, start=0)  # a0 <- a1
    clock.advance(1)
    b, _ = put(store, lid, 1, start=1000)  # b0
    clock.advance(1)
    store.lookup(lid, a)  # lookups do not refresh recency
    store.acquire(lid, a) and store.release_session(SessionId("local"))  # acquire+release does: a is now newest
    clock.advance(1)
    c, _ = put(store, lid, 1, start=2000)  # pool had 1 free block: no eviction
    clock.advance(1)
    d, _ = put(store, lid, 2, start=3000)  # needs 2 blocks: evicts b0 (t=1), then a1 (used t=2), not c0 (t=3)
    assert [store.lookup(lid, p) for p in (a, b, c, d)] == [CT, 0, CT, 2 * CT]
    clock.advance(1)
    e, _ = put(store, lid, 1, start=4000)  # a0 became a leaf with its own last use (t=2): oldest, goes next
    assert [store.lookup(lid, p) for p in (a, b, c, d, e)] == [0, 0, CT, 2 * CT, CT]
    assert store.stats().counters.pool_evictions == 3
    store.index.check_invariants()


def test_leased_and_reserved_chunks_are_never_evicted(make_store):
    store = make_store(pool_blocks=4, nvme_chunks=None)
    lid = store.register_layout(TINY)
    a, _ = put(store, lid, 2)
    lease = store.acquire(lid, a)
    r = store.reserve(lid, prompt(2, start=500))
    before = snapshot(store)
    full = store.reserve(lid, prompt(1, start=900), open_empty=False)  # a full cache is not an error
    assert (full.opened, full.slots, full.not_reserved_tokens) == (False, (), CT)
    assert "no room for 1 more chunks" in full.not_reserved_reason
    assert snapshot(store) == before
    assert store.evict().chunks == 0  # a is leased, nothing else is cached
    store.release(lease.lease_id)
    store.abort(r.reservation_id)
    assert store.evict().chunks == 2
    assert (store.pool.free_bytes // TINY.chunk_bytes) == 4


def test_reserve_gets_what_fits_when_pool_is_short(make_store):
    store = make_store(pool_blocks=3, nvme_chunks=None)
    lid = store.register_layout(TINY)
    a, _ = put(store, lid, 1)
    store.acquire(lid, a)
    r = store.reserve(lid, prompt(5, start=100))
    assert [s.position for s in r.slots] == [0, 1]  # two free blocks, the rest of the prompt waits


def test_write_back_demotes_and_acquire_promotes_identical_bytes(make_store, clock):
    store = make_store(pool_blocks=2, nvme_chunks=16)
    lid = store.register_layout(TINY)
    a, _ = put(store, lid, 2, salt=1)
    clock.advance(1)
    b, _ = put(store, lid, 2, start=100, salt=2)  # pushes a out of the pool, onto NVMe
    c = store.stats().counters
    assert c.demotions == 2 and c.pool_evictions == 2
    nodes_a = store.index.match(store.hashes(lid, a))
    assert [TierId(n.tiers) for n in nodes_a] == [TierId.NVME, TierId.NVME]
    assert store.lookup(lid, a) == 2 * CT  # still cached, on NVMe
    clock.advance(1)
    lease = store.acquire(lid, a)
    assert lease.matched_tokens == 2 * CT
    assert [bytes(store.read_chunk(lease, i)) for i in range(2)] == [payload(0, 1), payload(1, 1)]
    assert store.stats().counters.promotions == 2
    assert store.lookup(lid, b) == 2 * CT  # b was demoted in turn, not lost
    store.index.check_invariants()


def test_write_through_stores_on_commit(make_store):
    store = make_store(pool_blocks=4, nvme_chunks=16, write_through=True)
    lid = store.register_layout(TINY)
    a, _ = put(store, lid, 3)
    s = store.stats()
    assert s.nvme.chunks == 3 and s.counters.write_through_writes == 3
    assert all(n.tiers == TierId.POOL | TierId.NVME for n in store.index.nodes())
    put(store, lid, 4, start=100)  # pool eviction only drops pool copies: no demotion needed
    assert store.stats().counters.demotions == 0
    assert store.lookup(lid, a) == 3 * CT


def test_nvme_full_drops_oldest_nvme_leaves(make_store, clock):
    store = make_store(pool_blocks=1, nvme_chunks=2)
    lid = store.register_layout(TINY)
    prompts = []
    for i in range(4):
        toks, _ = put(store, lid, 1, start=100 * i)
        prompts.append(toks)
        clock.advance(1)
    # pool holds the newest; NVMe the two before it; the oldest was dropped
    assert [store.lookup(lid, p) for p in prompts] == [0, CT, CT, CT]
    assert store.stats().counters.nvme_evictions == 1
    store.index.check_invariants()


def test_cache_ttl_expires_leaf_first(make_store, clock):
    store = make_store(cache_ttl=100)
    lid = store.register_layout(TINY)
    a, _ = put(store, lid, 3)
    clock.advance(50)
    b, _ = put(store, lid, 1, start=500)
    lease = store.acquire(lid, prompt(1))  # pins a0 only
    clock.advance(60)  # a (t=0) is past 100 s, b (t=50) is not
    store.release(lease.lease_id)  # release at t=110 refreshes a0
    assert store.expire()["chunks"] == 2  # a2 then a1; a0 was just used
    assert store.lookup(lid, a) == CT and store.lookup(lid, b) == CT
    clock.advance(101)
    assert store.expire()["chunks"] == 2
    assert len(store.index) == 0 and (store.pool.free_bytes // TINY.chunk_bytes) == (store.pool.capacity_bytes // TINY.chunk_bytes)


def test_evict_by_layout_keeps_other_layouts(store):
    other = dataclasses.replace(TINY, model="test/other@1")
    l1, l2 = store.register_layout(TINY), store.register_layout(other)
    toks = prompt(2)
    store.put(l1, toks, [payload(0), payload(1)])
    store.put(l2, toks, [payload(0), payload(1)])
    rec = store.evict(l1)
    assert rec.chunks == 2 and rec.bytes >= 2 * TINY.chunk_bytes
    assert store.lookup(l1, toks) == 0 and store.lookup(l2, toks) == 2 * CT


def test_flush_writes_pool_only_chunks_to_nvme(store, lid):
    put(store, lid, 3)
    assert store.flush() == 3
    assert store.flush() == 0
    assert store.stats().nvme.chunks == 3


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,exc",
    [
        (lambda s, lid: s.acquire(LayoutId("nope"), prompt(1)), UnknownLayout),
        (lambda s, lid: s.lookup(LayoutId("nope"), prompt(1)), UnknownLayout),
        (lambda s, lid: s.acquire(lid, [-1, 2, 3, 4]), InvalidTokens),
        (lambda s, lid: s.acquire(lid, [2**32, 2, 3, 4]), InvalidTokens),
        (lambda s, lid: s.reserve(lid, ["a"] * 4), InvalidTokens),
        (lambda s, lid: s.reserve(lid, b"\x01\x02\x03"), InvalidTokens),
        (lambda s, lid: s.put(lid, prompt(2), [payload(0)]), InvalidKV),
        (lambda s, lid: s.put(lid, prompt(2), [payload(0), b"short"]), InvalidKV),
        (lambda s, lid: s.put(lid, prompt(1), [payload(0) + b"x"]), InvalidKV),
        (lambda s, lid: s.commit("put-unknown"), UnknownReservation),
        (lambda s, lid: s.release("lease-unknown"), UnknownLease),
    ],
    ids=["acquire-unknown-layout", "lookup-unknown-layout", "negative-token", "huge-token", "str-token",
         "ragged-bytes", "too-few-payloads", "short-payload", "long-payload", "commit-unknown", "release-unknown"],
)
def test_bad_input_raises_typed_error_and_changes_nothing(store, lid, call, exc):
    put(store, lid, 2)
    lease = store.acquire(lid, prompt(1))
    before = snapshot(store)
    counters = store.stats().counters
    with pytest.raises(exc):
        call(store, lid)
    assert snapshot(store) == before
    assert store.stats().counters == counters
    store.release(lease.lease_id)


def test_too_many_tokens_is_invalid(make_store):
    store = make_store(max_prompt_tokens=16)
    lid = store.register_layout(TINY)
    with pytest.raises(InvalidTokens, match="max_prompt_tokens"):
        store.acquire(lid, list(range(17)))


def test_layout_larger_than_the_pool_is_refused(store):
    big = dataclasses.replace(TINY, chunk_tokens=TINY.chunk_tokens * 17)  # the pool holds 16 TINY chunks
    with pytest.raises(InvalidLayout, match="larger than the whole pool"):
        store.register_layout(big)
    assert store.stats().layouts == 0


def test_chunks_of_any_size_share_the_pool(make_store):
    """The packed pool: a 20 MiB chunk (more than the old fixed 16 MiB block) and small chunks of
    another layout fit side by side, each taking exactly its own bytes."""
    big = KVLayout("test/big@1", num_layers=40, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=128)
    assert big.chunk_bytes == 20 << 20
    store = make_store(pool_blocks=3, layout=big, nvme_chunks=None, pool_prefault=False)
    lb, lt = store.register_layout(big), store.register_layout(TINY)
    store.put(lb, prompt(1, layout=big), [payload(0, layout=big)])
    store.put(lt, prompt(5), [payload(i) for i in range(5)])
    p = store.stats().pool
    assert p.payload_bytes == big.chunk_bytes + 5 * TINY.chunk_bytes == p.used_bytes
    assert p.free_bytes == 3 * big.chunk_bytes - p.used_bytes
    lease = store.acquire(lb, prompt(1, layout=big))
    assert bytes(store.read_chunk(lease, 0)) == payload(0, layout=big)
    store.release(lease.lease_id)
    store.pool.check()


def test_write_outside_reservation_is_refused(store, lid):
    r = store.reserve(lid, prompt(2))
    with pytest.raises(InvalidKV):
        store.write_reserved(r.reservation_id, 5, payload(0))
    with pytest.raises(InvalidKV):
        store.write_reserved(r.reservation_id, 0, b"short")
    with pytest.raises(InvalidKV):
        store.commit(r.reservation_id, chunks=3)
    assert store.stats().reservations_active == 1


def test_stats_report_pool_blocks(store, lid):
    toks, _ = put(store, lid, 3)
    store.acquire(lid, prompt(2))
    store.reserve(lid, prompt(1, start=77))
    p = store.stats().pool
    assert (p.leased_chunks, p.cached_chunks, p.reserved_chunks) == (2, 1, 1)
    assert p.free_bytes == p.capacity_bytes - 4 * TINY.chunk_bytes
    assert p.payload_bytes == 3 * TINY.chunk_bytes and p.reserved_bytes == TINY.chunk_bytes
    d = store.stats().to_dict()
    assert d["pool"]["leased_chunks"] == 2 and 0 <= d["hit_rate"] <= 1


def test_full_lmdb_map_stops_admission_and_the_store_keeps_serving(make_store, clock):
    # Capacity says 4096 chunks fit, but the LMDB map is tiny: the map fills first, grows to its
    # limit (4 x 64 KiB), and fills again.
    store = make_store(pool_blocks=2, nvme_chunks=4096, nvme_map_bytes=64 << 10)
    lid = store.register_layout(TINY)
    for i in range(1000):
        put(store, lid, 1, start=10 * i, salt=i % 200)
        clock.advance(1)
    s = store.stats()
    assert s.nvme.map_grows >= 1 and s.nvme.map_bytes >= 256 << 10  # (deletes on a full map may grow it more)
    assert s.counters.demotions > 0 and s.counters.nvme_evictions > 0  # it evicted to make room
    assert s.nvme.chunks < 1000
    last, _ = put(store, lid, 1, start=99_999)
    lease = store.acquire(lid, last)
    assert bytes(store.read_chunk(lease, 0)) == payload(0)
    store.index.check_invariants()


def test_evict_by_prefix_drops_the_subtree_only(store, lid):
    base = prompt(2)
    a = base + prompt(2, start=500)
    b = base + prompt(1, start=900)
    other = prompt(2, start=7000)
    for p in (a, b, other):
        store.put(lid, p, [payload(i) for i in range(len(p) // CT)])
    lease = store.acquire(lid, b)  # pins b's chunks (and base)
    rec = store.evict_prefix(lid, base + prompt(1, start=500))  # prompts starting with a's 3rd chunk
    assert rec.chunks == 2  # a2 and a3
    assert store.lookup(lid, a) == 2 * CT and store.lookup(lid, b) == 3 * CT and store.lookup(lid, other) == 2 * CT
    assert store.evict_prefix(lid, base).chunks == 0  # everything left under base is pinned (b) or is base itself
    store.release(lease.lease_id)
    assert store.evict_prefix(lid, base).chunks == 2  # b2, then base1; base0 is a shorter prefix and stays
    assert store.lookup(lid, b) == CT and store.lookup(lid, other) == 2 * CT
    assert store.evict_prefix(lid, prompt(1, start=12345)).chunks == 0  # not cached: nothing to do
    with pytest.raises(InvalidTokens):
        store.evict_prefix(lid, [1, 2])  # less than one chunk
    store.index.check_invariants()
