"""kvcached_client.hf fails open, and serves the models it cannot (fully) cache anyway.

Real components throughout: a real daemon (or a socket with none behind it), tiny random-weight
models built from configs. Each request is checked against plain generation without kvcached.

* no daemon, a daemon SIGKILLed between requests, a store the daemon refuses, a lease read
  that breaks: the request is answered, with the same tokens, and says why in ``cache_error``;
  each failure is counted (``kvcached_client_fail_open_total``) and logged once;
* sliding-window models (Mistral, Gemma-3 style mixed layers) are cached exactly: a miss gives
  bit-identical logits at every step, a hit the same greedy tokens;
* recurrent and hybrid models (Mamba, LFM2) are served without the cache, never failing.
"""

from __future__ import annotations

import logging
import signal
import time

import pytest
import torch
from prometheus_client import REGISTRY

from kvcached_client.client import CacheRequest
from kvcached_client import Client, InvalidArgumentError
from kvcached_client import hf
from kvcached_client.failopen import FailOpen
from kvcached_client.hf import generate, layout_for, prefill, reference_generate
from kvcached_client.policy import CachePolicy
from tests.clients.test_hf import CT, llama, prompt, qwen2

N_NEW = 8


def fail_open_total(op: str, reason: str) -> float:
    labels = {"integration": "hf", "op": op, "reason": reason}
    return REGISTRY.get_sample_value("kvcached_client_fail_open_total", labels) or 0.0


def warnings_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvcached_client" and r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def fresh_fail_open(monkeypatch, caplog):
    """A new FailOpen per test: whether an op is "failing" (what decides the one warning) is
    module state, which an earlier test must not leave behind. The counter is the process's
    Prometheus one: tests read its increase."""
    monkeypatch.setattr(hf, "FAIL_OPEN", FailOpen("hf"))
    caplog.set_level(logging.INFO, logger="kvcached_client")


@pytest.fixture
def hf_daemon(make_daemon):
    return make_daemon(pool_bytes="16M")


def _same_as_plain(model, ids, out, want_tokens, want_logits):
    assert out.tokens == want_tokens
    assert torch.equal(out.step_logits[0], want_logits)  # the model alone computed the whole prompt


# -- fail open -----------------------------------------------------------------------------------


def test_no_daemon_serves_every_request_from_the_model_alone(tmp_path, caplog):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    ids = prompt(3 * CT + 5, seed=21)
    want_tokens, want_logits = reference_generate(model, ids, N_NEW)
    before = fail_open_total("acquire", "UNAVAILABLE")
    with Client(str(tmp_path / "nobody-home.sock"), timeout=5) as c:
        t0 = time.perf_counter()
        outs = [generate(c, model, layout, ids, max_new_tokens=N_NEW, keep_logits=True) for _ in range(4)]
        elapsed = time.perf_counter() - t0
    for out in outs:
        _same_as_plain(model, ids, out, want_tokens, want_logits)
        assert out.cached_tokens == 0 and out.prefill.stored_chunks == 0
        assert out.cache_error is not None and out.cache_error.startswith("acquire: UNAVAILABLE")
    assert fail_open_total("acquire", "UNAVAILABLE") - before == 4
    assert hf.FAIL_OPEN.counts == {("acquire", "UNAVAILABLE"): 4}  # a failed acquire skips the store
    logged = warnings_logged(caplog)
    assert len(logged) == 1, logged
    assert "acquire failed (UNAVAILABLE" in logged[0] and "serving without the cache" in logged[0]
    assert elapsed < 30  # an absent daemon fails fast (a refused connect), not after the timeout


def test_no_daemon_store_only_request_fails_open_on_the_store(tmp_path, caplog):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    ids = prompt(2 * CT, seed=23)
    want_tokens, want_logits = reference_generate(model, ids, N_NEW)
    before = fail_open_total("store", "UNAVAILABLE")
    with Client(str(tmp_path / "nobody-home.sock"), timeout=5) as c:
        for _ in range(2):
            out = generate(c, model, layout, ids, max_new_tokens=N_NEW, keep_logits=True,
                           policy=CachePolicy(no_cache=True))  # no acquire: the store is tried
            _same_as_plain(model, ids, out, want_tokens, want_logits)
            assert out.prefill.stored_chunks == 0 and out.cache_error.startswith("store: UNAVAILABLE")
    assert fail_open_total("store", "UNAVAILABLE") - before == 2
    assert len(warnings_logged(caplog)) == 1


