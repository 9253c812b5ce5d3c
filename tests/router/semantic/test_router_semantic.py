"""The semantic response cache through the real router (aiohttp, in a thread of this process)
in front of a small fake OpenAI engine: exact and paraphrased repeats are answered by the
router, traps and other tenants reach the engine, the opt-out headers work, errors are never
stored, streams are stored and replayed, and the metrics, /router/semantic and the doctor
checks see it all. The embedder is the real MiniLM (loaded once for the module)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from aiohttp import web

from kvcached.contract.keys import write_new_key
from kvcached_router.config import RouterConfigError, config_from_dict
from kvcached_router.semantic.drift import semantic_checks
from kvcached_router.semantic.exchange import (CachedAnswer, Choice, answer_from_json, answer_from_sse,
                                               cache_request, render_json, render_sse)
from kvcached_router.server import RouterService, main

LAYOUT = {"model": "fake/model@1", "num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32",
          "chunk_tokens": 4}


class WordTokenizer:
    """One token per word; a chat request is its messages' contents joined."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [sum(map(ord, w)) % 30000 for w in text.split()]}


class FakeEngine:
    """OpenAI-compatible stand-in. ``answer(question, n)`` makes the n-th answer (the default
    numbers them, so a second engine answer is told from a cached one); a question containing
    FAIL gets a 500."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.answer: Callable[[str, int], str] = lambda q, n: f"Answer {n} to: {q}"

    def questions(self) -> list[str]:
        return [_question(path, body) for path, body in self.calls]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body))
        q = _question(request.path, body)
        if "FAIL" in q:
            return web.json_response({"error": {"message": "engine fell over", "type": "internal"}}, status=500)
        text = self.answer(q, len(self.calls))
        chat = request.path.endswith("/chat/completions")
        usage = {"prompt_tokens": len(q.split()), "completion_tokens": len(text.split()),
                 "total_tokens": len(q.split()) + len(text.split())}
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
                      else {"index": 0, "text": text, "finish_reason": "stop"})
            return web.json_response({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                      "model": body["model"], "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        words = text.split(" ")
        for i, w in enumerate(words):
            piece = w + (" " if i < len(words) - 1 else "")
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            event = {"choices": [{**choice, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        await resp.write(b"data: " + json.dumps({"choices": [{**last, "finish_reason": "stop"}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/health", self.health)
        return app


def _question(path: str, body: dict) -> str:
    return body["messages"][-1]["content"] if path.endswith("/chat/completions") else body["prompt"]


class Loop:
    """An event loop in a thread serving aiohttp apps on loopback ports."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))

        async def start() -> None:
            runner = web.AppRunner(app)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            self.runners.append(runner)

        self.run(start())
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        async def stop() -> None:
            for r in reversed(self.runners):
                await r.cleanup()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def embedder():
    from kvcached_router.semantic.embed import MiniLMEmbedder

    return MiniLMEmbedder()


class Router:
    def __init__(self, loop: Loop, url: str, service: RouterService, engine: FakeEngine) -> None:
        self.loop, self.url, self.service, self.engine = loop, url, service, engine

    def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, hdrs, raw = r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            status, hdrs, raw = e.code, dict(e.headers), e.read()
        self.settle()
        return status, hdrs, raw

    def ask(self, question: str, *, stream: bool = False, headers: dict | None = None, system: str = "You help.",
            **params) -> tuple[int, dict, bytes]:
        body = {"model": "fake", "messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": question}],
                "temperature": 0, "stream": stream, **params}
        return self.post("/v1/chat/completions", body, headers)

    def settle(self) -> None:
        """Wait for the stores and shadow requests the last answer started."""
        if self.service.semantic is not None:
            self.loop.run(self.service.semantic.drain())

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read()

    def state(self) -> dict:
        return json.loads(self.get("/router/semantic"))

    def metric(self, name: str, labels: dict | None = None) -> float | None:
        return self.service.metrics.registry.get_sample_value(name, labels or {})


