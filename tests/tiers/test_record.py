"""Golden NVMe records: the bytes an existing tier holds must keep decoding (format 1, read only,
and format 2), and the encoder must keep writing format 2's. The round-trip tests in test_nvme.py
compare the code with itself."""

from __future__ import annotations

import os
import struct
import zlib

import lmdb
import pytest
import xxhash

from kvcached.contract.errors import CorruptChunk
from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.nvme import NvmeTier
from kvcached.contract.record import (
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_SIZES,
    Header,
    RecordBuffer,
    check_payload,
    copy_verified,
    decode_header,
    encode_header,
    record_version,
    verified_payload,
)

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
KEY = GOLDEN_META.chunk_hash
# Computed once with struct and zlib.crc32 from the format-1 table in kvcached/contract/record.py's
# docstring (as test_golden_v1_matches_the_documented_layout checks), then pasted. What tiers
# written before format 2 hold: it must keep reading.
GOLDEN_V1 = bytes.fromhex(
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
# The same chunk in format 2, computed once with struct, xxhash.xxh3_64_intdigest and zlib.crc32
# from the format-2 table (as test_golden_v2_matches_the_documented_layout checks), then pasted.
GOLDEN_V2 = bytes.fromhex(
    "4b56434e"                              # magic "KVCN"
    "0200"                                  # format version 2
    "0000"                                  # flags
    "719e74a430f4380b6388bdaba99f0c8b"      # layout id
    "23ddf6ef24b18fcda06f3397941cd12f"      # chunk hash
    "a0a53ab5bcd8473926e90f5cdd012bd5"      # parent hash
    "01000000"                              # position 1
    "04000000"                              # token count 4
    "1000000000000000"                      # payload length 16
    "38f2ef28f31bdcb6"                      # payload XXH3-64 0xb6dc1bf328eff238
    "00000000"                              # reserved
    "7534c7d3"                              # header CRC-32 0xd3c73475
    "6b76636163686564207061796c6f6164"      # payload b"kvcached payload"
)
GOLDEN = {1: (GOLDEN_V1, 0x2DF24B3C), 2: (GOLDEN_V2, 0xB6DC1BF328EFF238)}


def test_sizes():
    assert (FORMAT_VERSION, HEADER_SIZE, HEADER_SIZES) == (2, 88, {1: 80, 2: 88}), ORPHANS


@pytest.mark.parametrize("version", [1, 2])
def test_golden_record_decodes_and_verifies(version):
    record, checksum = GOLDEN[version]
    assert len(record) == HEADER_SIZES[version] + len(GOLDEN_PAYLOAD)
    assert record_version(record) == version
    hdr = decode_header(record, KEY)
    assert hdr == Header(GOLDEN_META, 16, checksum, version, HEADER_SIZES[version]), ORPHANS
    assert bytes(verified_payload(record, KEY, 16)) == GOLDEN_PAYLOAD, ORPHANS
    assert bytes(check_payload(record, hdr)) == GOLDEN_PAYLOAD, ORPHANS
    dest = bytearray(16)
    copy_verified(record, KEY, memoryview(dest))
    assert bytes(dest) == GOLDEN_PAYLOAD, ORPHANS


def test_header_unpacks_as_the_older_triple():
    meta, plen, checksum = decode_header(GOLDEN_V2, KEY)
    assert (meta, plen, checksum) == (GOLDEN_META, 16, 0xB6DC1BF328EFF238)


def test_encoder_reproduces_the_golden_v2_record():
    got = encode_header(GOLDEN_META, GOLDEN_PAYLOAD) + GOLDEN_PAYLOAD
    assert got.hex() == GOLDEN_V2.hex(), ORPHANS


def test_the_record_buffer_writes_the_golden_record_and_is_reusable():
    """The write paths assemble records in a reused scratch buffer: the same bytes as the
    encoder's, whatever size came before (larger, then smaller, then larger again)."""
    buf = RecordBuffer()
    big = os.urandom(1 << 20)
    big_meta = ChunkMeta(GOLDEN_META.chunk_hash, GOLDEN_META.parent_hash, GOLDEN_META.layout_id, 1, 4)
    for meta, payload in ((big_meta, big), (GOLDEN_META, GOLDEN_PAYLOAD), (big_meta, memoryview(big)),
                          (GOLDEN_META, bytearray(GOLDEN_PAYLOAD))):
        got = buf.record(meta, payload)
        assert bytes(got) == encode_header(meta, bytes(payload)) + bytes(payload), ORPHANS
    assert bytes(buf.record(GOLDEN_META, GOLDEN_PAYLOAD)) == GOLDEN_V2, ORPHANS


def test_golden_v1_matches_the_documented_layout():
    """The constant itself, read field by field with struct and zlib as the docstring's table says."""
    r = GOLDEN_V1
    assert r[0:4] == b"KVCN"
    assert struct.unpack_from("<HH", r, 4) == (1, 0)
    assert r[8:24].hex() == GOLDEN_META.layout_id
    assert (r[24:40], r[40:56]) == (GOLDEN_META.chunk_hash, GOLDEN_META.parent_hash)
    assert struct.unpack_from("<IIQ", r, 56) == (1, 4, 16)
    assert struct.unpack_from("<I", r, 72)[0] == zlib.crc32(r[80:])
    assert struct.unpack_from("<I", r, 76)[0] == zlib.crc32(r[:76])
    assert r[80:] == GOLDEN_PAYLOAD


def test_golden_v2_matches_the_documented_layout():
    r = GOLDEN_V2
    assert r[0:4] == b"KVCN"
    assert struct.unpack_from("<HH", r, 4) == (2, 0)
    assert r[8:24].hex() == GOLDEN_META.layout_id
    assert (r[24:40], r[40:56]) == (GOLDEN_META.chunk_hash, GOLDEN_META.parent_hash)
    assert struct.unpack_from("<IIQ", r, 56) == (1, 4, 16)
    assert struct.unpack_from("<Q", r, 72)[0] == xxhash.xxh3_64_intdigest(r[88:])
    assert struct.unpack_from("<I", r, 80)[0] == 0
    assert struct.unpack_from("<I", r, 84)[0] == zlib.crc32(r[:84])
    assert r[88:] == GOLDEN_PAYLOAD


def encode_v1(meta: ChunkMeta, payload: bytes) -> bytes:
    """A format-1 value, built from the documented table (the encoder only writes format 2)."""
    body = struct.pack("<4sHH16s16s16sIIQI", b"KVCN", 1, 0, bytes.fromhex(meta.layout_id), meta.chunk_hash,
                       meta.parent_hash, meta.position, meta.token_count, len(payload), zlib.crc32(payload))
    return body + struct.pack("<I", zlib.crc32(body)) + payload


def encode_v2(meta: ChunkMeta, payload: bytes) -> bytes:
    return encode_header(meta, payload) + payload


ENCODERS = {1: encode_v1, 2: encode_v2}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_round_trip(version, n):
    payload = os.urandom(n)
    value = ENCODERS[version](GOLDEN_META, payload)
    assert len(value) == HEADER_SIZES[version] + n
    hdr = decode_header(memoryview(value), KEY)
    assert (hdr.meta, hdr.payload_len, hdr.version, hdr.header_size) == (GOLDEN_META, n, version, HEADER_SIZES[version])
    assert bytes(verified_payload(value, KEY, n)) == payload
    dest = bytearray(n)
    copy_verified(value, KEY, memoryview(dest))
    assert bytes(dest) == payload


def flipped(value: bytes, offset: int) -> bytes:
    bad = bytearray(value)
    bad[offset] ^= 0x01
    return bytes(bad)


@pytest.mark.parametrize("offset", [0, 6, 8, 30, 60, 64, 72, 79, 80, 84, 87])
def test_v2_header_damage_is_corrupt(offset):
    bad = flipped(GOLDEN_V2, offset)
    with pytest.raises(CorruptChunk, match="header CRC"):
        decode_header(bad, KEY)
    with pytest.raises(CorruptChunk):
        verified_payload(bad, KEY)
    with pytest.raises(CorruptChunk):
        copy_verified(bad, KEY, memoryview(bytearray(16)))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("where", [0, 7, 15])
def test_payload_damage_is_corrupt(version, where):
    record, _ = GOLDEN[version]
    bad = flipped(record, HEADER_SIZES[version] + where)
    decode_header(bad, KEY)  # the header alone is intact: scans keep it, reads drop it
    with pytest.raises(CorruptChunk, match="payload CRC"):
        verified_payload(bad, KEY)
    with pytest.raises(CorruptChunk, match="payload CRC"):
        copy_verified(bad, KEY, memoryview(bytearray(16)))


@pytest.mark.parametrize("version", [1, 2])
def test_wrong_length_and_wrong_key_are_corrupt(version):
    record, _ = GOLDEN[version]
    with pytest.raises(CorruptChunk, match="payload length"):
        decode_header(record[:-1], KEY)
    with pytest.raises(CorruptChunk, match="payload length"):
        decode_header(record + b"x", KEY)
    with pytest.raises(CorruptChunk, match="shorter"):
        decode_header(record[: HEADER_SIZES[version] - 1], KEY)
    with pytest.raises(CorruptChunk, match="expected 15"):
        verified_payload(record, KEY, 15)
    with pytest.raises(CorruptChunk, match="expected 17"):
        copy_verified(record, KEY, memoryview(bytearray(17)))
    other = bytes(reversed(KEY))
    for check in (lambda: decode_header(record, other), lambda: verified_payload(record, other),
                  lambda: copy_verified(record, other, memoryview(bytearray(16)))):
        with pytest.raises(CorruptChunk, match="disagrees with its key"):
            check()


def test_unknown_version_and_bad_magic():
    v3 = GOLDEN_V2[:4] + struct.pack("<H", 3) + GOLDEN_V2[6:]
    assert record_version(v3) == 3  # reported as is; decoding rejects it
    with pytest.raises(CorruptChunk, match="unknown format version 3"):
        decode_header(v3, KEY)
    bad_magic = b"XVCN" + GOLDEN_V2[4:]
    with pytest.raises(CorruptChunk, match="bad magic"):
        record_version(bad_magic)
    with pytest.raises(CorruptChunk, match="bad magic"):  # even with a header CRC that matches
        body = bad_magic[:84]
        decode_header(body + struct.pack("<I", zlib.crc32(body)) + GOLDEN_PAYLOAD, KEY)
    with pytest.raises(CorruptChunk, match="bad magic"):
        decode_header(b"\0" * 100, KEY)
    with pytest.raises(CorruptChunk, match="too short"):
        record_version(b"KVCN")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("n", [(1 << 20) + 1, 3 * (1 << 20) - 12345, 2 << 20])
def test_copy_verified_in_pieces(version, n):
    """Payloads over one 1 MiB piece, a multiple of it or not: the piecewise checksum is the
    whole payload's, and damage in any piece (last byte included) is caught."""
    payload = os.urandom(n)
    value = ENCODERS[version](GOLDEN_META, payload)
    dest = bytearray(n)
    copy_verified(value, KEY, memoryview(dest))
    assert dest == payload
    hs = HEADER_SIZES[version]
    for where in (0, (1 << 20) - 1, 1 << 20, n - 1):
        with pytest.raises(CorruptChunk, match="payload CRC"):
            copy_verified(flipped(value, hs + where), KEY, memoryview(bytearray(n)))


def test_tier_writes_v2_and_reads_both_formats(tmp_path):
    """What NvmeTier stores is the golden format-2 value under the chunk hash, and a tier file
    written before an upgrade (here: by plain lmdb, in format 1) is scanned and served."""
    t = NvmeTier(str(tmp_path / "new"), 1 << 20)
    s = t.reserve(len(GOLDEN_PAYLOAD))
    t.write(s, GOLDEN_PAYLOAD)
    t.commit(s, GOLDEN_META)
    assert t.used_bytes == len(GOLDEN_V2) == HEADER_SIZE + len(GOLDEN_PAYLOAD)
    t.close()
    env = lmdb.open(str(tmp_path / "new"), max_dbs=4, subdir=True, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        assert list(txn.cursor()) == [(KEY, GOLDEN_V2)], ORPHANS
    env.close()

    # An old tier (format 1) and one written across the upgrade (both formats side by side).
    other = ChunkMeta(ChunkHash(bytes(range(16))), KEY, GOLDEN_META.layout_id, 2, 4)
    other_payload = os.urandom(64)
    for name, records in (("old", {KEY: GOLDEN_V1}),
                          ("mixed", {KEY: GOLDEN_V1, other.chunk_hash: encode_v2(other, other_payload)})):
        env = lmdb.open(str(tmp_path / name), max_dbs=4, subdir=True)
        with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
            for k, v in records.items():
                txn.put(k, v)
        env.close()
        t = NvmeTier(str(tmp_path / name), 1 << 20)
        assert sorted(t.scan(), key=lambda m: m.chunk_hash) == sorted(
            [GOLDEN_META] + ([other] if name == "mixed" else []), key=lambda m: m.chunk_hash), ORPHANS
        assert t.dropped_corrupt == 0 and t.used_bytes == sum(len(v) for v in records.values())
        assert bytes(t.read(KEY)) == GOLDEN_PAYLOAD, ORPHANS
        dest = bytearray(16)
        t.read_into(KEY, memoryview(dest))
        assert bytes(dest) == GOLDEN_PAYLOAD, ORPHANS
        if name == "mixed":
            assert bytes(t.read(other.chunk_hash)) == other_payload
        t.close()
