"""Question: with N inference processes (default 48) replaying the Mooncake FAST'25 traces against
one real daemon whose pool and NVMe tier are both far smaller than the working set, for a bounded
time (default 120 s), does kvcached stay correct and stable: zero failed RPCs, every leased byte
right, zero leases / reservations / pins left once the clients are gone, daemon RSS flat after
warm-up; and what are the acquire p50 / p99 latencies, hit rate and eviction counts?

Setup: one real ``kvcached serve`` (``bench.harness.daemon.Daemon``: temp dir, Unix socket, device cpu, host
packed pool in /dev/shm sized to hold ``--pool-chunks`` 16 KiB chunks, default clients x
(max_chunks + 1) + 512 so a put can never find the pool all pinned, write-back on (the default),
NVMe tier on, ``--nvme-mib`` 128 MiB; both tiers are filled within seconds and then evict for the
rest of the run). N client processes, each a separate Python process with one channel and one
Session stream, like one inference worker with one ``Client``. Two models (layouts), both 512-token
chunks of 16 KiB: ``--synthetic-share`` (1/4) of the clients serve the synthetic trace as model B,
the rest the conversation trace as model A. Requests of a trace are dealt round-robin to its
clients and issued at their trace timestamps compressed ``--speed`` times (open loop; a client that
falls behind runs back to back and its lag is reported); a trace that runs out starts again (same
prompts: second-pass hits).

Per request (what the inference service does), block ``h`` = tokens ``h*512 .. h*512+511`` as in
``trace_replay.py``, prompts cut to ``--max-chunks`` (64) full chunks:

1. ``Lookup``  (the scheduler asks how much is cached)
2. ``Acquire`` (timed: the latency reported), pinning the cached prefix; half the clients
   (``--direct-share``) ask ``read_nvme_directly`` (the client library's default) and read
   NVMe-only chunks from the LMDB file themselves (header + payload CRCs checked, as
   ``kvcached_client.nvme`` does), the others let the daemon promote them into the pool
3. read the leased chunks (zero-copy view of the mapped pool, or the LMDB value) and compare
   ``--verify`` (default all) of them with the deterministic payload of their block: a 16 KiB
   random base XOR a 64-bit mix of (model, h), so a wrong, stale or shifted byte is caught
4. ``Release``
5. ``Reserve`` (with the trace's ``output_length`` as expected output tokens), write the
   payload of every reserved chunk straight into its place in the pool, ``Commit``

With probability 1/``--crash-every`` per request a client ends abruptly instead: it holds the
lease of step 2 and a half-written reservation and calls ``os._exit`` (no Release, no Abort, no
session close); a new process takes its place and its share. The daemon must release what the
dead session held. Workers use the raw stub + numpy (no torch: ``import torch`` costs ~250 MB
RSS and 1.5 s per process, too much for 48 processes on a 2-core box) with the client library's
pool mapping (``kvcached_client.pool.PoolMap``), location decoding and LMDB environment.

Measured: ops and failures per RPC type (any failed RPC is listed with its status), bytes
verified, daemon RSS (VmRSS and its anonymous / file / shmem parts, threads, fds) every second,
Stats every 2 s, acquire latency per 5 s window; after all clients exited: ``leases_active``,
``reservations_active``, open sessions, pool chunks leased / reserved (must all reach 0), LMDB
reader slots after ``doctor`` cleared dead readers. RSS "flat": VmRSS and RssAnon at the end
at most ``--rss-tolerance`` (10 %) above their value at the end of warm-up (``--warmup``, the first
third of the run; the tiers fill and the index reaches its steady size within it), with the
slope of a least-squares line over the post-warm-up samples in MiB/min.

Run:   .venv/bin/python bench/soak.py                 (48 clients x 120 s; ~2.5 min on a 2-core box)
       .venv/bin/python bench/soak.py --clients 64 --seconds 300
       .venv/bin/python bench/soak.py --quick         (4 clients x 8 s; writes soak.quick.json)
Output: bench/results/soak.json, bench/results/soak.png; exit status 1 if a check failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import (
    REPO_ROOT, TRACE_DIR, bench_parser, finish, format_table, install_sigterm_exit, save_figure, subplots,
)
from bench.harness.daemon import Daemon
from bench._soak_observe import Sampler, analyze, leftover, read_doc, stats_row, tail_log
from bench._soak_worker import CHUNK_BYTES, CRASH_RC, RPC_TIMEOUT, MiB, worker_main


@dataclasses.dataclass
class SoakConfig:
    clients: int = 48
    seconds: float = 120.0
    speed: float = 3.0  # trace time compression (see the module docstring for why not more)
    synthetic_share: float = 0.25
    direct_share: float = 0.5
    crash_every: int = 400  # mean requests between abrupt exits of one client; 0 = never
    max_chunks: int = 64
    pool_chunks: int = 0  # chunks the pool holds (pool_bytes = pool_chunks x 16 KiB); 0: clients * (max_chunks + 1) + 512
    nvme_mib: int = 64
    verify: float = 1.0  # fraction of leased chunks whose bytes are compared
    warmup: float = 1 / 3  # fraction of the run before the RSS baseline
    rss_tolerance: float = 0.10
    rss_interval: float = 1.0
    stats_interval: float = 2.0
    window: float = 5.0  # seconds per latency window in the time series
    seed: int = 7
    worker_threads: int = 4

    def resolved_pool_chunks(self) -> int:
        return self.pool_chunks or self.clients * (self.max_chunks + 1) + 512


# -- trace shares -----------------------------------------------------------------------------


def load_trace(name: str) -> list[list]:
    out = []
    with open(os.path.join(TRACE_DIR, f"{name}_trace.jsonl")) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append([d["timestamp"], int(d["input_length"]), int(d["output_length"]), d["hash_ids"]])
    return out


def assign(cfg: SoakConfig) -> list[tuple[str, int, int]]:
    """(trace, index among that trace's clients, clients on that trace) for each client slot."""
    n_syn = round(cfg.clients * cfg.synthetic_share) if cfg.clients > 1 else 0
    n_syn = min(max(n_syn, 1 if cfg.synthetic_share > 0 and cfg.clients > 1 else 0), cfg.clients - 1)
    n_conv = cfg.clients - n_syn
    out = []
    ci = si = 0
    for k in range(cfg.clients):  # interleave so both kinds start early
        if si < n_syn and (k % 4 == 3 or ci >= n_conv):
            out.append(("synthetic", si, n_syn))
            si += 1
        else:
            out.append(("conversation", ci, n_conv))
            ci += 1
    return out


def write_shares(cfg: SoakConfig, workdir: str) -> dict[tuple[str, int], str]:
    """One JSON file per client: its round-robin share of its trace, plus the trace's period."""
    paths = {}
    slots = assign(cfg)
    for name in sorted({t for t, _, _ in slots}):
        reqs = load_trace(name)
        t0 = reqs[0][0]
        period = reqs[-1][0] - t0 + (reqs[-1][0] - t0) / max(1, len(reqs) - 1)
        n = next(c for t, _, c in slots if t == name)
        for k in range(n):
            share = reqs[k::n]
            p = os.path.join(workdir, f"share-{name}-{k}.json")
            with open(p, "w") as f:
                json.dump({"trace": name, "t0_ms": t0, "period_ms": period, "requests": share}, f)
            paths[(name, k)] = p
    return paths


# -- the run -----------------------------------------------------------------------------------


def _spawn(spec: dict, workdir: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "clients")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    err = open(os.path.join(workdir, f"{spec['name']}.err"), "w")  # noqa: SIM115 - closed by the child's exit
    try:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    finally:
        err.close()


def daemon_settings(cfg: SoakConfig) -> dict:
    return {
        "device": "cpu",
        "pool_bytes": cfg.resolved_pool_chunks() * CHUNK_BYTES,  # a packed pool: exactly that many chunks
        "nvme_bytes": cfg.nvme_mib * MiB,
        "expire_interval": 1.0,
        "worker_threads": cfg.worker_threads,
        "log_level": "warning",
    }


def run_soak(cfg: SoakConfig, log=print) -> dict:
    """Start a daemon, run the clients for ``cfg.seconds``, check what is left; returns the results."""
    import grpc

    from kvcached.v1 import kvcached_pb2 as pb
    from kvcached.v1 import kvcached_pb2_grpc as pb_grpc

    wall0 = time.time()
    workdir = tempfile.mkdtemp(prefix="kvc-soak-")
    slots = assign(cfg)
    result: dict = {"config": dataclasses.asdict(cfg), "pool_chunks": cfg.resolved_pool_chunks(),
                    "daemon_settings": daemon_settings(cfg)}
    worker_docs: list[dict] = []
    worker_errors: list[dict] = []
    procs: dict[int, tuple[subprocess.Popen, dict]] = {}
    try:
        shares = write_shares(cfg, workdir)
        with Daemon.temp(daemon_settings(cfg), prefix="kvc-soak-d-") as d:
            pid = d.proc.pid
            startup = 1.0 + 0.15 * cfg.clients  # the workers import grpc + numpy meanwhile
            run_t0 = time.time() + startup
            deadline = run_t0 + cfg.seconds
            sampler = Sampler(pid, d.socket, run_t0, cfg)
            sampler.start()
            incarnation = Counter()

            def spec_for(k: int, start: int) -> dict:
                trace, idx, _ = slots[k]
                inc = incarnation[k]
                incarnation[k] += 1
                name = f"c{k:02d}.{inc}"
                return {"name": name, "socket": d.socket, "share": shares[(trace, idx)], "start": start,
                        "direct": (k % 2 == 0) if cfg.direct_share == 0.5 else (k < round(cfg.clients * cfg.direct_share)),
                        "run_t0": run_t0, "deadline": deadline, "speed": cfg.speed, "max_chunks": cfg.max_chunks,
                        "verify": cfg.verify, "crash_every": cfg.crash_every,
                        "seed": cfg.seed * 1_000_003 + k * 1009 + inc, "out": os.path.join(workdir, f"{name}.json")}

            for k in range(cfg.clients):  # spread over the start-up time, as real workers start
                spec = spec_for(k, 0)
                procs[k] = (_spawn(spec, workdir), spec)
                time.sleep(min(0.1, startup / 2 / cfg.clients))
            log(f"daemon pid {pid}; {cfg.clients} clients started; run {cfg.seconds:.0f} s after "
                f"{startup:.1f} s of start-up")
            hard_stop = deadline + 60 + cfg.clients * 0.5
            last_note = time.time()
            while procs:
                now = time.time()
                for k, (proc, spec) in list(procs.items()):
                    rc = proc.poll()
                    if rc is None:
                        if now > hard_stop:
                            proc.kill()
                            proc.wait()
                            worker_errors.append({"worker": spec["name"], "rc": "killed: still running 60 s after "
                                                  "the deadline", "log": tail_log(workdir, spec["name"])})
                            del procs[k]
                        continue
                    del procs[k]
                    doc = read_doc(spec["out"])
                    if doc is not None:
                        worker_docs.append(doc)
                    if rc == CRASH_RC and doc is not None and doc.get("crashed"):
                        if time.time() < deadline - 1.0:
                            nspec = spec_for(k, doc["next"])
                            procs[k] = (_spawn(nspec, workdir), nspec)
                    elif rc != 0 or doc is None:
                        worker_errors.append({"worker": spec["name"], "rc": rc, "log": tail_log(workdir, spec["name"])})
                if now - last_note >= 30 and now < deadline:
                    last_note = now
                    s = sampler.stats[-1] if sampler.stats else {}
                    log(f"  t={now - run_t0:5.0f} s  acquires {s.get('acquires', 0):,}  hit {s.get('hit_rate', 0):.3f}  "
                        f"pool evictions {s.get('pool_evictions', 0):,}  RSS "
                        f"{(sampler.proc[-1]['VmRSS'] / 1024 if sampler.proc else 0):.0f} MiB")
                time.sleep(0.1)
            clients_done = time.time()

            # After every client is gone: nothing may stay leased, reserved, pinned or open.
            channel = grpc.insecure_channel(f"unix:{d.socket}")
            stub = pb_grpc.KVCacheStub(channel)
            try:
                first = last = None
                t_zero = None
                while True:
                    row = stats_row(json.loads(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT).json))
                    first = first or row
                    last = row
                    if leftover(row) == 0:
                        t_zero = time.time() - clients_done
                        break
                    if time.time() - clients_done > 10:
                        break
                    time.sleep(0.05)
                doc = json.loads(stub.Stats(pb.StatsRequest(doctor=True), timeout=RPC_TIMEOUT).json)
                final = json.loads(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT).json)
            finally:
                channel.close()
            sampler.stop()
            alive = d.proc.poll() is None
            result["after_clients"] = {
                "first_stats": first, "final_stats": last, "seconds_to_zero": t_zero,
                "doctor": doc.get("doctor"), "nvme_readers_after_doctor": (final.get("nvme") or {}).get("readers"),
            }
            result["final_counters"] = final["counters"]
            result["final_pool"] = final["pool"]
            result["final_nvme"] = final.get("nvme")
            result["daemon_alive_at_end"] = alive
            daemon_log = d.log()
            result["daemon_stop_exit_code"] = d.stop()
            result["daemon_log_errors"] = [ln for ln in daemon_log.splitlines()
                                           if "Traceback" in ln or " ERROR" in ln or "CRITICAL" in ln][:20]
            result["rss_samples"] = sampler.proc
            result["stats_samples"] = sampler.stats
            result["sampler_failures"] = sampler.failures
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    result["worker_errors"] = worker_errors
    result["wall_seconds"] = time.time() - wall0
    analyze(result, worker_docs, cfg)
    return result


