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

Run:   .venv/bin/python bench/rpc_latency.py            (~8 min on a 2-core box)
       .venv/bin/python bench/rpc_latency.py --quick    (a few seconds; writes *.quick.json)
Output: bench/results/rpc_latency.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import json
import os
import sys
import time
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (
    RESULTS_DIR,
    Daemon,
    client_path,
    format_table,
    install_sigterm_exit,
    ratio,
    summarize_ns,
    time_calls,
    write_json,
)

client_path()

import grpc
import numpy as np
from kvcached_client import (
    AsyncClient,
    Client,
    KVLayout,
    _core,
)

from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc

PROMPT_TOKENS = 8192
CHUNK_TOKENS = 128
PROMPT_CHUNKS = PROMPT_TOKENS // CHUNK_TOKENS
TIMEOUT = 10.0  # what the client library passes on every call
MAX_IDS = 4096  # the servicer's per-call limit on lease ids

TARGET_P50_RATIO = 1.3
TARGET_THROUGHPUT_RATIO = 0.8

RAW = ("ping", "ping x2", "acquire", "acquire+release")
ONE = "acquire 1 chunk"  # the prompt's first 128 tokens: an acquire's per-call cost, whatever its length
API = ("api ping", "api acquire", "api acquire+release")
SYNC = ("sync api ping", "sync api acquire", "sync api acquire+release")

LAYOUT = KVLayout(model="bench/rpc-latency@1", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                  chunk_tokens=CHUNK_TOKENS)


# -- CPU accounting -----------------------------------------------------------------------------


class DaemonUsage(NamedTuple):
    """Totals over every thread of the daemon, from /proc/PID/task/*/schedstat."""

    cpu_ns: int  # time on a CPU
    wait_ns: int  # time runnable but waiting for a CPU (the box has 2 cores for client and daemon)
    slices: int  # times a thread was switched in: the daemon's context switches

    def __sub__(self, other: "DaemonUsage") -> "DaemonUsage":  # type: ignore[override]
        return DaemonUsage(self.cpu_ns - other.cpu_ns, self.wait_ns - other.wait_ns, self.slices - other.slices)


def daemon_usage(pid: int) -> DaemonUsage:
    cpu = wait = slices = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                a, b, c = (int(x) for x in f.read().split()[:3])
        except (OSError, ValueError):
            continue  # a thread that just exited
        cpu, wait, slices = cpu + a, wait + b, slices + c
    return DaemonUsage(cpu, wait, slices)


# -- callers ------------------------------------------------------------------------------------


class Caller:
    """One concurrent caller: a stub (maybe shared) and its prebuilt requests."""

    def __init__(self, stub: pb_grpc.KVCacheStub, acquire_req: pb.AcquireRequest) -> None:
        self.stub = stub
        self.acquire_req = acquire_req
        self.acquire_one_req = pb.AcquireRequest()
        self.acquire_one_req.CopyFrom(acquire_req)
        self.acquire_one_req.tokens = acquire_req.tokens[:CHUNK_TOKENS * 4]
        self.leases: list[str] = []
        self.misses = 0


PING = pb.PingRequest()


async def op_ping(c: Caller) -> None:
    await c.stub.Ping(PING, timeout=TIMEOUT)


async def op_ping2(c: Caller) -> None:
    await c.stub.Ping(PING, timeout=TIMEOUT)
    await c.stub.Ping(PING, timeout=TIMEOUT)


async def op_acquire(c: Caller) -> None:
    r = await c.stub.Acquire(c.acquire_req, timeout=TIMEOUT)
    c.leases.append(r.lease_id)
    if r.matched_tokens != PROMPT_TOKENS:
        c.misses += 1


async def op_acquire_one(c: Caller) -> None:
    r = await c.stub.Acquire(c.acquire_one_req, timeout=TIMEOUT)
    c.leases.append(r.lease_id)
    if r.matched_tokens != CHUNK_TOKENS:
        c.misses += 1


async def op_acquire_release(c: Caller) -> None:
    r = await c.stub.Acquire(c.acquire_req, timeout=TIMEOUT)
    if r.matched_tokens != PROMPT_TOKENS:
        c.misses += 1
    await c.stub.Release(pb.ReleaseRequest(lease_ids=[r.lease_id], session_id=c.acquire_req.session_id),
                         timeout=TIMEOUT)


