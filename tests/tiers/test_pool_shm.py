from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached.errors import ChunkNotCached, InternalInvariantError, InvalidKV, TierFull
from kvcached.keys import ChunkHash, LayoutId
from kvcached.tiers.base import ChunkMeta
from kvcached.tiers.pool_shm import HostPool, HostPoolMapping

BLOCK = 4096


def meta(i: int) -> ChunkMeta:
    return ChunkMeta(ChunkHash(bytes([i]) * 16), ChunkHash(bytes(16)), LayoutId("00" * 16), i, 4)


@pytest.fixture
def pool():
    p = HostPool("kvcached.test", BLOCK, 4)
    yield p
    p.close()


def test_reserve_write_commit_read(pool):
    s = pool.reserve(BLOCK)
    assert (s.slot_id, s.offset) == (0, 0)  # a fresh pool hands out the lowest block first
    pool.write(s, b"\x07" * BLOCK)
    assert meta(1).chunk_hash not in pool
    pool.commit(s, meta(1))
    assert bytes(pool.read(meta(1).chunk_hash)) == b"\x07" * BLOCK
    assert pool.slot_of(meta(1).chunk_hash).offset == 0
    assert pool.used_bytes == BLOCK and pool.free_blocks == 3


def test_smaller_chunk_uses_one_block_and_reads_its_own_size(pool):
    s = pool.reserve(100)
    pool.write(s, b"x" * 100)
    pool.commit(s, meta(2))
    assert pool.read(meta(2).chunk_hash).nbytes == 100


def test_full_pool_and_free_order(pool):
    slots = [pool.reserve(BLOCK) for _ in range(4)]
    with pytest.raises(TierFull):
        pool.reserve(BLOCK)
    pool.abort(slots[2])
    pool.abort(slots[2])  # idempotent
    assert pool.reserve(BLOCK).slot_id == 2  # last freed, first reused
    assert pool.free_blocks == 0


def test_bad_writes_raise(pool):
    s = pool.reserve(BLOCK)
    with pytest.raises(InvalidKV):
        pool.write(s, b"short")
    with pytest.raises(InvalidKV):
        pool.reserve(BLOCK + 1)
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
    assert pool.free_blocks == 4


def test_close_unlinks_the_segment():
    p = HostPool("kvcached.test", BLOCK, 2)
    path = f"/dev/shm/{p.name}"
    assert os.path.exists(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    p.close()
    assert not os.path.exists(path)


_READER = r"""
import sys, json
from kvcached.tiers.pool_shm import HostPoolMapping, PoolHandle
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

    bad = dataclasses.replace(pool.handle(), num_blocks=99)
    with pytest.raises(ValueError, match="bytes, handle says"):
        HostPoolMapping(bad)
    with HostPoolMapping(pool.handle(), writable=False) as m:
        with pytest.raises(ValueError):
            m.block(BLOCK * 4 - 1, 2)
