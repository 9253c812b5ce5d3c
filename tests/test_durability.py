"""What a commit acknowledges as durable is on NVMe, byte for byte, when the commit returns; what
it could not write it says so (a full LMDB map here, a full disk in tests/reliability)."""

from __future__ import annotations

import pytest

from kvcached.contract.errors import ChunkNotCached
from kvcached.contract.keys import KVLayout
from kvcached.contract.locations import NVME
from tests.conftest import TINY, payload, prompt

#: 4 KiB chunks: with LMDB's 4 KiB pages every record spills into overflow pages, so a
#: 256 KiB map fills after a couple of dozen chunks (the scenario the review ran).
BIG = KVLayout("test/durability@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)


def _put(store, lid, toks, salt, layout=TINY):
    n = len(toks) // layout.chunk_tokens
    return store.put(lid, toks, [payload(i, salt, layout) for i in range(n)])


def test_write_through_acknowledges_exactly_what_reached_nvme(make_store):
    store = make_store(pool_blocks=64, nvme_chunks=10_000, layout=BIG, write_through=True, nvme_map_bytes=256 << 10)
    lid = store.register_layout(BIG)
    ct = BIG.chunk_tokens
    durable = short = 0
    for i in range(80):  # ~2.5 MiB of records: past the map's growth limit (4 x 256 KiB)
        toks = prompt(4, start=i * 100_000, layout=BIG)
        r = _put(store, lid, toks, salt=i, layout=BIG)
        assert r.committed_chunks == 4 and r.cached_tokens == 4 * ct and r.write_through
        hashes = store.hashes(lid, toks)
        k = r.durable_tokens // ct
        assert r.durable_tokens % ct == 0 and 0 <= k <= 4
        for pos in range(k):  # acknowledged: on NVMe now, with the right bytes
            assert bytes(store.nvme.read(hashes[pos])) == payload(pos, i, BIG)
        if k < 4:  # not acknowledged: and indeed not on NVMe (the reply is not pessimistic either)
            with pytest.raises(ChunkNotCached):
                store.nvme.read(hashes[k])
        durable += r.durable
        short += not r.durable
    c = store.stats().counters
    assert short > 0 and durable > 0, "the map should fill part-way through"
    assert c.write_through_failures > 0 and store.nvme.map_grows >= 1
    store.index.check_invariants()


def test_write_back_is_durable_only_after_a_flush(make_store):
    store = make_store(pool_blocks=16, nvme_chunks=64)
    lid = store.register_layout(TINY)
    toks = prompt(3)
    r = _put(store, lid, toks, salt=1)
    assert (r.committed_chunks, r.cached_tokens, r.durable_tokens, r.write_through) == (3, 3 * 4, 0, False)
    assert not r.durable
    assert store.flush() == 3
    again = _put(store, lid, toks, salt=1)  # nothing to write; the reply still says what is durable
    assert (again.committed_chunks, again.durable_tokens) == (0, 3 * 4) and again.durable
    res = store.reserve(lid, toks + list(range(500, 504)))  # one more chunk: the cached part is durable
    assert (res.cached_tokens, res.durable_tokens) == (12, 12)
    store.abort(res.reservation_id)


def test_a_gap_in_the_nvme_copies_ends_the_durable_prefix(make_store):
    store = make_store(pool_blocks=16, nvme_chunks=64)
    lid = store.register_layout(TINY)
    toks = prompt(3)
    _put(store, lid, toks, salt=1)
    store.flush()
    nodes = store.index.match(store.hashes(lid, toks))
    store.nvme.delete(nodes[1].hash)  # the middle chunk loses its NVMe copy (as if its write had failed)
    assert store.index.drop_tier(nodes[1], NVME)  # still in the pool
    r = _put(store, lid, toks + list(range(500, 504)), salt=1)
    assert r.committed_chunks == 1 and r.cached_tokens == 16
    assert r.durable_tokens == 4  # chunk 0 only: a restart rebuilds nothing below the gap


def test_no_nvme_tier_means_nothing_is_durable_and_write_through_is_off(make_store):
    store = make_store(nvme_chunks=None, write_through=True)
    lid = store.register_layout(TINY)
    r = _put(store, lid, prompt(2), salt=1)
    assert (r.committed_chunks, r.durable_tokens, r.write_through) == (2, 0, False)