@pytest.fixture(scope="module")
def make_router(loop, embedder, tmp_path_factory) -> Callable[..., Router]:
    key = tmp_path_factory.mktemp("key") / "hash.key"
    write_new_key(str(key))

    def factory(semantic: dict | None = None, **top) -> Router:
        engine = FakeEngine()
        engine_url = loop.serve(engine.app())
        raw = {"hosts": [{"name": "engine", "url": engine_url}], "layout": LAYOUT, "hash_key_file": str(key),
               "tokenizer": "unused", "health_interval": 0.2, **top}
        if semantic is not None:
            raw["semantic"] = semantic
        service = RouterService(config_from_dict(raw), tokenizer=WordTokenizer(), embedder=embedder)
        url = loop.serve(service.app())
        return Router(loop, url, service, engine)

    return factory


@pytest.fixture(scope="module")
def router(make_router) -> Router:
    return make_router({"enabled": True, "shadow_rate": 0.0, "tenant_header": "X-Tenant"})


def content(raw: bytes) -> str:
    return json.loads(raw)["choices"][0]["message"]["content"]


def sse_content(raw: bytes) -> tuple[str, list[dict]]:
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return text, chunks


# -- the request and answer formats ------------------------------------------------------------------

def test_cache_request_splits_system_history_query_and_params():
    body = {"model": "m", "temperature": 0, "max_tokens": 5, "stream": True, "user": "u1",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Opening hours?"}]}
    req, why = cache_request("/v1/chat/completions", body, "t:a")
    assert why == "ok" and req.system == "Be brief." and req.query == "Opening hours?" and req.semantic
    assert "Hello" in req.context and '"max_tokens":5' in req.context and "u1" not in req.context
    same_but_streamed = {**body, "stream": False, "user": "u2"}
    assert cache_request("/v1/chat/completions", same_but_streamed, "t:a")[0].exact_key == req.exact_key
    other_turns = {**body, "messages": body["messages"][:1] + body["messages"][3:]}
    assert cache_request("/v1/chat/completions", other_turns, "t:a")[0].scope != req.scope
    assert cache_request("/v1/chat/completions", {**body, "max_tokens": 6}, "t:a")[0].scope != req.scope
    assert cache_request("/v1/chat/completions", {**body, "temperature": 0.7}, "t:a") == (None, "sampled")
    no_temperature = {k: v for k, v in body.items() if k != "temperature"}
    assert cache_request("/v1/chat/completions", no_temperature, "t:a") == (None, "sampled")  # the engine's 1.0
    assert cache_request("/v1/chat/completions", no_temperature, "t:a", default_temperature=0)[0] is not None
    assert cache_request("/v1/completions", {"model": "m", "prompt": [1, 2], "temperature": 0}, "") == \
        (None, "token_prompt")
    ends_with_assistant = {**body, "messages": body["messages"][:3]}
    req2, _ = cache_request("/v1/chat/completions", ends_with_assistant, "t:a")
    assert req2.semantic is False and req2.query == ""


def test_answers_round_trip_through_json_and_sse():
    answer = CachedAnswer("chat", (Choice("Open Settings, then  Display.\nDone.", "stop"),), '{"total_tokens":9}')
    assert answer_from_json("chat", json.dumps(render_json(answer, "m")).encode()) == answer
    sse = render_sse(answer, "m", include_usage=True)
    assert answer_from_sse("chat", sse) == answer
    assert answer_from_sse("chat", sse.replace(b"data: [DONE]\n\n", b"")) is None  # cut short: not stored
    comp = CachedAnswer("completion", (Choice(" forty-two", "length"),), "null")
    assert answer_from_sse("completion", render_sse(comp, "m")) == comp
    tool = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                 "tool_calls": [{"id": "c"}]}, "finish_reason": "tool_calls"}]}
    assert answer_from_json("chat", json.dumps(tool).encode()) is None
    assert answer_from_json("chat", b'{"error": {"message": "x"}}') is None


def test_semantic_config_is_checked():
    base = {"hosts": [{"name": "e", "url": "http://127.0.0.1:1"}], "layout": LAYOUT, "hash_key_file": "k",
            "tokenizer": "t"}
    cfg = config_from_dict(base)
    assert cfg.semantic.enabled is False and cfg.normalize_prompts is False
    assert config_from_dict({**base, "semantic": {"enabled": True, "ttl": 60}}).semantic.ttl == 60
    with pytest.raises(RouterConfigError, match="unknown \\[semantic\\] setting"):
        config_from_dict({**base, "semantic": {"enabled": True, "tll": 60}})
    with pytest.raises(RouterConfigError, match="shadow_rate"):
        config_from_dict({**base, "semantic": {"shadow_rate": 2}})


