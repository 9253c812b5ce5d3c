"""rpc_latency.py's attribution: the in-process breakdown (no RPC) of what an Acquire adds to an
empty RPC, the comparison daemons (``--what-if``: no-memo, floor, handlers), one daemon's
measurement, and the split of an Acquire's extra daemon CPU by the transport floor.
Not a benchmark itself: ``bench/rpc_latency.py`` runs them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from bench._common import ratio, summarize_ns, time_calls
from bench.harness.daemon import Daemon
from bench._rpc_contenders import (
    LAYOUT, ONE, PROMPT_CHUNKS, PROMPT_TOKENS, TARGET_THROUGHPUT_RATIO, measure_async, measure_sync, verdicts,
)

import numpy as np
from kvcached_client import Client, _core

from kvcached.v1 import kvcached_pb2 as pb


def breakdown(tokens: bytes, args: argparse.Namespace) -> dict:
    """In process, no RPC: the pieces an Acquire adds on top of an empty RPC, to size fixes.

    Store work (acquire+release of the 64-chunk prompt), the servicer's response building
    (``convert.lease_to_proto``), protobuf serialize/parse, the client's per-chunk ``Location``
    objects, and the hop to a worker thread that every store call takes in the servicer
    (``loop.run_in_executor`` of a no-op on a 4-thread pool, on uvloop like the daemon), with
    its CPU cost per call.
    """
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from kvcached.config import StoreConfig
    from kvcached.service import convert
    from kvcached.store import Store

    n = args.breakdown_iterations
    state_dir = tempfile.mkdtemp(prefix="kvc-bench-rpc-inproc-")
    out: dict = {}
    try:
        # 256 chunks of LAYOUT (a packed pool of N * chunk_bytes holds exactly N). Steady-state
        # latency: no background write-back thread (there is no NVMe tier here either).
        cfg = StoreConfig(state_dir=state_dir, pool_bytes=LAYOUT.chunk_bytes * 256, pool_prefault=False,
                          nvme_bytes=0, lease_ttl=1e9, writeback=False)
        with Store(cfg) as store:
            lid = store.register_layout(LAYOUT)
            store.put(lid, tokens, [bytes(LAYOUT.chunk_bytes)] * PROMPT_CHUNKS)
            r = store.acquire(lid, tokens)
            resp = convert.lease_to_proto(r, 30.0)
            wire = resp.SerializeToString()
            parsed = pb.AcquireResponse.FromString(wire)
            fns = {
                "store.acquire + store.release (in process)": lambda: store.release(store.acquire(lid, tokens).lease_id),
                "servicer: convert.lease_to_proto (64 chunks, packed offsets)":
                    lambda: convert.lease_to_proto(r, 30.0),
                "AcquireResponse.SerializeToString": resp.SerializeToString,
                "AcquireResponse.FromString (client parse)": lambda: pb.AcquireResponse.FromString(wire),
                "client: list(offsets) (what a Lease keeps)": lambda: list(parsed.chunks.offsets),
                "client: _core.locations (64 Location objects, only built on demand)":
                    lambda: _core.locations(parsed.chunks),
            }
            samples = {k: [] for k in fns}
            for rnd in range(3):
                for k, fn in fns.items():
                    time_calls(fn, n // 3, samples[k] if rnd or n < 30 else [])
            out = {k: summarize_ns(v) for k, v in samples.items()}
            # The same store call run cold: after a pause, as a request reaches a daemon between
            # other work. Back to back, the loop above keeps caches and branch predictors warm.
            for pause_ms in (0.1, 1.0):
                lat: list[int] = []
                for _ in range(min(n, 600)):
                    time.sleep(pause_ms / 1e3)
                    time_calls(lambda: store.release(store.acquire(lid, tokens).lease_id), 1, lat)
                out[f"store.acquire + store.release, {pause_ms:g} ms apart (cold)"] = summarize_ns(lat)
            store.release(r.lease_id)
            out["_sizes"] = {"acquire_response_wire_bytes": len(wire), "acquire_request_tokens_bytes": len(tokens)}
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)

    async def hops() -> dict:
        loop = asyncio.get_running_loop()
        ex = ThreadPoolExecutor(max_workers=4)
        try:
            def noop() -> None:
                return None

            for _ in range(200):
                await loop.run_in_executor(ex, noop)
            lat: list[int] = []
            pc = time.perf_counter_ns
            c0 = time.process_time_ns()
            for _ in range(n):
                t0 = pc()
                await loop.run_in_executor(ex, noop)
                lat.append(pc() - t0)
            cpu = (time.process_time_ns() - c0) / n / 1e3
            s = summarize_ns(lat)
            s["cpu_us_per_call"] = cpu
            return s
        finally:
            ex.shutdown()

    try:
        import uvloop

        out["servicer hop: await loop.run_in_executor(no-op), uvloop"] = uvloop.run(hops())
    except ImportError:  # pragma: no cover
        out["servicer hop: await loop.run_in_executor(no-op), asyncio"] = asyncio.run(hops())
    return out


#: Comparison daemons, measured with the raw rows over one shared channel in the same run:
#: name -> (settings that differ from the main daemon's, Python run in the daemon before it starts).
#: ``no-memo``: hash_memo_bytes = 0, so every request hashes its tokens afresh (SHA-256 chain).
#: ``floor``: the transport floor. Acquire still travels with its 32 KB of packed tokens, is parsed,
#: and its tokens are read once (the copy the real handler makes), but the handler answers with the
#: response of the first real Acquire of that session and prompt length, kept: the same bytes back,
#: no store work and no response building. What is left between this daemon's ``acquire`` and ``ping`` is what gRPC
#: charges for carrying the request and the response; the rest of the real daemon's gap is kvcached.
FLOOR_PRELUDE = """
from kvcached.service import servicer as _servicer
from kvcached.v1 import kvcached_pb2 as _pb
_real_acquire = _servicer.KVCacheServicer.Acquire
_real_release = _servicer.KVCacheServicer.Release
_answers = {}
_replayed = set()
async def _floor_acquire(self, request, context):
    tokens = request.tokens  # the one read (a 32 KB copy) the real handler makes too
    key = (request.layout_id, request.session_id, len(tokens))
    answer = _answers.get(key)
    if answer is None:
        answer = _answers[key] = await _real_acquire(self, request, context)
        _replayed.add(answer.lease_id)
    return answer
