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
import asyncio
import gc
import glob
import json
import os
import sys
import threading
import time
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import (
    RESULTS_DIR,
    Daemon,
    format_table,
    install_sigterm_exit,
    ratio,
    summarize_ns,
    time_calls,
    write_json,
)

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


# -- per-request rows: the sync Client, one per thread ------------------------------------------
#
# One request's whole cache work through the public API, next to an empty RPC at the same
# concurrency: N threads, each with its own ``Client`` (its own channel and session stream),
# issuing requests back to back. They run in a daemon of their own (the main settings, with a pool
# big enough for one batch of misses; see ``measure_per_request``).

REQ_PING, REQ_HIT, REQ_MISS = "ping", "request full hit", "request miss"
REQ_HIT_CHUNKS = "request full hit, a view per chunk"  # the client's hit before lease.runs()
PER_REQUEST = (REQ_PING, REQ_HIT, REQ_HIT_CHUNKS, REQ_MISS)
#: Targets from the issue, per concurrency: request / empty RPC.
PER_REQUEST_TARGETS = {
    "hit_p50_over_ping_p50_max": 1.3,
    "miss_p50_over_ping_p50_max": 2.3,
    "hit_throughput_over_ping_min": 0.8,
    "miss_throughput_over_ping_min": 0.45,
}
#: The misses' layout: the same shape as LAYOUT under another model name, so the misses' chunks
#: can be evicted between batches (untimed) without touching the hit prompt's.
MISS_LAYOUT = KVLayout(model="bench/rpc-latency-miss@1", num_layers=1, num_kv_heads=1, head_dim=8,
                       dtype="float16", chunk_tokens=CHUNK_TOKENS)


def req_ping(c: Client, tokens: Any, kv: Any) -> tuple[int, bool]:
    c.ping()
    return 0, True


def req_hit(c: Client, tokens: Any, kv: Any) -> tuple[int, bool]:
    """AcquireReserve of the cached prompt (the one RPC), a view of each run of chunks laid back
    to back (``lease.runs()``: one for the whole prompt when it was stored in one piece), finish
    (no RPC: nothing reserved, the lease's release goes on the session stream). Returns (ns spent
    on the views, whether it was a full hit with nothing reserved)."""
    r = c.acquire_reserve(LAYOUT, tokens)
    t0 = time.perf_counter_ns()
    lease = r.lease
    runs = lease.runs()
    ptr = 0
    for _, v in runs:  # every view built and touched (its address), one pool element read
        ptr ^= v.data_ptr()
    if runs:
        runs[-1][1][-1, 1, 0, 0, -1, -1].item()
    read_ns = time.perf_counter_ns() - t0
    ok = lease.matched_tokens == PROMPT_TOKENS and sum(v.shape[0] for _, v in runs) == PROMPT_CHUNKS \
        and not r.reservation.opened
    r.finish()
    return read_ns, ok


def req_hit_chunks(c: Client, tokens: Any, kv: Any) -> tuple[int, bool]:
    """As :func:`req_hit`, with a view per chunk (``lease.chunk(i)`` for each of the 64)."""
    r = c.acquire_reserve(LAYOUT, tokens)
    t0 = time.perf_counter_ns()
    lease = r.lease
    views = [lease.chunk(i) for i in range(len(lease))]
    ptr = 0
    for v in views:  # every view built and touched (its address), one pool element read
        ptr ^= v.data_ptr()
    if views:
        views[-1][1, 0, 0, -1, -1].item()
    read_ns = time.perf_counter_ns() - t0
    ok = lease.matched_tokens == PROMPT_TOKENS and len(views) == PROMPT_CHUNKS and not r.reservation.opened
    r.finish()
    return read_ns, ok


def req_miss(c: Client, tokens: Any, kv: Any) -> tuple[int, bool]:
    """AcquireReserve of a prompt nobody stored (nothing to lease, 64 chunks reserved), write the
    KV into the reserved pool blocks, finish (one Commit: there is no lease to release). Returns
    (ns spent writing, whether all 64 chunks were reserved and committed)."""
    r = c.acquire_reserve(MISS_LAYOUT, tokens)
    t0 = time.perf_counter_ns()
    r.write(kv)
    write_ns = time.perf_counter_ns() - t0
    receipt = r.finish()
    ok = r.matched_tokens == 0 and len(r.reservation.slots) == PROMPT_CHUNKS and \
        receipt.stored_chunks == PROMPT_CHUNKS
    return write_ns, ok


