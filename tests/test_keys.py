from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import stat
import struct
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.contract.errors import InvalidLayout, InvalidTokens
from kvcached.contract.keys import (ChunkHasher, KVLayout, Namespace, load_or_create_key, load_shared_key, normalize_tokens,
                                    write_new_key)

BASE = KVLayout("meta-llama/Llama-3-8B@abc123", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
KEY = bytes(range(32))


def chain(layout: KVLayout, tokens, domain: str = "default", key: bytes = KEY):
    h = ChunkHasher(key)
    return h.chain(h.root(Namespace(domain, layout)), normalize_tokens(tokens), layout.chunk_tokens)


def test_chunk_bytes_follow_from_layout():
    # DESIGN.md: Llama-3-8B bf16 is 128 KiB per token, 16 MiB per 128-token chunk.
    assert BASE.token_bytes == 128 * 1024
    assert BASE.chunk_bytes == 16 * 1024 * 1024
    assert BASE.chunk_shape == (2, 32, 8, 128, 128)
    assert dataclasses.replace(BASE, dtype="float32").chunk_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "meta-llama/Llama-3-8B@def456"),
        ("num_layers", 31),
        ("num_kv_heads", 4),
        ("head_dim", 64),
        ("dtype", "float16"),
        ("chunk_tokens", 64),
        ("lora_name", "sql-adapter"),
        ("lora_version", "2"),
        ("extra", (("rope_scaling", "yarn"),)),
        ("vocab_size", 128256),
    ],
)
def test_every_identity_field_changes_the_hash(field, value):
    other = dataclasses.replace(BASE, **{field: value})
    tokens = list(range(256))
    assert other.layout_id != BASE.layout_id
    assert chain(other, tokens)[0] != chain(BASE, tokens)[0]


def test_domain_and_key_change_the_hash():
    tokens = list(range(128))
    assert chain(BASE, tokens, domain="a") != chain(BASE, tokens, domain="b")
    assert chain(BASE, tokens, key=KEY) != chain(BASE, tokens, key=bytes(32))


def test_length_prefixing_separates_shifted_fields():
    a = KVLayout("ab", 1, 1, 1, lora_name="c")
    b = KVLayout("a", 1, 1, 1, lora_name="bc")
    assert a.encode() != b.encode()
    assert a.layout_id != b.layout_id
    x = KVLayout("m", 1, 1, 1, extra=(("k", "v=1"),))
    y = KVLayout("m", 1, 1, 1, extra=(("k=v", "1"),))
    assert x.encode() != y.encode()


def test_extra_order_does_not_matter():
    a = KVLayout("m", 1, 1, 1, extra=(("a", "1"), ("b", "2")))
    b = KVLayout("m", 1, 1, 1, extra=(("b", "2"), ("a", "1")))
    assert a == b and a.layout_id == b.layout_id


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6),
                  st.lists(st.tuples(st.text(max_size=3), st.text(max_size=3)), max_size=2)),
        min_size=2, max_size=6,
    )
)
def test_no_two_identities_encode_alike(fields):
    layouts = set()
    for model, lora, ver, extra in fields:
        layouts.add(KVLayout("m" + model, 1, 1, 1, lora_name=lora, lora_version=ver, extra=tuple(extra)))
    encodings = {lay.encode() for lay in layouts}
    assert len(encodings) == len(layouts)


