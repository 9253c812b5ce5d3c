"""Question: what does the kvcached connector cost a vLLM engine that gets no hit, and how much of
vLLM's scheduler thread does it take per request?

Two vLLM CPU engines alive side by side, each in its own process (JSON over stdin/stdout): ``plain``
(no connector) and ``kvc`` (``KvcachedConnector`` on a real daemon). A random-weight Llama (4
layers, hidden 512, 8 heads, 2 KV heads, float32; ``kvcached_client.vllm.random_model``), vLLM
0.32 CPU, eager, block size 128.

* **Throughput, all misses**: each round sends 64 new prompts at once (``LLM.generate`` of 64
  requests, random token ids never seen before, 512 tokens each, 32 output tokens, greedy,
  ignore_eos), first to one engine then the other (the order alternates per round), and times the
  batch. The ``kvc`` engine looks every prompt up, misses, and stores its 4 chunks (the copies
  into the pool and the commits are inside the timed run). Reported: requests/s per engine,
  median over rounds, and kvc/plain (target >= 0.97).
* **The scheduler thread**: in ``kvc`` every connector hook that runs on vLLM's scheduler thread
  is timed (``on_new_request``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``update_connector_output``, ``request_finished``); per request, the
  connector's own account (``SchedulerSide.request_seconds``: the time spent for that request)
  p50/p99 for the misses above and for hits (the same prompts again after
  ``reset_prefix_cache``: every whole chunk loaded from kvcached), and the total hook time divided
  by the requests (which also counts the per-step work no request owns). Targets: <= 0.1 ms p50,
  <= 0.5 ms p99. Per hook, every call's wall time beside the scheduler thread's own CPU time in
  it (a wall far above the CPU is a wait: for the GIL, or for a core). The connector's one wait,
  on a step vLLM scheduled nothing for while lookups were in flight (``_wait_idle``, inside
  ``build_connector_meta``), is reported apart and not counted as a request's time.

Run:   .venv/bin/python bench/vllm_overhead.py            (~3 min on an idle 2-core box)
       .venv/bin/python bench/vllm_overhead.py --quick    (2 layers, 16 prompts, 2 rounds)
The CPU seconds of each engine process and of the daemon per round are recorded too: on a 2-core
box whatever the daemon and the connector's threads use is taken from vLLM's own threads.

Output: bench/results/vllm_overhead.json (``vllm_overhead.quick.json`` for --quick)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import RESULTS_DIR, percentile, write_json
from bench.harness.daemon import Daemon
from bench.vllm_ttft import SCHEDULER_HOOKS, Engine, _HookTimer, kv_transfer, worker_channel

BLOCK = 128


def worker_main(args: argparse.Namespace) -> int:
    send = worker_channel()

    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw = {}
        if args.socket:
            kw["kv_transfer_config"] = kv_transfer(args.socket)
        llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_bytes, enable_prefix_caching=True,
                  max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=64, seed=0, **kw)
        sched = timer = None
        if args.socket:
            sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
            # the idle wait (inside build_connector_meta) is timed on its own as well, to be told apart
            timer = _HookTimer(sched, tuple(h for h in (*SCHEDULER_HOOKS, "_wait_idle") if hasattr(sched, h)),
                               per_call=True)
    except BaseException:  # noqa: BLE001
        send({"error": traceback.format_exc()})
        return 1
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            if cmd.get("reset"):
                assert llm.reset_prefix_cache()
            sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
            done0 = len(sched.request_seconds) if sched else 0
            stats0 = dict(sched.stats) if sched else {}
            idle0 = getattr(sched, "idle_wait_seconds", 0.0) if sched else 0.0
            if timer:
                timer.clear()
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            reply = {"wall_s": wall, "num_cached": [o.num_cached_tokens for o in outs]}
            if sched:
                reply["request_s"] = list(sched.request_seconds)[done0:]
                reply["hooks_s"] = {k: v for k, v in timer.by_hook.items() if k != "_wait_idle"}
                # build_connector_meta's wait on steps vLLM scheduled nothing for (the engine had no
                # work: lookups in flight), counted apart from the hooks' own time
                reply["idle_wait_s"] = getattr(sched, "idle_wait_seconds", 0.0) - idle0
                reply["hooks_s"]["build_connector_meta"] -= reply["idle_wait_s"]
                reply["hook_calls"] = timer.calls
                reply["stats"] = {k: v - stats0.get(k, 0) for k, v in sched.stats.items() if v != stats0.get(k, 0)}
            send(reply)
        except Exception:  # noqa: BLE001
            send({"error": traceback.format_exc()})
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-batched-tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    from bench._common import install_sigterm_exit

    install_sigterm_exit()
    quick = args.quick
    n_req, prompt_len, out_tokens = (16, 512, 16) if quick else (64, 512, 32)
    rounds = args.rounds or (2 if quick else 9)
    shape = dict(layers=2, hidden=256, heads=8, kv_heads=2) if quick else dict(layers=4, hidden=512, heads=8, kv_heads=2)
    head_dim = shape["hidden"] // shape["heads"]
    token_bytes = 2 * shape["layers"] * shape["kv_heads"] * head_dim * 4
    chunks = n_req * (prompt_len // BLOCK) * (rounds + 1) + 64
    tmp = tempfile.mkdtemp(prefix="kvc-vllm-overhead-")
    from kvcached_client.vllm.random_model import build

    model = build(os.path.join(tmp, "model"), layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                  kv_heads=shape["kv_heads"], vocab=8192, intermediate=4 * shape["hidden"], max_positions=4096)
    cfg = {"max_model_len": prompt_len + out_tokens + BLOCK, "max_batched_tokens": 8192,
           "kv_cache_bytes": 2 * n_req * (prompt_len + out_tokens + BLOCK) * token_bytes + (64 << 20)}
    settings = {"pool_bytes": chunks * BLOCK * token_bytes, "nvme_bytes": chunks * BLOCK * token_bytes + (1 << 30),
                "log_level": "warning"}
    with Daemon.temp(settings, prefix="kvc-bench-vllm-overhead-") as daemon:
        engines = {"plain": Engine("plain", model, None, cfg, tmp, script=os.path.abspath(__file__)),
                   "kvc": Engine("kvc", model, daemon.socket, cfg, tmp, script=os.path.abspath(__file__))}
        try:
            rows, miss_s, hit_s, hooks_miss, hooks_hit, hit_cached, cpu, calls, idle = _measure(
                engines, n_req, prompt_len, out_tokens, rounds, daemon.proc.pid)
        finally:
            for e in engines.values():
                e.close()
    return _report(args, quick, n_req, prompt_len, out_tokens, rounds, shape, rows, miss_s, hit_s, hooks_miss,
                   hooks_hit, hit_cached, cpu, calls, idle)


def _measure(engines: dict, n_req: int, prompt_len: int, out_tokens: int, rounds: int, daemon_pid: int) -> tuple:
    for e in engines.values():
        e.wait_ready()
    rng = random.Random(7)

    def batch() -> list[list[int]]:
        return [[rng.randrange(3, 8192) for _ in range(prompt_len)] for _ in range(n_req)]

    for e in engines.values():  # warm-up: kernels, allocator, the connector's session and pool mapping
        e.call(op="gen", prompts=batch()[:4], max_tokens=4)
    rows: dict[str, list[float]] = {"plain": [], "kvc": []}
    miss_s: list[float] = []
    hit_s: list[float] = []
    hooks_miss: list[float] = []
    hooks_hit: list[float] = []
    hit_cached: list[int] = []
    # every hook call's (wall, thread CPU) seconds, all-miss and all-hit rounds apart; and the
    # scheduler thread's idle waits (steps with nothing scheduled while lookups were in flight)
    calls: dict[str, dict[str, list]] = {"miss": {}, "hit": {}}
    idle: dict[str, list[float]] = {"miss": [], "hit": []}
    # CPU seconds per all-miss round: each engine process, and the daemon during kvc's rounds (on
    # this 2-core box whatever the daemon and the connector's threads use is taken from vLLM).
    cpu: dict[str, list[float]] = {"plain": [], "kvc": [], "daemon": []}
    for r in range(rounds):
        prompts = batch()
        order = ("plain", "kvc") if r % 2 == 0 else ("kvc", "plain")
        for name in order:
            c0, d0 = cpu_seconds(engines[name].info["pid"]), cpu_seconds(daemon_pid)
            rep = engines[name].call(op="gen", prompts=prompts, max_tokens=out_tokens)
            cpu[name].append(cpu_seconds(engines[name].info["pid"]) - c0)
            if name == "kvc":
                cpu["daemon"].append(cpu_seconds(daemon_pid) - d0)
            rows[name].append(n_req / rep["wall_s"])
            if name == "kvc":
                assert sum(rep["num_cached"]) == 0, rep["num_cached"]  # all misses
                miss_s += rep["request_s"]
                hooks_miss.append(sum(rep["hooks_s"].values()) / n_req)
                idle["miss"].append(rep["idle_wait_s"])
                for k, v in rep["hook_calls"].items():
                    calls["miss"].setdefault(k, []).extend(v)
        rep = engines["kvc"].call(op="gen", prompts=prompts, max_tokens=1, reset=True)  # all hits
        hit_s += rep["request_s"]
        hooks_hit.append(sum(rep["hooks_s"].values()) / n_req)
        idle["hit"].append(rep["idle_wait_s"])
        for k, v in rep["hook_calls"].items():
            calls["hit"].setdefault(k, []).extend(v)
        hit_cached += rep["num_cached"]
        print(f"round {r + 1}/{rounds}: plain {rows['plain'][-1]:.2f} req/s, kvc {rows['kvc'][-1]:.2f} req/s",
              flush=True)
    return rows, miss_s, hit_s, hooks_miss, hooks_hit, hit_cached, cpu, calls, idle


def _hook_table(calls: dict[str, list]) -> dict[str, dict[str, float]]:
    """Per hook: calls, wall and thread-CPU p50/p99/max in ms."""
    out = {}
    for name, pairs in sorted(calls.items()):
        wall = sorted(w for w, _ in pairs)
        cpu = sorted(c for _, c in pairs)
        out[name] = {"calls": len(pairs), "wall_p50": percentile(wall, 50) * 1e3, "wall_p99": percentile(wall, 99) * 1e3,
                     "wall_max": wall[-1] * 1e3, "cpu_p50": percentile(cpu, 50) * 1e3,
                     "cpu_p99": percentile(cpu, 99) * 1e3, "cpu_max": cpu[-1] * 1e3}
    return out


def _report(args, quick, n_req, prompt_len, out_tokens, rounds, shape, rows, miss_s, hit_s, hooks_miss, hooks_hit,
            hit_cached, cpu, calls, idle) -> int:  # noqa: ANN001
    med = {k: statistics.median(v) for k, v in rows.items()}
    miss_s, hit_s = sorted(miss_s), sorted(hit_s)
    ms = lambda xs, q: percentile(xs, q) * 1e3  # noqa: E731
    result = {
        "config": {"requests": n_req, "prompt_tokens": prompt_len, "output_tokens": out_tokens, "rounds": rounds,
                   "model": shape, "load_mode": "auto (sync on CPU)"},
        "throughput_req_s": {"plain": rows["plain"], "kvc": rows["kvc"], "median": med,
                             "ratio_kvc_over_plain": med["kvc"] / med["plain"]},
        "scheduler_thread_ms": {
            "miss_p50": ms(miss_s, 50), "miss_p99": ms(miss_s, 99), "hit_p50": ms(hit_s, 50), "hit_p99": ms(hit_s, 99),
            "all_hooks_per_request_miss_median": statistics.median(hooks_miss) * 1e3,
            "all_hooks_per_request_hit_median": statistics.median(hooks_hit) * 1e3,
            "requests": {"miss": len(miss_s), "hit": len(hit_s)}},
        "hooks_ms": {"miss": _hook_table(calls["miss"]), "hit": _hook_table(calls["hit"])},
        "idle_wait_ms_per_round": {k: [x * 1e3 for x in v] for k, v in idle.items()},
        "hit_tokens_per_request_median": statistics.median(hit_cached),
        "cpu_seconds_per_round": {"samples": cpu, "median": {k: statistics.median(v) for k, v in cpu.items()}},
        "targets": {"throughput_ratio_ge_0.97": med["kvc"] / med["plain"] >= 0.97,
                    "scheduler_p50_le_0.1ms": max(ms(miss_s, 50), ms(hit_s, 50)) <= 0.1,
                    "scheduler_p99_le_0.5ms": max(ms(miss_s, 99), ms(hit_s, 99)) <= 0.5},
    }
    name = "vllm_overhead.quick.json" if quick else "vllm_overhead.json"
    path = write_json(name.removesuffix(".json"), result, args.out)
    st = result["scheduler_thread_ms"]
    print(f"throughput, {n_req} concurrent all-miss requests: kvc/plain {result['throughput_req_s']['ratio_kvc_over_plain']:.3f} "
          f"({med['kvc']:.2f} vs {med['plain']:.2f} req/s, medians of {rounds})")
    print(f"scheduler thread per request: miss p50 {st['miss_p50']:.3f} ms p99 {st['miss_p99']:.3f} ms; "
          f"hit p50 {st['hit_p50']:.3f} ms p99 {st['hit_p99']:.3f} ms; all hooks / request: miss "
          f"{st['all_hooks_per_request_miss_median']:.3f} ms, hit {st['all_hooks_per_request_hit_median']:.3f} ms")
    for kind in ("miss", "hit"):
        for name, h in result["hooks_ms"][kind].items():  # build_connector_meta's figures include _wait_idle's
            print(f"  {kind:4s} {name:28s} {h['calls']:6d} calls  wall p50 {h['wall_p50']:.3f} p99 {h['wall_p99']:.3f} "
                  f"max {h['wall_max']:.2f} ms   thread CPU p50 {h['cpu_p50']:.3f} p99 {h['cpu_p99']:.3f} ms")
    print(f"idle waits (steps with nothing scheduled, lookups in flight), ms per round: miss "
          f"{[round(x, 1) for x in result['idle_wait_ms_per_round']['miss']]}, hit "
          f"{[round(x, 1) for x in result['idle_wait_ms_per_round']['hit']]}")
    c = result["cpu_seconds_per_round"]["median"]
    print(f"CPU seconds per all-miss round (medians): plain engine {c['plain']:.1f}, kvc engine {c['kvc']:.1f}, "
          f"daemon during kvc's round {c['daemon']:.1f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
