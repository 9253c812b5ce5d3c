"""soak.py's client process: the deterministic chunk payloads and prompts, and one inference
worker (``worker_main``) that replays its share of a trace against the daemon and checks every
byte it reads. Not a benchmark itself: ``bench/soak.py --worker SPEC`` runs it."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

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
