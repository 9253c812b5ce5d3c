"""The connector on the model families people deploy now, in real vLLM CPU engines: exact greedy
tokens from a fresh engine that loads what another one stored.

* Gemma-3 style (windowed and global layers interleaved: two KV-cache groups, vLLM's hybrid
  allocator on) and Mistral style (every layer windowed, the window shorter than a chunk), with
  chunked prefill (200 tokens a step), so that vLLM frees windowed blocks before their chunk is
  whole: the connector must copy each step's blocks as they are computed. A one-line mutation
  (counting a chunk as written once its last block is copied, partial or not) fails these tests.
* DeepSeek-V2 style MLA on vLLM's CPU MLA backend (the latent: kv_lora_rank 512 + rope 64).
* The answer's KV: a finished request's generated whole chunks are stored, so the next turn of a
  conversation hits them.

Each family: engine A computes (a miss: its tokens are a run without the cache), vLLM's own
prefix cache is reset, A computes a prompt sharing a prefix (a kvcached hit, then a store after
it), then an engine with nothing in vLLM's own cache loads both (a fresh engine in its own
process for the hybrid; A again after a prefix-cache reset for the others, to keep CI short):
its tokens must equal A's.
"""

from __future__ import annotations

import pytest

from kvcached_client import Client
from tests.vllm.conftest import Engine, prompt

pytestmark = pytest.mark.slow

CHUNK = 128


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            from kvcached_client.vllm.random_model import build

            layers = 4 if family == "gemma3" else 2
            built[family] = build(str(tmp_path_factory.mktemp(family)), family=family, layers=layers, window=64)
        return built[family]

    return get


@pytest.mark.parametrize("family,args", [
    ("gemma3", ["--max-num-batched-tokens", "200"]),
    ("mistral", ["--max-num-batched-tokens", "200"]),
    # CPU_MLA: on a CPU with AMX vLLM would pick AMX_MLA, which needs bf16 weights (these are float32)
    ("deepseek_v2", ["--attention-backend", "CPU_MLA"]),
])
def test_fresh_engine_loads_exactly(family, args, family_model, vdaemon, tmp_path, tiny_model):
    model = family_model(family)
    p = prompt(600, 1)
    half = p[:300] + prompt(300, 2)  # 2 whole chunks in common with p
    a = Engine(model, str(tmp_path), vdaemon.socket, args=args)
    ra = a.generate([p])
    assert ra["num_cached"] == [0] and ra["worker"]["loaded_blocks"] == 0  # computed: the reference
    a.call(op="reset")  # half's common prefix can only come from kvcached now
    rh = a.generate([half])
    assert rh["num_cached"] == [2 * CHUNK], rh  # loaded, then its own chunks 2..3 stored after the hit
    with Client(vdaemon.socket, session=False) as c:
        layouts = c.stats()
    a.close()  # a fresh engine in a fresh process: nothing in vLLM's own cache
    c_ = Engine(model, str(tmp_path), vdaemon.socket, args=args)
    r = c_.generate([half])
    assert r["num_cached"] == [4 * CHUNK] and r["worker"]["failed_blocks"] == 0, r
    assert r["tokens"] == rh["tokens"]
    c_.call(op="reset")
    r = c_.generate([p])
    assert r["num_cached"] == [4 * CHUNK] and r["tokens"] == ra["tokens"]
    assert r["fail_open"] == {}, r
    assert layouts["indexed_chunks"] == 6  # p's 4 and half's 2 after the shared ones: nothing twice


