"""rpc_latency.py's per-request rows (``--only per_request``): one request's whole cache work
through the public sync ``Client``, N threads each with its own client, next to an empty RPC.
Not a benchmark itself: ``bench/rpc_latency.py`` runs them."""

from __future__ import annotations

import gc
import glob
import os
import threading
import time
from typing import Any

from bench._common import format_table, ratio, summarize_ns
from bench.harness.daemon import Daemon
from bench._rpc_contenders import CHUNK_TOKENS, LAYOUT, PROMPT_CHUNKS, PROMPT_TOKENS, Tally, daemon_usage

import numpy as np
from kvcached_client import Client, KVLayout

from kvcached.v1 import kvcached_pb2 as pb

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
    with Daemon.temp(settings, prefix="kvc-bench-rpc-req-") as d:
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
