"""The store's thread-safety contract: calls from many threads are serialised and the
invariants hold afterwards (the gRPC service will call it from a thread pool)."""

from __future__ import annotations

import random
import threading

from kvcached.contract.errors import TierFull
from kvcached.leases import SessionId
from tests.conftest import TINY, payload, prompt

CT = TINY.chunk_tokens


def test_threads_hammering_one_store_keep_invariants(make_store):
    store = make_store(pool_blocks=24, nvme_chunks=48)
    lid = store.register_layout(TINY)
    errors: list[BaseException] = []
    reads = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        session = SessionId(f"t{seed}")
        try:
            for _ in range(300):
                p = rng.randrange(12)
                n = 1 + p % 4
                toks = prompt(n, start=100 * p)
                op = rng.random()
                if op < 0.4:
                    try:
                        store.put(lid, toks, [payload(i, salt=p) for i in range(n)], session)
                    except TierFull:
                        pass
                elif op < 0.9:
                    lease = store.acquire(lid, toks, session)
                    for i in range(len(lease.chunks)):
                        assert bytes(store.read_chunk(lease, i)) == payload(i, salt=p)
                        reads[0] += 1
                    store.release(lease.lease_id, session)
                else:
                    store.evict()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker is still running after 120 s (deadlock?)"
    assert not errors, errors[0]
    assert reads[0] > 0
    store.index.check_invariants()
    s = store.stats()
    assert s.leases_active == 0 and s.reservations_active == 0
    assert all(n.refcount == 0 for n in store.index.nodes())
    assert s.pool.reserved_chunks == 0 and s.pool.leased_chunks == 0
    assert s.pool.free_bytes + s.pool.cached_chunks * TINY.chunk_bytes == s.pool.capacity_bytes
    store.pool.check()