def test_the_answer_is_stored_for_the_next_turn(vdaemon, engines, reference):
    """Turn 1 (600 prompt tokens, 200 generated) stores its answer's whole chunks when it finishes:
    a fresh engine serving turn 2 (turn 1's prompt, the answer, a new question) loads 6 chunks,
    not only the prompt's 4, and its tokens are a run without the cache's. Controls: with
    ``store_answers: false`` the same kind of turn 2 hits the prompt's 4 chunks only, and a turn 1
    sent with ``no_store`` stores nothing at all."""
    p = prompt(600, 7)
    a = engines(vdaemon.socket)
    r1 = a.generate([p], max_tokens=200, ignore_eos=True)
    assert r1["num_cached"] == [0] and r1["scheduler"]["answer_stores"] == 1, r1["scheduler"]
    answer = r1["tokens"][0]
    assert answer == reference([p], max_tokens=200)[0]
    turn2 = p + answer + prompt(40, 8)
    want = reference([turn2])
    b = engines(vdaemon.socket)
    r2 = b.generate([turn2])
    assert r2["num_cached"] == [6 * CHUNK], r2  # (600 + 199 computed) // 128: the answer's 2 chunks too
    assert r2["tokens"] == want and r2["worker"]["failed_blocks"] == 0
    with Client(vdaemon.socket, session=False) as c:
        s = c.stats()
    assert (s["leases_active"], s["reservations_active"], s["indexed_chunks"]) == (0, 0, 6)

    q = prompt(600, 9)
    off = engines(vdaemon.socket, extra={"store_answers": False})
    r1 = off.generate([q], max_tokens=200, ignore_eos=True)
    off.call(op="reset")  # turn 2's hits can only come from kvcached
    r2 = off.generate([q + r1["tokens"][0] + prompt(40, 10)])
    assert r2["num_cached"] == [4 * CHUNK]  # the prompt's chunks only

    r1 = b.generate([prompt(600, 11)], max_tokens=200, ignore_eos=True, kv={"kvcached": {"no_store": True}})
    assert r1["scheduler"].get("answer_stores", 0) == 0
    with Client(vdaemon.socket, session=False) as c:
        # p and its answer (6), q's prompt (4) and turn 2's own prompt chunks past them (2): nothing of no_store
        assert c.stats()["indexed_chunks"] == 6 + 4 + 2


def fp8_refusal() -> str | None:
    """Why vLLM's CPU build cannot run an fp8 KV cache here (None if it can)."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "vLLM's CPU build refuses fp8 KV caches without AVX-512 or AMX, and this CPU has neither"


def test_an_fp8_kv_cache_loads_exactly_in_a_fresh_engine(vdaemon, tmp_path, tiny_model):
    """fp8 KV (vLLM's per-tensor scale 1.0 on CPU): the chunks hold the cache's bytes under a
    uint8 layout that says fp8; a fresh engine loads them and generates what the engine that
    computed them did (its attention read the same fp8 bytes)."""
    why = fp8_refusal()
    if why:
        pytest.skip(why)
    args = ["--kv-cache-dtype", "fp8"]
    p = prompt(600, 21)
    a = Engine(tiny_model, str(tmp_path), vdaemon.socket, args=args)
    ra = a.generate([p])
    assert ra["num_cached"] == [0] and ra["fail_open"] == {}, ra
    a.close()
    with Client(vdaemon.socket, session=False) as c:
        s = c.stats()
    (spec,) = s["layouts_detail"].values()
    assert spec["dtype"] == "uint8" and dict(map(tuple, spec["extra"]))["kv_cache_dtype"] == "fp8", spec
    assert s["indexed_chunks"] == 4
    b = Engine(tiny_model, str(tmp_path), vdaemon.socket, args=args)
    rb = b.generate([p])
    assert rb["num_cached"] == [4 * CHUNK] and rb["tokens"] == ra["tokens"], rb
    # control: an engine with the model's own (float32) KV cache is another layout
    plain = Engine(tiny_model, str(tmp_path), vdaemon.socket)
    rp = plain.generate([p])
    assert rp["num_cached"] == [0], rp  # fp8 chunks never serve a float32 cache


def test_mla_with_tensor_parallelism_stores_each_chunk_once(family_model, vdaemon, tmp_path):
    """An MLA latent is the same on every TP rank: both ranks share one layout, so a 600-token
    prompt is 4 chunks in the daemon (not 4 per rank), and a fresh TP-2 engine loads them on both
    ranks with the tokens the first one computed."""
    model = family_model("deepseek_v2")
    p = prompt(600, 12)
    a = Engine(model, str(tmp_path), vdaemon.socket, tp=2, args=["--attention-backend", "CPU_MLA"])
    ra = a.generate([p])
    assert ra["num_cached"] == [0]
    with Client(vdaemon.socket, session=False) as c:
        s = c.stats()
    tps = sorted(dict(map(tuple, spec["extra"])).get("tp") for spec in s["layouts_detail"].values())
    assert tps == ["replicated/2"] and s["indexed_chunks"] == 4, (tps, s["indexed_chunks"])
    a.close()
    b = Engine(model, str(tmp_path), vdaemon.socket, tp=2, args=["--attention-backend", "CPU_MLA"])
    rb = b.generate([p])
    assert rb["num_cached"] == [4 * CHUNK] and rb["tokens"] == ra["tokens"], rb
