"""The NVMe value format: a fixed header, then the chunk payload.

::

    offset size field
    0      4    magic b"KVCN"
    4      2    format version (1)
    6      2    flags (0)
    8      16   layout id (its 16 raw bytes: BLAKE2b-128 of the layout encoding, see kvcached.keys)
    24     16   chunk hash (also the LMDB key)
    40     16   parent hash (namespace seed h_{-1} for position 0)
    56     4    position (chunk index in the prompt)
    60     4    token count
    64     8    payload length
    72     4    CRC-32 of the payload
    76     4    CRC-32 of bytes 0..75
    80     ...  payload

Integers are little-endian (``struct`` ``"<4sHH16s16s16sIIQI"`` then ``"<I"``);
CRC-32 is zlib's (``zlib.crc32``, start 0), which ISA-L computes too. The
header alone is enough to rebuild the index after a restart; the header
CRC is checked on every scan, the payload CRC on every read, and a value that
fails either is dropped, never served. Changing any of this orphans every
existing tier (an unknown version is dropped as corrupt);
``tests/tiers/test_record.py`` pins a golden record.
"""

from __future__ import annotations

import struct

try:  # ISA-L computes the same CRC-32 ~8x faster (bench/chunk_read.py); zlib is the fallback
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency, but the format must not need it
    from zlib import crc32 as _crc32

from kvcached.errors import CorruptChunk
from kvcached.keys import ChunkHash, LayoutId
from kvcached.tiers.base import ChunkMeta

MAGIC = b"KVCN"
FORMAT_VERSION = 1
_BODY = struct.Struct("<4sHH16s16s16sIIQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size  # 80


def encode_header(meta: ChunkMeta, payload: memoryview | bytes) -> bytes:
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        bytes.fromhex(meta.layout_id),
        meta.chunk_hash,
        meta.parent_hash,
        meta.position,
        meta.token_count,
        len(payload),
        _crc32(payload),
    )
    return body + _CRC.pack(_crc32(body))


def decode_header(value: memoryview | bytes, key: bytes) -> tuple[ChunkMeta, int, int]:
    """Parse and check a value's header; returns (meta, payload length, payload CRC).

    Raises :class:`CorruptChunk` on a short value, bad magic, unknown version,
    header CRC mismatch, a payload length that disagrees with the value size,
    or a stored hash that disagrees with the LMDB key.
    """
    if len(value) < HEADER_SIZE:
        raise CorruptChunk(f"value of {len(value)} bytes is shorter than the {HEADER_SIZE} byte header")
    body = value[: _BODY.size]
    (crc,) = _CRC.unpack_from(value, _BODY.size)
    if _crc32(body) != crc:
        raise CorruptChunk("header CRC mismatch")
    magic, version, _flags, layout, chunk, parent, position, tokens, plen, pcrc = _BODY.unpack(body)
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"unknown format version {version}")
    if plen != len(value) - HEADER_SIZE:
        raise CorruptChunk(f"payload length {plen} disagrees with value size {len(value) - HEADER_SIZE}")
    if chunk != bytes(key):
        raise CorruptChunk("stored chunk hash disagrees with its key")
    meta = ChunkMeta(ChunkHash(chunk), ChunkHash(parent), LayoutId(layout.hex()), position, tokens)
    return meta, plen, pcrc


def check_payload(value: memoryview, pcrc: int) -> memoryview:
    payload = value[HEADER_SIZE:]
    if _crc32(payload) != pcrc:
        raise CorruptChunk("payload CRC mismatch")
    return payload


def verified_payload(value: memoryview | bytes, key: bytes, expected_len: int | None = None) -> memoryview:
    """The payload of a stored value after every check (header, key, length, payload CRC).

    Raises :class:`CorruptChunk`. Used by the daemon's NVMe tier and by clients
    that read the LMDB file themselves.
    """
    _meta, plen, pcrc = decode_header(value, key)
    if expected_len is not None and plen != expected_len:
        raise CorruptChunk(f"payload is {plen} bytes, expected {expected_len}")
    return check_payload(memoryview(value), pcrc)


_PIECE = 1 << 20


def copy_verified(value: memoryview | bytes, key: bytes, dest: memoryview) -> None:
    """Copy the payload into ``dest`` and check it, in one pass.

    The CRC is computed over each 1 MiB piece right after it was copied, while
    it is still in cache, instead of reading the payload twice. On a mismatch
    :class:`CorruptChunk` is raised and ``dest`` holds garbage: the caller must
    discard it (the pool aborts the slot; the client drops the tensor).
    """
    _meta, plen, pcrc = decode_header(value, key)
    if plen != dest.nbytes:
        raise CorruptChunk(f"payload is {plen} bytes, expected {dest.nbytes}")
    src = memoryview(value)[HEADER_SIZE:]
    crc = 0
    for off in range(0, plen, _PIECE):
        end = min(off + _PIECE, plen)
        dest[off:end] = src[off:end]
        crc = _crc32(dest[off:end], crc)
    if crc != pcrc:
        raise CorruptChunk("payload CRC mismatch")