# -- report --------------------------------------------------------------------------------------


def print_report(r: dict) -> None:
    cfg = r["config"]
    print(f"\nsoak: {cfg['clients']} clients x {cfg['seconds']:.0f} s, trace speed x{cfg['speed']:g}, "
          f"pool of {r['pool_chunks']:,} x 16 KiB chunks, NVMe {cfg['nvme_mib']} MiB; "
          f"{r['worker_processes']} client processes ran ({r['abrupt_session_ends']} ended abruptly)")
    rows = []
    for k in ("lookup", "acquire", "release", "reserve", "commit"):
        lt = r["latency"].get(k, {})
        rows.append([k, r["ops"].get(k, 0), r["failed_ops"].get(k, 0), lt.get("p50_us", float("nan")),
                     lt.get("p99_us", float("nan")), lt.get("max_us", float("nan"))])
    other = {k: v for k, v in r["ops"].items() if k not in ("lookup", "acquire", "release", "reserve", "commit")}
    print(format_table(["RPC", "ok", "failed", "p50 us", "p99 us", "max us"], rows))
    print(f"  other RPCs: {other}; failed RPCs in total: {r['failed_rpcs']}"
          + (f" {r['failure_codes']}" if r["failure_codes"] else ""))
    c = r["counts"]
    print(f"  requests {c.get('requests', 0):,} ({r['requests_per_s']:.0f}/s), schedule lag p50 "
          f"{r['schedule_lag_ms']['p50']:.1f} ms p99 {r['schedule_lag_ms']['p99']:.1f} ms")
    print(f"  chunks leased {c.get('chunks_leased', 0):,}, verified {c.get('chunks_verified', 0):,} "
          f"({c.get('bytes_verified', 0) / MiB:,.0f} MiB, {c.get('nvme_direct_reads', 0):,} read from LMDB directly), "
          f"wrong {c.get('chunks_bad', 0)}; written {c.get('chunks_written', 0):,}, committed "
          f"{c.get('chunks_committed', 0):,}")
    print(f"  hit rate: {r['hit_rate_chunks']:.3f} of prompt chunks (daemon, tokens incl. lookups: "
          f"{(r['hit_rate_daemon_tokens'] or 0):.3f}); evictions {r['evictions']}")
    a = r.get("after_clients", {})
    print(f"  after the clients exited: {r['leaked']} (all 0 after {a.get('seconds_to_zero')} s); "
          f"LMDB readers after doctor: {a.get('nvme_readers_after_doctor')}")
    x = r["rss"]
    if "vmrss_warm_mib" in x:
        rows = [[lbl, x[f"{k}_warm_mib"], x[f"{k}_end_mib"], x[f"{k}_ratio"], x[f"{k}_slope_mib_per_min"]]
                for lbl, k in (("VmRSS", "vmrss"), ("RssAnon", "anon"), ("RssFile", "file"), ("RssShmem", "shmem"))]
        print(f"\ndaemon memory, warm-up end (t={x['warmup_end_s']:.0f} s) vs end:")
        print(format_table(["", "warm MiB", "end MiB", "end/warm", "MiB/min"], rows))
        print(f"  threads {x['threads_warm']} -> {x['threads_end']}, fds {x['fds_warm']} -> {x['fds_end']}, "
              f"daemon CPU {x['daemon_cpu_util'] * 100:.0f} % of a core")
    print("\nchecks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()))
    if r["failures"]:
        print("failed RPCs (first ones):")
        for f in r["failures"][:10]:
            print(f"  {f}")
    if r["client_errors"]:
        print(f"client errors ({r['counts'].get('client_errors')}; first ones):")
        for e in r["client_errors"][:5]:
            print(f"  {e}")
    if r["mismatches"]:
        print("wrong bytes (first ones):")
        for m in r["mismatches"][:10]:
            print(f"  {m}")
    for e in r["worker_errors"][:5]:
        print(f"worker error {e['worker']} rc={e['rc']}:\n{e['log']}")
    for ln in r["daemon_log_errors"][:10]:
        print(f"daemon log: {ln}")
    print(f"\nwall {r['wall_seconds']:.0f} s; verdict: {'OK' if r['ok'] else 'FAILED'}")


def plot(r: dict, path: str) -> None:
    fig, (ax1, ax2) = subplots(2, 1, figsize=(8, 6.4), sharex=True)
    s = [x for x in r["rss_samples"] if x["t"] >= 0]
    t = [x["t"] for x in s]
    for key, label, style in (("VmRSS", "VmRSS", "-"), ("RssAnon", "RssAnon (heap)", "-"),
                              ("RssShmem", "RssShmem (pool pages)", "--"), ("RssFile", "RssFile (LMDB, code)", ":")):
        ax1.plot(t, [x[key] / 1024 for x in s], style, label=label)
    ax1.axvline(r["rss"]["warmup_end_s"], color="grey", lw=0.8, ls="--", label="warm-up end")
    ax1.set_ylabel("daemon memory (MiB)")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=7.5, loc="upper left", ncol=2)
    ax1.grid(True, alpha=0.3)
    cfg = r["config"]
    ax1.set_title(f"kvcached soak: {cfg['clients']} client processes, trace x{cfg['speed']:g}, "
                  f"{r['requests_per_s']:.0f} req/s, failed RPCs {r['failed_rpcs']}")
    w = r["acquire_windows"]
    tw = [x["t"] for x in w]
    ax2.plot(tw, [x["p50_us"] / 1000 for x in w], "-o", ms=3, label="acquire p50")
    ax2.plot(tw, [x["p99_us"] / 1000 for x in w], "-s", ms=3, label="acquire p99")
    ax2.set_yscale("log")
    ax2.set_ylabel("acquire latency (ms)")
    ax2.set_xlabel("seconds since start")
    ax2.axvline(r["rss"]["warmup_end_s"], color="grey", lw=0.8, ls="--")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7.5, loc="upper left")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        try:
            return worker_main(json.loads(sys.argv[2]))
        except BaseException:
            traceback.print_exc()
            return 1
    p = bench_parser(__doc__, "4 clients x 8 s; writes soak.quick.json")
    d = SoakConfig()
    p.add_argument("--clients", type=int, default=d.clients, help=f"client processes (32..64 intended; default {d.clients})")
    p.add_argument("--seconds", type=float, default=d.seconds, help=f"run time (default {d.seconds:g})")
    p.add_argument("--speed", type=float, default=d.speed, help=f"trace time compression (default {d.speed:g})")
    p.add_argument("--synthetic-share", type=float, default=d.synthetic_share)
    p.add_argument("--direct-share", type=float, default=d.direct_share,
                   help="fraction of clients that read NVMe chunks from the LMDB file themselves")
    p.add_argument("--crash-every", type=int, default=d.crash_every,
                   help="mean requests between abrupt exits of one client (0: never)")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks)
    p.add_argument("--pool-chunks", type=int, default=0,
                   help="chunks the pool holds (pool_bytes = that x 16 KiB); default clients * (max_chunks + 1) + 512")
    p.add_argument("--nvme-mib", type=int, default=d.nvme_mib)
    p.add_argument("--verify", type=float, default=d.verify, help="fraction of leased chunks compared (default all)")
    p.add_argument("--warmup", type=float, default=d.warmup, help="fraction of the run before the RSS baseline")
    p.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance)
    args = p.parse_args(argv)
    if not os.path.isdir(TRACE_DIR):
        print(f"the Mooncake traces are not at {TRACE_DIR} (set KVCACHED_TRACES)", file=sys.stderr)
        return 2
    cfg = SoakConfig(clients=args.clients, seconds=args.seconds, speed=args.speed, synthetic_share=args.synthetic_share,
                     direct_share=args.direct_share, crash_every=args.crash_every, max_chunks=args.max_chunks,
                     pool_chunks=args.pool_chunks, nvme_mib=args.nvme_mib, verify=args.verify, warmup=args.warmup,
                     rss_tolerance=args.rss_tolerance)
    if args.quick:
        cfg = dataclasses.replace(cfg, clients=4, seconds=8.0, crash_every=min(cfg.crash_every or 100, 100),
                                  nvme_mib=min(cfg.nvme_mib, 16), window=1.0)
    install_sigterm_exit()
    res = run_soak(cfg)
    finish("soak", res, args, print_report, plot=plot)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
