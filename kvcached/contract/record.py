"""The NVMe value format: a fixed header, then the chunk payload.

New records are written in format 2; format 1 records (what tiers written
before it hold) are still read and served, never written.

Format 2 (written), 88-byte header::

    offset size field
    0      4    magic b"KVCN"
    4      2    format version (2)
    6      2    flags (0)
    8      16   layout id (its 16 raw bytes: BLAKE2b-128 of the layout encoding, see kvcached.contract.keys)
    24     16   chunk hash (also the LMDB key)
    40     16   parent hash (namespace seed h_{-1} for position 0)
    56     4    position (chunk index in the prompt)
    60     4    token count
    64     8    payload length
    72     8    XXH3-64 of the payload (seed 0)
    80     4    reserved (0)
    84     4    CRC-32 of bytes 0..83
    88     ...  payload

Format 1 (read only), 80-byte header::

    offset size field
    0      4    magic b"KVCN"
    4      2    format version (1)
    6      2    flags (0)
    8      16   layout id
    24     16   chunk hash (also the LMDB key)
    40     16   parent hash
    56     4    position
    60     4    token count
    64     8    payload length
    72     4    CRC-32 of the payload
    76     4    CRC-32 of bytes 0..75
    80     ...  payload

Integers are little-endian (``struct`` ``"<4sHH16s16s16sIIQQI"`` then ``"<I"``
for format 2, ``"<4sHH16s16s16sIIQI"`` then ``"<I"`` for format 1). CRC-32 is
zlib's (``zlib.crc32``, start 0), which ISA-L computes too; XXH3-64 is
``xxhash.xxh3_64_intdigest`` (seed 0). Flags and the reserved field are
written 0 and ignored on read. The header alone is enough to rebuild the
index after a restart; the header CRC is checked on every scan, the payload
checksum on every read, and a value that fails either is dropped, never
served. A value's own version decides its header size, so the two formats
can share a tier (its accounting uses each value's length); ``HEADER_SIZE``
is the size of the header new records get. Changing any of this orphans
every existing tier (an unknown version is dropped as corrupt);
``tests/tiers/test_record.py`` pins a golden record of each format.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

try:  # ISA-L computes the same CRC-32 ~8x faster (bench/chunk_read.py); zlib is the fallback
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency, but the format must not need it
    from zlib import crc32 as _crc32

from kvcached.contract.errors import CorruptChunk
from kvcached.contract.keys import ChunkHash, LayoutId

@dataclass(frozen=True)
class ChunkMeta:
    """What a tier records next to the payload (NVMe persists it: the index is rebuilt from it)."""

    chunk_hash: ChunkHash
    parent_hash: ChunkHash  # for position 0: the namespace seed h_{-1}
    layout_id: LayoutId
    position: int  # chunk index in its prompt, 0-based
    token_count: int


MAGIC = b"KVCN"
FORMAT_VERSION = 2  # what encode_header writes
_CRC = struct.Struct("<I")
_PREFIX = struct.Struct("<4sH")  # magic, version: the same in every format
_BODY = {
    1: struct.Struct("<4sHH16s16s16sIIQI"),  # ..., payload CRC-32
    2: struct.Struct("<4sHH16s16s16sIIQQI"),  # ..., payload XXH3-64, reserved
}
#: Header size of each readable format version.
HEADER_SIZES = {v: body.size + _CRC.size for v, body in _BODY.items()}  # {1: 80, 2: 88}
#: The header size of a record written now (capacity accounting of new writes).
HEADER_SIZE = HEADER_SIZES[FORMAT_VERSION]
_MIN_HEADER = min(HEADER_SIZES.values())


@dataclass(frozen=True, slots=True)
class Header:
    """A checked header: what :func:`decode_header` returns.

    ``checksum`` is the stored payload checksum: CRC-32 in format 1, XXH3-64
    in format 2. Iterating yields the older ``(meta, payload_len, checksum)``
    triple, so callers that unpack three values keep working.
    """

    meta: ChunkMeta
    payload_len: int
    checksum: int
    version: int
    header_size: int

    def __iter__(self) -> Iterator[object]:
        return iter((self.meta, self.payload_len, self.checksum))


class _Hasher(Protocol):
    def update(self, data: memoryview | bytes, /) -> None: ...

    def intdigest(self) -> int: ...


class _Crc32:
    """CRC-32 with the streaming interface of ``xxhash.xxh3_64``."""

    __slots__ = ("_crc",)

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: memoryview | bytes, /) -> None:
        self._crc = _crc32(data, self._crc)

    def intdigest(self) -> int:
        return self._crc


def _hasher(version: int) -> _Hasher:
    """A fresh payload hasher for a record of ``version`` (already checked to be known)."""
    return _Crc32() if version == 1 else xxhash.xxh3_64()


def _checksum(version: int, payload: memoryview | bytes) -> int:
    return _crc32(payload) if version == 1 else xxhash.xxh3_64_intdigest(payload)


def _mismatch(version: int) -> CorruptChunk:
    # "payload CRC" in both formats: callers and tests match on it (tests/tiers/test_nvme.py).
    return CorruptChunk(f"payload CRC mismatch ({'CRC-32' if version == 1 else 'XXH3-64'})")


def encode_header(meta: ChunkMeta, payload: memoryview | bytes) -> bytes:
    """The format-2 header (``HEADER_SIZE`` bytes) for ``payload``; the value is header + payload."""
    body = _BODY[2].pack(
        MAGIC,
        2,
        0,
        bytes.fromhex(meta.layout_id),
        meta.chunk_hash,
        meta.parent_hash,
        meta.position,
        meta.token_count,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        0,
    )
    return body + _CRC.pack(_crc32(body))


class RecordBuffer:
    """Scratch space to assemble records (header + payload) for LMDB puts, one after another.

    ``bytes(header) + payload`` copies the payload holding the GIL (measured: ~100 us per MiB
    here, during which no other thread of the daemon runs). :meth:`record` copies it with
    numpy instead, which releases the GIL, into a buffer reused for every record of a batch
    (LMDB copies a value into its pages during the put, so one buffer serves them all). The
    returned view is valid until the next :meth:`record` call. Not thread-safe: one per writer.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def record(self, meta: ChunkMeta, payload: memoryview | bytes) -> memoryview:
        src = np.frombuffer(payload, dtype=np.uint8)
        need = HEADER_SIZE + src.size
        if self._buf.size < need:
            self._buf = np.empty(need, dtype=np.uint8)
        out = memoryview(self._buf)[:need]  # type: ignore[arg-type]  # an ndarray is a buffer (typeshed < 3.12 cannot say)
        out[:HEADER_SIZE] = encode_header(meta, payload)
        np.copyto(self._buf[HEADER_SIZE:need], src)  # the GIL released for the copy
        return out