async def _floor_release(self, request, context):
    if _replayed.issuperset(request.lease_ids):
        return _pb.ReleaseResponse(released=len(request.lease_ids))
    return await _real_release(self, request, context)
_servicer.KVCacheServicer.Acquire = _floor_acquire
_servicer.KVCacheServicer.Release = _floor_release
"""
#: ``handlers``: the main daemon, with each unary handler timed on the event-loop thread (thread CPU
#: and wall time per call, by RPC and request size), written at exit to ``handler_times.json`` next to
#: its state dir. It measures what the Python of one call costs *inside* the daemon, between gRPC's
#: thread hops, next to the same store calls in process (the breakdown's hot and cold rows). The
#: wrapper adds about a microsecond per call, so this daemon's ratios are not the main ones.
HANDLERS_PRELUDE = """
import atexit as _atexit, json as _json, os as _os, sys as _sys, time as _time
from kvcached.service import servicer as _servicer
_times = {}
def _timed(rpc, size):
    real = getattr(_servicer.KVCacheServicer, rpc)
    async def handler(self, request, context):
        c0, w0 = _time.thread_time_ns(), _time.perf_counter_ns()
        try:
            return await real(self, request, context)
        finally:
            key = f"{rpc} {size(request)}".strip()
            t = _times.get(key)
            if t is None:
                t = _times[key] = [0, 0, 0]
            t[0] += 1
            t[1] += _time.thread_time_ns() - c0
            t[2] += _time.perf_counter_ns() - w0
    setattr(_servicer.KVCacheServicer, rpc, handler)
_timed("Ping", lambda r: "")
_timed("Acquire", lambda r: f"{len(r.tokens) // 4} tokens")
_timed("Release", lambda r: f"{len(r.lease_ids)} leases")
def _dump():
    state_dir = _sys.argv[_sys.argv.index("--state-dir") + 1]
    with open(_os.path.join(_os.path.dirname(state_dir), "handler_times.json"), "w") as f:
        _json.dump({k: {"calls": n, "cpu_us_per_call": c / n / 1e3, "wall_us_per_call": w / n / 1e3}
                    for k, (n, c, w) in sorted(_times.items())}, f)
