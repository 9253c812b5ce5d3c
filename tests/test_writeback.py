"""Background write-back (kvcached.writeback): exact-LRU batches, one transaction each, the thread
keeping the pool's free space up, and puts that never fail for a full pool."""

from __future__ import annotations

import time

from kvcached.contract.locations import TierId
from tests.conftest import TINY, payload, prompt

CT = TINY.chunk_tokens


def _put(store, lid, n, start):
    toks = prompt(n, start=start)
    store.put(lid, toks, [payload(i, salt=start) for i in range(n)])
    return toks


def _in_pool(store, lid, toks) -> str:
    return "".join("1" if store.index.get(h).tiers & TierId.POOL else "." for h in store.hashes(lid, toks))


def test_a_batch_demotes_in_exact_lru_order_from_the_prompts_end(make_store, clock):
    """A prompt's dirty chunks keep their parents out of the LRU queue until written; the batch
    must still take the oldest prompt's chunks from its end, not the last chunk of every prompt
    (nor a more recently used clean prompt)."""
    store = make_store(pool_blocks=40, nvme_chunks=64)
    lid = store.register_layout(TINY)
    r = _put(store, lid, 8, 1000)
    assert store.flush() == 8  # R is clean (on NVMe too)
    prompts = []
    for start in (0, 100, 200):
        clock.advance(1)
        prompts.append(_put(store, lid, 8, start))
    clock.advance(1)
    store.release(store.acquire(lid, r).lease_id)  # R: the most recently used
    batches = store.stats().counters.writeback_batches
    assert store.writeback_step(store.pool.free_bytes + 4 * TINY.chunk_bytes) == 4
    assert [_in_pool(store, lid, p) for p in prompts] == ["1111....", "11111111", "11111111"]
    assert _in_pool(store, lid, r) == "11111111"
    c = store.stats().counters
    assert c.writeback_batches == batches + 1 and c.writeback_chunks == 12  # 8 by flush, 4 in one transaction
    assert store.lookup(lid, prompts[0]) == 8 * CT  # demoted, not dropped
    store.index.check_invariants()
    store.pool.check()


def test_the_thread_keeps_free_space_and_puts_never_fail(make_store):
    """With the thread on, filling the pool several times over stores every chunk (pool or NVMe),
    mostly without demoting on the request path, and the free space is kept above the low mark."""
    store = make_store(pool_blocks=64, nvme_chunks=1024, writeback=True, writeback_low=0.25, writeback_high=0.5)
    lid = store.register_layout(TINY)
    prompts = [_put(store, lid, 8, 1000 * i) for i in range(40)]  # 320 chunks into a 64-chunk pool
    assert all(store.lookup(lid, p) == 8 * CT for p in prompts)
    deadline = time.monotonic() + 10
    while store.pool.free_bytes < 0.25 * store.pool.capacity_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.pool.free_bytes >= 0.25 * store.pool.capacity_bytes
    c = store.stats().counters
    assert c.writeback_batches > 0 and c.writeback_chunks >= 320 - 64
    assert c.writeback_batches < c.writeback_chunks  # batched: several chunks per transaction
    lease = store.acquire(lid, prompts[0])  # the oldest comes back from NVMe with its bytes
    assert lease.matched_tokens == 8 * CT
    assert all(bytes(store.read_chunk(lease, i)) == payload(i, salt=0) for i in range(8))
    store.release(lease.lease_id)


def test_a_reservation_bigger_than_the_free_pool_says_what_it_could_not_store(make_store):
    store = make_store(pool_blocks=4, nvme_chunks=None)
    lid = store.register_layout(TINY)
    pinned = _put(store, lid, 3, 0)
    lease = store.acquire(lid, pinned)
    r = store.reserve(lid, prompt(5, start=500), open_empty=False)
    assert [s.position for s in r.slots] == [0] and r.not_reserved_tokens == 4 * CT
    assert "no room for 4 more chunks" in r.not_reserved_reason
    assert store.stats().counters.not_reserved_chunks == 4
    store.abort(r.reservation_id)
    store.release(lease.lease_id)


def test_legacy_records_are_rewritten_when_demoted_again(make_store):
    store = make_store(pool_blocks=8, nvme_chunks=64)
    lid = store.register_layout(TINY)
    toks = _put(store, lid, 4, 0)
    assert store.flush() == 4
    hashes = store.hashes(lid, toks)
    store.nvme.legacy.update(hashes[2:])  # as a scan of format-1 records marks them
    assert store.flush() == 2  # dirty again: rewritten in the current format
    assert not store.nvme.legacy and store.stats().counters.legacy_rewritten == 2
    assert store.nvme.chunk_count == 4
