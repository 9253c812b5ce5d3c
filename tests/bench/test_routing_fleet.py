"""The routing bench's simulated fleet (bench/routing): real daemons behind simulated hosts.

A 2-host SimFleet: the same chat prompt twice to host 0 hits its daemon (cached tokens = the full
chunks of the shared prefix), host 1 has nothing cached; streaming works; the tokenizer builds
offline; the conversation trace's workload shares prefixes; a killed daemon makes the simhost
fail open (HTTP 200, counted) and a restarted one serves the cache again; the KV events reach a
subscriber; teardown leaves no process and no /dev/shm segment.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from bench.routing.fleet import SimFleet
from bench.routing.tokenizer import WORD_ID_OFFSET, build_tokenizer, load_tokenizer
from bench.routing.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.environ.get("KVCACHED_TRACES", os.path.join(ROOT, "..", "shared", "traces", "mooncake-fast25"))
EXCERPT = os.path.join(ROOT, "tests", "data", "mooncake-fast25-excerpt")
CONVERSATION = next(p for p in (os.path.join(TRACES, "conversation_trace.jsonl"),
                                os.path.join(EXCERPT, "conversation_trace.jsonl")) if os.path.exists(p))
CT = 16  # the fleet's chunk_tokens


def post(url: str, body: dict, timeout: float = 30.0) -> tuple[dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return json.load(r), dict(r.headers)


def post_stream(url: str, body: dict, timeout: float = 30.0) -> list[str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return [line.decode().rstrip("\n") for line in r if line.strip()]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload(CONVERSATION, 32, limit=400)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    f = SimFleet(2, str(work), prefill_tps=200000, decode_tps=2000, chunk_tokens=CT)
    with f:
        yield f
    pids = [p for h in f._hosts for p in h.daemon_pids] + [h.simhost.pid for h in f._hosts]
    for pid in pids:  # every process it started is gone (reaped, so not even a zombie)
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert f.leftover_segments == []
    left = [n for n in os.listdir("/dev/shm") if n.startswith("kvcached.")
            and any(f".{pid}." in n for pid in pids)]
    assert left == []


def pair_with_shared_prefix(wl: Workload):
    """A request and its predecessor in the same conversation sharing >= 2 blocks."""
    preds = wl.predecessors()
    for i, p in enumerate(preds):
        if p is not None and wl.shared_prefix_tokens(wl.requests[p], wl.requests[i], chat=True) >= 3 * CT:
            return wl.requests[p], wl.requests[i]
    raise AssertionError("no multi-turn pair in the trace excerpt")


def test_the_tokenizer_builds_offline_and_renders_the_chat_template(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    d = build_tokenizer(str(tmp_path / "tok"), vocab_size=1000)
    stamp = os.stat(os.path.join(d, "tokenizer.json")).st_mtime_ns
    assert build_tokenizer(str(tmp_path / "tok"), vocab_size=1000) == d  # reused, not rebuilt
    assert os.stat(os.path.join(d, "tokenizer.json")).st_mtime_ns == stamp
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(d)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok("w0 w5 w999")["input_ids"] == [WORD_ID_OFFSET, WORD_ID_OFFSET + 5, WORD_ID_OFFSET + 999]
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        assert "chat_template" in json.load(f)
    text = tok.apply_chat_template([{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|system|> w1 w2\n<|user|> w3\n<|assistant|>"
    ids = tok(text)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # no BOS added either way
    assert len(ids) == 6 and ids[1:3] == [WORD_ID_OFFSET + 1, WORD_ID_OFFSET + 2]


def test_the_workload_keeps_the_traces_prefix_sharing(workload, fleet):
    tok = load_tokenizer(fleet.tokenizer_dir)
    a, b = pair_with_shared_prefix(workload)
    ta, tb = workload.token_ids(a, chat=True), workload.token_ids(b, chat=True)
    def render(r):
        return tok.apply_chat_template(workload.messages(r), tokenize=False, add_generation_prompt=True)

    assert tok(render(a))["input_ids"] == ta and tok(render(b))["input_ids"] == tb  # the real tokenizer agrees
    assert tok(workload.prompt(b))["input_ids"] == workload.token_ids(b)
    shared = workload.shared_prefix_tokens(a, b, chat=True)
    assert shared >= CT and ta[:CT] == tb[:CT]  # at least one chunk in common
    # The rendered follow-up starts with the predecessor's rendered text up to the end of their
    # shared blocks (system block, then the shared user blocks).
    k = next(i for i, (x, y) in enumerate(zip(a.hash_ids + (-1,), b.hash_ids + (-2,))) if x != y)
    assert k >= 2
    common = (f"<|system|> {workload.block_text(a.hash_ids[0])}\n<|user|> "
              + " ".join(workload.block_text(h, a.block_words[i]) for i, h in enumerate(a.hash_ids[1:k], 1)))
    assert render(a).startswith(common) and render(b).startswith(common)
    # Equal hash ids, equal text; the first block (the system prompt) is every request's.
    assert workload.block_text(a.hash_ids[0]) == workload.block_text(b.hash_ids[0])
    assert all(r.hash_ids[0] == 0 for r in workload.requests)
    # Users get whole conversations, in trace order.
    sessions = workload.user_sessions(20)
    owner = {r.index: s.user for s in sessions for r in s.requests}
    assert sorted(owner) == list(range(len(workload.requests)))
    for conv in workload.conversations():
        assert len({owner[i] for i in conv}) == 1
    for s in sessions:
        ts = [r.timestamp_s for r in s.requests]
        assert ts == sorted(ts) and all(t >= 0 for t in s.think_times_s)
    assert all(1 <= r.output_tokens <= 16 for r in workload.requests)


def test_a_repeated_prompt_hits_the_host_that_served_it_and_only_that_one(workload, fleet):
    a, b = pair_with_shared_prefix(workload)
    h0, h1 = fleet.url(0), fleet.url(1)
    body = workload.chat_body(a, "sim")
    n = len(workload.token_ids(a, chat=True))
    first, _ = post(h0 + "/v1/chat/completions", body)
    assert first["usage"]["prompt_tokens"] == n and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["object"] == "chat.completion" and first["choices"][0]["finish_reason"] == "length"
    again, headers = post(h0 + "/v1/chat/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n // CT * CT  # every full chunk
    assert headers["X-Cached-Tokens"] == str(n // CT * CT) and headers["X-Simhost"] == "host0"
    # The follow-up turn: its cached prefix is the full chunks of what it shares with the first.
    shared = workload.shared_prefix_tokens(a, b, chat=True)
    follow, _ = post(h0 + "/v1/chat/completions", workload.chat_body(b, "sim"))
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // CT * CT > 0
    other, _ = post(h1 + "/v1/chat/completions", body)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    s0 = get(h0 + "/stats")
    assert s0["requests"] >= 3 and s0["cached_tokens"] >= n // CT * CT and s0["verify_mismatches"] == 0
    assert s0["daemon_errors"] == 0 and s0["in_flight"] == 0 and s0["queued_prefill_tokens"] == 0
    assert get(h0 + "/health")["status"] == "ok"


def test_streaming_chat_and_completions(workload, fleet):
    r = workload.requests[5]
    url = fleet.url(1)
    body = {**workload.chat_body(r, "sim", stream=True), "max_tokens": 5, "stream_options": {"include_usage": True}}
    for attempt in range(2):
        lines = post_stream(url + "/v1/chat/completions", body)
        assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
        events = [json.loads(x[6:]) for x in lines[:-1]]
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        pieces = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
        assert len([p for p in pieces if p]) == 5 and events[-2]["choices"][0]["finish_reason"] == "length"
        usage = events[-1]["usage"]
        n = len(workload.token_ids(r, chat=True))
        assert usage["prompt_tokens"] == n
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if attempt == 0:  # new to host 1 but for the shared system prompt (sent there before)
            assert cached < n // CT * CT
        else:
            assert cached == n // CT * CT
    lines = post_stream(url + "/v1/completions", {**workload.completion_body(r, "sim", stream=True), "max_tokens": 3})
    events = [json.loads(x[6:]) for x in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(events) == 3 and events[0]["object"] == "text_completion"
    plain, _ = post(url + "/v1/completions", workload.completion_body(r, "sim"))
    assert plain["usage"]["prompt_tokens"] == len(workload.token_ids(r))
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == len(workload.token_ids(r)) // CT * CT


def test_kv_events_reach_a_subscriber(workload, fleet):
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(fleet.hosts[0].events_endpoint)
        time.sleep(0.3)  # the slow-joiner: let the subscription reach the publisher
        r = workload.requests[7]
        post(fleet.url(0) + "/v1/completions", workload.completion_body(r, "sim"))
        ids = workload.token_ids(r)
        deadline = time.monotonic() + 10
        stored = []
        while time.monotonic() < deadline and not stored:
            if sub.poll(500):
                _topic, seq, payload = sub.recv_multipart()
                batch = msgspec.msgpack.decode(payload)
                stored += [e for e in batch[1] if e["type"] == "BlockStored"
                           and e["token_ids"][:CT] == ids[:CT]]
        assert stored and stored[0]["block_size"] == CT and stored[0]["medium"] == "CPU"
    finally:
        sub.close(0)
    d = fleet.hosts[0]
    assert d.domain == "default" and os.path.exists(d.hash_key_file) and d.layout.chunk_tokens == CT
    cfg = json.load(open(fleet.write_config(os.path.join(fleet.workdir, "hosts.json"))))
    assert [h["url"] for h in cfg["hosts"]] == [fleet.url(0), fleet.url(1)]


def test_a_dead_daemon_fails_open_and_a_restarted_one_serves_again(workload, fleet):
    url = fleet.url(1)
    r = workload.requests[9]
    body = workload.chat_body(r, "sim")
    post(url + "/v1/chat/completions", body)  # stored on host 1
    before = get(url + "/stats")
    fleet.kill_daemon(1, signal.SIGKILL)
    out, _ = post(url + "/v1/chat/completions", body)  # HTTP 200 all the same
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = get(url + "/stats")
    assert after["daemon_errors"] > before["daemon_errors"] and after["failed_open_requests"] >= 1
    assert after["daemon_up"] is False and get(url + "/health")["daemon"] == "down"
    fleet.start_daemon(1)  # empty (no NVMe tier): a miss, stored again, then a hit
    deadline = time.monotonic() + 15
    while True:
        out, _ = post(url + "/v1/chat/completions", body)
        if out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(workload.token_ids(r, chat=True)) // CT * CT
    assert get(url + "/stats")["daemon_up"] is True