class ApiCaller:
    def __init__(self, client: AsyncClient, tokens: np.ndarray) -> None:
        self.client = client
        self.tokens = tokens
        self.leases: list[str] = []
        self.misses = 0


async def api_ping(c: ApiCaller) -> None:
    await c.client.ping()


async def api_acquire(c: ApiCaller) -> None:
    lease = await c.client.acquire(LAYOUT, c.tokens)
    c.leases.append(lease.lease_id)
    if lease.matched_tokens != PROMPT_TOKENS:
        c.misses += 1


async def api_acquire_release(c: ApiCaller) -> None:
    lease = await c.client.acquire(LAYOUT, c.tokens)
    if lease.matched_tokens != PROMPT_TOKENS:
        c.misses += 1
    await lease.release()


OPS = {
    "ping": op_ping, "ping x2": op_ping2, "acquire": op_acquire, "acquire+release": op_acquire_release,
    ONE: op_acquire_one,
    "api ping": api_ping, "api acquire": api_acquire, "api acquire+release": api_acquire_release,
}


async def run_callers(callers: list, op, k: int, out: list[int]) -> float:
    """Each caller runs ``op`` ``k`` times back to back; per-op ns appended to ``out``. Returns wall s."""
    pc = time.perf_counter_ns

    async def one(c) -> None:
        for _ in range(k):
            t0 = pc()
            await op(c)
            out.append(pc() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in callers))
    return time.perf_counter() - t0


async def release_batched(stub: pb_grpc.KVCacheStub, ids: list[str], sid: str) -> tuple[int, int]:
    """Release ``ids`` (leases of session ``sid``) in calls of at most MAX_IDS; returns (released, ns spent)."""
    t0 = time.perf_counter_ns()
    released = 0
    for i in range(0, len(ids), MAX_IDS):
        req = pb.ReleaseRequest(lease_ids=ids[i:i + MAX_IDS], session_id=sid)
        released += (await stub.Release(req, timeout=60)).released
    return released, time.perf_counter_ns() - t0


# -- measurement --------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.lat: list[int] = []
        self.throughput: list[float] = []
        self.ops = 0
        self.wall = 0.0
        self.client_cpu_ns = 0
        self.daemon = DaemonUsage(0, 0, 0)
        self.release_ns = 0
        self.released = 0
        self.misses = 0

    def record(self, lat: list[int], wall: float, client_cpu_ns: int, daemon: DaemonUsage) -> None:
        """One measured round of one contender."""
        self.lat.extend(lat)
        self.ops += len(lat)
        self.wall += wall
        self.throughput.append(len(lat) / wall)
        self.client_cpu_ns += client_cpu_ns
        self.daemon = DaemonUsage(*(a + b for a, b in zip(self.daemon, daemon)))

    def summary(self) -> dict:
        s = summarize_ns(self.lat)
        tp = sorted(self.throughput)
        s.update(
            ops=self.ops,
            throughput_ops_s_median=float(np.median(tp)) if tp else float("nan"),
            throughput_ops_s_min=tp[0] if tp else float("nan"),
            throughput_ops_s_max=tp[-1] if tp else float("nan"),
            throughput_ops_s_overall=self.ops / self.wall if self.wall else float("nan"),
            client_cpu_us_per_op=self.client_cpu_ns / self.ops / 1e3 if self.ops else float("nan"),
            daemon_cpu_us_per_op=self.daemon.cpu_ns / self.ops / 1e3 if self.ops else float("nan"),
            daemon_wait_us_per_op=self.daemon.wait_ns / self.ops / 1e3 if self.ops else float("nan"),
            daemon_switches_per_op=self.daemon.slices / self.ops if self.ops else float("nan"),
            misses=self.misses,
        )
        if self.released:
            s["batched_release_us_per_lease"] = self.release_ns / self.released / 1e3
            s["leases_released"] = self.released
        return s


async def open_session(stub: pb_grpc.KVCacheStub, name: str):
    call = stub.Session()
    await call.write(pb.SessionRequest(client_name=name))
    first = await call.read()
    return first.session_id, call


