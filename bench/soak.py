"""Question: with N inference processes (default 48) replaying the Mooncake FAST'25 traces against
one real daemon whose pool and NVMe tier are both far smaller than the working set, for a bounded
time (default 120 s), does kvcached stay correct and stable: zero failed RPCs, every leased byte
right, zero leases / reservations / pins left once the clients are gone, daemon RSS flat after
warm-up; and what are the acquire p50 / p99 latencies, hit rate and eviction counts?

Setup: one real ``kvcached serve`` (``_common.Daemon``: temp dir, Unix socket, device cpu, host
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

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import REPO_ROOT, RESULTS_DIR, TRACE_DIR, Daemon, format_table, install_sigterm_exit, percentile, save_figure, subplots, write_results

import numpy as np

BLOCK = 512  # tokens per trace block = chunk_tokens of both models
CHUNK_BYTES = 16 * 1024
RPC_TIMEOUT = 10.0  # what the client library passes on every call
CRASH_RC = 86  # exit status of a worker that ended abruptly on purpose
MiB = 1 << 20

#: Two models served by the same daemon; both 512-token chunks of 16 KiB.
MODELS = {
    "conversation": dict(model="soak/model-a@1", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                         chunk_tokens=BLOCK),
    "synthetic": dict(model="soak/model-b@1", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16",
                      chunk_tokens=BLOCK),
}
TAGS = {"conversation": 1, "synthetic": 2}
PAYLOAD_SEED = 0x5EED_50AC


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


# -- payloads (shared by workers and tests) --------------------------------------------------

_M64 = (1 << 64) - 1


def mix64(tag: int, h: int) -> int:
    """splitmix64 of (model tag, block id): the per-chunk word XORed into the base."""
    z = (((tag << 40) ^ h) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def payload_base(nbytes: int = CHUNK_BYTES) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(PAYLOAD_SEED).bytes(nbytes), dtype=np.uint64).copy()


def payload(base: np.ndarray, tag: int, h: int) -> np.ndarray:
    """The bytes chunk ``h`` of model ``tag`` must hold, as uint64 words."""
    return base ^ np.uint64(mix64(tag, h))


_AR = np.arange(BLOCK, dtype=np.uint32)


def prompt_tokens(hash_ids: list[int], input_length: int, max_chunks: int) -> np.ndarray:
    """Block h -> tokens h*512 .. h*512+511 (as in trace_replay.py), cut to max_chunks full chunks."""
    n = min(input_length, max_chunks * BLOCK)
    ids = np.asarray(hash_ids[: -(-n // BLOCK)], dtype=np.uint32)
    return (ids[:, None] * np.uint32(BLOCK) + _AR[None, :]).ravel()[:n]


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


# -- worker process ---------------------------------------------------------------------------


class _RpcFailed(Exception):
    pass


def worker_main(spec: dict) -> int:
    """One inference process: replay a share until the deadline, write counters to spec['out']."""
    import random

    import grpc
    import lmdb
    from kvcached.contract.errors import CorruptChunk
    from kvcached.contract.keys import KVLayout
    from kvcached.contract.record import copy_verified
    from kvcached.v1 import kvcached_pb2 as pb
    from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
    from kvcached_client import _core
    from kvcached_client.nvme import _acquire_env
    from kvcached_client.pool import PoolMap

    with open(spec["share"]) as f:
        share = json.load(f)
    trace = share["trace"]
    reqs, t0_ms, period_ms = share["requests"], share["t0_ms"], share["period_ms"]
    tag = TAGS[trace]
    layout = KVLayout(**MODELS[trace])
    assert layout.chunk_bytes == CHUNK_BYTES
    base = payload_base(layout.chunk_bytes)
    direct = bool(spec["direct"])
    run_t0, deadline, speed = spec["run_t0"], spec["deadline"], spec["speed"]
    max_chunks, verify = spec["max_chunks"], spec["verify"]
    rng = random.Random(spec["seed"])
    crash_p = 1.0 / spec["crash_every"] if spec["crash_every"] else 0.0

    ops: Counter = Counter()
    failed_ops: Counter = Counter()
    failures: list[dict] = []
    mismatches: list[dict] = []
    client_errors: list[dict] = []
    lat: dict[str, list[int]] = {k: [] for k in ("lookup", "acquire", "release", "reserve", "commit")}
    acq_t: list[int] = []  # ms since run_t0 of each timed acquire
    lags: list[float] = []
    c = Counter()  # requests, tokens, chunks, bytes

    def note_failure(method: str, e: grpc.RpcError) -> None:
        failed_ops[method] += 1
        if len(failures) < 50:
            failures.append({"method": method, "code": e.code().name if e.code() else "?", "details": e.details(),
                             "t": round(time.time() - run_t0, 3), "worker": spec["name"], "pid": os.getpid()})

    def call(method: str, fn, req, timed: bool = True):
        t = time.perf_counter_ns()
        try:
            resp = fn(req, timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:
            note_failure(method, e)
            raise _RpcFailed(method) from None
        ops[method] += 1
        if timed:
            lat[method].append((time.perf_counter_ns() - t) // 1000)
        return resp

    channel = grpc.insecure_channel(_core.target(spec["socket"]), options=_core.CHANNEL_OPTIONS)
    stub = pb_grpc.KVCacheStub(channel)
    end = threading.Event()
    name = f"{spec['name']} pid {os.getpid()}"

    def session_requests():
        yield pb.SessionRequest(client_name=name)
        end.wait()  # held open until the worker closes it; the daemon releases everything when it ends

    pool = PoolMap()
    mapping = None
    nvme: tuple | None = None
    scratch = np.empty(layout.chunk_bytes // 8, dtype=np.uint64)
    state = {"next": spec["start"]}

    def ensure_pool(generation: str):
        nonlocal mapping, nvme_path
        if mapping is None or pool.generation != generation:
            msg = call("pool_handle", stub.GetPoolHandle, pb.PoolHandleRequest(), timed=False)
            mapping = pool.ensure(_core.handle_from_proto(msg))
            nvme_path = msg.nvme_path
        return mapping

    nvme_path = ""

    def read_nvme(key: bytes) -> np.ndarray | None:
        nonlocal nvme
        if nvme is None:
            nvme = _acquire_env(nvme_path)
        env, db, _gate = nvme
        try:
            with env.begin(db=db, buffers=True) as txn:  # the client library's shared reader env
                value = txn.get(key)
                if value is None:
                    return None
                copy_verified(value, key, memoryview(scratch).cast("B"))
        except lmdb.Error as e:  # a fault of the client's read path (the run fails on any)
            c["client_errors"] += 1
            if len(client_errors) < 10:
                client_errors.append({"worker": spec["name"], "error": f"{type(e).__name__}: {e}",
                                      "t": round(time.time() - run_t0, 3)})
            raise
        return scratch

    def check_chunks(resp, ids: list[int], req_no: int) -> None:
        locs = _core.locations(resp.chunks)
        if not locs:
            return
        m = ensure_pool(resp.pool_generation)
        for loc in locs:
            c["chunks_leased"] += 1
            if verify < 1.0 and rng.random() >= verify:
                continue
            h = ids[loc.position]
            where = "nvme" if loc.offset == _core.NVME_CHUNK else "pool"
            try:
                if where == "nvme":
                    c["nvme_direct_reads"] += 1
                    got = read_nvme(loc.nvme_key)
                    if got is None:
                        raise CorruptChunk("pinned chunk is missing from the LMDB file")
                else:
                    if loc.nbytes != layout.chunk_bytes:
                        raise CorruptChunk(f"chunk_bytes {loc.nbytes} != {layout.chunk_bytes}")
                    got = np.frombuffer(m.block(loc.offset, loc.nbytes), dtype=np.uint64)
            except CorruptChunk as e:
                c["chunks_bad"] += 1
                if len(mismatches) < 20:
                    mismatches.append({"worker": spec["name"], "request": req_no, "position": loc.position,
                                       "block": h, "tier": where, "offset": loc.offset, "error": str(e)})
                continue
            want = payload(base, tag, h)
            if not np.array_equal(got, want):
                c["chunks_bad"] += 1
                if len(mismatches) < 20:
                    bad = np.flatnonzero(got != want)
                    mismatches.append({"worker": spec["name"], "request": req_no, "position": loc.position,
                                       "block": h, "tier": where, "offset": loc.offset, "bad_words": int(bad.size),
                                       "first_bad_word": int(bad[0]),
                                       "mix_of_got": hex(int(got[0] ^ base[0]))})
            else:
                c["chunks_verified"] += 1
                c["bytes_verified"] += layout.chunk_bytes

    def write_slots(resp, ids: list[int], limit: int | None = None) -> int:
        locs = _core.locations(resp.slots)
        if not locs:
            return 0
        m = ensure_pool(resp.pool_generation)
        for loc in locs[:limit]:
            dest = np.frombuffer(m.block(loc.offset, loc.nbytes), dtype=np.uint64)
            np.bitwise_xor(base, np.uint64(mix64(tag, ids[loc.position])), out=dest)
        return len(locs)

    def crash() -> None:
        dump(crashed=True)
        os._exit(CRASH_RC)  # no Release, no Abort, no session close: the daemon must clean up

    def dump(crashed: bool = False) -> None:
        doc = {
            "name": spec["name"], "trace": trace, "direct": direct, "crashed": crashed, "next": state["next"],
            "ops": dict(ops), "failed_ops": dict(failed_ops), "failures": failures, "mismatches": mismatches,
            "client_errors": client_errors,
            "counts": dict(c), "lat_us": lat, "acquire_t_ms": acq_t, "lag_ms": [round(x * 1000, 1) for x in lags],
        }
        tmp = spec["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, spec["out"])

    session = stub.Session(session_requests())
    try:
        sid = next(session).session_id
    except grpc.RpcError as e:
        note_failure("session", e)
        dump()
        return 1
    ops["session"] += 1
    try:
        lid = call("register", stub.RegisterLayout, _core.layout_request(layout), timed=False).layout_id
    except _RpcFailed:
        dump()
        return 1
    n = len(reqs)
    i = spec["start"]
    while True:
        p, j = divmod(i, n)
        ts, input_length, output_length, ids = reqs[j]
        due = run_t0 + (p * period_ms + ts - t0_ms) / 1000.0 / speed
        now = time.time()
        if due >= deadline or now >= deadline:
            break
        if due > now:
            time.sleep(due - now)
            now = time.time()
        lags.append(max(0.0, now - due))
        state["next"] = i + 1
        i += 1
        tokens = prompt_tokens(ids, input_length, max_chunks)
        packed = tokens.tobytes()
        full = len(tokens) // BLOCK
        c["requests"] += 1
        c["prompt_chunks"] += full
        crash_now = crash_p and rng.random() < crash_p
        lease = None
        try:
            call("lookup", stub.Lookup, pb.LookupRequest(layout_id=lid, tokens=[packed]))
            t = time.time()
            lease = call("acquire", stub.Acquire, pb.AcquireRequest(
                layout_id=lid, tokens=packed, session_id=sid, read_nvme_directly=direct))
            acq_t.append(int((t - run_t0) * 1000))
            c["hit_chunks"] += lease.matched_tokens // BLOCK
            if lease.matched_tokens > full * BLOCK or lease.matched_tokens % BLOCK:
                c["bad_matched_tokens"] += 1
            check_chunks(lease, ids, i - 1)
            if not crash_now:
                r = call("release", stub.Release, pb.ReleaseRequest(lease_ids=[lease.lease_id], session_id=sid))
                if r.released != 1:
                    c["release_not_live"] += 1  # the lease had expired or vanished under us
                lease = None
            res = call("reserve", stub.Reserve, pb.ReserveRequest(
                layout_id=lid, tokens=packed, session_id=sid, expected_output_tokens=output_length))
            if crash_now:
                slots = len(res.slots.offsets)
                write_slots(res, ids, limit=slots // 2)
                c["crashes"] += 1
                crash()
            try:
                c["chunks_written"] += write_slots(res, ids)
            except BaseException:
                call("abort", stub.Abort, pb.AbortRequest(reservation_ids=[res.reservation_id], session_id=sid), timed=False)
                raise
            r = call("commit", stub.Commit, pb.CommitRequest(reservation_id=res.reservation_id, session_id=sid))
            c["chunks_committed"] += r.committed_chunks
        except _RpcFailed:
            c["requests_failed"] += 1
            if lease is not None:
                try:
                    call("release", stub.Release, pb.ReleaseRequest(lease_ids=[lease.lease_id], session_id=sid), timed=False)
                except _RpcFailed:
                    pass

    end.set()
    session.cancel()
    channel.close()
    if nvme is not None:
        from kvcached_client.nvme import _release_env

        _release_env(nvme_path)
    pool.close()
    dump()
    return 0


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
                        self.stats.append({"t": round(t, 3), **_stats_row(d)})
                    except grpc.RpcError as e:
                        self.failures.append({"method": "stats (sampler)", "code": e.code().name, "details": e.details(),
                                              "t": round(t, 3), "worker": "sampler"})
                self._halt.wait(self.cfg.rss_interval)
        finally:
            channel.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def _stats_row(d: dict) -> dict:
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
        with Daemon(daemon_settings(cfg), prefix="kvc-soak-d-") as d:
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
                                                  "the deadline", "log": _tail(workdir, spec["name"])})
                            del procs[k]
                        continue
                    del procs[k]
                    doc = _read_doc(spec["out"])
                    if doc is not None:
                        worker_docs.append(doc)
                    if rc == CRASH_RC and doc is not None and doc.get("crashed"):
                        if time.time() < deadline - 1.0:
                            nspec = spec_for(k, doc["next"])
                            procs[k] = (_spawn(nspec, workdir), nspec)
                    elif rc != 0 or doc is None:
                        worker_errors.append({"worker": spec["name"], "rc": rc, "log": _tail(workdir, spec["name"])})
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
                    row = _stats_row(json.loads(stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT).json))
                    first = first or row
                    last = row
                    if _leftover(row) == 0:
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
            daemon_log = _daemon_log(d)
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


def _leftover(row: dict) -> int:
    return (row["leases_active"] + row["reservations_active"] + (row["sessions_open"] or 0)
            + row["pool_leased_chunks"] + row["pool_reserved_chunks"])


def _read_doc(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(workdir: str, name: str, n: int = 3000) -> str:
    try:
        with open(os.path.join(workdir, f"{name}.err")) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _daemon_log(d: Daemon) -> str:
    out = []
    for name in ("stdout.log", "stderr.log"):
        try:
            with open(os.path.join(d.dir, name)) as f:
                out.append(f.read())
        except OSError:
            pass
    return "\n".join(out)


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--quick", action="store_true", help="4 clients x 8 s; writes soak.quick.json")
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
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
    res["quick"] = args.quick
    print_report(res)
    write_results("soak", res, args.out, quick=args.quick, plot=plot)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