def test_chain_covers_whole_prefix():
    lay = dataclasses.replace(BASE, chunk_tokens=4)
    a = chain(lay, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chain(lay, [9, 2, 3, 4, 5, 6, 7, 8])  # same second chunk, different first
    assert len(a) == 2 and a[1] != b[1]
    assert chain(lay, [1, 2, 3, 4, 5, 6, 7, 8, 9])[:2] == a  # the partial chunk is ignored
    assert chain(lay, [1, 2, 3]) == []  # only full chunks
    assert all(len(h) == 16 for h in a)


def test_token_encodings_agree():
    toks = [0, 1, 2**32 - 1, 42] * 32
    want = chain(BASE, toks)
    assert chain(BASE, np.array(toks, dtype=np.uint32)) == want
    assert chain(BASE, np.array(toks, dtype=np.int64)) == want
    assert chain(BASE, array("I", toks)) == want
    assert chain(BASE, np.array(toks, dtype="<u4").tobytes()) == want


@pytest.mark.parametrize(
    "bad",
    [[-1, 2], [2**32], [1.5], ["a"], np.array([[1, 2]]), np.array([1.0]), np.array([-3, 1]), b"\x00\x01\x02"],
    ids=["negative", "too-big", "float", "str", "2d", "float-array", "neg-array", "ragged-bytes"],
)
def test_bad_tokens_raise(bad):
    with pytest.raises(InvalidTokens):
        normalize_tokens(bad)


def test_vocab_size_bounds_tokens():
    with pytest.raises(InvalidTokens, match="out of range"):
        normalize_tokens([5, 100], vocab_size=100)
    with pytest.raises(InvalidTokens):
        normalize_tokens(np.array([100]), vocab_size=100)
    with pytest.raises(InvalidTokens):
        normalize_tokens(np.array([100], dtype="<u4").tobytes(), vocab_size=100)
    assert normalize_tokens([99], vocab_size=100) == (99).to_bytes(4, "little")


@pytest.mark.parametrize(
    "kw",
    [dict(model=""), dict(num_layers=0), dict(num_kv_heads=-1), dict(head_dim=True), dict(dtype="float64"),
     dict(chunk_tokens=0), dict(chunk_tokens=10**6), dict(vocab_size=-1), dict(extra=(("a",),))],
)
def test_bad_layouts_raise(kw):
    with pytest.raises(InvalidLayout):
        dataclasses.replace(BASE, **kw)


def test_layout_round_trips_through_dict():
    lay = dataclasses.replace(BASE, extra=(("x", "1"),), lora_name="l")
    assert KVLayout.from_dict(lay.to_dict()) == lay


def test_hash_key_is_created_private_and_reused(tmp_path):
    path = str(tmp_path / "hash.key")
    k1 = load_or_create_key(path)
    assert len(k1) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_key(path) == k1
    with open(path, "wb") as f:
        f.write(b"short")
    with pytest.raises(ValueError, match="expected 32"):
        load_or_create_key(path)


def test_a_shared_key_file_is_read_never_made_and_must_be_private(tmp_path):
    path = str(tmp_path / "domain.key")
    with pytest.raises(ValueError, match="does not exist.*kvcachectl keygen"):
        load_shared_key(path)
    assert not os.path.exists(path)  # never created: a host with its own key would share nothing
    write_new_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_shared_key(path)
    assert len(key) == 32 and load_shared_key(path) == key
    with pytest.raises(FileExistsError):
        write_new_key(path)  # never replaced in place
    assert load_shared_key(path) == key
    hexed = tmp_path / "hex.key"
    hexed.write_text(key.hex() + "\n")
    hexed.chmod(0o400)
    assert load_shared_key(str(hexed)) == key  # `openssl rand -hex 32` works too
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match="readable by others"):
        load_shared_key(path)
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"x" * 31)
    bad.chmod(0o600)
    with pytest.raises(ValueError, match="expected 32 raw bytes or 64 hex digits"):
        load_shared_key(str(bad))


def test_no_collisions_among_many_prompts():
    lay = dataclasses.replace(BASE, chunk_tokens=2)
    seen = {}
    for toks in itertools.product(range(5), repeat=4):
        for i, h in enumerate(chain(lay, list(toks))):
            key = tuple(toks[: 2 * (i + 1)])
            assert seen.setdefault(h, key) == key
    assert len(seen) == 25 + 625


# -- known answers ---------------------------------------------------------------------------
# Every test above compares the code with itself. These pin the bytes: chunks on NVMe are found
# again only by these hashes, and stamped with this layout id.

ORPHANS = ("changed: this orphans every existing NVMe tier (its chunks are found again only by these hashes, "
           "and rebuilt under this layout id). Restore the encoding; change the golden values only for a "
           "deliberate, announced format break")

GOLDEN_LAYOUT = KVLayout(
    "meta-llama/Llama-3-8B@abc123", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=4,
    lora_name="sql-adapter", lora_version="2", extra=(("rope_scaling", "yarn"),), vocab_size=128256,
)
GOLDEN_DOMAIN = "tenant-a"
GOLDEN_TOKENS = [0, 1, 128255, 7, 42, 42, 42, 42, 100000, 3, 2, 1, 9]  # 3 full chunks + 1 token, ignored
# Computed once with hashlib from the formula in kvcached/contract/keys.py's docstring (as _reference_* below
# does), key bytes(range(32)); pasted here so that the formula itself cannot drift.
GOLDEN_LAYOUT_ID = "719e74a430f4380b6388bdaba99f0c8b"
GOLDEN_ROOT = "43bf52f2ce3b661f6f42c8e3d006dd21"
GOLDEN_CHAIN = [
    "a0a53ab5bcd8473926e90f5cdd012bd5",
    "23ddf6ef24b18fcda06f3397941cd12f",
    "ef7e9b6b39982e216ffccac5ee599d3b",
]