async def measure_async(sock: str, pid: int, tokens: bytes, tokens_np: np.ndarray, args, channel_modes: list[str],
                        api: bool) -> dict:
    target = _core.target(sock)
    results: dict = {}
    for mode in channel_modes:
        max_n = max(args.concurrency)
        channels: list[grpc.aio.Channel] = []
        sessions = []
        api_client = None
        try:
            if mode == "shared":
                ch = grpc.aio.insecure_channel(target, options=_core.CHANNEL_OPTIONS)
                channels.append(ch)
                stub = pb_grpc.KVCacheStub(ch)
                lid = (await stub.RegisterLayout(_core.layout_request(LAYOUT))).layout_id
                sid, call = await open_session(stub, "bench rpc_latency shared")
                sessions.append(call)
                req = pb.AcquireRequest(layout_id=lid, tokens=tokens, session_id=sid)
                pool = [Caller(stub, req) for _ in range(max_n)]
                if api:
                    api_client = AsyncClient(sock)
                    await api_client.register(LAYOUT)
                    api_pool = [ApiCaller(api_client, tokens_np) for _ in range(max_n)]
                    names = RAW + (ONE,) + API
                else:
                    api_pool, names = [], RAW
            else:
                opts = _core.CHANNEL_OPTIONS + [("grpc.use_local_subchannel_pool", 1)]
                pool = []
                lid = None
                for i in range(max_n):
                    ch = grpc.aio.insecure_channel(target, options=opts)
                    channels.append(ch)
                    stub = pb_grpc.KVCacheStub(ch)
                    if lid is None:
                        lid = (await stub.RegisterLayout(_core.layout_request(LAYOUT))).layout_id
                    sid, call = await open_session(stub, f"bench rpc_latency caller {i}")
                    sessions.append(call)
                    pool.append(Caller(stub, pb.AcquireRequest(layout_id=lid, tokens=tokens, session_id=sid)))
                api_pool = []
                names = RAW
            # Warm every connection and code path once.
            for c in pool:
                await op_ping(c)
                await op_acquire_release(c)
            for c in api_pool[:1]:
                await api_acquire_release(c)

            for n in args.concurrency:
                k = max(args.min_ops_per_caller, args.ops_per_round // n)
                tallies = {name: Tally() for name in names}
                for rnd in range(args.rounds + 1):  # round 0 is warm-up, not recorded
                    order = names[rnd % len(names):] + names[:rnd % len(names)]
                    for name in order:
                        callers = (api_pool if name.startswith("api") else pool)[:n]
                        t = tallies[name]
                        lat: list[int] = []
                        gc.collect()
                        gc.disable()
                        try:
                            c0, d0 = time.process_time_ns(), daemon_usage(pid)
                            wall = await run_callers(callers, OPS[name], k, lat)
                            c1, d1 = time.process_time_ns(), daemon_usage(pid)
                        finally:
                            gc.enable()
                        ids = [x for c in callers for x in c.leases]
                        by_session: dict[tuple[Any, str], list[str]] = {}  # leases are bound to their session
                        for c in callers:
                            if isinstance(c, Caller):
                                key = (c.stub, c.acquire_req.session_id)
                            else:
                                key = (c.client._stub, c.client._session_id or "")
                            by_session.setdefault(key, []).extend(c.leases)
                        for c in callers:
                            t.misses += c.misses if rnd else 0
                            c.leases.clear()
                            c.misses = 0
                        if ids:
                            released = rel_ns = 0
                            for (rel_stub, sid), group in by_session.items():
                                got, ns = await release_batched(rel_stub, group, sid)
                                released, rel_ns = released + got, rel_ns + ns
                            if released != len(ids):
                                raise RuntimeError(f"{name}: released {released} of {len(ids)} leases")
                        if not rnd:
                            continue
                        t.record(lat, wall, c1 - c0, d1 - d0)
                        if ids:
                            t.released += len(ids)
                            t.release_ns += rel_ns
                results[f"{mode}/c{n}"] = {name: t.summary() for name, t in tallies.items()}
                print(f"  {mode} concurrency {n}: done ({k} ops per caller per round)", flush=True)
        finally:
            for call in sessions:
                call.cancel()
            if api_client is not None:
                await api_client.close()
            for ch in channels:
                await ch.close()
    return results


def measure_sync(sock: str, pid: int, tokens_np: np.ndarray, args) -> dict:
    """The sync Client at concurrency 1 (public API)."""
    tallies = {name: Tally() for name in SYNC}
    k = max(2, args.ops_per_round)
    with Client(sock) as c:
        held: list = []

        def acq() -> None:
            held.append(c.acquire(LAYOUT, tokens_np))

        fns = {
            "sync api ping": c.ping,
            "sync api acquire": acq,
            "sync api acquire+release": lambda: c.acquire(LAYOUT, tokens_np).release(),
        }
        fns["sync api acquire+release"]()
        pc = time.perf_counter_ns
        for rnd in range(args.rounds + 1):
            order = SYNC[rnd % len(SYNC):] + SYNC[:rnd % len(SYNC)]
            for name in order:
                fn, lat = fns[name], []
                gc.collect()
                gc.disable()
                try:
                    c0, d0 = time.process_time_ns(), daemon_usage(pid)
                    w0 = time.perf_counter()
                    for _ in range(k):
                        t0 = pc()
                        fn()
                        lat.append(pc() - t0)
                    if name == "sync api acquire+release":
                        # Lease.release() only queues the release on the session stream: wait until
                        # the daemon has done them, so the wall (throughput) and the daemon's CPU
                        # include that work and none of it spills into the next contender.
                        c.sync()
                    wall = time.perf_counter() - w0
                    c1, d1 = time.process_time_ns(), daemon_usage(pid)
                finally:
                    gc.enable()
                t = tallies[name]
                if held:
                    for lease in held:
                        t.misses += (lease.matched_tokens != PROMPT_TOKENS) if rnd else 0
                        lease.released = True  # released below, in batches
                    ids = [lease.lease_id for lease in held]
                    held.clear()
                    r0 = pc()
                    released = sum(c.release(ids[i:i + MAX_IDS]) for i in range(0, len(ids), MAX_IDS))
                    rel_ns = pc() - r0
                    if released != len(ids):
                        raise RuntimeError(f"{name}: released {released} of {len(ids)} leases")
                    if rnd:
                        t.released += len(ids)
                        t.release_ns += rel_ns
                if not rnd:
                    continue
                t.record(lat, wall, c1 - c0, d1 - d0)
    return {"sync/c1": {name: t.summary() for name, t in tallies.items()}}


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
    with Daemon(settings, prefix="kvc-bench-rpc-", prelude=prelude) as d:
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
        times_path = os.path.join(d.dir, "handler_times.json")
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


def verdicts(results: dict) -> dict:
    """Ratios to the empty RPC and the two targets, per (channels, concurrency)."""
    out = {}
    for key, level in results.items():
        base_ping = "sync api ping" if key.startswith("sync") else "ping"
        rows = {}
        pairs = [("acquire", base_ping), ("acquire+release", base_ping), ("acquire+release", "ping x2"),
                 ("api acquire", "api ping"), ("api acquire+release", "api ping"),
                 ("api acquire", "ping"), ("api acquire+release", "ping"),
                 ("sync api acquire", "sync api ping"), ("sync api acquire+release", "sync api ping")]
        for a, b in pairs:
            if a not in level or b not in level:
                continue
            sa, sb = level[a], level[b]
            p50 = ratio(sa["p50_us"], sb["p50_us"])
            tp = ratio(sa["throughput_ops_s_median"], sb["throughput_ops_s_median"])
            rows[f"{a} vs {b}"] = {
                "p50_ratio": p50,
                "p99_ratio": ratio(sa["p99_us"], sb["p99_us"]),
                "throughput_ratio": tp,
                "p50_target_met": p50 <= TARGET_P50_RATIO,
                "throughput_target_met": tp >= TARGET_THROUGHPUT_RATIO,
            }
        out[key] = rows
    return out


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few rounds and ops (a few seconds)")
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
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
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
    res["quick"] = args.quick
    print_report(res)
    path = write_json("rpc_latency.quick" if args.quick else "rpc_latency", res, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
