from __future__ import annotations

import os

import lmdb
import pytest

from kvcached.contract.errors import ChunkNotCached, CorruptChunk, TierFull
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.nvme import NvmeTier
from kvcached.contract.record import HEADER_SIZE, decode_header, encode_header

LID = LayoutId("ab" * 16)


def meta(i: int, parent: int = 0) -> ChunkMeta:
    return ChunkMeta(ChunkHash(bytes([i]) * 16), ChunkHash(bytes([parent]) * 16), LID, i, 128)


def put(tier: NvmeTier, m: ChunkMeta, data: bytes) -> None:
    s = tier.reserve(len(data))
    tier.write(s, data)
    tier.commit(s, m)


def corrupt(path: str, key: bytes, offset: int) -> None:
    env = lmdb.open(path, max_dbs=4, subdir=True)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        v = bytearray(txn.get(key))
        v[offset] ^= 0xFF
        txn.put(key, bytes(v))
    env.close()


def test_header_round_trip_and_checks():
    m = meta(3, parent=2)
    payload = os.urandom(1000)
    value = encode_header(m, payload) + payload
    assert len(value) == HEADER_SIZE + 1000
    got, plen, _ = decode_header(value, m.chunk_hash)
    assert got == m and plen == 1000
    for off, why in [(0, "header CRC"), (60, "header CRC"), (HEADER_SIZE - 1, "header CRC")]:
        bad = bytearray(value)
        bad[off] ^= 1
        with pytest.raises(CorruptChunk, match=why):
            decode_header(bytes(bad), m.chunk_hash)
    with pytest.raises(CorruptChunk, match="disagrees with its key"):
        decode_header(value, meta(4).chunk_hash)
    with pytest.raises(CorruptChunk, match="payload length"):
        decode_header(value[:-1], m.chunk_hash)
    with pytest.raises(CorruptChunk, match="shorter"):
        decode_header(value[:10], m.chunk_hash)


def test_put_read_delete_and_accounting(tmp_path):
    t = NvmeTier(str(tmp_path / "nv"), 1 << 20)
    data = os.urandom(4096)
    put(t, meta(1), data)
    assert bytes(t.read(meta(1).chunk_hash)) == data
    buf = bytearray(4096)
    t.read_into(meta(1).chunk_hash, memoryview(buf))
    assert bytes(buf) == data
    assert t.used_bytes == 4096 + HEADER_SIZE and t.chunk_count == 1
    assert meta(1).chunk_hash in t
    assert t.delete(meta(1).chunk_hash) and not t.delete(meta(1).chunk_hash)
    assert t.used_bytes == 0
    with pytest.raises(ChunkNotCached):
        t.read(meta(1).chunk_hash)
    t.close()


def test_capacity_is_enforced(tmp_path):
    t = NvmeTier(str(tmp_path / "nv"), 2 * (1000 + HEADER_SIZE))
    put(t, meta(1), bytes(1000))
    s = t.reserve(1000)  # reserved bytes count too
    with pytest.raises(TierFull):
        t.reserve(1000)
    t.abort(s)
    put(t, meta(2), bytes(1000))
    t.close()


def test_scan_survives_reopen_and_drops_corrupt_headers(tmp_path):
    path = str(tmp_path / "nv")
    t = NvmeTier(path, 1 << 20)
    for i in range(1, 6):
        put(t, meta(i, i - 1), bytes([i]) * 512)
    t.close()
    corrupt(path, meta(3).chunk_hash, 30)  # inside the header
    t = NvmeTier(path, 1 << 20)
    got = sorted(m.position for m in t.scan())
    assert got == [1, 2, 4, 5]
    assert t.dropped_corrupt == 1 and t.chunk_count == 4
    assert t.used_bytes == 4 * (512 + HEADER_SIZE)
    assert meta(3).chunk_hash not in t  # dropped from the file, not just skipped
    t.close()


def test_corrupt_payload_is_dropped_not_served(tmp_path):
    path = str(tmp_path / "nv")
    t = NvmeTier(path, 1 << 20)
    put(t, meta(1), bytes(512))
    put(t, meta(2), bytes(512))
    t.close()
    corrupt(path, meta(1).chunk_hash, HEADER_SIZE + 100)
    corrupt(path, meta(2).chunk_hash, HEADER_SIZE + 5)
    t = NvmeTier(path, 1 << 20)
    assert len(list(t.scan())) == 2  # headers are fine; payloads are checked on read
    with pytest.raises(CorruptChunk, match="payload CRC"):
        t.read(meta(1).chunk_hash)
    with pytest.raises(CorruptChunk):
        t.read_into(meta(2).chunk_hash, memoryview(bytearray(512)))
    assert meta(1).chunk_hash not in t and meta(2).chunk_hash not in t
    assert t.dropped_corrupt == 2
    t.close()


def test_full_map_stops_admission_instead_of_crashing(tmp_path):
    t = NvmeTier(str(tmp_path / "nv"), 64 << 20, map_size=256 << 10)
    data = bytes(32 << 10)
    stored = 0
    with pytest.raises(TierFull, match="map"):
        for i in range(1, 100):
            put(t, meta(i), data)
            stored += 1
    assert 0 < stored < 99
    assert t.admitting is False
    with pytest.raises(TierFull, match="not admitting"):
        t.reserve(10)
    assert all(bytes(t.read(meta(i).chunk_hash)) == data for i in range(1, stored + 1))  # still served
    for i in range(1, stored + 1):  # LMDB reuses freed pages only a transaction later; free them all
        t.delete(meta(i).chunk_hash)
    t.resume_admission()
    put(t, meta(200), data)
    t.close()


def test_layouts_persist(tmp_path):
    lay = KVLayout("m@1", 2, 2, 8, "float16", chunk_tokens=16, extra=(("k", "v"),))
    t = NvmeTier(str(tmp_path / "nv"), 1 << 20)
    t.save_layout(lay)
    t.close()
    t = NvmeTier(str(tmp_path / "nv"), 1 << 20)
    assert t.load_layouts() == {lay.layout_id: lay}
    t.close()