def _reference_lp(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _reference_str(s: str) -> bytes:
    return _reference_lp(s.encode("utf-8"))


def _reference_int(v: int) -> bytes:
    return _reference_lp(v.to_bytes(max(1, (v.bit_length() + 8) // 8), "little", signed=True))


def _reference_layout(lay: KVLayout) -> bytes:
    parts = [_reference_str("kvcached.layout.v1"), _reference_str(lay.model), _reference_int(lay.num_layers),
             _reference_int(lay.num_kv_heads), _reference_int(lay.head_dim), _reference_str(lay.dtype),
             _reference_int(lay.chunk_tokens), _reference_str(lay.lora_name), _reference_str(lay.lora_version),
             _reference_int(len(lay.extra))]
    parts += [_reference_str(k) + _reference_str(v) for k, v in sorted(lay.extra)]
    parts.append(_reference_int(lay.vocab_size))
    return b"".join(parts)


def _reference_hashes(key: bytes, domain: str, lay: KVLayout, tokens: list[int]) -> tuple[str, bytes, list[bytes]]:
    """(layout id, h_{-1}, [h_0, h_1, ...]) straight from the module docstring, with hashlib and struct."""
    enc = _reference_layout(lay)
    layout_id = hashlib.blake2b(enc, digest_size=16, person=b"kvc-layout").hexdigest()
    ns = _reference_str("kvcached.namespace.v1") + _reference_str(domain) + _reference_lp(enc)
    root = hashlib.sha256(b"kvcached.namespace.v1\x00" + key + ns).digest()[:16]
    out, prev, n = [], root, lay.chunk_tokens
    for i in range(len(tokens) // n):
        chunk = struct.pack(f"<{n}I", *tokens[i * n : (i + 1) * n])
        prev = hashlib.sha256(b"kvcached.chunk.v1\x00" + key + prev + chunk).digest()[:16]
        out.append(prev)
    return layout_id, root, out


@pytest.mark.parametrize(
    "lay,domain,tokens",
    [
        (dataclasses.replace(BASE, chunk_tokens=4), "default", list(range(12))),
        (GOLDEN_LAYOUT, GOLDEN_DOMAIN, GOLDEN_TOKENS),
        (KVLayout("m", 1, 1, 1, dtype="float32", chunk_tokens=2, extra=(("b", "2"), ("a", "é"))), "",
         [2**32 - 1, 0, 255, 256, 65536, 2**31]),
    ],
    ids=["base", "every-field", "edge-values"],
)
def test_hashes_follow_the_documented_formula(lay, domain, tokens):
    layout_id, root, want = _reference_hashes(KEY, domain, lay, tokens)
    h = ChunkHasher(KEY)
    got_root = h.root(Namespace(domain, lay))
    assert lay.encode() == _reference_layout(lay), "layout encoding " + ORPHANS
    assert lay.layout_id == layout_id, "layout id " + ORPHANS
    assert got_root == root, "namespace root h_{-1} " + ORPHANS
    assert h.chain(got_root, normalize_tokens(tokens), lay.chunk_tokens) == want, "chain " + ORPHANS
    assert len(want) == 3


def test_golden_hashes():
    lay = dataclasses.replace(BASE, chunk_tokens=4, lora_name="sql-adapter", lora_version="2",
                              extra=(("rope_scaling", "yarn"),), vocab_size=128256)
    assert lay == GOLDEN_LAYOUT
    assert GOLDEN_LAYOUT.layout_id == GOLDEN_LAYOUT_ID, "layout id " + ORPHANS
    h = ChunkHasher(KEY)
    root = h.root(Namespace(GOLDEN_DOMAIN, GOLDEN_LAYOUT))
    assert root.hex() == GOLDEN_ROOT, "namespace root h_{-1} " + ORPHANS
    got = [c.hex() for c in h.chain(root, normalize_tokens(GOLDEN_TOKENS), GOLDEN_LAYOUT.chunk_tokens)]
    assert got == GOLDEN_CHAIN, "chain " + ORPHANS
    # The reference implementation agrees with the constants (so neither drifted alone).
    layout_id, ref_root, ref_chain = _reference_hashes(KEY, GOLDEN_DOMAIN, GOLDEN_LAYOUT, GOLDEN_TOKENS)
    assert (layout_id, ref_root.hex(), [c.hex() for c in ref_chain]) == (GOLDEN_LAYOUT_ID, GOLDEN_ROOT, GOLDEN_CHAIN)