REQ_OPS = {REQ_PING: req_ping, REQ_HIT: req_hit, REQ_HIT_CHUNKS: req_hit_chunks, REQ_MISS: req_miss}
REQ_PART = {REQ_HIT: "read", REQ_HIT_CHUNKS: "read", REQ_MISS: "write"}  # the client-side piece timed apart inside the request


class RequestTally(Tally):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[int] = []
        self.drain_throughput: list[float] = []
        self.drain_ns = 0

    def summary(self) -> dict:
        s = super().summary()
        s["p50_ms"], s["p99_ms"] = s["p50_us"] / 1e3, s["p99_us"] / 1e3
        tp = sorted(self.drain_throughput)
        # The same rounds with the window closed only once every client's stream releases were
        # done (Client.sync() on each, after the last request returned).
        s["throughput_incl_drain_ops_s_median"] = float(np.median(tp)) if tp else float("nan")
        s["drain_us_per_op"] = self.drain_ns / self.ops / 1e3 if self.ops else float("nan")
        if any(self.parts):
            p = summarize_ns(self.parts)
            s["part_p50_us"], s["part_p99_us"] = p["p50_us"], p["p99_us"]
        s["wrong_outcomes"] = s.pop("misses")  # hits that were not full hits, misses not fully stored
        return s


def _run_threads(clients: list[Client], fn, tokens: list, kv: Any, k: int) -> tuple[list[int], list[int], float, int]:
    """Each client's thread runs ``fn`` ``k`` times back to back (``tokens[j][i]`` is thread j's
    i-th prompt). Returns (per-request ns, per-request part ns, wall s from the moment every
    thread was released to the moment the last one finished, wrong outcomes)."""
    n = len(clients)
    marks: list[int] = [0, 0]
    start = threading.Barrier(n + 1, action=lambda: marks.__setitem__(0, time.perf_counter_ns()))
    end = threading.Barrier(n + 1, action=lambda: marks.__setitem__(1, time.perf_counter_ns()))
    lats: list[list[int]] = [[] for _ in range(n)]
    parts: list[list[int]] = [[] for _ in range(n)]
    bad = [0] * n
    errors: list[BaseException] = []

    def work(j: int) -> None:
        c, toks, out, po, pc = clients[j], tokens[j], lats[j], parts[j], time.perf_counter_ns
        try:
            start.wait()
            for i in range(k):
                t0 = pc()
                part, ok = fn(c, toks[i], kv)
                out.append(pc() - t0)
                po.append(part)
                if not ok:
                    bad[j] += 1
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)
        finally:
            try:
                end.wait()
            except threading.BrokenBarrierError:
                pass

    threads = [threading.Thread(target=work, args=(j,), name=f"rpc-bench-req-{j}", daemon=True) for j in range(n)]
    for t in threads:
        t.start()
    try:
        start.wait()
        end.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [x for xs in lats for x in xs], [x for xs in parts for x in xs], (marks[1] - marks[0]) / 1e9, sum(bad)


def count_rpcs(c: Client, fn, tokens: list, kv: Any) -> dict:
    """RPCs (and session-stream messages) per request of ``fn`` on a warm client: its ``_call``
    and ``_release_later`` wrapped for ``len(tokens)`` requests, outside any timed loop."""
    names = {id(getattr(c._stub, m.name)): m.name for m in pb.DESCRIPTOR.services_by_name["KVCache"].methods
             if hasattr(c._stub, m.name)}
    calls: dict[str, int] = {}
    stream = [0]
    real_call, real_later = c._call, c._release_later

    def counted_call(method, request, timeout=None):
        name = names.get(id(method), "?")
        calls[name] = calls.get(name, 0) + 1
        return real_call(method, request, timeout)

    def counted_later(*a, **kw):
        stream[0] += 1
        return real_later(*a, **kw)

    c._call, c._release_later = counted_call, counted_later  # type: ignore[method-assign]
    try:
        for t in tokens:
            fn(c, t, kv)
    finally:
        del c._call, c._release_later  # back to the class's methods
    n = len(tokens)
    return {"requests": n, "rpcs_per_request": sum(calls.values()) / n,
            "by_method": {k: v / n for k, v in sorted(calls.items())},
            "session_stream_messages_per_request": stream[0] / n}