def test_calibrate_is_a_subcommand_and_serving_flags_still_parse(capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--config" not in out  # calibrate's own arguments, not the server's
    with pytest.raises(SystemExit) as e:
        main(["--listen", "127.0.0.1:1"])  # the server's flags: --config is still required
    assert e.value.code == 2 and "--config" in capsys.readouterr().err


# -- through the router ------------------------------------------------------------------------------

def test_an_exact_repeat_is_answered_by_the_router_as_json_and_as_a_stream(router):
    code, h, first = router.ask("How do I turn on dark mode?")
    assert code == 200 and "X-Semantic-Cache" not in h
    calls = len(router.engine.calls)
    code, h, again = router.ask("How  do I turn on dark mode？")  # the same once normalised
    assert code == 200 and h["X-Semantic-Cache"] == "exact"
    assert content(again) == content(first) and len(router.engine.calls) == calls
    code, h, raw = router.ask("How do I turn on dark mode?", stream=True, stream_options={"include_usage": True})
    assert code == 200 and h["X-Semantic-Cache"] == "exact" and h["Content-Type"].startswith("text/event-stream")
    text, chunks = sse_content(raw)
    assert text == content(first) and len(chunks) > 3  # replayed in pieces
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[-1]["usage"]["total_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert len(router.engine.calls) == calls


def test_a_paraphrase_is_served_and_traps_are_not(router):
    router.ask("How can I reset my password?")
    calls = len(router.engine.calls)
    code, h, raw = router.ask("How do I reset my password?")
    assert code == 200 and h["X-Semantic-Cache"].startswith("semantic; similarity=0."), h.get("X-Semantic-Cache")
    assert float(h["X-Semantic-Cache"].split("=")[1]) < 1.0
    assert content(raw).endswith("to: How can I reset my password?") and len(router.engine.calls) == calls
    for trap in ("How can I not reset my password?",  # negation
                 "How can I reset my password in 2 steps?"):  # a number
        code, h, raw = router.ask(trap)
        assert code == 200 and "X-Semantic-Cache" not in h, trap
        assert router.engine.questions()[-1] == trap
    lookups = router.state()["lookups"]
    assert lookups["semantic"]["hit"] >= 1
    assert sum(v for k, v in lookups["miss"].items() if k.startswith("guard:")) >= 1, lookups


def test_entries_never_cross_tenants_models_or_system_prompts(router):
    router.ask("What are your opening hours?", headers={"X-Tenant": "alpha"})
    calls = len(router.engine.calls)
    assert router.ask("What are your opening hours?", headers={"X-Tenant": "alpha"})[1]["X-Semantic-Cache"] == "exact"
    for kw in ({"headers": {"X-Tenant": "beta"}}, {"headers": {"X-Tenant": "alpha"}, "system": "You are terse."},
               {"headers": {"Authorization": "Bearer key-1"}}):
        code, h, _ = router.ask("What are your opening hours?", **kw)
        assert code == 200 and "X-Semantic-Cache" not in h, kw
    assert len(router.engine.calls) == calls + 3
    code, h, _ = router.ask("What are your opening hours?", headers={"Authorization": "Bearer key-2"})
    assert "X-Semantic-Cache" not in h  # another API key is another tenant
    code, h, _ = router.ask("What are your opening hours?", headers={"Authorization": "Bearer key-1"})
    assert h["X-Semantic-Cache"] == "exact"


@pytest.mark.parametrize("header", ["Cache-Control", "X-Cache-Control"])
def test_no_cache_and_no_store(router, header):
    system = f"You help ({header})."  # a scope of its own
    q = "Which plan includes priority support?"
    router.ask(q, system=system)
    n = len(router.engine.calls)
    code, h, fresh = router.ask(q, system=system, headers={header: "no-cache"})  # not served from the cache...
    assert "X-Semantic-Cache" not in h and len(router.engine.calls) == n + 1
    code, h, again = router.ask(q, system=system)  # ...but stored: the fresh answer replaced the old one
    assert h["X-Semantic-Cache"] == "exact" and content(again) == content(fresh)
    q2 = "Is there a student discount?"
    router.ask(q2, system=system, headers={header: "no-store"})
    code, h, _ = router.ask(q2, system=system)
    assert "X-Semantic-Cache" not in h and router.engine.questions()[-2:] == [q2, q2]
    assert router.metric("kvcached_router_semantic_stores_total", {"result": "no_store"}) >= 1


def test_errors_and_sampled_requests_are_never_stored(router):
    for _ in range(2):
        code, h, _ = router.ask("FAIL: what is my balance?")
        assert code == 500 and "X-Semantic-Cache" not in h
    assert router.engine.questions()[-2:] == ["FAIL: what is my balance?"] * 2
    assert router.metric("kvcached_router_semantic_stores_total", {"result": "error_status"}) >= 2
    for _ in range(2):
        code, h, _ = router.ask("Tell me a joke about cats.", temperature=0.8)
        assert code == 200 and "X-Semantic-Cache" not in h
    assert router.engine.questions()[-2:] == ["Tell me a joke about cats."] * 2
    assert router.metric("kvcached_router_semantic_lookups_total", {"outcome": "bypass", "reason": "sampled"}) >= 2


def test_a_streamed_answer_is_stored_and_served_to_a_plain_request(router):
    code, h, raw = router.ask("Where can I download my invoices?", stream=True)
    text, _ = sse_content(raw)
    assert code == 200 and "X-Semantic-Cache" not in h and text.startswith("Answer ")
    code, h, again = router.ask("Where can I download my invoices?")
    assert h["X-Semantic-Cache"] == "exact" and content(again) == text


def test_completions_are_cached_too(router):
    body = {"model": "fake", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    code, _, first = router.post("/v1/completions", body)
    code, h, again = router.post("/v1/completions", body)
    assert code == 200 and h["X-Semantic-Cache"] == "exact"
    assert json.loads(again)["choices"][0]["text"] == json.loads(first)["choices"][0]["text"]
    assert json.loads(again)["object"] == "text_completion"


def test_metrics_state_and_doctor_checks(router, capsys):
    # Four questions of one scope: at least the last three reach a matcher holding entries
    # (this test must not rely on what earlier tests of the module stored).
    for q in ("How do I export my contacts?", "How can I export my contacts?", "Where do I change my avatar?",
              "How do I change my avatar?"):
        router.ask(q)
    metrics = router.get("/metrics").decode()
    assert "semantic_similarity_distribution_bucket" in metrics
    count = router.metric("semantic_similarity_distribution_count")
    st = router.state()
    semantic_lookups = sum(v for outcome in ("semantic", "miss") for k, v in st["lookups"].get(outcome, {}).items()
                           if k not in ("no_exact", "exact_only", "empty", "no_cache"))
    assert count == semantic_lookups and count >= 3  # every lookup that reached a matcher, and only those
    assert router.metric("kvcached_router_semantic_entries") == st["cache"]["entries"] > 0
    assert router.metric("kvcached_router_semantic_bytes") == st["cache"]["bytes"] > 0
    assert st["drift"]["reference_source"] == "live" and not st["drift"]["alert"]
    checks = {c["check"]: c["verdict"] for c in semantic_checks(st)}
    assert checks == {"semantic drift": "ok", "semantic false hits": "ok"}
    capsys.readouterr()
    assert main(["doctor", "--url", router.url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in out] == [["OK", "semantic", "drift"], ["OK", "semantic", "false"]]
    assert json.loads(router.get("/router/state"))["semantic"]["entries"] == st["cache"]["entries"]


def test_the_shadow_sample_measures_false_hits(make_router):
    r = make_router({"enabled": True, "shadow_rate": 1.0})
    r.engine.answer = lambda q, n: "Go to Settings, then Security, then Reset password."
    r.ask("How can I reset my password?")
    code, h, _ = r.ask("How do I reset my password?")
    assert h["X-Semantic-Cache"].startswith("semantic")
    assert r.engine.questions()[-1] == "How do I reset my password?"  # re-run in the background
    assert r.engine.calls[-1][1].get("stream") is None
    s = r.state()["shadow"]
    assert (s["agree"], s["disagree"]) == (1, 0)
    r.engine.answer = lambda q, n: "Passwords cannot be reset online; call support."
    r.ask("How do I reset my password please?")
    s = r.state()["shadow"]
    assert (s["agree"], s["disagree"]) == (1, 1) and s["false_hit_rate"] == 0.5
    assert r.metric("kvcached_router_semantic_shadow_false_hit_rate") == 0.5


def test_semantic_off_by_default_and_normalize_prompts(make_router):
    r = make_router(normalize_prompts=True)
    assert r.service.semantic is None and r.state() == {"enabled": False}
    assert json.loads(r.get("/router/state"))["semantic"] is None
    code, h, _ = r.ask("Hello，  world。 “Quoted”")
    assert code == 200 and "X-Semantic-Cache" not in h
    assert r.engine.calls[-1][1]["messages"][-1]["content"] == 'Hello, world. "Quoted"'
    code, _, _ = r.post("/v1/completions", {"model": "fake", "prompt": "ａｂｃ　 def", "temperature": 0})
    assert r.engine.calls[-1][1]["prompt"] == "abc def"


def test_a_calibration_sets_the_thresholds_and_the_drift_reference(make_router, tmp_path, capsys):
    from kvcached_router.semantic.calibrate import Calibration

    cal = tmp_path / "calibration.json"
    Calibration(thresholds={"same": 0.5, "edit": 0.9, "reworded": 0.95}, target=0.02, model="all-MiniLM-L6-v2",
                reference_similarities=(0.97, 0.98, 0.99) * 50).save(str(cal))
    r = make_router({"enabled": True, "shadow_rate": 0.0, "calibration": str(cal), "drift_min_samples": 4,
                     "drift_window": 4})
    r.ask("How can I reset my password?")
    code, h, _ = r.ask("how do i reset my pasword")  # 0.61: served at this calibration's "same" threshold only
    assert h.get("X-Semantic-Cache", "").startswith("semantic"), h
    st = r.state()["drift"]
    assert st["reference_source"] == "calibration" and st["reference_samples"] == 150 and not st["alert"]
    for q in ("What is the weather like in Oslo?", "Recommend a good novel.", "Explain photosynthesis briefly."):
        r.ask(q)  # nothing like the near-duplicates the calibration saw
    assert r.state()["drift"]["alert"] and r.metric("kvcached_router_semantic_drift_alert") == 1.0
    assert r.metric("kvcached_router_semantic_drift_psi") > 0.25
    checks = {c["check"]: c["verdict"] for c in semantic_checks(r.state())}
    assert checks["semantic drift"] == "warn"
    capsys.readouterr()
    assert main(["doctor", "--url", r.url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["healthy"] is False and report["checks"][0]["verdict"] == "warn"


def test_a_busy_embedder_is_skipped_not_queued_behind(make_router):
    """With max_queued_lookups lookups already waiting for the embedder (0 here: always), a
    request skips the semantic path: the exact path still answers, the engine answers the rest."""
    r = make_router({"enabled": True, "shadow_rate": 0.0, "max_queued_lookups": 0})
    r.ask("How can I reset my password?")
    assert r.ask("How can I reset my password?")[1]["X-Semantic-Cache"] == "exact"
    code, h, _ = r.ask("How do I reset my password?")  # a paraphrase the semantic path would serve
    assert code == 200 and "X-Semantic-Cache" not in h
    assert r.metric("kvcached_router_semantic_lookups_total", {"outcome": "miss", "reason": "busy"}) == 2
    assert r.metric("kvcached_router_semantic_stores_total", {"result": "not_indexed_busy"}) == 2
    assert r.metric("semantic_similarity_distribution_count") == 0


def test_the_exact_path_alone_loads_no_model(make_router):
    r = make_router({"enabled": True, "match": False})
    assert r.service.semantic.embedder is None and not r.service.semantic.cache.semantic
    r.ask("How can I reset my password?")
    assert r.ask("How  can I reset my password？")[1]["X-Semantic-Cache"] == "exact"
    code, h, _ = r.ask("How do I reset my password?")
    assert code == 200 and "X-Semantic-Cache" not in h
    assert r.metric("kvcached_router_semantic_lookups_total", {"outcome": "miss", "reason": "exact_only"}) == 2
    assert r.metric("semantic_similarity_distribution_count") == 0
    code, h, _ = r.ask("How can I reset my password?", headers={"X-Tenant": "other"})
    assert h["X-Semantic-Cache"] == "exact"  # no tenant_header configured: the header is just a header
