"""Tier movement through the host pool: promotion, prefetch, demotion, no partial chunks."""

from __future__ import annotations

import pytest

from kvcached.contract.errors import TierFull
from kvcached.contract.locations import NVME, POOL, TierId
from tests.conftest import TINY, payload, prompt

CT = TINY.chunk_tokens


def tiers(store, lid, toks):
    return [TierId(n.tiers) for n in store.index.match(store.hashes(lid, toks))]


def put(store, lid, toks, salt=0):
    n = len(toks) // CT
    return store.put(lid, toks, [payload(i, salt) for i in range(n)])


@pytest.fixture
def demoted(make_store, clock):
    """A 10-chunk prompt A pushed entirely to NVMe by a second 10-chunk prompt B."""
    store = make_store(pool_blocks=10, nvme_chunks=64, prefetch_distance=3)
    lid = store.register_layout(TINY)
    a = prompt(10)
    put(store, lid, a, salt=1)
    clock.advance(1)
    put(store, lid, prompt(10, start=5000), salt=2)
    clock.advance(1)
    assert tiers(store, lid, a) == [TierId.NVME] * 10
    return store, lid, a


def test_acquire_promotes_and_prefetches_the_window(demoted):
    store, lid, a = demoted
    lease = store.acquire(lid, a[: 2 * CT])
    assert lease.matched_tokens == 2 * CT
    assert [bytes(store.read_chunk(lease, i)) for i in range(2)] == [payload(0, 1), payload(1, 1)]
    assert tiers(store, lid, a) == [POOL | NVME] * 5 + [TierId.NVME] * 5  # 2 needed + 3 ahead
    c = store.stats().counters
    assert (c.promotions, c.prefetched) == (5, 3)
    store.release(lease.lease_id)
    store.index.check_invariants()


def test_prefetched_chunks_are_served_from_the_pool_next(demoted):
    store, lid, a = demoted
    store.release(store.acquire(lid, a[: 2 * CT]).lease_id)
    before = store.stats().counters.promotions
    lease = store.acquire(lid, a[: 5 * CT])
    assert [bytes(store.read_chunk(lease, i)) for i in range(5)] == [payload(i, 1) for i in range(5)]
    assert store.stats().counters.promotions == before + 3  # only the next window, 5..7, was copied
    assert tiers(store, lid, a)[5:8] == [POOL | NVME] * 3


def test_prefetch_follows_the_most_recently_used_branch(make_store, clock):
    store = make_store(pool_blocks=8, nvme_chunks=64, prefetch_distance=4)
    lid = store.register_layout(TINY)
    p = prompt(2)
    x = p + prompt(3, start=700)
    y = p + prompt(3, start=900)
    put(store, lid, x, salt=1)
    clock.advance(1)
    put(store, lid, y, salt=2)
    clock.advance(1)
    store.release(store.acquire(lid, x).lease_id)  # x is now the hot branch under p
    clock.advance(1)
    put(store, lid, prompt(8, start=5000))  # push everything to NVMe
    clock.advance(1)
    assert set(tiers(store, lid, x) + tiers(store, lid, y)) == {TierId.NVME}
    store.release(store.acquire(lid, p).lease_id)
    assert tiers(store, lid, x) == [POOL | NVME] * 5  # p (2) + x's 3 prefetched
    assert tiers(store, lid, y)[2:] == [TierId.NVME] * 3


def test_prefetch_off(make_store, clock):
    store = make_store(pool_blocks=10, nvme_chunks=64, prefetch_distance=0)
    lid = store.register_layout(TINY)
    a = prompt(10)
    put(store, lid, a)
    clock.advance(1)
    put(store, lid, prompt(10, start=5000))
    store.release(store.acquire(lid, a[: 2 * CT]).lease_id)
    assert tiers(store, lid, a) == [POOL | NVME] * 2 + [TierId.NVME] * 8


def test_no_lease_promotion_without_promote(demoted):
    store, lid, a = demoted
    lease = store.acquire(lid, a[: 3 * CT], promote=False)
    assert [c.tier for c in lease.chunks] == [NVME] * 3
    assert [bytes(store.read_chunk(lease, i)) for i in range(3)] == [payload(i, 1) for i in range(3)]
    assert store.stats().counters.promotions == 0
    store.release(lease.lease_id)