def test_daemon_sigkilled_between_requests_then_restarted(hf_daemon, caplog):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    ids = prompt(3 * CT, seed=22)
    want_tokens, want_logits = reference_generate(model, ids, N_NEW)
    with Client(hf_daemon.socket, timeout=5) as c:
        first = generate(c, model, layout, ids, max_new_tokens=N_NEW)
        assert first.tokens == want_tokens and first.cache_error is None and first.prefill.stored_chunks == 3

        hf_daemon.stop(signal.SIGKILL)
        before = fail_open_total("acquire", "UNAVAILABLE")
        second = generate(c, model, layout, ids, max_new_tokens=N_NEW, keep_logits=True)
        _same_as_plain(model, ids, second, want_tokens, want_logits)
        assert second.cached_tokens == 0 and second.cache_error.startswith("acquire: UNAVAILABLE")
        assert fail_open_total("acquire", "UNAVAILABLE") - before == 1
        assert len(warnings_logged(caplog)) == 1
        assert not [r for r in caplog.records if r.levelno == logging.INFO]

        hf_daemon.start()
        deadline = time.monotonic() + 10  # the channel reconnects within its 500 ms backoff cap
        while True:
            out = generate(c, model, layout, ids, max_new_tokens=N_NEW)
            assert out.tokens == want_tokens  # every request is answered, while it reconnects too
            if out.cache_error is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert out.cache_error is None
        info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "works again" in r.getMessage()]
        assert info == ["kvcached hf: acquire works again"]

        hit = generate(c, model, layout, ids, max_new_tokens=N_NEW)  # stored after the restart, if not recovered
        assert hit.cached_tokens == 3 * CT - 1 and hit.tokens == want_tokens and hit.cache_error is None
    assert len(warnings_logged(caplog)) == 1


def test_store_refused_by_the_daemon_is_skipped_and_counted(hf_daemon, caplog, monkeypatch):
    """An INVALID_ARGUMENT on the store (KV that does not fit the layout: a cache-side problem
    for this request) is logged and counted, and the request is answered."""
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    ids = prompt(2 * CT + 3, seed=24)
    want_tokens, want_logits = reference_generate(model, ids, N_NEW)
    before = fail_open_total("store", "INVALID_ARGUMENT")
    with Client(hf_daemon.socket) as c:
        real_write = CacheRequest.write
        # short KV (prefill writes per layer, (keys, values) each [kv_heads, tokens, head_dim])
        monkeypatch.setattr(CacheRequest, "write", lambda self, kv: real_write(self, [(k[:, :5], v[:, :5]) for k, v in kv]))
        out = generate(c, model, layout, ids, max_new_tokens=N_NEW, keep_logits=True)
        _same_as_plain(model, ids, out, want_tokens, want_logits)
        assert out.prefill.stored_chunks == 0 and out.cache_error.startswith("store: INVALID_ARGUMENT: layer 0's KV covers 5 tokens")
        assert fail_open_total("store", "INVALID_ARGUMENT") - before == 1
        c.sync()  # the failed request's reservation was aborted on the session stream
        assert c.lookup(layout, ids) == 0 and c.stats()["reservations_active"] == 0
        monkeypatch.setattr(CacheRequest, "write", real_write)
        assert generate(c, model, layout, ids, max_new_tokens=N_NEW).prefill.stored_chunks == 2
    assert "store works again" in caplog.text


def test_lease_read_that_breaks_is_released_and_the_prompt_computed(hf_daemon, monkeypatch):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    ids = prompt(3 * CT, seed=25)
    want_tokens, want_logits = reference_generate(model, ids, N_NEW)
    with Client(hf_daemon.socket) as c:
        prefill(c, model, layout, ids)
        leases = []
        real_acquire = c.acquire_reserve

        def acquire(layout, tokens, **kw):
            req = real_acquire(layout, tokens, **kw)
            leases.append(req.lease)

            def broken_read(out, first=0):
                raise InvalidArgumentError("chunk 1 failed its checksum")  # any error while reading

            req.lease.copy_into = broken_read
            return req

        monkeypatch.setattr(c, "acquire_reserve", acquire)
        out = generate(c, model, layout, ids, max_new_tokens=N_NEW, keep_logits=True)
        _same_as_plain(model, ids, out, want_tokens, want_logits)
        assert out.cached_tokens == 0 and out.cache_error == "acquire: INVALID_ARGUMENT: chunk 1 failed its checksum"
        assert len(leases) == 1 and leases[0].released and leases[0].matched_tokens == 3 * CT
        monkeypatch.setattr(c, "acquire_reserve", real_acquire)
        assert generate(c, model, layout, ids, max_new_tokens=N_NEW).cached_tokens == 3 * CT - 1