def record_version(value: memoryview | bytes) -> int:
    """The format version a stored value claims, after checking its magic.

    Cheap: nothing else is checked (not even the header CRC), and an unknown
    version is returned as is; :func:`decode_header` rejects it. Raises
    :class:`CorruptChunk` on a value too short to hold the field or a bad magic.
    """
    if len(value) < _PREFIX.size:
        raise CorruptChunk(f"value of {len(value)} bytes is too short to hold a format version")
    magic, version = _PREFIX.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {magic!r}")
    return version


def decode_header(value: memoryview | bytes, key: bytes, *, value_len: int | None = None) -> Header:
    """Parse and check a value's header (either format).

    Raises :class:`CorruptChunk` on a short value, bad magic, unknown version,
    header CRC mismatch, a payload length that disagrees with the value size,
    or a stored hash that disagrees with the LMDB key. The payload itself is
    not read (see :func:`check_payload`). ``value_len``: the whole value's length
    when ``value`` holds only its first bytes (a value read in parts).
    """
    if len(value) < _MIN_HEADER:
        raise CorruptChunk(f"value of {len(value)} bytes is shorter than the {_MIN_HEADER} byte header")
    # The version picks the layout before the CRC can be checked; a damaged version field is
    # caught as unknown, or (landing on the other version) by the CRC read from the wrong place.
    magic, version = _PREFIX.unpack_from(value, 0)
    body_struct = _BODY.get(version)
    if body_struct is None:
        if magic != MAGIC:
            raise CorruptChunk(f"bad magic {magic!r}")
        raise CorruptChunk(f"unknown format version {version}")
    size = HEADER_SIZES[version]
    if len(value) < size:
        raise CorruptChunk(f"value of {len(value)} bytes is shorter than the {size} byte format-{version} header")
    body = value[: body_struct.size]
    (crc,) = _CRC.unpack_from(value, body_struct.size)
    if _crc32(body) != crc:
        raise CorruptChunk("header CRC mismatch")
    fields = body_struct.unpack(body)
    magic, _version, _flags, layout, chunk, parent, position, tokens, plen, psum = fields[:10]
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {magic!r}")
    total = len(value) if value_len is None else value_len
    if plen != total - size:
        raise CorruptChunk(f"payload length {plen} disagrees with value size {total - size}")
    if chunk != bytes(key):
        raise CorruptChunk("stored chunk hash disagrees with its key")
    meta = ChunkMeta(ChunkHash(chunk), ChunkHash(parent), LayoutId(layout.hex()), position, tokens)
    return Header(meta, plen, psum, version, size)


def check_payload(value: memoryview | bytes, header: Header) -> memoryview:
    """The payload of ``value`` (whose header decoded to ``header``) after its checksum check."""
    payload = memoryview(value)[header.header_size:]
    check_payload_of(payload, header)
    return payload


def check_payload_of(payload: memoryview | bytes, header: Header) -> None:
    """:func:`check_payload` for a payload held apart from its header (a value read in parts)."""
    if _checksum(header.version, payload) != header.checksum:
        raise _mismatch(header.version)


def verified_payload(value: memoryview | bytes, key: bytes, expected_len: int | None = None) -> memoryview:
    """The payload of a stored value after every check (header, key, length, payload checksum).

    Raises :class:`CorruptChunk`. Used by the daemon's NVMe tier and by clients
    that read the LMDB file themselves.
    """
    header = decode_header(value, key)
    if expected_len is not None and header.payload_len != expected_len:
        raise CorruptChunk(f"payload is {header.payload_len} bytes, expected {expected_len}")
    return check_payload(value, header)


_PIECE = 1 << 20


def copy_verified(value: memoryview | bytes, key: bytes, dest: memoryview) -> None:
    """Copy the payload into ``dest`` and check it, in one pass.

    The checksum is computed over each 1 MiB piece right after it was copied,
    while it is still in cache, instead of reading the payload twice. On a
    mismatch :class:`CorruptChunk` is raised and ``dest`` holds garbage: the
    caller must discard it (the pool aborts the slot; the client drops the tensor).
    """
    header = decode_header(value, key)
    plen = header.payload_len
    if plen != dest.nbytes:
        raise CorruptChunk(f"payload is {plen} bytes, expected {dest.nbytes}")
    src = memoryview(value)[header.header_size:]
    h = _hasher(header.version)
    for off in range(0, plen, _PIECE):
        end = min(off + _PIECE, plen)
        dest[off:end] = src[off:end]
        h.update(dest[off:end])
    if h.intdigest() != header.checksum:
        raise _mismatch(header.version)
