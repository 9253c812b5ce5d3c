"""The routing bench (issue 18): Locust users replay the Mooncake conversation trace through
kvcached-router onto simulated hosts, one run per policy on the same workload, side by side.

    python bench/routing/run.py                  # 1000 users, spawn rate 50, every policy
    python bench/routing/run.py --quick          # 100 users for 60 s, 3 hosts, kvcached only (CI)

**The engines are simulated; the cache work is real** (bench/routing/README.md): each host is a
real kvcached daemon publishing KV events, behind simhost.py, which spends prefill time on the
tokens its daemon did not have (``--prefill-tps``) on one simulated accelerator per host.

Per policy, on a fresh fleet (empty caches) and a fresh router (``audit = true``: each route
is checked against every daemon's Lookup at routing time):

* hit rate per ``--window`` s window, from the hosts' realised cached tokens (their /stats);
  fluctuation = max |window - mean| / mean over the steady-state windows (after ``--warmup``);
* the same for the **ideal** of the same requests: what one host with an unbounded cache would
  have served (every full chunk some earlier request of the replay already held), per window,
  from the request log. Its fluctuation is the workload's own: with ~100-150 requests of very
  different lengths per window, which requests land in a window moves the hit rate by tens of
  percent whatever the router does. ``hit_over_ideal`` per window (realised / ideal) is the
  routing's and the caches' part, with the workload's mix divided out;
* wrong routes: another healthy host within the load bound held at least one more chunk
  (the router's audit, against the daemons, not its own index);
* TTFT p50/p90/p99 (first response byte at the Locust user), requests/s, the busiest and
  least busy host's share of requests, the box's CPU use.

Writes bench/results/routing.json (``routing.quick.json``) and a PNG of hit rate and TTFT over
time per policy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench._common import RESULTS_DIR, machine_info, save_figure, subplots, write_json
from bench.harness.daemon import BIN
from bench.harness.ports import free_ports
from bench.routing.fleet import SimFleet, to_toml
from bench.routing.workload import Workload, trace_path

HERE = os.path.dirname(os.path.abspath(__file__))

ALL_POLICIES = ("kvcached", "longest_prefix", "round_robin", "least_loaded", "prefix_hash")
TARGETS = {"fluctuation_max": 0.05, "wrong_route_max": 0.001, "hit_over_oracle_min": 0.95,
           "busiest_over_least_max": 1.5, "ttft_p90_over_round_robin_max": 0.5, "ttft_p90_over_prefix_hash_max": 1.0}


def cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_policy(policy: str, args: argparse.Namespace, work: str) -> dict:
    root = os.path.join(work, policy)
    os.makedirs(root)
    with SimFleet(args.hosts, root, prefill_tps=args.prefill_tps, decode_tps=args.decode_tps) as fleet:
        port = free_ports(1)[0]
        cfg = os.path.join(root, "router.toml")
        with open(cfg, "w") as f:
            f.write(to_toml(fleet.kvcached_router_config(policy=policy, listen=f"127.0.0.1:{port}", audit=True,
                                                         load_factor=args.load_factor)))
        router = subprocess.Popen([os.path.join(BIN, "kvcached-router"), "--config", cfg],
                                  stdout=open(os.path.join(root, "router.log"), "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if json.load(urllib.request.urlopen(url + "/health", timeout=2))["healthy_hosts"]:
                    break
            except OSError:
                pass
            if router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start: {open(os.path.join(root, 'router.log')).read()[-2000:]}")
            time.sleep(0.2)
        warm = prewarm(url, args.prewarm) if args.prewarm else {}
        log_path = os.path.join(root, "requests.jsonl")
        env = dict(os.environ, ROUTING_USERS=str(args.users), ROUTING_TIME_SCALE=str(args.time_scale),
                   ROUTING_LOG=log_path, ROUTING_LIMIT=str(args.limit or 0), ROUTING_SKIP=str(args.prewarm))
        locust = subprocess.Popen(
            [os.path.join(BIN, "locust"), "-f", os.path.join(HERE, "locustfile.py"), "--headless", "--users",
             str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", f"{args.seconds}s", "--host", url,
             "--only-summary", "--stop-timeout", "5", "--csv", os.path.join(root, "locust")],
            stdout=open(os.path.join(root, "locust.log"), "w"), stderr=subprocess.STDOUT, env=env)
        windows = []
        busy0, total0 = cpu_jiffies()
        prev = [fleet.stats(k) for k in range(args.hosts)]
        t_start = time.time()
        while locust.poll() is None:
            time.sleep(args.window)
            now = [fleet.stats(k) for k in range(args.hosts)]
            d_prompt = sum(n["prompt_tokens"] - p["prompt_tokens"] for n, p in zip(now, prev))
            d_cached = sum(n["cached_tokens"] - p["cached_tokens"] for n, p in zip(now, prev))
            d_req = [n["requests"] - p["requests"] for n, p in zip(now, prev)]
            windows.append({"t": time.time() - t_start, "prompt_tokens": d_prompt, "cached_tokens": d_cached,
                            "hit_rate": d_cached / d_prompt if d_prompt else None, "requests_per_host": d_req})
            prev = now
        busy1, total1 = cpu_jiffies()
        m = scrape(url + "/metrics")
        wrong_samples = json.load(urllib.request.urlopen(url + "/router/decisions?wrong=1&limit=20", timeout=10))
        router.send_signal(signal.SIGTERM)
        router.wait(30)
        rows = [json.loads(x) for x in open(log_path)] if os.path.exists(log_path) else []
        final = [fleet.stats(k) for k in range(args.hosts)]
    t0 = min((r["t"] for r in rows), default=t_start)
    steady = [w for w in windows if w["t"] > args.warmup and w["hit_rate"] is not None][:-1] or \
        [w for w in windows if w["hit_rate"] is not None]
    rates = [w["hit_rate"] for w in steady]
    mean = statistics.fmean(rates) if rates else float("nan")
    fluct = max(abs(r - mean) / mean for r in rates) if rates and mean else float("nan")
    steady_rows = [r for r in rows if r["t"] - t0 > args.warmup]
    ttft = [r["ttft_ms"] for r in steady_rows if r["ok"]]
    per_host = [sum(w["requests_per_host"][k] for w in steady) for k in range(args.hosts)]
    ideal = ideal_windows(rows, args.prewarm, t_start, args.window, args.warmup)
    audited, wrong = m.get("kvcached_router_audited_routes_total", 0.0), m.get("kvcached_router_wrong_routes_total", 0.0)
    prompt_total = sum(s["prompt_tokens"] for s in final)
    return {
        "policy": policy, "prewarm": warm, "windows": windows, "steady_windows": len(steady), "hit_rate_steady_mean": mean,
        "hit_rate_fluctuation": fluct, "hit_rate_overall": sum(s["cached_tokens"] for s in final) / prompt_total
        if prompt_total else None,
        "ideal": ideal, "ideal_hit_rate_fluctuation": ideal["ideal_hit_rate_fluctuation"],
        "hit_over_ideal_fluctuation": ideal["hit_over_ideal_fluctuation"], "hit_over_ideal_mean": ideal["hit_over_ideal_mean"],
        "hit_over_ideal_not_load_moved_fluctuation": ideal["hit_over_ideal_not_load_moved_fluctuation"],
        "load_moved_ideal_share": ideal["load_moved_ideal_share"],
        "requests": len(rows), "failed_requests": sum(1 for r in rows if not r["ok"]),
        "requests_per_s": len(steady_rows) / max(args.seconds - args.warmup, 1),
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "p99": percentile(ttft, 0.99)},
        "ttft_p50_by_window": [statistics.median([r["ttft_ms"] for r in rows if w["t"] - args.window < r["t"] - t0 <= w["t"]] or [float("nan")]) for w in windows],
        "requests_per_host_steady": per_host,
        "busiest_over_least_busy": max(per_host) / min(per_host) if per_host and min(per_host) else None,
        "audited_routes": audited, "wrong_routes": wrong, "wrong_route_rate": wrong / audited if audited else None,
        "routes_by_reason": _by_reason(m),
        "wrong_route_samples": wrong_samples,
        "daemon_errors": sum(s.get("daemon_errors", 0) for s in final),
        # what a realised/ideal dip comes from when it is not the routing: chunks a full pool
        # did not take, requests served without the cache, time spent queued for a prefill
        "hosts": {key: sum(s.get(key, 0) for s in final) for key in (
            "stored_chunks", "not_stored_tokens", "failed_open_requests", "verify_mismatches", "queue_wait_s")},
        "cpu_busy_fraction": (busy1 - busy0) / max(total1 - total0, 1),
    }


def _trace_chunks(limit: int, chunk_tokens: int) -> Callable[[int], list[int]]:
    wl = Workload(trace_path(), skip=0, limit=limit)

    def chunks(idx: int) -> list[int]:
        toks = wl.token_ids(wl.requests[idx], chat=True)
        out, h = [], 0
        for k in range(len(toks) // chunk_tokens):
            h = hash((h, tuple(toks[k * chunk_tokens:(k + 1) * chunk_tokens])))
            out.append(h)
        return out
    return chunks


def ideal_windows(rows: list[dict], prewarm: int, t_start: float, window: float, warmup: float,
                  chunk_tokens: int = 16, chunks_of: Callable[[int], list[int]] | None = None) -> dict:
    """Per ``window``, the realised and the ideal hit rate of the requests the users sent.

    The ideal of a request: its leading full chunks that the prewarm, or a user's request whose
    prefill was done before this request's was, also held in full, on one host with an unbounded
    cache: the most any routing could serve. "Done before" is what a cache can serve at all: a
    chunk exists once the request computing it has prefilled (the first token marks that; the
    host stores right after its prefill), so a request sent earlier but still queued or
    prefilling when this one is served helps no cache. Ordering by send time instead would
    count those chunks too, and then the realised/ideal ratio would move with how loaded the
    box is (more requests overlap when prefills queue), not with the routing. ``rows`` are the
    locustfile's log lines (``t``, ``ttft_ms``, ``ok``, ``prompt_tokens``, ``cached_tokens``,
    ``trace_index``); the last window (cut short by the run's end) is left out, as are the
    windows before ``warmup``. Windows are by send time. ``chunks_of(i)``: the chained chunk
    hashes of trace request ``i`` (default: the trace's, rendered as the users send them).
    """
    seen: set[int] = set()
    chunks = chunks_of or _trace_chunks(prewarm + max((r["trace_index"] for r in rows), default=0) + 1, chunk_tokens)

    for i in range(prewarm):
        seen.update(chunks(i))
    per: dict[int, list[int]] = {}
    uncached: list[int] = []  # per request: realised prompt tokens not from the cache
    ideal_uncached: list[int] = []  # and the ideal's
    ideal_chunks: dict[int, int] = {}  # row position -> the ideal's leading chunks
    done = sorted(range(len(rows)), key=lambda i: rows[i]["t"] + rows[i]["ttft_ms"] / 1e3)
    for i in done:
        hs = chunks(prewarm + rows[i]["trace_index"])  # the users' trace indices start after the prewarm's
        n = 0
        while n < len(hs) and hs[n] in seen:
            n += 1
        ideal_chunks[i] = n
        if rows[i]["ok"]:  # a failed request stored nothing
            seen.update(hs)
    for i in sorted(range(len(rows)), key=lambda i: rows[i]["t"]):
        r, n = rows[i], ideal_chunks[i]
        if not r["ok"]:
            continue
        if r["t"] - t_start > warmup:
            uncached.append(r["prompt_tokens"] - r["cached_tokens"])
            ideal_uncached.append(r["prompt_tokens"] - min(n * chunk_tokens, r["prompt_tokens"]))
        w = per.setdefault(int((r["t"] - t_start) // window), [0, 0, 0, 0, 0])
        w[0] += r["prompt_tokens"]
        w[1] += r["cached_tokens"]
        w[2] += n * chunk_tokens
        if r.get("route") != "load":  # the router's reason (X-Kvcached-Route); absent in older logs
            w[3] += r["cached_tokens"]
            w[4] += n * chunk_tokens
    keys = sorted(per)[:-1]
    out = [{"t": (k + 1) * window, "prompt_tokens": per[k][0], "hit_rate": per[k][1] / per[k][0] if per[k][0] else None,
            "ideal_hit_rate": per[k][2] / per[k][0] if per[k][0] else None,
            "hit_over_ideal": per[k][1] / per[k][2] if per[k][2] else None,
            # the same, leaving out the requests the load bound sent away from the host holding
            # their prefix (reason "load"): what the routing gives up for balance, it gives up
            # on purpose, and how much of it there is depends on how loaded the hosts run
            "hit_over_ideal_not_load_moved": per[k][3] / per[k][4] if per[k][4] else None,
            "load_moved_ideal_share": 1 - per[k][4] / per[k][2] if per[k][2] else None} for k in keys]
    steady = [w for w in out if w["t"] > warmup and w["hit_over_ideal"] is not None]
    steady_keys = [k for k in keys if (k + 1) * window > warmup]

    def fluct(key: str) -> float:
        xs = [w[key] for w in steady if w[key] is not None]
        m = statistics.fmean(xs) if xs else float("nan")
        return max(abs(x - m) / m for x in xs) if xs and m else float("nan")

    return {"windows": out, "steady_windows": len(steady),
            # What bounds TTFT: the prefill each request needs. The ideal's p90 is the least any
            # routing can leave (before queueing); a policy's p90 TTFT cannot fall far below its
            # uncached p90 / prefill_tps.
            "uncached_tokens_p90": percentile(uncached, 0.9), "ideal_uncached_tokens_p90": percentile(ideal_uncached, 0.9),
            "uncached_tokens_mean": statistics.fmean(uncached) if uncached else float("nan"),
            "ideal_uncached_tokens_mean": statistics.fmean(ideal_uncached) if ideal_uncached else float("nan"), "ideal_hit_rate_fluctuation": fluct("ideal_hit_rate"),
            "hit_over_ideal_fluctuation": fluct("hit_over_ideal"),
            "hit_over_ideal_not_load_moved_fluctuation": fluct("hit_over_ideal_not_load_moved"),
            "load_moved_ideal_share": 1 - sum(per[k][4] for k in steady_keys) / max(sum(per[k][2] for k in steady_keys), 1),
            "hit_over_ideal_mean": statistics.fmean([w["hit_over_ideal"] for w in steady]) if steady else float("nan")}


def prewarm(url: str, n: int, concurrency: int = 6) -> dict:
    """Replay the trace's first ``n`` requests through the router as fast as it takes them
    (not measured), so the measured part starts with caches holding the conversations in
    progress, as a serving system that has been up a while does. The users then replay the
    trace from request ``n`` on."""
    import concurrent.futures

    w = Workload(trace_path(), limit=n)
    t0 = time.monotonic()

    def send(req) -> int:
        body = json.dumps(w.chat_body(req, "sim")).encode()
        r = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(r, timeout=120) as resp:
                resp.read()
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        codes = list(ex.map(send, w.requests))
    return {"requests": n, "seconds": time.monotonic() - t0, "failed": sum(1 for c in codes if c != 200)}


def _by_reason(m: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in m.items():
        if k.startswith("kvcached_router_routes_total{"):
            reason = k.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 users, 60 s, 3 hosts, kvcached only (CI)")
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--spawn-rate", type=float, default=None)
    ap.add_argument("--seconds", type=int, default=None)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--policies", default=None)
    ap.add_argument("--time-scale", type=float, default=None, help="x the trace's gaps (smaller: more load)")
    ap.add_argument("--limit", type=int, default=0, help="trace lines to use (0: all)")
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--prewarm", type=int, default=None,
                    help="trace requests replayed before measuring (default 1000; quick 400)")
    ap.add_argument("--warmup", type=float, default=None)
    ap.add_argument("--prefill-tps", type=float, default=20_000.0)
    ap.add_argument("--decode-tps", type=float, default=200.0)
    ap.add_argument("--load-factor", type=float, default=1.25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None,
                    help="keep each policy's logs (requests.jsonl, router.log, locust.log) under this folder")
    args = ap.parse_args(argv)
    q = args.quick
    args.users = args.users or (100 if q else 1000)
    args.spawn_rate = args.spawn_rate or (50 if not q else 25)
    args.seconds = args.seconds or (60 if q else 240)
    args.time_scale = args.time_scale if args.time_scale is not None else (0.3 if q else 0.3)
    args.warmup = args.warmup if args.warmup is not None else (20.0 if q else 60.0)
    args.prewarm = args.prewarm if args.prewarm is not None else (400 if q else 1000)
    policies = (args.policies or ("kvcached" if q else ",".join(ALL_POLICIES))).split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvc-routing-") as tmp:
        work = args.work or tmp
        os.makedirs(work, exist_ok=True)
        for p in policies:
            print(f"policy {p}: {args.users} users, {args.seconds} s ...", flush=True)
            results[p] = run_policy(p, args, work)
            r = results[p]
            print(f"  hit rate {r['hit_rate_steady_mean']:.3f} (fluctuation {r['hit_rate_fluctuation']:.3f}; the ideal's "
                  f"{r['ideal_hit_rate_fluctuation']:.3f}; realised/ideal {r['hit_over_ideal_mean']:.3f}, fluctuation "
                  f"{r['hit_over_ideal_fluctuation']:.3f}, {r['hit_over_ideal_not_load_moved_fluctuation']:.3f} without the "
                  f"{r['load_moved_ideal_share']:.1%} of the ideal the load bound moved), uncached tokens p90 {r['ideal']['uncached_tokens_p90']:.0f} "
                  f"(the ideal's {r['ideal']['ideal_uncached_tokens_p90']:.0f}), "
                  f"wrong routes {r['wrong_routes']:.0f}/{r['audited_routes']:.0f}, TTFT p50/p90/p99 "
                  f"{r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p90']:.0f}/{r['ttft_ms']['p99']:.0f} ms, "
                  f"{r['requests_per_s']:.1f} req/s, busiest/least {r['busiest_over_least_busy']}, "
                  f"CPU {r['cpu_busy_fraction']:.0%}, failed {r['failed_requests']}", flush=True)
    k = results.get("kvcached")
    targets: dict = {}
    if k:
        targets["hit-rate fluctuation < 5 %"] = {"value": k["hit_rate_fluctuation"], "met": k["hit_rate_fluctuation"] < TARGETS["fluctuation_max"]}
        wr = k["wrong_route_rate"]
        targets["wrong routes < 0.1 %"] = {"value": wr, "met": wr is not None and wr < TARGETS["wrong_route_max"]}
        if k["busiest_over_least_busy"] is not None:
            targets["busiest host <= 1.5x the least busy"] = {"value": k["busiest_over_least_busy"],
                                                               "met": k["busiest_over_least_busy"] <= TARGETS["busiest_over_least_max"]}
        if "longest_prefix" in results and results["longest_prefix"]["hit_rate_steady_mean"]:
            v = k["hit_rate_steady_mean"] / results["longest_prefix"]["hit_rate_steady_mean"]
            targets["hit rate >= 0.95x the oracle (longest_prefix)"] = {"value": v, "met": v >= TARGETS["hit_over_oracle_min"]}
        for other, key in (("round_robin", "ttft_p90_over_round_robin_max"), ("prefix_hash", "ttft_p90_over_prefix_hash_max")):
            if other in results:
                v = k["ttft_ms"]["p90"] / results[other]["ttft_ms"]["p90"]
                targets[f"TTFT p90 <= {TARGETS[key]}x {other}'s"] = {"value": v, "met": v <= TARGETS[key]}
    res = {"benchmark": "routing", "machine": machine_info(), "quick": q,
           "engines": "simulated (bench/routing/simhost.py): prefill at --prefill-tps on one simulated accelerator "
                      "per host; the cache work (lookup, lease, read, put, KV events) is real",
           "parameters": {k2: v for k2, v in vars(args).items()}, "policies": results, "targets": targets}
    name = "routing.quick" if q else "routing"
    path = write_json(name, res, args.out)
    try:
        plot(res, os.path.join(args.out or RESULTS_DIR, f"{name}.png"))
    except ImportError:
        pass
    print(json.dumps(targets, indent=1))
    print(f"wrote {path}")
    return 0


def plot(res: dict, path: str) -> None:
    fig, (a, b) = subplots(1, 2, figsize=(12, 4.5))
    for p, r in res["policies"].items():
        ts = [w["t"] for w in r["windows"]]
        a.plot(ts, [w["hit_rate"] if w["hit_rate"] is not None else float("nan") for w in r["windows"]], label=p)
        b.plot(ts, r["ttft_p50_by_window"], label=p)
    a.set(title="hit rate per window (hosts' cached tokens)", xlabel="s", ylabel="hit rate")
    b.set(title="TTFT p50 per window", xlabel="s", ylabel="ms", yscale="log")
    a.legend(), b.legend()
    fig.suptitle("kvcached-router, simulated engines, real caches")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
