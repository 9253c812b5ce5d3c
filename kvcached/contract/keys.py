"""Layouts, namespaces and chained chunk hashes.

A chunk of ``chunk_tokens`` token ids is identified by

    h_{-1} = H(encode(namespace))
    h_i    = H(h_{i-1} || encode(tokens of chunk i))

where H is SHA-256 over ``label || key || message``, truncated to 16 bytes,
with a per-daemon 32-byte secret ``key`` and a distinct label per use
(namespace seed vs chunk). Keying means a client cannot precompute hashes
that collide with another tenant's chunks, and the daemon computes every hash
itself from token ids; it never accepts a hash from a caller. Truncation to
128 of 256 bits is what makes the secret-prefix construction safe: the
output does not reveal the internal state, so no length extension.

Exactly (``||`` concatenates; ``u64le`` is an 8-byte little-endian unsigned)::

    lp(b)       = u64le(len(b)) || b
    str(s)      = lp(UTF-8 of s)
    int(v)      = lp(v as little-endian two's complement in max(1, (v.bit_length() + 8) // 8)
                     bytes)                       # 4 -> 04, 128 -> 80 00, 0 -> 00
    layout      = str("kvcached.layout.v1") || str(model) || int(num_layers)
                  || int(num_kv_heads) || int(head_dim) || str(dtype) || int(chunk_tokens)
                  || str(lora_name) || str(lora_version) || int(len(extra))
                  || str(k) || str(v) for each (k, v) of extra, sorted
                  || int(vocab_size)
    layout id   = hex(BLAKE2b(layout, digest_size=16, person=b"kvc-layout"))   # not keyed
    namespace   = str("kvcached.namespace.v1") || str(domain) || lp(layout)
    h_{-1}      = SHA-256(b"kvcached.namespace.v1\\x00" || key || namespace)[:16]
    h_i         = SHA-256(b"kvcached.chunk.v1\\x00" || key || h_{i-1} || tokens_i)[:16]

``key`` is the 32 raw bytes of ``hash.key``; ``tokens_i`` is token ids
``i * chunk_tokens`` .. ``(i + 1) * chunk_tokens - 1`` as little-endian
uint32, fixed width, so it needs no length prefix (``chunk_tokens`` is in
the namespace; the parent is always 16 bytes). Chunk hashes and layout ids
are what the NVMe tier is keyed and stamped with (:mod:`kvcached.contract.record`):
changing any byte of this encoding orphans every existing tier.
``tests/test_keys.py`` recomputes it with plain ``hashlib`` and pins golden
values.

Why not BLAKE2b-128 (the design card's suggestion): ``bench/acquire_latency.py``
hashes an 8k-token prompt (64 chunks) in ~72 µs with keyed BLAKE2b and
~50 µs with SHA-256, which uses the CPU's SHA extensions through OpenSSL;
hashing was most of an in-process acquire (target ≤ 100 µs), so the faster,
equally collision-resistant function wins. (The layout id, computed once per
layout, is still BLAKE2b.) The store also keeps a :mod:`kvcached.hashmemo` of
runs it has hashed, so a prefix it has seen costs a byte comparison instead
(same hashes, by construction). Every identity field is length-prefixed, so
two different identities can never produce the same encoded bytes
(``("ab", "c")`` vs ``("a", "bc")``).

Only full chunks are hashed: a prompt of 300 tokens with ``chunk_tokens=128``
has two chunks; the trailing 44 tokens are never cached.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from dataclasses import dataclass, field
from typing import NewType, Sequence, Union

import numpy as np

from kvcached.contract.errors import InvalidLayout, InvalidTokens, shown

ChunkHash = NewType("ChunkHash", bytes)
"""16-byte keyed chained digest of a chunk and its whole prefix (see module docstring)."""

LayoutId = NewType("LayoutId", str)
"""Stable hex id of a layout's identity (not keyed: the same on every host)."""