def test_failed_copy_exposes_nothing_and_leaks_nothing(demoted, monkeypatch):
    store, lid, a = demoted

    def broken(h, dest):
        dest[: dest.nbytes // 2] = b"\xff" * (dest.nbytes // 2)  # half written, then the disk fails
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.nvme, "read_into", broken)
    with pytest.raises(OSError):
        store.acquire(lid, a[: 2 * CT])
    assert tiers(store, lid, a) == [TierId.NVME] * 10  # the half-written block never became visible
    assert all(n.refcount == 0 for n in store.index.nodes())
    pool = store.pool
    assert pool.reserved_chunks == 0 and (pool.free_bytes // TINY.chunk_bytes) + pool.committed_chunks == (pool.capacity_bytes // TINY.chunk_bytes)
    store.index.check_invariants()
    monkeypatch.undo()
    lease = store.acquire(lid, a[: 2 * CT])
    assert bytes(store.read_chunk(lease, 1)) == payload(1, 1)


def test_pool_eviction_demotes_write_back_and_keeps_bytes(make_store, clock):
    store = make_store(pool_blocks=3, nvme_chunks=64)
    lid = store.register_layout(TINY)
    a = prompt(3)
    put(store, lid, a, salt=4)
    assert store.stats().nvme.chunks == 0  # write-back: nothing on NVMe until evicted
    clock.advance(1)
    put(store, lid, prompt(3, start=900))
    assert store.stats().nvme.chunks == 3
    assert bytes(store.nvme.read(store.hashes(lid, a)[2])) == payload(2, 4)


def test_leak_free_after_any_mix(make_store, clock):
    import random

    from kvcached.leases import SessionId

    store = make_store(pool_blocks=12, nvme_chunks=32, lease_ttl=5, reservation_ttl=5)
    lid = store.register_layout(TINY)
    rng = random.Random(3)
    for step in range(400):
        s = SessionId(f"s{rng.randrange(4)}")
        toks = prompt(1 + rng.randrange(4), start=100 * rng.randrange(8))
        r = rng.random()
        if r < 0.3:
            try:
                store.put(lid, toks, [payload(i) for i in range(len(toks) // CT)], s)
            except TierFull:  # every block leased or reserved: allowed; anything else is a bug
                pass
        elif r < 0.6:
            lease = store.acquire(lid, toks, s)
            if rng.random() < 0.5:
                store.release(lease.lease_id)
        elif r < 0.75:
            try:
                store.reserve(lid, toks, s)  # never committed: left to expiry or session end
            except TierFull:
                pass
        elif r < 0.85:
            store.release_session(s)  # a client dies
        else:
            clock.advance(rng.choice([1, 3, 6]))
            store.expire()
    clock.advance(10)
    store.expire()
    s = store.stats()
    assert s.leases_active == 0 and s.reservations_active == 0
    assert all(n.refcount == 0 for n in store.index.nodes())
    store.evict()
    assert (store.pool.free_bytes // TINY.chunk_bytes) == (store.pool.capacity_bytes // TINY.chunk_bytes)  # everything reclaimable
    store.index.check_invariants()


def test_run_inline_takes_the_fast_path_only_without_io(demoted):
    import threading

    from kvcached.contract.errors import WouldBlock

    store, lid, a = demoted
    b = prompt(10, start=5000)  # in the pool
    lease = store.run_inline(store.acquire, lid, b)  # pure memory work: runs inline
    assert lease.matched_tokens == 10 * CT
    store.run_inline(store.release, lease.lease_id)
    before = [(n.hash, n.refcount, n.tiers, n.last_use) for n in store.index.nodes()]
    with pytest.raises(WouldBlock):
        store.run_inline(store.acquire, lid, a)  # a is on NVMe: promotion is disk I/O
    with pytest.raises(WouldBlock):
        store.run_inline(store.reserve, lid, prompt(3, start=9000))  # the pool is full: room means demotion
    assert [(n.hash, n.refcount, n.tiers, n.last_use) for n in store.index.nodes()] == before  # nothing changed
    assert store.stats().leases_active == 0 and store.stats().reservations_active == 0
    held, release = threading.Event(), threading.Event()

    def holder():
        with store._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    with pytest.raises(WouldBlock):  # never waits for the lock on the event loop's thread
        store.run_inline(store.lookup, lid, b)
    release.set()
    t.join()
    assert store.run_inline(store.lookup, lid, b) == 10 * CT
