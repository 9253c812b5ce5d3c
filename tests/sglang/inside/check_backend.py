"""The SGLang backend against SGLang's real classes (run in SGLang's venv by tests/sglang/test_backend.py).

SGLang's ``HiCacheStorage``, ``HiCacheStorageConfig`` and backend factory are the real ones; the
host pools are SGLang's real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` classes with
their buffers set directly (their constructors need a device pool and, on CPU, CUDA's pinned
allocator), so ``set_from_flat_data_page`` / ``get_data_page`` are SGLang's own code: the oracle
for what a page holds. The daemon is the real one.
"""

from __future__ import annotations

import hashlib
import logging
import struct

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvcached_client.failopen import FAIL_OPEN_TOTAL
from kvcached_client.sglang import KvcachedStorage
from kvcached_client.sglang.pages import HostPages, UnsupportedPool

L, H, D, P, SIZE = 3, 2, 8, 16, 16 * 12
MLA_D = 24  # kv_lora_rank + rope, as one latent


class MHAPool(MHATokenToKVPoolHost):
    """SGLang's MHA host pool class, its buffer allocated here (its __init__ needs a device pool)."""

    def __init__(self, layout: str, dtype: torch.dtype = torch.bfloat16) -> None:  # noqa: D107
        self.layout, self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layout, L, H, D, D
        self.page_size, self.size, self.page_num, self.dtype = P, SIZE, SIZE // P, dtype
        shape = {"layer_first": (2, L, SIZE, H, D), "page_first": (2, SIZE, L, H, D),
                 "page_first_direct": (2, SIZE // P, L, P, H, D)}[layout]
        self.kv_buffer = torch.zeros(shape, dtype=dtype)


class MLAPool(MLATokenToKVPoolHost):
    def __init__(self, layout: str, dtype: torch.dtype = torch.bfloat16) -> None:  # noqa: D107
        self.layout, self.layer_num, self.kv_cache_dim, self.dcp_size = layout, L, MLA_D, 1
        self.page_size, self.size, self.page_num, self.dtype = P, SIZE, SIZE // P, dtype
        shape = {"layer_first": (L, SIZE, 1, MLA_D), "page_first": (SIZE, L, 1, MLA_D),
                 "page_first_direct": (SIZE // P, L, P, 1, MLA_D)}[layout]
        self.kv_buffer = torch.zeros(shape, dtype=dtype)


def make_pool(kind: str, layout: str):
    return (MLAPool if kind == "mla" else MHAPool)(layout)


def flat_page_len(pool) -> int:
    return pool.get_data_page(0).numel()


def config(socket: str = "", *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="test/tiny@1",
        extra_config={"backend_name": "kvcached", "module_path": "kvcached_client.sglang",
                      "class_name": "KvcachedStorage", "interface_v1": 1,
                      **({"socket": socket} if socket else {}), **extra})


def page_keys(tokens: list[int], salt: bytes = b"") -> list[str]:
    """SGLang's page keys: SHA-256 chained page by page over little-endian uint32 token ids."""
    keys, prior = [], salt
    for i in range(0, len(tokens) - len(tokens) % P, P):
        h = hashlib.sha256(prior + struct.pack(f"<{P}I", *tokens[i:i + P]))
        keys.append(h.hexdigest())
        prior = h.digest()
    return keys


def slots(pages: list[int]) -> torch.Tensor:
    """host_indices for host pages ``pages`` (each page's P consecutive token slots)."""
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages]).to(torch.int64)


def fill(pool, pages: list[int], seed: int) -> list[torch.Tensor]:
    """Random flat pages written with SGLang's own set_from_flat_data_page; returns them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in pages:
        data = torch.randn(flat_page_len(pool), generator=g).to(pool.dtype)
        pool.set_from_flat_data_page(p * P, data)
        out.append(data)
    return out


def canonical(pool, page: int) -> torch.Tensor:
    """SGLang's page (get_data_page) as [2, layers, heads, tokens, dim], from the flat shape
    SGLang's own set_from_flat_data_page gives each layout."""
    d = pool.get_data_page(page * P, flat=False)
    if isinstance(pool, MLAPool):
        lat = {"layer_first": lambda: d[:, :, 0], "page_first": lambda: d[:, :, 0].transpose(0, 1),
               "page_first_direct": lambda: d[0, :, :, 0]}[pool.layout]()  # (L, P, Dk)
        return torch.stack([lat[..., :MLA_D // 2], lat[..., MLA_D // 2:]]).unsqueeze(2)
    return {"layer_first": lambda: d.permute(0, 1, 3, 2, 4), "page_first": lambda: d.permute(0, 2, 3, 1, 4),
            "page_first_direct": lambda: d[:, 0].permute(0, 1, 3, 2, 4)}[pool.layout]()


LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"),
           ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct")]


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_page_views_are_sglangs_pages_in_chunk_order(kind, layout):
    pool = make_pool(kind, layout)
    fill(pool, range(SIZE // P), seed=1)
    pages = HostPages(pool, mla=kind == "mla")
    for p in (0, 5, SIZE // P - 1):
        assert torch.equal(pages.page(p * P), canonical(pool, p))
    # and a write through the view lands where SGLang reads the page
    new = torch.randn(pages.page(0).shape).to(pool.dtype)
    pages.page(3 * P).copy_(new)
    assert torch.equal(canonical(pool, 3), new)


def test_the_factory_builds_the_backend():
    backend = StorageBackendFactory.create_backend("dynamic", config(), None)
    assert isinstance(backend, KvcachedStorage) and isinstance(backend, HiCacheStorage)
    backend.register_mem_pool_host(MHAPool("layer_first"))
    lay = backend.layout
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.chunk_tokens) == (L, H, D, "bfloat16", P)
    assert dict(lay.extra)["client_keys"] == "sglang-page-sha256" and dict(lay.extra)["tp"] == "0/1"


def test_mla_is_one_layout_for_every_rank():
    a, b = KvcachedStorage(config(mla=True, tp_rank=0, tp_size=2)), KvcachedStorage(config(mla=True, tp_rank=1, tp_size=2))
    for s in (a, b):
        s.register_mem_pool_host(MLAPool("layer_first"))
    assert a.layout == b.layout and a.layout.num_kv_heads == 1 and a.layout.head_dim == MLA_D // 2
    m0, m1 = KvcachedStorage(config(tp_rank=0, tp_size=2)), KvcachedStorage(config(tp_rank=1, tp_size=2))
    for s in (m0, m1):
        s.register_mem_pool_host(MHAPool("layer_first"))
    assert m0.layout != m1.layout  # MHA: each rank its own heads


def test_what_cannot_be_served_exactly_is_refused_at_start(monkeypatch):
    small = MHAPool("layer_first")
    small.page_size = 4
    with pytest.raises(UnsupportedPool, match="page-size"):
        KvcachedStorage(config()).register_mem_pool_host(small)
    monkeypatch.setenv("SGLANG_USE_XXH3_HASH", "1")
    with pytest.raises(UnsupportedPool, match="64-bit"):
        KvcachedStorage(config())


def backend(socket: str, layout: str = "layer_first", kind: str = "mha", **kw) -> tuple[KvcachedStorage, object]:
    b = StorageBackendFactory.create_backend("dynamic", config(socket, mla=kind == "mla", **kw), None)
    pool = make_pool(kind, layout)
    b.register_mem_pool_host(pool)
    return b, pool


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_stored_by_one_engine_load_into_another_with_another_host_layout(make_daemon, kind):
    d = make_daemon(trust_client_keys=True)
    tokens = list(range(1000, 1000 + 6 * P))
    keys = page_keys(tokens)
    a, pool_a = backend(d.socket, "layer_first", kind)
    b, pool_b = backend(d.socket, "page_first_direct", kind)
    fill(pool_a, [2, 7, 4, 9, 1, 3], seed=2)
    # engine A writes its pages in two calls, the second with its prefix keys (as SGLang's backup does)
    assert a.batch_set_v1(keys[:4], slots([2, 7, 4, 9]), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    assert a.batch_set_v1(keys[4:], slots([1, 3]), HiCacheStorageExtraInfo(prefix_keys=keys[:4])) == [True] * 2
    assert a.batch_set_v1(keys[:2], slots([2, 7])) == [True, True]  # already there: stored, nothing written
    # engine B: how many pages from a point, then load them into its own (other) host pages
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 6
    assert b.batch_exists(keys[3:], HiCacheStorageExtraInfo(prefix_keys=keys[:3])) == 3
    assert b.batch_exists(page_keys(tokens[:P] + [7] * P)) == 1  # the second page differs
    other = page_keys(tokens[:5 * P] + [7] * P)[5]
    assert b.batch_exists([*keys[4:], other], HiCacheStorageExtraInfo(prefix_keys=keys[:4])) == 2
    got = b.batch_get_v1(keys[1:5], slots([0, 5, 6, 8]), HiCacheStorageExtraInfo(prefix_keys=keys[:1]))
    assert got == [True] * 4
    for src, dst in zip([7, 4, 9, 1], [0, 5, 6, 8]):
        assert torch.equal(canonical(pool_b, dst), canonical(pool_a, src))
    assert torch.count_nonzero(canonical(pool_b, 10)) == 0  # nothing else written
    assert b.counts["loaded_pages"] == 4


def test_a_page_whose_prefix_the_daemon_lost_is_not_stored(make_daemon):
    d = make_daemon(trust_client_keys=True)
    keys = page_keys(list(range(4 * P)))
    a, pool = backend(d.socket)
    fill(pool, [0, 1, 2, 3], seed=3)
    assert a.batch_set_v1(keys[2:], slots([2, 3]), HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [False, False]
    assert a.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    # without prefix keys (SGLang's hicache_storage_pass_prefix_keys off) a run is keyed on its own, still exactly
    assert a.batch_set_v1(keys[2:], slots([2, 3])) == [True, True]
    assert a.batch_exists(keys[2:]) == 2 and a.batch_exists(keys[3:]) == 0


def test_an_mla_rank_that_is_not_the_writer_stores_nothing(make_daemon):
    d = make_daemon(trust_client_keys=True)
    keys = page_keys(list(range(2 * P)))
    r1, pool = backend(d.socket, kind="mla", tp_rank=1, tp_size=2)
    fill(pool, [0, 1], seed=4)
    assert r1.batch_set_v1(keys, slots([0, 1])) == [True, True]  # SGLang must not retry: rank 0 stores
    assert r1.batch_exists(keys) == 0


def fail_open_count(op: str, reason: str) -> float:
    return FAIL_OPEN_TOTAL.labels("sglang", op, reason)._value.get()


def test_a_domain_that_does_not_trust_client_keys_is_a_miss_not_an_error(make_daemon, caplog):
    d = make_daemon()  # trust_client_keys off (the default)
    keys = page_keys(list(range(2 * P)))
    before = fail_open_count("start", "FAILED_PRECONDITION"), fail_open_count("set", "FAILED_PRECONDITION")
    with caplog.at_level(logging.WARNING, logger="kvcached_client"):
        a, pool = backend(d.socket, retry_s=0)  # the engine starts; the reason is logged at once
        assert fail_open_count("start", "FAILED_PRECONDITION") == before[0] + 1
        assert "trust_client_keys" in caplog.text
        assert a.batch_set_v1(keys, slots([0, 1])) == [False, False]
    assert fail_open_count("set", "FAILED_PRECONDITION") == before[1] + 1


def test_no_daemon_means_misses_one_warning_and_a_metric(tmp_path, caplog):
    keys = page_keys(list(range(3 * P)))
    before = fail_open_count("start", "UNAVAILABLE"), fail_open_count("exists", "UNAVAILABLE")
    with caplog.at_level(logging.WARNING, logger="kvcached_client"):
        a, pool = backend(str(tmp_path / "nobody.sock"), retry_s=0)
        for _ in range(3):
            assert a.batch_exists(keys) == 0
            assert a.batch_get_v1(keys, slots([0, 1, 2])) == [False] * 3
            assert a.batch_set_v1(keys, slots([0, 1, 2])) == [False] * 3
    assert fail_open_count("start", "UNAVAILABLE") == before[0] + 1
    assert fail_open_count("exists", "UNAVAILABLE") == before[1] + 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4, [r.getMessage() for r in warnings]  # one per operation (start included), not per call
    assert torch.count_nonzero(pool.kv_buffer) == 0


def test_after_a_failure_calls_skip_the_daemon_for_retry_s(tmp_path):
    keys = page_keys(list(range(P)))
    before = fail_open_count("start", "UNAVAILABLE"), fail_open_count("exists", "UNAVAILABLE")
    a, _ = backend(str(tmp_path / "nobody.sock"), retry_s=60)  # the start's warm-up fails: the first failure
    for _ in range(5):
        assert a.batch_exists(keys) == 0
    assert fail_open_count("start", "UNAVAILABLE") == before[0] + 1
    assert fail_open_count("exists", "UNAVAILABLE") == before[1]  # no call tried the daemon within retry_s


def test_the_engine_start_maps_the_pool_so_the_first_hit_does_not(make_daemon):
    """register_mem_pool_host (engine start) opens the session, registers the layout and maps
    the pool: the first hit then finds the mapping made (its page-table fill started long before)."""
    d = make_daemon(trust_client_keys=True)
    a, _ = backend(d.socket)
    client = a._client
    assert client is not None and client._pool.maps == 1 and client._layouts
    keys = page_keys(list(range(2 * P)))
    assert a.batch_set_v1(keys, slots([0, 1])) == [True, True]
    assert a.batch_get_v1(keys, slots([2, 3])) == [True, True]
    assert a._client is client and client._pool.maps == 1  # nothing mapped again
