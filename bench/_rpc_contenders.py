"""rpc_latency.py's contenders: the raw-stub, AsyncClient and sync Client callers, their ops, the
per-contender tallies (latency, throughput, client and daemon CPU) and the ratios to the empty RPC.
Not a benchmark itself: ``bench/rpc_latency.py`` runs them."""

from __future__ import annotations

import asyncio
import gc
import glob
import time
from typing import Any, NamedTuple

from bench._common import ratio, summarize_ns

import grpc
import numpy as np
from kvcached_client import AsyncClient, Client, KVLayout, _core

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
