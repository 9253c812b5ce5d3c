"""Prefix reuse in Hugging Face transformers: same outputs with and without kvcached.

Models are built from configs with random weights (no downloads). Each case runs the plain
model (full prefill, no cache) as the reference and the kvcached path against a real daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvcached_client import Client
from kvcached_client.hf import generate, layout_for, prefill, reference_generate
from kvcached_client.policy import CachePolicy

CT = 16  # chunk tokens: small so that prompts of a few chunks exercise every case


def llama(dtype=torch.float32, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # GQA: 2 KV heads
    return LlamaForCausalLM(cfg).to(dtype).eval()


def qwen2(dtype=torch.float32, seed=1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


@pytest.fixture
def hf_daemon(make_daemon):
    return make_daemon(pool_bytes="16M")


def _check(client, model, layout, ids, cached_expected, atol):
    want_tokens, want_logits = reference_generate(model, ids, 32)
    out = generate(client, model, layout, ids, max_new_tokens=32, keep_logits=True)
    assert out.prefill.cached_tokens == cached_expected
    torch.testing.assert_close(out.step_logits[0].float(), want_logits.float(), atol=atol, rtol=0)
    assert out.tokens == want_tokens
    return out


@pytest.mark.parametrize(
    "case",
    ["not-cached", "fully-cached", "half-cached", "not-a-chunk-multiple"],
)
def test_llama_gqa_float32_same_logits_and_greedy_tokens(hf_daemon, case):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    assert (layout.num_kv_heads, layout.num_layers, layout.head_dim, layout.dtype) == (2, 3, 16, "float32")
    with Client(hf_daemon.socket) as c:
        ids = prompt(4 * CT)
        if case == "not-cached":
            _check(c, model, layout, ids, 0, 1e-5)
        elif case == "fully-cached":
            prefill(c, model, layout, ids)  # stores 4 chunks
            _check(c, model, layout, ids, 4 * CT - 1, 1e-5)  # the last token is always recomputed
        elif case == "half-cached":
            prefill(c, model, layout, ids[: 2 * CT])
            _check(c, model, layout, ids, 2 * CT, 1e-5)
        else:
            longer = torch.cat([ids, prompt(CT // 2 + 3, seed=9)])  # 4.7 chunks
            prefill(c, model, layout, longer)
            _check(c, model, layout, longer, 4 * CT, 1e-5)


def test_llama_bfloat16_within_bf16_tolerance(hf_daemon):
    model = llama(torch.bfloat16)
    layout = layout_for(model, model_id="test/llama-gqa-bf16@random0", chunk_tokens=CT)
    assert layout.dtype == "bfloat16"
    with Client(hf_daemon.socket) as c:
        ids = prompt(3 * CT + 5, seed=3)
        prefill(c, model, layout, ids)
        _, want_logits = reference_generate(model, ids, 1)
        out = prefill(c, model, layout, ids)
        assert out.cached_tokens == 3 * CT
        # bf16 keeps ~3 significant digits; the suffix-only pass rounds differently.
        torch.testing.assert_close(out.logits.float(), want_logits.float(), atol=5e-2, rtol=2e-2)
        assert int(out.logits.argmax()) == int(want_logits.argmax())


def test_qwen2_another_architecture(hf_daemon):
    model = qwen2()
    layout = layout_for(model, model_id="test/qwen2@random1", chunk_tokens=CT)
    assert dict(layout.extra)["architecture"] == "qwen2"
    with Client(hf_daemon.socket) as c:
        ids = prompt(3 * CT, seed=5)
        prefill(c, model, layout, ids)
        _check(c, model, layout, ids, 3 * CT - 1, 1e-5)


def test_no_store_policy_and_header_and_long_generation_bypass(hf_daemon):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    with Client(hf_daemon.socket) as c:
        ids = prompt(2 * CT, seed=7)
        pol = CachePolicy.from_headers({"X-Cache-Control": "no-store"})
        assert prefill(c, model, layout, ids, policy=pol).stored_chunks == 0
        assert c.lookup(layout, ids) == 0
        long_gen = CachePolicy(expected_output_tokens=10_000)  # over bypass_generation_tokens (8192)
        assert prefill(c, model, layout, ids, policy=long_gen).stored_chunks == 0
        assert prefill(c, model, layout, ids).stored_chunks == 2
        no_cache = CachePolicy.from_headers({"x-cache-control": "No-Cache"})
        assert prefill(c, model, layout, ids, policy=no_cache).cached_tokens == 0


_TURN = r"""
import sys, json, torch
from kvcached_client import Client
from kvcached_client.hf import generate, layout_for
from tests.clients.test_hf import llama, prompt, CT
model = llama()
layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
ids = torch.tensor(json.loads(sys.argv[2]))
with Client(sys.argv[1]) as c:
    out = generate(c, model, layout, ids, max_new_tokens=8)
print(json.dumps({"cached": out.prefill.cached_tokens, "stored": out.prefill.stored_chunks, "tokens": out.tokens}))
"""


def test_two_processes_share_a_conversation(hf_daemon):
    turn1 = prompt(3 * CT, seed=11)
    a = json.loads(subprocess.run([sys.executable, "-c", _TURN, hf_daemon.socket, json.dumps(turn1.tolist())],
                                  capture_output=True, text=True, timeout=300, check=True).stdout)
    assert a["cached"] == 0 and a["stored"] == 3
    turn2 = torch.cat([turn1, torch.tensor(a["tokens"]), prompt(CT, seed=12)])  # turn 1 + reply + new question
    b = json.loads(subprocess.run([sys.executable, "-c", _TURN, hf_daemon.socket, json.dumps(turn2.tolist())],
                                  capture_output=True, text=True, timeout=300, check=True).stdout)
    assert b["cached"] == 3 * CT  # process B reused process A's chunks
    want, _ = reference_generate(llama(), turn2, 8)
    assert b["tokens"] == want
