"""soak.py's observation of the daemon and the analysis of a run: /proc and Stats sampling while
the clients run, and the counters, latencies, RSS trend and verdicts computed from them.
Not a benchmark itself: ``bench/soak.py`` runs them."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from bench._common import percentile
from bench._soak_worker import RPC_TIMEOUT

import numpy as np

if TYPE_CHECKING:
    from bench.soak import SoakConfig

# -- daemon sampling --------------------------------------------------------------------------


def read_proc(pid: int) -> dict | None:
    """VmRSS and its parts (KiB), threads, fds, CPU seconds of ``pid``; None once it is gone."""
    out: dict = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[k] = int(v.split()[0])
                elif k == "Threads":
                    out[k] = int(v)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return out


class Sampler(threading.Thread):
    """Every ``rss_interval``: the daemon's /proc figures; every ``stats_interval``: its Stats."""

    def __init__(self, pid: int, socket: str, run_t0: float, cfg: SoakConfig) -> None:
        super().__init__(daemon=True)
        self.pid, self.socket, self.run_t0, self.cfg = pid, socket, run_t0, cfg
        self.proc: list[dict] = []
        self.stats: list[dict] = []
        self.failures: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        import grpc

        from kvcached.v1 import kvcached_pb2 as pb
        from kvcached.v1 import kvcached_pb2_grpc as pb_grpc

        channel = grpc.insecure_channel(f"unix:{self.socket}")
        stub = pb_grpc.KVCacheStub(channel)
        next_stats = 0.0
        try:
            while not self._halt.is_set():
                t = time.time() - self.run_t0
                p = read_proc(self.pid)
                if p is not None:
                    p["t"] = round(t, 3)
                    self.proc.append(p)
                if t >= next_stats:
                    next_stats = t + self.cfg.stats_interval
                    try:
                        d = json.loads(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT).json)
                        self.stats.append({"t": round(t, 3), **stats_row(d)})
                    except grpc.RpcError as e:
                        self.failures.append({"method": "stats (sampler)", "code": e.code().name, "details": e.details(),
                                              "t": round(t, 3), "worker": "sampler"})
                self._halt.wait(self.cfg.rss_interval)
        finally:
            channel.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def stats_row(d: dict) -> dict:
    c, pool, nv = d["counters"], d["pool"], d.get("nvme") or {}
    return {
        "leases_active": d["leases_active"], "reservations_active": d["reservations_active"],
        "sessions_open": d.get("sessions_open"), "indexed_chunks": d["indexed_chunks"],
        "pool_free_bytes": pool["free_bytes"], "pool_largest_free_bytes": pool["largest_free_bytes"],
        "pool_payload_bytes": pool["payload_bytes"], "pool_leased_chunks": pool["leased_chunks"],
        "pool_reserved_chunks": pool["reserved_chunks"], "nvme_chunks": nv.get("chunks"),
        "nvme_used_bytes": nv.get("used_bytes"),
        "nvme_file_bytes": nv.get("file_bytes"), "nvme_readers": nv.get("readers"),
        "pool_evictions": c["pool_evictions"], "nvme_evictions": c["nvme_evictions"], "demotions": c["demotions"],
        "promotions": c["promotions"], "hit_rate": d["hit_rate"], "acquires": c["acquires"],
        "leases_expired": c["leases_expired"], "reservations_expired": c["reservations_expired"],
        "leases_session_released": c["leases_session_released"], "dropped_no_room": c["dropped_no_room"],
        "corrupt_dropped": c["corrupt_dropped"], "inline_fallbacks": d.get("inline_fallbacks"),
    }


def leftover(row: dict) -> int:
    return (row["leases_active"] + row["reservations_active"] + (row["sessions_open"] or 0)
            + row["pool_leased_chunks"] + row["pool_reserved_chunks"])


