"""Question: over the daemon's Unix socket, what do acquire + release of a cached 8k-token prompt
(64 chunks x 128 tokens) cost next to an empty RPC (Ping) on the same server, at concurrency 1,
16 and 64: p50/p99 latency and throughput?

Setup: one real ``kvcached serve`` process (its own temp dir, default 4 worker threads, NVMe on
but unused), one small layout (1 layer, 1 KV head, head_dim 8, float16: 4 KiB chunks, so the pool
is tiny; the RPCs carry ids and offsets only, so their cost does not depend on chunk bytes), and
one 8,192-token prompt put once, so every acquire is a full 64-chunk hit in the pool. The client
is this process: Python, grpc.aio, on the same box as the daemon (2 cores here), so a large part
of every figure is the client's own CPU; the table shows CPU per op on each side, and the
daemon's context switches per op (from /proc/PID/task/*/schedstat).

Concurrency N = N asyncio tasks (callers) issuing ops back to back. Channels:

* ``shared``      one grpc.aio channel (one HTTP/2 connection) for all N callers: what one
                  inference process with one AsyncClient does
* ``per-caller``  one channel per caller, each on its own connection
                  (``grpc.use_local_subchannel_pool``): N processes, each with its own client

Contenders, interleaved round by round (order rotated) so the box's noise hits them alike:

* ``ping``             one empty RPC (the baseline)
* ``ping x2``          two empty RPCs back to back (the baseline for an op made of 2 RPCs)
* ``acquire``          one Acquire RPC; the leases are released after the timed window, in
                       batched Release calls (timed apart, reported per lease)
* ``acquire+release``  Acquire then Release of that lease: one request's control cost, 2 RPCs
* ``acquire 1 chunk``  Acquire of the prompt's first 128 tokens (shared channel): the cost every
                       Acquire pays before its length counts, with next to no transport
* ``api acquire``, ``api acquire+release``, ``api ping``: the same through the public
                       ``AsyncClient`` (lease objects, session and layout handling); shared
                       channel only
* ``sync api ...``     the sync ``Client`` at concurrency 1 (what most callers use). Its
                       ``Lease.release()`` is asynchronous (queued on the session stream), so
                       ``sync api acquire+release`` latency is the acquire plus queueing the
                       release; the round's wall time (throughput) and daemon CPU include a
                       ``c.sync()`` at its end, i.e. the daemon having done every release

Per request (``per_request`` in the JSON; ``--only per_request`` runs just these): one
request's whole cache work through the public sync ``Client``, N threads each with its own
client, in a daemon of their own (the same settings, with a pool that holds a whole batch of
misses; the misses' chunks are evicted between batches, untimed):

* ``ping``              ``Client.ping()``, one empty RPC (the baseline)
* ``request full hit``  ``acquire_reserve`` of the cached prompt (one AcquireReserve RPC), a view
                        of each of its 64 chunks (``lease.chunk(i)``), ``finish()``: no RPC (the
                        release goes on the session stream)
* ``request miss``      ``acquire_reserve`` of a fresh prompt (64 chunks reserved), ``write(kv)``
                        into the pool, ``finish()``: one Commit RPC

with targets, per concurrency: hit p50 <= 1.3x and miss p50 <= 2.3x the ping's p50; hit
throughput >= 0.8x and miss throughput >= 0.45x the ping's. RPCs per request are counted once,
untimed, by wrapping the client's ``_call``.

The raw rows call the generated stub with prebuilt requests (tokens already packed), with the
same ``timeout`` the client library passes.

Attribution: an in-process breakdown (no RPC) of what an Acquire adds to an empty RPC (store
work, response building, protobuf, the client's per-chunk objects, the servicer's hop to a worker
thread); and three comparison daemons (``--what-if``, all on by default in full runs), measured
with the raw rows, shared channel, in the same run:

* ``no-memo``  the same kvcached with ``hash_memo_bytes = 0``, so every Acquire hashes its 32 KB
               of tokens afresh: the memo's effect end to end
* ``floor``    the transport floor: Acquire carries the same 32 KB request and gets the same
               response bytes back, but the handler does no store work (it replays the session's
               first answer). ``acquire`` vs ``ping`` there is what gRPC alone charges for the
               request's size; the main daemon's gap beyond it is kvcached's own work
* ``handlers`` the main daemon with each unary handler timed on the event-loop thread (thread
               CPU and wall time per call, by RPC and size): what one call's Python costs inside
               the daemon, next to the in-process breakdown's hot and cold rows

Targets from the issue: acquire p50 <= 1.3x the empty RPC's p50, and acquire throughput >= 0.8x
the empty RPC's. They are checked for ``acquire`` (one RPC) vs ``ping`` and, as the stricter
per-request reading, ``acquire+release`` (2 RPCs) vs ``ping`` and vs ``ping x2``.

Run:   .venv/bin/python bench/rpc_latency.py            (~10 min on a 2-core box)
       .venv/bin/python bench/rpc_latency.py --quick    (a few seconds; writes *.quick.json)
       .venv/bin/python bench/rpc_latency.py --only per_request   (the per-request rows, ~2 min)
Output: bench/results/rpc_latency.json (--only per_request: rpc_latency.per_request.json)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import bench_parser, finish, format_table, install_sigterm_exit, ratio
from bench._rpc_contenders import LAYOUT, PROMPT_CHUNKS, PROMPT_TOKENS, TARGET_P50_RATIO, TARGET_THROUGHPUT_RATIO, TIMEOUT
from bench._rpc_daemons import WHAT_IFS, attribution, breakdown, measure_daemon
from bench._rpc_per_request import measure_per_request, print_per_request

import grpc
import numpy as np


def run(args: argparse.Namespace) -> dict:
    settings = {
        "pool_bytes": "16M",  # 4,096 of the 4 KiB chunks (a packed pool)
        "nvme_bytes": "256M",
        "lease_ttl": 3600.0,
        # The "acquire" rows hold every lease of a round (released in one batch after it), far
        # more than a real client would: lift the per-session cap so it measures the RPC.
        "max_leases_per_session": 1 << 20,
        "worker_threads": args.workers,
        "log_level": "warning",
    }
    rng = np.random.default_rng(args.seed)
    tokens_np = rng.integers(0, 128_000, PROMPT_TOKENS, dtype=np.uint32)
    tokens = tokens_np.astype("<u4").tobytes()
    if args.only == "per_request":
        print("per-request rows only", flush=True)
        return {"question": " ".join(__doc__.strip().split("\n\n")[0].split()), "only": "per_request",
                "setup": {"prompt_tokens": PROMPT_TOKENS, "prompt_chunks": PROMPT_CHUNKS,
                          "concurrency": args.concurrency, "rounds": args.rounds,
                          "ops_per_round_per_contender": args.ops_per_round,
                          "min_ops_per_caller_per_round": args.min_ops_per_caller, "grpc": grpc.__version__},
                "per_request": measure_per_request(settings, tokens_np, args)}
    pieces = breakdown(tokens, args)
    out = {
        "question": " ".join(__doc__.strip().split("\n\n")[0].split()),
        "setup": {
            "daemon_settings": settings,
            "layout": LAYOUT.to_dict(),
            "chunk_bytes": LAYOUT.chunk_bytes,
            "prompt_tokens": PROMPT_TOKENS,
            "prompt_chunks": PROMPT_CHUNKS,
            "concurrency": args.concurrency,
            "channels": args.channels,
            "rounds": args.rounds,
            "ops_per_round_per_contender": args.ops_per_round,
            "min_ops_per_caller_per_round": args.min_ops_per_caller,
            "grpc": grpc.__version__,
            "client_event_loop": "asyncio (default loop); the daemon runs uvloop",
            "timeout_per_call_s": TIMEOUT,
        },
    }
    out.update(measure_daemon(settings, None, tokens, tokens_np, args, args.channels, api=True, sync=True))
    print("per-request daemon", flush=True)
    out["per_request"] = measure_per_request(settings, tokens_np, args)
    out["breakdown_in_process"] = pieces
    out["what_if"] = {}
    for name in args.what_if:
        print(f"comparison daemon: {name}", flush=True)
        changed, prelude = WHAT_IFS[name]
        w = measure_daemon({**settings, **changed}, prelude, tokens, tokens_np, args, ["shared"], api=False,
                           sync=False)
        w["settings_changed"], w["prelude"] = changed, prelude
        out["what_if"][name] = w
    if "floor" in out["what_if"]:
        out["attribution"] = attribution(out["results"], out["what_if"]["floor"]["results"])
    out["targets"] = {"acquire_p50_over_ping_p50_max": TARGET_P50_RATIO,
                      "acquire_throughput_over_ping_min": TARGET_THROUGHPUT_RATIO}
    return out


def _print_results(results: dict) -> None:
    headers = ["channels/conc  op", "p50 us", "p99 us", "ops/s (median)", "p50/ping", "ops/s / ping",
               "client cpu us/op", "daemon cpu us/op", "daemon switches/op", "release us/lease"]
    rows = []
    for key, level in results.items():
        base = level["sync api ping"] if key.startswith("sync") else level["ping"]
        for name, s in level.items():
            rows.append([f"{key:13s} {name}", s["p50_us"], s["p99_us"], s["throughput_ops_s_median"],
                         ratio(s["p50_us"], base["p50_us"]),
                         ratio(s["throughput_ops_s_median"], base["throughput_ops_s_median"]),
                         s["client_cpu_us_per_op"], s["daemon_cpu_us_per_op"], s["daemon_switches_per_op"],
                         s.get("batched_release_us_per_lease", float("nan"))])
    print(format_table(headers, rows))


def _print_verdicts(ratios: dict) -> None:
    for key, rows_ in ratios.items():
        for pair, v in rows_.items():
            if pair.startswith("api acquire") and pair.endswith("vs ping"):
                continue  # shown in the table; the verdicts compare like with like
            print(f"  {key:14s} {pair:42s} p50 {v['p50_ratio']:.2f}x -> {'MET' if v['p50_target_met'] else 'NOT MET'};"
                  f"  throughput {v['throughput_ratio']:.2f}x -> {'MET' if v['throughput_target_met'] else 'NOT MET'}")


def print_report(res: dict) -> None:
    if res.get("only") == "per_request":
        print_per_request(res["per_request"])
        return
    print(f"\nacquire of an {PROMPT_TOKENS}-token prompt ({PROMPT_CHUNKS} chunks, all in the pool) vs Ping, "
          f"over a Unix socket; {res['setup']['rounds']} interleaved rounds\n")
    _print_results(res["results"])
    print("\nin process (no RPC), what an Acquire adds on top of an empty RPC:")
    print(format_table(["piece", "p50 us", "p99 us", "cpu us/call"],
                       [[k, v["p50_us"], v["p99_us"], v.get("cpu_us_per_call", float("nan"))]
                        for k, v in res["breakdown_in_process"].items() if not k.startswith("_")]))
    for name, w in res["what_if"].items():
        print(f"\ncomparison daemon ({name}):")
        _print_results(w["results"])
    print(f"\ntargets: p50 <= {TARGET_P50_RATIO}x the empty RPC's p50; throughput >= {TARGET_THROUGHPUT_RATIO}x "
          "the empty RPC's")
    _print_verdicts(res["ratios"])
    for name, w in res["what_if"].items():
        print(f"comparison ({name}):")
        _print_verdicts(w["ratios"])
    if res.get("attribution"):
        print("\nwhere an Acquire's extra daemon CPU goes (shared channel; us per op, main daemon's acquire - ping,"
              " split by the floor daemon):")
        print(format_table(
            ["concurrency", "acquire - ping", "transport (floor)", "kvcached", "budget at 0.8x", "1 chunk - ping",
             "ops/s / ping", "floor ops/s / ping", "1 chunk ops/s / ping", "floor p50/ping"],
            [[k, a["daemon_cpu_us_acquire_minus_ping"], a["of_which_transport_us"], a["of_which_kvcached_us"],
              a["kvcached_budget_us_at_target"], a["one_chunk_acquire_minus_ping_us"], a["throughput_ratio"],
              a["floor_throughput_ratio"], a["one_chunk_throughput_ratio"], a["floor_p50_ratio"]]
             for k, a in res["attribution"].items()]))
    times = res["what_if"].get("handlers", {}).get("handler_times")
    if times:
        print("\nin the daemon: each handler's own time on the event-loop thread (the handlers comparison daemon;"
              " us per call, all concurrencies):")
        print(format_table(["rpc", "calls", "thread cpu us", "wall us"],
                           [[k, t["calls"], t["cpu_us_per_call"], t["wall_us_per_call"]] for k, t in times.items()]))
    if res.get("per_request"):
        print_per_request(res["per_request"])


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "few rounds and ops (a few seconds)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 6; quick 1)")
    p.add_argument("--ops-per-round", type=int, default=None,
                   help="ops per contender per round, split over the callers (default 960; quick 64)")
    p.add_argument("--min-ops-per-caller", type=int, default=None,
                   help="at least this many back-to-back ops per caller per round (default 15; quick 2)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated caller counts (default 1,16,64)")
    p.add_argument("--channels", default=None, help="shared,per-caller (default both; quick: shared)")
    p.add_argument("--what-if", default=None,
                   help="comparison daemons to measure too, comma-separated: no-memo, floor, handlers, or 'none' "
                        "(default all of them; quick none)")
    p.add_argument("--workers", type=int, default=4, help="daemon worker_threads (default 4, the daemon's default)")
    p.add_argument("--breakdown-iterations", type=int, default=None,
                   help="samples per in-process breakdown piece (default 3000; quick 300)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", choices=["per_request"], default=None,
                   help="run only these rows: per_request (ping / request full hit / request miss through the "
                        "sync Client, one per thread); writes rpc_latency.per_request[.quick].json")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 6)
    args.ops_per_round = args.ops_per_round or (64 if args.quick else 960)
    args.min_ops_per_caller = args.min_ops_per_caller or (2 if args.quick else 15)
    args.breakdown_iterations = args.breakdown_iterations or (300 if args.quick else 3000)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.channels = (args.channels or ("shared" if args.quick else "shared,per-caller")).split(",")
    wi = args.what_if or ("none" if args.quick else ",".join(WHAT_IFS))
    args.what_if = [] if wi == "none" else wi.split(",")
    unknown = [k for k in args.what_if if k not in WHAT_IFS]
    if unknown:
        p.error(f"unknown --what-if {', '.join(unknown)} (known: {', '.join(WHAT_IFS)}, none)")
    bad = set(args.channels) - {"shared", "per-caller"}
    if bad:
        p.error(f"unknown --channels {sorted(bad)}")
    install_sigterm_exit()
    res = run(args)
    finish("rpc_latency" + (f".{args.only}" if args.only else ""), res, args, print_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