HASH_BYTES = 16
KEY_BYTES = 32
MAX_TOKEN_ID = 2**32 - 1
DEFAULT_CHUNK_TOKENS = 128

#: dtype name -> bytes per element. Names follow torch (``torch.bfloat16`` -> "bfloat16").
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

TokenInput = Union[Sequence[int], np.ndarray, bytes, bytearray, memoryview, array]


def _lp(b: bytes) -> bytes:
    """Length-prefix: 8-byte little-endian length, then the bytes."""
    return struct.pack("<Q", len(b)) + b


def _lp_str(s: str) -> bytes:
    return _lp(s.encode("utf-8"))


def _lp_int(v: int) -> bytes:
    return _lp(v.to_bytes(max(1, (v.bit_length() + 8) // 8), "little", signed=True))


#: The ``extra`` entry of a layout whose clients send, in place of token ids, keys they computed
#: themselves, encoded as uint32 words (e.g. SGLang's SHA-256 page chain: its HiCache storage
#: backends are given page keys, never token ids). The daemon still derives its own keyed chunk
#: hashes from those words, and the entry is part of the layout's identity, so such chunks never
#: meet chunks keyed by token ids. A domain accepts these layouts only with ``trust_client_keys``.
CLIENT_KEYS = "client_keys"


@dataclass(frozen=True)
class KVLayout:
    """One model's KV geometry. Every field is part of the cache identity.

    ``model`` is ``"org/name@revision"``; a missing revision is allowed but
    means different revisions of the same name share cache entries, so
    production configs should always pin one.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    lora_name: str = ""
    lora_version: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())
    vocab_size: int = 0  # 0 = unknown; token ids are then only checked against 2**32

    def __post_init__(self) -> None:
        if not self.model or len(self.model) > 512:
            raise InvalidLayout("layout.model must be a non-empty string of at most 512 characters")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidLayout(f"layout.{name} must be a positive integer, got {shown(v)}")
        if self.num_layers > 4096 or self.num_kv_heads > 4096 or self.head_dim > 65536:
            raise InvalidLayout("layout dimensions are implausibly large (layers/heads ≤ 4096, head_dim ≤ 65536)")
        if not 1 <= self.chunk_tokens <= 65536:
            raise InvalidLayout(f"layout.chunk_tokens must be in 1..65536, got {self.chunk_tokens}")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidLayout(
                f"layout.dtype {shown(self.dtype)} is not supported; use one of {sorted(DTYPE_SIZES)}"
            )
        if not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise InvalidLayout("layout.vocab_size must be a non-negative integer (0 = unknown)")
        if not isinstance(self.extra, tuple) or not all(
            isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(s, str) for s in kv)
            for kv in self.extra
        ):
            raise InvalidLayout("layout.extra must be a tuple of (str, str) pairs")
        # Canonical order, so the same extras given in another order are the same layout.
        object.__setattr__(self, "extra", tuple(sorted(self.extra)))

    @property
    def client_keys(self) -> str:
        """The scheme of the keys this layout's clients send in place of token ids ("" for a
        layout keyed by token ids, the normal case). See :data:`CLIENT_KEYS`."""
        return dict(self.extra).get(CLIENT_KEYS, "")

    @property
    def token_bytes(self) -> int:
        """KV bytes per token: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def chunk_bytes(self) -> int:
        return self.token_bytes * self.chunk_tokens

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one chunk's tensor: [2, layers, kv_heads, chunk_tokens, head_dim]."""
        return (2, self.num_layers, self.num_kv_heads, self.chunk_tokens, self.head_dim)

    def encode(self) -> bytes:
        """Unambiguous byte encoding of every identity field."""
        parts = [
            _lp_str("kvcached.layout.v1"),
            _lp_str(self.model),
            _lp_int(self.num_layers),
            _lp_int(self.num_kv_heads),
            _lp_int(self.head_dim),
            _lp_str(self.dtype),
            _lp_int(self.chunk_tokens),
            _lp_str(self.lora_name),
            _lp_str(self.lora_version),
            _lp_int(len(self.extra)),
            *(_lp_str(k) + _lp_str(v) for k, v in self.extra),
            _lp_int(self.vocab_size),
        ]
        return b"".join(parts)

    @property
    def layout_id(self) -> LayoutId:
        return LayoutId(hashlib.blake2b(self.encode(), digest_size=16, person=b"kvc-layout").hexdigest())

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "chunk_tokens": self.chunk_tokens,
            "lora_name": self.lora_name,
            "lora_version": self.lora_version,
            "extra": [list(kv) for kv in self.extra],
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        d = dict(d)
        d["extra"] = tuple(tuple(kv) for kv in d.get("extra", ()))
        return cls(**d)


@dataclass(frozen=True)
class Namespace:
    """(trust domain, layout). The domain comes from how a request arrived, never from its fields."""

    domain: str
    layout: KVLayout

    def encode(self) -> bytes:
        return _lp_str("kvcached.namespace.v1") + _lp_str(self.domain) + _lp(self.layout.encode())


class ChunkHasher:
    """Keyed chained hashing. One instance per daemon (per key).

    Thread-safe: it holds only prepared hash states (label and key already
    absorbed) that are copied per call, never updated in place.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"hash key must be {KEY_BYTES} bytes")
        self._seed = hashlib.sha256(b"kvcached.namespace.v1\x00" + key)
        self._chunk = hashlib.sha256(b"kvcached.chunk.v1\x00" + key)

    def root(self, ns: Namespace) -> ChunkHash:
        """h_{-1}: the seed of every chain in ``ns``."""
        h = self._seed.copy()
        h.update(ns.encode())
        return ChunkHash(h.digest()[:HASH_BYTES])

    def chain(self, root: ChunkHash, tokens: bytes, chunk_tokens: int) -> list[ChunkHash]:
        """Hashes of every full chunk of ``tokens`` (little-endian uint32 bytes).

        The chunk encoding is fixed-width (``chunk_tokens`` × 4 bytes, and
        ``chunk_tokens`` is itself in the namespace), so no length prefix is
        needed inside the chain; the parent digest is always 16 bytes.
        """
        step = chunk_tokens * 4
        return self.chain_range(root, tokens, 0, len(tokens) // step, step)

    def chain_range(self, parent: ChunkHash, tokens: bytes, start: int, end: int, step: int) -> list[ChunkHash]:
        """Hashes of chunks ``start``..``end - 1`` of ``tokens`` (``step`` bytes each), the
        chain continuing from ``parent``, the hash of chunk ``start - 1`` (or the root)."""
        out: list[ChunkHash] = []
        append = out.append
        prev: bytes = parent
        copy = self._chunk.copy
        for off in range(start * step, end * step, step):
            h = copy()
            h.update(prev)
            h.update(tokens[off : off + step])
            prev = h.digest()[:HASH_BYTES]
            append(prev)  # type: ignore[arg-type]  # a ChunkHash, without NewType's call per chunk
        return out


def load_shared_key(path: str) -> bytes:
    """A trust domain's hash key from a file the operator provides (``hash_key_file``): the same
    file on every host of the domain, so that they compute the same chunk hashes (and MAC keys)
    and can share chunks through the remote tier. Unlike :func:`load_or_create_key` it is never
    created here: a host that made its own key would silently share nothing. The file holds
    :data:`KEY_BYTES` raw bytes (``kvcachectl keygen``, or a copy of a host's ``hash.key``) or
    their hex; it must not be readable by group or others (as a password file).

    Raises ValueError naming the file and what is wrong with it.
    """
    try:
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise ValueError(f"hash key file {path} is readable by others (mode {oct(st.st_mode & 0o777)}); "
                             "chmod 600 it")
        with open(path, "rb") as f:
            data = f.read(4 * KEY_BYTES + 2)
    except FileNotFoundError:
        raise ValueError(f"hash key file {path} does not exist: make it once with `kvcachectl keygen {path}` "
                         "and copy it to every host of the trust domain") from None
    except OSError as e:
        raise ValueError(f"hash key file {path}: {e.strerror}") from None
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ValueError(f"hash key file {path}: expected {KEY_BYTES} raw bytes or {2 * KEY_BYTES} hex digits, "
                     f"found {len(data)} bytes")


def write_new_key(path: str) -> None:
    """Write a fresh random key to ``path`` (mode 0600), refusing to replace an existing file:
    replacing a domain's key orphans every chunk hashed with the old one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)


def load_or_create_key(path: str) -> bytes:
    """The per-daemon hash key, created (mode 0600) on first use.

    It must survive restarts: chunks on NVMe are found again by their hash.
    Deleting it orphans the NVMe tier (the rebuild then keeps the entries but
    no new request can hash to them; ``kvcachectl flush`` clears them).
    """
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) != KEY_BYTES:
            raise ValueError(f"{path}: hash key has {len(key)} bytes, expected {KEY_BYTES}")
        return key
    except FileNotFoundError:
        pass
    key = os.urandom(KEY_BYTES)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process won the race; then use theirs
    except FileExistsError:
        os.unlink(tmp)
        return load_or_create_key(path)
    os.unlink(tmp)
    return key


def normalize_tokens(tokens: TokenInput, vocab_size: int = 0) -> bytes:
    """Validate token ids and return them as little-endian uint32 bytes.

    Accepts a sequence of ints, an integer numpy array, or bytes already in
    uint32 little-endian form (what the gRPC layer receives as a packed
    array). Raises :class:`InvalidTokens` on negative ids, ids ≥ 2**32 or
    ≥ ``vocab_size`` when the layout declares one, non-integers, and
    byte strings whose length is not a multiple of 4.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        b = bytes(tokens)
        if len(b) % 4:
            raise InvalidTokens(f"packed token array has {len(b)} bytes, not a multiple of 4 (uint32 little-endian)")
        if vocab_size:
            arr = np.frombuffer(b, dtype="<u4")
            if arr.size and int(arr.max()) >= vocab_size:
                raise InvalidTokens(f"token id {int(arr.max())} is out of range for vocab_size {vocab_size}")
        return b
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidTokens(f"token ids must be a 1-D array, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise InvalidTokens(f"token ids must be integers, got dtype {tokens.dtype}")
        if tokens.size:
            lo, hi = int(tokens.min()), int(tokens.max())
            _check_range(lo, hi, vocab_size)
        return tokens.astype("<u4", copy=False).tobytes()
    if isinstance(tokens, array) and tokens.typecode in "IL" and tokens.itemsize == 4:
        if vocab_size and len(tokens) and max(tokens) >= vocab_size:
            raise InvalidTokens(f"token id {max(tokens)} is out of range for vocab_size {vocab_size}")
        return tokens.tobytes()
    try:
        words = array("I", tokens)
    except OverflowError:
        seq = list(tokens)
        bad = next((t for t in seq if not 0 <= t <= MAX_TOKEN_ID), None)
        raise InvalidTokens(f"token id {bad} is out of range 0..{MAX_TOKEN_ID}") from None
    except TypeError as e:
        raise InvalidTokens(f"token ids must be integers: {e}") from None
    if words.itemsize != 4:  # pragma: no cover - every Linux ABI has 4-byte unsigned int
        raise InvalidTokens("platform unsigned int is not 4 bytes")
    if vocab_size and len(words) and max(words) >= vocab_size:
        raise InvalidTokens(f"token id {max(words)} is out of range for vocab_size {vocab_size}")
    return words.tobytes()


def _check_range(lo: int, hi: int, vocab_size: int) -> None:
    if lo < 0:
        raise InvalidTokens(f"token id {lo} is negative")
    limit = vocab_size or (MAX_TOKEN_ID + 1)
    if hi >= limit:
        raise InvalidTokens(f"token id {hi} is out of range 0..{limit - 1}")
