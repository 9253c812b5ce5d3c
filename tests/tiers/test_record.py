"""A golden NVMe record: the bytes an existing tier holds must keep decoding, and the encoder must
keep writing them. The round-trip tests in test_nvme.py compare the code with itself."""

from __future__ import annotations

import struct
import zlib

import lmdb

from kvcached.keys import ChunkHash, LayoutId
from kvcached.tiers.base import ChunkMeta
from kvcached.tiers.nvme import NvmeTier
from kvcached.tiers.record import HEADER_SIZE, copy_verified, decode_header, encode_header, verified_payload

ORPHANS = ("NVMe record format changed: this orphans every existing NVMe tier (its values are dropped as corrupt "
           "or misread). Restore the format; change the golden record only for a deliberate, announced break")

# Chunk 1 of the golden chain in tests/test_keys.py (its parent is chunk 0), 4 tokens, a 16-byte payload.
GOLDEN_META = ChunkMeta(
    chunk_hash=ChunkHash(bytes.fromhex("23ddf6ef24b18fcda06f3397941cd12f")),
    parent_hash=ChunkHash(bytes.fromhex("a0a53ab5bcd8473926e90f5cdd012bd5")),
    layout_id=LayoutId("719e74a430f4380b6388bdaba99f0c8b"),
    position=1,
    token_count=4,
)
GOLDEN_PAYLOAD = b"kvcached payload"
# Computed once with struct and zlib.crc32 from the table in kvcached/tiers/record.py's docstring
# (as test_golden_record_matches_the_documented_layout checks), then pasted.
GOLDEN_RECORD = bytes.fromhex(
    "4b56434e"                              # magic "KVCN"
    "0100"                                  # format version 1
    "0000"                                  # flags
    "719e74a430f4380b6388bdaba99f0c8b"      # layout id
    "23ddf6ef24b18fcda06f3397941cd12f"      # chunk hash
    "a0a53ab5bcd8473926e90f5cdd012bd5"      # parent hash
    "01000000"                              # position 1
    "04000000"                              # token count 4
    "1000000000000000"                      # payload length 16
    "3c4bf22d"                              # payload CRC-32 0x2df24b3c
    "b2cc7f9b"                              # header CRC-32 0x9b7fccb2
    "6b76636163686564207061796c6f6164"      # payload b"kvcached payload"
)


def test_golden_record_decodes_and_verifies():
    assert len(GOLDEN_RECORD) == HEADER_SIZE + len(GOLDEN_PAYLOAD) == 96
    meta, plen, pcrc = decode_header(GOLDEN_RECORD, GOLDEN_META.chunk_hash)
    assert meta == GOLDEN_META, ORPHANS
    assert (plen, pcrc) == (16, 0x2DF24B3C), ORPHANS
    assert bytes(verified_payload(GOLDEN_RECORD, GOLDEN_META.chunk_hash, 16)) == GOLDEN_PAYLOAD, ORPHANS
    dest = bytearray(16)
    copy_verified(GOLDEN_RECORD, GOLDEN_META.chunk_hash, memoryview(dest))
    assert bytes(dest) == GOLDEN_PAYLOAD, ORPHANS


def test_encoder_reproduces_the_golden_record():
    got = encode_header(GOLDEN_META, GOLDEN_PAYLOAD) + GOLDEN_PAYLOAD
    assert got.hex() == GOLDEN_RECORD.hex(), ORPHANS


def test_golden_record_matches_the_documented_layout():
    """The constant itself, read field by field with struct and zlib as the docstring's table says."""
    r = GOLDEN_RECORD
    assert r[0:4] == b"KVCN"
    assert struct.unpack_from("<HH", r, 4) == (1, 0)
    assert r[8:24].hex() == GOLDEN_META.layout_id
    assert (r[24:40], r[40:56]) == (GOLDEN_META.chunk_hash, GOLDEN_META.parent_hash)
    assert struct.unpack_from("<IIQ", r, 56) == (1, 4, 16)
    assert struct.unpack_from("<I", r, 72)[0] == zlib.crc32(r[80:])
    assert struct.unpack_from("<I", r, 76)[0] == zlib.crc32(r[:76])
    assert r[80:] == GOLDEN_PAYLOAD


def test_tier_writes_and_reads_the_golden_record(tmp_path):
    """What NvmeTier stores is the golden value under the chunk hash, and a tier file written
    before an upgrade (here: by plain lmdb) is scanned and served."""
    t = NvmeTier(str(tmp_path / "new"), 1 << 20)
    s = t.reserve(len(GOLDEN_PAYLOAD))
    t.write(s, GOLDEN_PAYLOAD)
    t.commit(s, GOLDEN_META)
    t.close()
    env = lmdb.open(str(tmp_path / "new"), max_dbs=4, subdir=True, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        assert list(txn.cursor()) == [(GOLDEN_META.chunk_hash, GOLDEN_RECORD)], ORPHANS
    env.close()

    env = lmdb.open(str(tmp_path / "old"), max_dbs=4, subdir=True)
    with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
        txn.put(GOLDEN_META.chunk_hash, GOLDEN_RECORD)
    env.close()
    t = NvmeTier(str(tmp_path / "old"), 1 << 20)
    assert list(t.scan()) == [GOLDEN_META], ORPHANS
    assert t.dropped_corrupt == 0 and t.used_bytes == len(GOLDEN_RECORD)
    assert bytes(t.read(GOLDEN_META.chunk_hash)) == GOLDEN_PAYLOAD, ORPHANS
    t.close()