def read_doc(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tail_log(workdir: str, name: str, n: int = 3000) -> str:
    try:
        with open(os.path.join(workdir, f"{name}.err")) as f:
            return f.read()[-n:]
    except OSError:
        return ""


# -- analysis ------------------------------------------------------------------------------------


def _slope_per_min(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 3:
        return float("nan")
    return float(np.polyfit(np.asarray(ts), np.asarray(ys), 1)[0] * 60)


def _lat_summary(xs_us: list[int]) -> dict:
    xs = sorted(xs_us)
    return {"n": len(xs), "p50_us": percentile(xs, 50), "p90_us": percentile(xs, 90), "p99_us": percentile(xs, 99),
            "max_us": float(xs[-1]) if xs else float("nan")}


def analyze(result: dict, docs: list[dict], cfg: SoakConfig) -> None:
    ops: Counter = Counter()
    failed: Counter = Counter()
    counts: Counter = Counter()
    failures: list[dict] = []
    mismatches: list[dict] = []
    client_errors: list[dict] = []
    lat: dict[str, list[int]] = {}
    acq_points: list[tuple[int, int]] = []
    lags: list[float] = []
    for doc in docs:
        ops.update(doc["ops"])
        failed.update(doc["failed_ops"])
        counts.update(doc["counts"])
        failures.extend(doc["failures"])
        mismatches.extend(doc["mismatches"])
        client_errors.extend(doc.get("client_errors", []))
        for k, xs in doc["lat_us"].items():
            lat.setdefault(k, []).extend(xs)
        acq_points.extend(zip(doc["acquire_t_ms"], doc["lat_us"]["acquire"]))
        lags.extend(doc["lag_ms"])
    failures.extend(result.get("sampler_failures", []))
    failed_total = sum(failed.values()) + len(result.get("sampler_failures", []))
    result["ops"] = dict(ops)
    result["ops_total"] = sum(ops.values())
    result["failed_ops"] = dict(failed)
    result["failed_rpcs"] = failed_total
    result["failures"] = failures[:50]
    result["failure_codes"] = dict(Counter(f"{f['method']}: {f['code']}" for f in failures))
    result["counts"] = dict(counts)
    result["worker_processes"] = len(docs)
    result["mismatches"] = mismatches[:20]
    result["client_errors"] = client_errors[:20]
    result["latency"] = {k: _lat_summary(v) for k, v in lat.items()}
    lags.sort()
    result["schedule_lag_ms"] = {"p50": percentile(lags, 50), "p99": percentile(lags, 99),
                                 "max": lags[-1] if lags else float("nan")}
    req = counts["requests"]
    result["requests_per_s"] = req / cfg.seconds if cfg.seconds else float("nan")
    result["hit_rate_chunks"] = counts["hit_chunks"] / counts["prompt_chunks"] if counts["prompt_chunks"] else 0.0

    # acquire latency per window
    win = cfg.window if cfg.seconds >= 4 * cfg.window else max(1.0, cfg.seconds / 4)
    buckets: dict[int, list[int]] = {}
    for t_ms, us in acq_points:
        buckets.setdefault(int(t_ms / 1000 // win), []).append(us)
    result["acquire_windows"] = [
        {"t": (b + 0.5) * win, **_lat_summary(v)} for b, v in sorted(buckets.items()) if b * win < cfg.seconds
    ]

    # RSS
    samples = [s for s in result.get("rss_samples", []) if 0 <= s["t"] <= cfg.seconds + 0.5]
    warm_t = cfg.warmup * cfg.seconds
    post = [s for s in samples if s["t"] >= warm_t]
    rss: dict = {"warmup_end_s": warm_t}
    if len(post) >= 2:
        a, b = post[0], post[-1]
        for key, label in (("VmRSS", "vmrss"), ("RssAnon", "anon"), ("RssFile", "file"), ("RssShmem", "shmem")):
            rss[f"{label}_warm_mib"] = a[key] / 1024
            rss[f"{label}_end_mib"] = b[key] / 1024
            rss[f"{label}_ratio"] = b[key] / a[key] if a[key] else float("nan")
            rss[f"{label}_slope_mib_per_min"] = _slope_per_min([s["t"] for s in post], [s[key] / 1024 for s in post])
        rss["peak_vmrss_mib"] = max(s["VmRSS"] for s in samples) / 1024
        rss["threads_warm"], rss["threads_end"] = a["Threads"], b["Threads"]
        rss["fds_warm"], rss["fds_end"] = a["fds"], b["fds"]
        rss["daemon_cpu_s"] = samples[-1]["cpu_s"] - samples[0]["cpu_s"]
        rss["daemon_cpu_util"] = rss["daemon_cpu_s"] / max(1e-9, samples[-1]["t"] - samples[0]["t"])
        tol = cfg.rss_tolerance
        # one-sided: shrinking after warm-up (freed gRPC buffers, arenas returned) is no leak
        rss["anon_flat"] = bool(rss["anon_ratio"] <= 1 + tol)
        rss["vmrss_flat"] = bool(rss["vmrss_ratio"] <= 1 + tol)
    else:
        rss["anon_flat"] = rss["vmrss_flat"] = False
    result["rss"] = rss

    after = result.get("after_clients", {})
    final = after.get("final_stats") or {}
    fc = result.get("final_counters", {})
    result["evictions"] = {k: fc.get(k) for k in ("pool_evictions", "nvme_evictions", "demotions", "promotions",
                                                   "prefetched", "dropped_no_room")}
    result["hit_rate_daemon_tokens"] = final.get("hit_rate")
    leaked = {k: final.get(k) for k in ("leases_active", "reservations_active", "sessions_open", "pool_leased_chunks",
                                        "pool_reserved_chunks")}
    result["leaked"] = leaked
    crashes = counts["crashes"]
    result["abrupt_session_ends"] = crashes
    result["checks"] = {
        "zero_failed_rpcs": failed_total == 0,
        "zero_worker_errors": not result.get("worker_errors"),
        "zero_client_errors": counts["client_errors"] == 0,
        "zero_leaks_after_clients_exit": bool(final) and all(v == 0 for v in leaked.values()),
        "every_byte_verified": counts["chunks_bad"] == 0 and counts["bad_matched_tokens"] == 0
        and counts["chunks_verified"] > 0
        and (cfg.verify < 1.0 or counts["chunks_verified"] == counts["chunks_leased"]),
        "no_lease_expired_under_a_client": counts["release_not_live"] == 0 and fc.get("leases_expired", 0) == 0,
        "daemon_alive": bool(result.get("daemon_alive_at_end")) and result.get("daemon_stop_exit_code") == 0,
        "no_errors_in_daemon_log": not result.get("daemon_log_errors"),
        # every abrupt exit held exactly one lease, which only the session's end could release
        "session_end_released_crashed_leases": fc.get("leases_session_released") == crashes,
        "rss_anon_flat": rss["anon_flat"],  # private memory: heap, index, leases (where a leak grows)
        "vmrss_flat": rss["vmrss_flat"],  # + mapped pool and LMDB pages (grow with the LMDB file)
        "eviction_happened": (fc.get("pool_evictions") or 0) > 0 and (fc.get("nvme_evictions") or 0) > 0,
    }
    result["ok"] = all(result["checks"].values())
