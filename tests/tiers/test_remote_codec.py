"""The remote tier's keys and values (kvcached.contract.remote_format): what is served, what is not."""

from __future__ import annotations

import os

import pytest

from kvcached.contract.errors import CorruptChunk
from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.contract.remote_format import MAC_BYTES, RemoteValueRefused, decode, encode, key_prefix, mac_key, remote_key

LAYOUT = LayoutId("0f" * 16)
H = ChunkHash(bytes(range(16)))
PARENT = ChunkHash(bytes(range(16, 32)))
KEY = mac_key(b"domain key of host A and B")
PAYLOAD = os.urandom(4096)


def value(payload: bytes = PAYLOAD, key: bytes = KEY, h: ChunkHash = H, layout: LayoutId = LAYOUT) -> bytes:
    return encode(ChunkMeta(h, PARENT, layout, 3, 128), payload, key)


def test_a_value_round_trips():
    v = value()
    assert len(v) == 88 + len(PAYLOAD) + MAC_BYTES
    assert bytes(decode(v, H, LAYOUT, KEY, len(PAYLOAD))) == PAYLOAD


def test_keys_are_one_per_chunk_under_the_domain_prefix_without_hash_tags():
    k = remote_key("tenant-a", LAYOUT, H)
    assert k == f"kvc:tenant-a:{LAYOUT}:{H.hex()}" and k.startswith(key_prefix("tenant-a"))
    assert "{" not in k and "}" not in k  # a hash tag would put a whole domain in one cluster slot


def test_the_mac_key_is_derived_not_the_domain_key():
    assert mac_key(b"k") != b"k" and len(mac_key(b"k")) == 32 and mac_key(b"k") != mac_key(b"l")


@pytest.mark.parametrize("reason, bad", [
    ("mac", lambda: value(key=mac_key(b"another domain"))),  # planted by a writer without the key
    ("truncated", lambda: value()[:MAC_BYTES]),
    ("mac", lambda: value()[:-1]),  # cut short by one byte
    ("mac", lambda: bytes([value()[0] ^ 1]) + value()[1:]),  # any flipped bit
    ("mac", lambda: value()[:200] + bytes([value()[200] ^ 0x40]) + value()[201:]),
])
def test_what_is_refused(reason, bad):
    with pytest.raises(RemoteValueRefused) as e:
        decode(bad(), H, LAYOUT, KEY)
    assert e.value.reason == reason
    assert isinstance(e.value, CorruptChunk)  # the read path treats it as a corrupt copy: dropped, not served


def test_a_well_formed_value_of_another_chunk_or_layout_is_refused():
    other = ChunkHash(bytes(16))
    with pytest.raises(RemoteValueRefused) as e:
        decode(value(h=other), H, LAYOUT, KEY)  # stored under the wrong key
    assert e.value.reason == "header"
    with pytest.raises(RemoteValueRefused) as e:
        decode(value(layout=LayoutId("aa" * 16)), H, LAYOUT, KEY)
    assert e.value.reason == "header"
    with pytest.raises(RemoteValueRefused) as e:
        decode(value(), H, LAYOUT, KEY, expected_len=len(PAYLOAD) + 1)
    assert e.value.reason == "length"