_atexit.register(_dump)
"""
WHAT_IFS: dict[str, tuple[dict, str | None]] = {
    "no-memo": ({"hash_memo_bytes": 0}, None),
    "floor": ({}, FLOOR_PRELUDE),
    "handlers": ({}, HANDLERS_PRELUDE),
}


def measure_daemon(settings: dict, prelude: str | None, tokens: bytes, tokens_np: np.ndarray, args,
                   channel_modes: list[str], api: bool, sync: bool) -> dict:
    with Daemon.temp(settings, prefix="kvc-bench-rpc-", prelude=prelude) as d:
        import torch

        with Client(d.socket) as c:
            kv = torch.zeros(2, 1, 1, PROMPT_TOKENS, 8, dtype=torch.float16)
            stored = c.put(LAYOUT, tokens_np, kv).stored_chunks
            assert stored == PROMPT_CHUNKS, stored
            assert c.lookup(LAYOUT, tokens_np) == PROMPT_TOKENS
            st0 = c.stats()
        t0 = time.perf_counter()
        res = asyncio.run(measure_async(d.socket, d.proc.pid, tokens, tokens_np, args, channel_modes, api))
        if sync:
            res.update(measure_sync(d.socket, d.proc.pid, tokens_np, args))
        wall = time.perf_counter() - t0
        with Client(d.socket) as c:
            st1 = c.stats()
        d.stop()
        exit_code = d.exit_code
        times_path = os.path.join(d.root, "handler_times.json")
        handler_times = None
        if os.path.exists(times_path):
            with open(times_path) as f:
                handler_times = json.load(f)
    for level in res.values():
        for name, s in level.items():
            if s["misses"]:
                raise RuntimeError(f"{name}: {s['misses']} acquires were not full hits")
    if exit_code != 0:
        raise RuntimeError(f"the daemon exited with {exit_code} on SIGTERM")
    return {
        "daemon_stats_before": {k: st0.get(k) for k in ("pool", "leases_active", "layouts", "indexed_chunks")},
        "daemon_counters_after": st1.get("counters"),
        "daemon_exit_code": exit_code,
        "timed_wall_seconds": wall,
        "results": res,
        "ratios": verdicts(res),
        **({"handler_times": handler_times} if handler_times else {}),
    }


def attribution(main: dict, floor: dict) -> dict:
    """Per concurrency (shared channel): the daemon CPU an Acquire costs beyond a Ping, split into
    what the transport floor daemon also pays (gRPC carrying 32 KB in and the response out) and
    the rest (kvcached's own work), and the throughput ratio each daemon reaches."""
    out = {}
    for key, level in main.items():
        if not key.startswith("shared/") or key not in floor:
            continue
        m, f = level, floor[key]
        gap = m["acquire"]["daemon_cpu_us_per_op"] - m["ping"]["daemon_cpu_us_per_op"]
        transport = f["acquire"]["daemon_cpu_us_per_op"] - f["ping"]["daemon_cpu_us_per_op"]
        out[key] = {
            "daemon_cpu_us_acquire_minus_ping": gap,
            "of_which_transport_us": transport,
            "of_which_kvcached_us": gap - transport,
            "throughput_ratio": ratio(m["acquire"]["throughput_ops_s_median"], m["ping"]["throughput_ops_s_median"]),
            "floor_throughput_ratio": ratio(f["acquire"]["throughput_ops_s_median"],
                                            f["ping"]["throughput_ops_s_median"]),
            "floor_p50_ratio": ratio(f["acquire"]["p50_us"], f["ping"]["p50_us"]),
            # An acquire of one chunk (512 B of tokens): what every Acquire costs before its length
            # counts (servicer, store call, lease, response), with next to no transport on top.
            "one_chunk_acquire_minus_ping_us": m[ONE]["daemon_cpu_us_per_op"] - m["ping"]["daemon_cpu_us_per_op"]
            if ONE in m else float("nan"),
            "one_chunk_throughput_ratio": ratio(m[ONE]["throughput_ops_s_median"], m["ping"]["throughput_ops_s_median"])
            if ONE in m else float("nan"),
            # Daemon CPU per Acquire that would give 0.8x the Ping's throughput, if the daemon's
            # CPU sets the pace (it does at 16 and 64 callers: one core stays busy for both).
            "kvcached_budget_us_at_target": m["ping"]["daemon_cpu_us_per_op"] / TARGET_THROUGHPUT_RATIO
            - m["ping"]["daemon_cpu_us_per_op"] - transport,
        }
    return out