def test_programming_errors_still_raise(tmp_path):
    model = llama()
    layout = layout_for(model, model_id="test/llama-gqa@random0", chunk_tokens=CT)
    with Client(str(tmp_path / "nobody-home.sock")) as c:
        with pytest.raises(ValueError, match="empty prompt"):
            prefill(c, model, layout, torch.tensor([], dtype=torch.long))
        other = layout_for(qwen2(), model_id="test/llama-gqa@random0", chunk_tokens=CT)  # 2 layers, not 3
        with pytest.raises(ValueError, match="make it with layout_for"):
            prefill(c, model, other, prompt(CT))


# -- sliding windows ------------------------------------------------------------------------------

SW = 40  # window shorter than the 100-token prompt (6 full chunks of 16)


def mistral(seed=3):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=SW)
    return MistralForCausalLM(cfg).eval()


def gemma3_mixed(seed=4):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           sliding_window=SW, layer_types=["sliding_attention", "full_attention"] * 2)
    return Gemma3ForCausalLM(cfg).eval()


def _all_logits(model, ids, n):
    """Every step's logits of plain greedy generation (the model's own cache)."""
    with torch.no_grad():
        logits, cache = hf._forward(model, ids.reshape(1, -1), None)
        out = []
        for _ in range(n):
            out.append(logits.clone())
            logits, cache = hf._forward(model, torch.tensor([[int(torch.argmax(logits))]]), cache)
    return out


@pytest.mark.parametrize("build", [mistral, gemma3_mixed], ids=["mistral", "gemma3-mixed"])
def test_sliding_window_shorter_than_the_prompt_is_cached_exactly(hf_daemon, caplog, build):
    model = build()
    layout = layout_for(model, model_id=f"test/{build.__name__}@random", chunk_tokens=CT)
    ids = prompt(100, seed=26)
    n_new = 24  # decoding goes on past the window's edge
    want_tokens, _ = reference_generate(model, ids, n_new)
    want_logits = _all_logits(model, ids, n_new)
    with Client(hf_daemon.socket) as c:
        miss = generate(c, model, layout, ids, max_new_tokens=n_new, keep_logits=True)
        assert miss.cache_error is None and miss.cached_tokens == 0 and miss.prefill.stored_chunks == 6
        assert miss.tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(miss.step_logits, want_logits, strict=True))  # bit-identical

        hit = generate(c, model, layout, ids, max_new_tokens=n_new, keep_logits=True)
        assert hit.cache_error is None and hit.cached_tokens == 96 and hit.prefill.stored_chunks == 0
        assert hit.tokens == want_tokens
        for a, b in zip(hit.step_logits, want_logits, strict=True):  # bit-identical here; rounding may differ
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

        # What prefill hands back is the model's own kind of cache: sliding layers hold their window.
        pre = prefill(c, model, layout, ids)
        types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * model.config.num_hidden_layers
        for t, layer in zip(types, pre.past_key_values.layers, strict=True):
            assert layer.keys.shape[2] == (SW - 1 if t == "sliding_attention" else 100)
    assert warnings_logged(caplog) == []


# -- models kvcached cannot hold ----------------------------------------------------------------


def mamba(seed=5):
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    return MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8)).eval()


def lfm2(seed=6):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    cfg = Lfm2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, layer_types=["conv", "full_attention"] * 2)
    return Lfm2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("build,why", [(mamba, "recurrent"), (lfm2, "conv")], ids=["mamba", "lfm2-hybrid"])
def test_recurrent_and_hybrid_models_are_served_without_the_cache(hf_daemon, caplog, build, why):
    model = build()
    layout = layout_for(model, model_id=f"test/{build.__name__}@random", chunk_tokens=CT)  # never fails
    ids = prompt(3 * CT, seed=27)
    want_tokens, want_logits = reference_generate(model, ids, N_NEW)
    with Client(hf_daemon.socket) as c:
        for _ in range(2):
            out = generate(c, model, layout, ids, max_new_tokens=N_NEW, keep_logits=True)
            _same_as_plain(model, ids, out, want_tokens, want_logits)
            assert out.cached_tokens == 0 and out.prefill.stored_chunks == 0
            assert out.cache_error.startswith("unsupported: ") and why in out.cache_error
    logged = warnings_logged(caplog)
    assert len(logged) == 1 and "served without the cache" in logged[0], logged
    assert hf.FAIL_OPEN.total() == 0  # nothing failed: the cache was not asked
