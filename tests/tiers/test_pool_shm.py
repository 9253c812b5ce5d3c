from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached.contract.errors import ChunkNotCached, InternalInvariantError, InvalidKV, TierFull
from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.contract.poolmap import HostPoolMapping
from kvcached.tiers.base import Slot
from kvcached.tiers.pool_shm import HostPool

BLOCK = 4096


def meta(i: int) -> ChunkMeta:
    return ChunkMeta(ChunkHash(bytes([i]) * 16), ChunkHash(bytes(16)), LayoutId("00" * 16), i, 4)


@pytest.fixture
def pool():
    p = HostPool("kvcached.test", 4 * BLOCK)
    yield p
    p.close()


def test_reserve_write_commit_read(pool):
    s = pool.reserve(BLOCK)
    assert (s.slot_id, s.offset) == (0, 0)  # a fresh pool hands out the lowest address first
    pool.write(s, b"\x07" * BLOCK)
    assert meta(1).chunk_hash not in pool
    pool.commit(s, meta(1))
    assert bytes(pool.read(meta(1).chunk_hash)) == b"\x07" * BLOCK
    assert pool.slot_of(meta(1).chunk_hash).offset == 0
    assert pool.used_bytes == BLOCK and pool.free_bytes == 3 * BLOCK and pool.payload_bytes == BLOCK


def test_a_chunk_takes_its_size_rounded_to_the_alignment(pool):
    s = pool.reserve(100)
    pool.write(s, b"x" * 100)
    pool.commit(s, meta(2))
    assert pool.read(meta(2).chunk_hash).nbytes == 100
    assert pool.used_bytes == 128 and pool.payload_bytes == 100  # 64-byte grain
    assert pool.reserve(64).offset == 128  # packed right after it


def test_full_pool_and_best_fit_reuse(pool):
    slots = [pool.reserve(BLOCK) for _ in range(4)]
    with pytest.raises(TierFull, match="no free run"):
        pool.reserve(BLOCK)
    pool.abort(slots[2])
    pool.abort(slots[2])  # idempotent
    assert pool.reserve(BLOCK).offset == 2 * BLOCK  # the only gap that fits
    assert pool.free_bytes == 0
    pool.abort(slots[1])
    pool.abort(slots[3])
    assert pool.largest_free == BLOCK  # two gaps, not adjacent
    assert pool.reserve(BLOCK // 2).offset == BLOCK  # best fit, lowest address on a tie
    pool.check()


def test_a_reservation_is_committed_in_one_go(pool):
    first = pool.reserve(BLOCK)
    run = [pool.reserve(BLOCK), pool.reserve(BLOCK)]
    for i, s in enumerate(run):
        pool.write(s, bytes([i + 1]) * BLOCK)
    hashes = [meta(1).chunk_hash, meta(2).chunk_hash]
    with pytest.raises(InternalInvariantError):  # a slot not reserved: nothing committed
        pool.commit_run([run[0], Slot(first.tier, 3 * BLOCK, 3 * BLOCK, BLOCK)], hashes)
    with pytest.raises(InternalInvariantError):  # one chunk twice: nothing committed
        pool.commit_run(run, [hashes[0], hashes[0]])
    assert pool.committed_chunks == 0 and pool.reserved_chunks == 3
    pool.commit_run(run, hashes)
    assert [bytes(pool.read(h))[:1] for h in hashes] == [b"\x01", b"\x02"]
    assert pool.committed_chunks == 2 and pool.reserved_chunks == 1 and pool.payload_bytes == 2 * BLOCK
    pool.abort(first)
    assert pool.delete(hashes[0]) and pool.largest_free == 2 * BLOCK  # each chunk of a run is freed alone
    pool.check()


def test_bad_writes_raise(pool):
    s = pool.reserve(BLOCK)
    with pytest.raises(InvalidKV):
        pool.write(s, b"short")
    with pytest.raises(InvalidKV):
        pool.reserve(4 * BLOCK + 1)  # more than the whole pool
    pool.abort(s)
    with pytest.raises(InternalInvariantError):
        pool.write(s, b"\x00" * BLOCK)  # no longer reserved
    with pytest.raises(ChunkNotCached):
        pool.read(meta(9).chunk_hash)


def test_delete_frees_the_block(pool):
    s = pool.reserve(BLOCK)
    pool.write(s, bytes(BLOCK))
    pool.commit(s, meta(1))
    assert pool.delete(meta(1).chunk_hash) is True
    assert pool.delete(meta(1).chunk_hash) is False
    assert pool.free_bytes == 4 * BLOCK and pool.free_runs == 1  # merged back into one run


def test_close_unlinks_the_segment():
    p = HostPool("kvcached.test", 2 * BLOCK)
    path = f"/dev/shm/{p.name}"
    assert os.path.exists(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    p.close()
    assert not os.path.exists(path)


_READER = r"""
import sys, json
from kvcached.contract.pool import PoolHandle
from kvcached.contract.poolmap import HostPoolMapping
h = PoolHandle(**json.loads(sys.argv[1]))
offset, n = int(sys.argv[2]), int(sys.argv[3])
with HostPoolMapping(h, writable=True) as m:
    sys.stdout.buffer.write(bytes(m.block(offset, n)))
    m.block(offset + n, 4)[:] = b"BACK"   # write through the mapping, seen by the daemon side
"""


def test_second_process_maps_pool_and_reads_exact_bytes(pool):
    import dataclasses
    import json

    data = os.urandom(BLOCK)
    s = pool.reserve(BLOCK)
    pool.write(s, data)
    pool.commit(s, meta(1))
    s2 = pool.reserve(BLOCK)
    out = subprocess.run(
        [sys.executable, "-c", _READER, json.dumps(dataclasses.asdict(pool.handle())), str(s.offset), str(BLOCK)],
        capture_output=True, check=True, timeout=60,
    )
    assert out.stdout == data
    assert bytes(pool.reserved_view(s2)[:4]) == b"BACK"
    assert os.path.exists(f"/dev/shm/{pool.name}")  # the reader's exit did not unlink it


def test_mapping_checks_size_and_bounds(pool):
    import dataclasses

    bad = dataclasses.replace(pool.handle(), size_bytes=99 * BLOCK)
    with pytest.raises(ValueError, match="bytes, handle says"):
        HostPoolMapping(bad)
    with HostPoolMapping(pool.handle(), writable=False) as m:
        with pytest.raises(ValueError):
            m.block(BLOCK * 4 - 1, 2)


@pytest.mark.parametrize("populate", [True, False], ids=["populated", "control-not-populated"])
def test_a_mapping_populates_its_page_tables_in_the_background(populate):
    """A client's mapping fills its page tables off the request path: once the background
    populate is done, writing every page of the pool takes (almost) no page fault. The control,
    without it, takes one fault per page; that is what a first store paid before."""
    import resource

    pages = 2048  # 8 MiB
    p = HostPool("kvcached.test-populate", pages * 4096)
    try:
        with HostPoolMapping(p.handle(), populate=populate) as m:
            if populate:
                assert m.populating is not None
                m.populating.join(10)
                assert not m.populating.is_alive()
            else:
                assert m.populating is None
            view = m.block(0, pages * 4096)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for i in range(0, pages * 4096, 4096):
                view[i] = 1
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            del view
        if populate:
            assert faults < pages // 20, faults
        else:
            assert faults > pages // 2, faults
    finally:
        p.close()
