"""How many requests one simulated host sustains on this box, and what CPU it takes.

Starts a one-host SimFleet (a real daemon + simhost.py), then drives it closed-loop with
``--concurrency`` workers sending the workload's chat requests (conversation trace, in trace
order) for ``--seconds``; reports requests/s, the hit rate, TTFT percentiles (streaming) and the
CPU seconds per second of the simhost, its daemon and this load generator (psutil).

::

    python bench/routing/capacity.py                       # the default simulated model speeds
    python bench/routing/capacity.py --prefill-tps 1e9 --decode-tps 1e6   # CPU-bound: no model time
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench.routing.fleet import SimFleet
from bench.routing.workload import Workload, trace_path


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def drive(url: str, wl: Workload, concurrency: int, seconds: float, stream: bool) -> dict:
    reqs = wl.requests
    nxt = 0
    ttft: list[float] = []
    lat: list[float] = []
    errors = 0
    done = 0
    stop_at = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal nxt, errors, done
        while time.monotonic() < stop_at:
            r = reqs[nxt % len(reqs)]
            nxt += 1
            t0 = time.monotonic()
            try:
                async with session.post(url + "/v1/chat/completions", json=wl.chat_body(r, "sim", stream=stream)) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    if stream:
                        first = True
                        async for line in resp.content:
                            if first and line.startswith(b"data: "):
                                ttft.append(time.monotonic() - t0)
                                first = False
                    else:
                        await resp.read()
                        ttft.append(time.monotonic() - t0)
                lat.append(time.monotonic() - t0)
                done += 1
            except aiohttp.ClientError:
                errors += 1

    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return {"completed": done, "errors": errors, "wall_s": wall, "requests_per_s": done / wall,
            "ttft_p50_ms": 1000 * (pct(ttft, 50) or 0), "ttft_p90_ms": 1000 * (pct(ttft, 90) or 0),
            "ttft_p99_ms": 1000 * (pct(ttft, 99) or 0), "latency_p50_ms": 1000 * (pct(lat, 50) or 0)}


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prefill-tps", type=float, default=20000.0)
    ap.add_argument("--decode-tps", type=float, default=200.0)
    ap.add_argument("--words-per-block", type=int, default=32)
    ap.add_argument("--limit", type=int, default=3000, help="trace requests to cycle through")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--trace", default=trace_path())
    ap.add_argument("--workdir")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args(argv)
    wl = Workload(a.trace, a.words_per_block, limit=a.limit)
    work = a.workdir or tempfile.mkdtemp(prefix="kvc-capacity-")
    with SimFleet(1, work, prefill_tps=a.prefill_tps, decode_tps=a.decode_tps) as fleet:
        pids = fleet.pids()
        host = psutil.Process(pids["host0 simhost"])
        daemon = psutil.Process(pids["host0 daemon"])
        me = psutil.Process()
        before = (cpu_s(host), cpu_s(daemon), cpu_s(me), fleet.stats(0))
        res = asyncio.run(drive(fleet.url(0), wl, a.concurrency, a.seconds, not a.no_stream))
        after = (cpu_s(host), cpu_s(daemon), cpu_s(me), fleet.stats(0))
    wall = res["wall_s"]
    s0, s1 = before[3], after[3]
    prompt = s1["prompt_tokens"] - s0["prompt_tokens"]
    out = {
        "simulated_model": {"prefill_tps": a.prefill_tps, "decode_tps": a.decode_tps},
        "concurrency": a.concurrency, "stream": not a.no_stream, "words_per_block": a.words_per_block,
        **res,
        "hit_rate": (s1["cached_tokens"] - s0["cached_tokens"]) / prompt if prompt else None,
        "prompt_tokens_per_request": prompt / max(1, res["completed"]),
        "accelerator_busy": (s1["prefill_busy_s"] - s0["prefill_busy_s"]) / wall,
        "cpu_simhost": (after[0] - before[0]) / wall, "cpu_daemon": (after[1] - before[1]) / wall,
        "cpu_loadgen": (after[2] - before[2]) / wall, "nproc": os.cpu_count(),
        "daemon_errors": s1["daemon_errors"], "verify_mismatches": s1["verify_mismatches"],
        "cpu_ms_per_request_simhost_plus_daemon":
            1000 * ((after[0] - before[0]) + (after[1] - before[1])) / max(1, res["completed"]),
    }
    print(json.dumps(out, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