def _socket_fds(pid: int) -> int:
    n = 0
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            n += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return n


def measure_per_request(settings: dict, tokens_np: np.ndarray, args) -> dict:
    """The per-request rows: at each concurrency N, N threads each with its own sync ``Client``;
    contenders interleaved round by round (order rotated), round 0 a warm-up."""
    import torch

    max_n = max(args.concurrency)
    ks = {n: max(args.min_ops_per_caller, args.ops_per_round // n) for n in args.concurrency}
    # Room for one whole batch of misses (never evicting, and the write-back thread, which starts
    # demoting when less than writeback_low of the pool is free, never woken), plus the hit prompt.
    # Between batches, untimed, the misses' chunks are evicted.
    batch_chunks = max(k * n for n, k in ks.items()) * PROMPT_CHUNKS
    pool_bytes = -(-int((batch_chunks + PROMPT_CHUNKS) * LAYOUT.chunk_bytes / 0.8) // (1 << 20)) << 20
    settings = {**settings, "pool_bytes": pool_bytes}
    rng = np.random.default_rng(args.seed + 1)
    kv = torch.zeros(2, 1, 1, PROMPT_TOKENS, 8, dtype=torch.float16)
    results: dict = {}
    rpcs: dict = {}
    evicted_per_batch: list[int] = []
    pool_min_free_fraction = 1.0
    with Daemon(settings, prefix="kvc-bench-rpc-req-") as d:
        pid = d.proc.pid
        fds0 = _socket_fds(pid)
        clients = [Client(d.socket, client_name=f"bench rpc_latency request {j}") for j in range(max_n)]
        try:
            for c in clients:
                c.warm_up()  # session stream open, pool mapped
                c.register(LAYOUT)
                c.register(MISS_LAYOUT)
            c0 = clients[0]
            miss_lid = c0.register(MISS_LAYOUT)
            assert c0.put(LAYOUT, tokens_np, kv).stored_chunks == PROMPT_CHUNKS
            fds1 = _socket_fds(pid)

            def fresh(n: int, k: int) -> list:
                return list(rng.integers(0, 128_000, (n, k, PROMPT_TOKENS), dtype=np.uint32))

            def evict_misses() -> int:
                return c0.evict(layout_id=miss_lid)[0]

            # Every client's first request of each kind, then the RPC count (untimed, once).
            for j, c in enumerate(clients):
                req_ping(c, None, kv)
                req_hit(c, tokens_np, kv)
                req_miss(c, fresh(1, 1)[0][0], kv)
            for name in PER_REQUEST:
                toks = fresh(1, 8)[0] if name == REQ_MISS else [tokens_np] * 8
                rpcs[name] = count_rpcs(c0, REQ_OPS[name], list(toks), kv)
            for c in clients:
                c.sync()
            evict_misses()

            for n in args.concurrency:
                k = ks[n]
                callers = clients[:n]
                tallies = {name: RequestTally() for name in PER_REQUEST}
                for rnd in range(args.rounds + 1):  # round 0 is warm-up, not recorded
                    order = PER_REQUEST[rnd % len(PER_REQUEST):] + PER_REQUEST[:rnd % len(PER_REQUEST)]
                    for name in order:
                        toks = fresh(n, k) if name == REQ_MISS else [[tokens_np] * k] * n
                        gc.collect()
                        gc.disable()
                        try:
                            cpu0, d0 = time.process_time_ns(), daemon_usage(pid)
                            lat, parts, wall, bad = _run_threads(callers, REQ_OPS[name], toks, kv, k)
                            w0 = time.perf_counter_ns()
                            for c in callers:  # the stream releases (hits), so none spill over
                                c.sync()
                            drain_ns = time.perf_counter_ns() - w0
                            cpu1, d1 = time.process_time_ns(), daemon_usage(pid)
                        finally:
                            gc.enable()
                        if name == REQ_MISS:
                            pool = c0.stats()["pool"]
                            pool_min_free_fraction = min(pool_min_free_fraction,
                                                         pool["free_bytes"] / pool["capacity_bytes"])
                            evicted = evict_misses()
                            if evicted != n * k * PROMPT_CHUNKS:
                                raise RuntimeError(f"{name}: evicted {evicted} chunks, "
                                                   f"expected {n * k * PROMPT_CHUNKS}")
                            evicted_per_batch.append(evicted)
                        if not rnd:
                            continue
                        t = tallies[name]
                        t.record(lat, wall, cpu1 - cpu0, d1 - d0)
                        t.misses += bad
                        t.parts.extend(parts)
                        t.drain_ns += drain_ns
                        t.drain_throughput.append(len(lat) / (wall + drain_ns / 1e9))
                results[f"c{n}"] = {name: t.summary() for name, t in tallies.items()}
                print(f"  per-request concurrency {n}: done ({k} requests per thread per round)", flush=True)
            st = c0.stats()
        finally:
            for c in clients:
                c.close()
        d.stop()
        exit_code = d.exit_code
    for level in results.values():
        for name, s in level.items():
            if s["wrong_outcomes"]:
                raise RuntimeError(f"{name}: {s['wrong_outcomes']} requests had the wrong outcome")
    if exit_code != 0:
        raise RuntimeError(f"the per-request daemon exited with {exit_code} on SIGTERM")
    return {
        "setup": {
            "daemon_settings": settings,
            "layouts": {"hit": LAYOUT.to_dict(), "miss": MISS_LAYOUT.to_dict()},
            "clients": "one sync kvcached_client.Client per thread (own channel and session stream), "
                       "N threads in this process issuing requests back to back",
            # The clients' channels have the same target and options, so gRPC's process-wide
            # subchannel pool may put them all on one connection: 1 here means it did.
            "daemon_socket_fds_added_by_clients": fds1 - fds0,
            "requests_per_thread_per_round": {f"c{n}": k for n, k in ks.items()},
            "rows": {
                REQ_PING: "Client.ping(): one empty RPC",
                REQ_HIT: f"acquire_reserve of the cached {PROMPT_TOKENS}-token prompt (a full hit, nothing "
                         f"reserved); lease.runs(): a zero-copy view per run of blocks laid back to back (one "
                         f"for all {PROMPT_CHUNKS} chunks when they were stored in one piece; each touched by its "
                         "data_ptr(), one element of the last read with .item()), then finish(): no "
                         "RPC, the lease release goes on the session stream",
                REQ_HIT_CHUNKS: f"the same with lease.chunk(i) for each of the {PROMPT_CHUNKS} chunks (the hit "
                                "before run views)",
                REQ_MISS: f"acquire_reserve of a fresh random {PROMPT_TOKENS}-token prompt (distinct per request; "
                          f"nothing leased, {PROMPT_CHUNKS} chunks reserved), write(kv) of a [2, 1, 1, "
                          f"{PROMPT_TOKENS}, 8] float16 tensor into the reserved pool blocks, finish(): one Commit",
            },
            "part": "part_p50_us / part_p99_us: the chunk views (hit) or write(kv) (miss), timed inside the request",
            "miss_room": (f"the pool ({pool_bytes >> 20} MiB) holds a whole batch of misses with >= 20% free, so no "
                          "miss evicts and the write-back thread (demotes below writeback_low free) never runs; "
                          "the misses' chunks are evicted between batches, untimed (Evict of the miss layout)"),
            "pool_min_free_fraction_after_a_miss_batch": pool_min_free_fraction,
            "chunks_evicted_per_miss_batch": sorted(set(evicted_per_batch)),
            "drain": "after each batch, untimed for latency and throughput, Client.sync() on every client (the "
                     "daemon has done the stream releases); throughput_incl_drain closes the window there; the "
                     "daemon CPU per op includes that work",
        },
        "results": results,
        "ratios": per_request_verdicts(results),
        "rpcs_per_request": rpcs,
        "targets": PER_REQUEST_TARGETS,
        "daemon_counters_after": st.get("counters"),
        "daemon_exit_code": exit_code,
    }


def per_request_verdicts(results: dict) -> dict:
    t = PER_REQUEST_TARGETS
    out = {}
    for key, level in results.items():
        ping, hit, miss = level[REQ_PING], level[REQ_HIT], level[REQ_MISS]
        hp50, mp50 = ratio(hit["p50_us"], ping["p50_us"]), ratio(miss["p50_us"], ping["p50_us"])
        htp = ratio(hit["throughput_ops_s_median"], ping["throughput_ops_s_median"])
        mtp = ratio(miss["throughput_ops_s_median"], ping["throughput_ops_s_median"])
        out[key] = {
            "hit_p50_over_ping_p50": hp50, "hit_p50_target_met": hp50 <= t["hit_p50_over_ping_p50_max"],
            "miss_p50_over_ping_p50": mp50, "miss_p50_target_met": mp50 <= t["miss_p50_over_ping_p50_max"],
            "hit_throughput_over_ping": htp, "hit_throughput_target_met": htp >= t["hit_throughput_over_ping_min"],
            "miss_throughput_over_ping": mtp,
            "miss_throughput_target_met": mtp >= t["miss_throughput_over_ping_min"],
            "hit_p99_over_ping_p99": ratio(hit["p99_us"], ping["p99_us"]),
            "hit_p50_over_hit_with_a_view_per_chunk": ratio(hit["p50_us"], level[REQ_HIT_CHUNKS]["p50_us"]),
            "hit_read_part_p50_over_a_view_per_chunk": ratio(hit.get("part_p50_us", float("nan")),
                                                             level[REQ_HIT_CHUNKS].get("part_p50_us", float("nan"))),
            "miss_p99_over_ping_p99": ratio(miss["p99_us"], ping["p99_us"]),
            "hit_throughput_incl_drain_over_ping": ratio(hit["throughput_incl_drain_ops_s_median"],
                                                         ping["throughput_incl_drain_ops_s_median"]),
            "miss_throughput_incl_drain_over_ping": ratio(miss["throughput_incl_drain_ops_s_median"],
                                                          ping["throughput_incl_drain_ops_s_median"]),
        }
    return out


def print_per_request(pr: dict) -> None:
    print(f"\nper request, sync Client, one per thread ({PROMPT_TOKENS}-token prompt, {PROMPT_CHUNKS} chunks): "
          "a full hit (acquire_reserve + chunk views + finish) and a miss (acquire_reserve + write + finish) "
          "vs Ping")
    headers = ["conc  row", "p50 ms", "p99 ms", "req/s (median)", "p50/ping", "req/s / ping", "req/s incl drain",
               "part p50 us", "client cpu us/op", "daemon cpu us/op", "daemon switches/op"]
    rows = []
    for key, level in pr["results"].items():
        base = level[REQ_PING]
        for name, s in level.items():
            rows.append([f"{key:4s} {name}", s["p50_ms"], s["p99_ms"], s["throughput_ops_s_median"],
                         ratio(s["p50_us"], base["p50_us"]),
                         ratio(s["throughput_ops_s_median"], base["throughput_ops_s_median"]),
                         s["throughput_incl_drain_ops_s_median"],
                         s.get("part_p50_us", float("nan")), s["client_cpu_us_per_op"], s["daemon_cpu_us_per_op"],
                         s["daemon_switches_per_op"]])
    print(format_table(headers, rows))
    print("RPCs per request (counted once, untimed, on a warm client):")
    for name, r in pr["rpcs_per_request"].items():
        by = ", ".join(f"{k} {v:g}" for k, v in r["by_method"].items())
        print(f"  {name:17s} {r['rpcs_per_request']:g}  ({by}; session-stream messages "
              f"{r['session_stream_messages_per_request']:g})")
    t = pr["targets"]
    print(f"targets: hit p50 <= {t['hit_p50_over_ping_p50_max']}x ping, miss p50 <= "
          f"{t['miss_p50_over_ping_p50_max']}x, hit throughput >= {t['hit_throughput_over_ping_min']}x, "
          f"miss throughput >= {t['miss_throughput_over_ping_min']}x")

    def v(ok: bool) -> str:
        return "PASS" if ok else "NOT MET"

    for key, r in pr["ratios"].items():
        print(f"  {key:4s} hit p50 {r['hit_p50_over_ping_p50']:.2f}x -> {v(r['hit_p50_target_met'])};"
              f"  miss p50 {r['miss_p50_over_ping_p50']:.2f}x -> {v(r['miss_p50_target_met'])};"
              f"  hit throughput {r['hit_throughput_over_ping']:.2f}x -> {v(r['hit_throughput_target_met'])};"
              f"  miss throughput {r['miss_throughput_over_ping']:.2f}x -> {v(r['miss_throughput_target_met'])}")


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
    p.add_argument("--only", choices=["per_request"], default=None,
                   help="run only these rows: per_request (ping / request full hit / request miss through the "
                        "sync Client, one per thread); writes rpc_latency.per_request[.quick].json")
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
    name = "rpc_latency" + (f".{args.only}" if args.only else "") + (".quick" if args.quick else "")
    path = write_json(name, res, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
