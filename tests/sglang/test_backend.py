"""The SGLang backend: the daemon's side of client keys, and the backend against SGLang's classes."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from kvcached.contract.keys import CLIENT_KEYS, KVLayout
from kvcached_client import Client, FailedPreconditionError
from kvcached_client.sglang.pages import KEY_SCHEME, UnsupportedPool, key_words
from tests.sglang.conftest import HERE, ROOT, sglang_env

KEYED = KVLayout("test/tiny@1", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", chunk_tokens=8,
                 extra=((CLIENT_KEYS, KEY_SCHEME),))
KEY = "ab" * 32


def test_a_domain_refuses_client_keys_unless_it_trusts_them(make_daemon):
    d = make_daemon()
    with Client(d.socket) as c:
        with pytest.raises(FailedPreconditionError, match="trust_client_keys"):
            c.register(KEYED)
        assert c.stats()["layouts"] == 0  # nothing registered
    d.stop()
    trusting = make_daemon(trust_client_keys=True)
    with Client(trusting.socket) as c:
        c.register(KEYED)
        words = key_words([KEY], 8)
        c.put(KEYED, words, _kv())
        assert c.lookup(KEYED, words) == 8


def _kv():
    import torch

    return torch.ones((2, 1, 1, 8, 4), dtype=torch.float32)


def test_client_keyed_chunks_never_meet_token_keyed_ones(make_daemon):
    d = make_daemon(trust_client_keys=True)
    plain = KVLayout("test/tiny@1", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", chunk_tokens=8)
    words = key_words([KEY], 8)
    with Client(d.socket) as c:
        c.put(KEYED, words, _kv())
        assert c.lookup(plain, words) == 0  # the same words as token ids under a plain layout: no hit


def test_key_words_are_the_keys_bytes_then_zeros():
    w = key_words(["00010203" + "0" * 56, "ff" * 32], 16)
    assert w.dtype == np.dtype("<u4") and w.shape == (32,)
    assert w[0] == 0x03020100 and not w[1:16].any() and (w[16:24] == 0xFFFFFFFF).all() and not w[24:].any()
    with pytest.raises(UnsupportedPool, match="got 64 bits"):
        key_words(["ab" * 8], 16)  # XXH3-64 keys
    with pytest.raises(UnsupportedPool, match="page-size"):
        key_words([KEY], 4)


def test_the_backend_against_sglangs_own_classes(sglang_python):
    """inside/check_backend.py under SGLang's Python: SGLang's real HiCacheStorage, config,
    backend factory and host-pool classes, a real daemon (see that file)."""
    r = subprocess.run([sglang_python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                        os.path.join(HERE, "inside", "check_backend.py")],
                       cwd=ROOT, env=sglang_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
