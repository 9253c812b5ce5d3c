"""Bad input (issue #7): the whole corpus of malformed and adversarial requests
(:mod:`tests.reliability.corpus`) against one real daemon.

For every request: the status code is the expected one; an error's details name the
problem in a short, printable message; the daemon's state (indexed chunks, leases,
reservations, free pool blocks, NVMe chunks, layouts, open sessions) is exactly what it
was; and the daemon still answers Ping. At the end the process is alive, a normal
put/acquire round trip returns identical bytes, it stops cleanly, and its whole log holds no
traceback.

Failures are collected over the whole corpus and reported together (one line per case:
name, request, got vs expected), so one misbehaviour does not hide the others.

``KVCACHED_WRITE_RESULTS=1`` (set by the report script) writes a summary to
bench/results/bad_input.json; a normal test run writes nothing into the repository.
"""

from __future__ import annotations

import json
import os
import time

import grpc
import torch

from kvcached.contract import proto
from kvcached.service.servicer import MAX_TTL
from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import Client
from tests.reliability.conftest import LAYOUT
from tests.reliability.corpus import (CATEGORIES, CT, DAEMON_SETTINGS, LONG_CHUNKS, METHODS, RESPONSE_TYPE, VOCAB,
                                      Case, World, build_corpus, chunk, summary, tokens)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_DETAILS = 1024  # an error message longer than this is not one a person reads


def snapshot(stub: pb_grpc.KVCacheStub) -> tuple:
    s = json.loads(stub.Stats(pb.StatsRequest(), timeout=10).json)
    return (("indexed_chunks", s["indexed_chunks"]), ("leases_active", s["leases_active"]),
            ("reservations_active", s["reservations_active"]), ("pool_free_bytes", s["pool"]["free_bytes"]),
            ("nvme_chunks", s["nvme"]["chunks"]), ("layouts", s["layouts"]), ("sessions_open", s["sessions_open"]))


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the daemon"
        time.sleep(0.02)


def set_up_world(stub: pb_grpc.KVCacheStub, sid: str, other_sid: str, closed_sid: str) -> World:
    """Everything the corpus refers to, made before the first snapshot. Long TTLs: nothing may
    expire while the corpus runs (that would change the state between two snapshots)."""
    lid = stub.RegisterLayout(pb.RegisterLayoutRequest(layout=proto.layout_to_proto(LAYOUT))).layout_id
    vlid = stub.RegisterLayout(pb.RegisterLayoutRequest(layout=proto.layout_to_proto(VOCAB))).layout_id
    assert (lid, vlid) == (LAYOUT.layout_id, VOCAB.layout_id)
    cached = tokens(2 * CT)
    put = stub.PutBytes(pb.PutBytesRequest(layout_id=lid, tokens=cached, chunks=[chunk(1), chunk(2)]))
    assert put.committed_chunks == 2

    def acquire(session: str, ttl: float = MAX_TTL) -> str:
        req = pb.AcquireRequest(layout_id=lid, tokens=cached, session_id=session, ttl_seconds=ttl)
        return stub.Acquire(req).lease_id

    def reserve(start: int, session: str) -> pb.ReserveResponse:
        return stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=tokens(2 * CT, start), session_id=session,
                                              ttl_seconds=MAX_TTL))

    own, foreign, released = acquire(sid), acquire(other_sid), acquire(sid)
    assert stub.Release(pb.ReleaseRequest(lease_ids=[released], session_id=sid)).released == 1
    before = snapshot(stub)
    expired = acquire(sid, ttl=0.05)
    wait_for(lambda: snapshot(stub) == before)  # the expiry sweep closed it as "expired"
    open_res = reserve(90_000, other_sid)
    committed = reserve(100_000, sid)
    stub.Commit(pb.CommitRequest(reservation_id=committed.reservation_id, session_id=sid))
    aborted = reserve(110_000, sid)
    assert stub.Abort(pb.AbortRequest(reservation_ids=[aborted.reservation_id], session_id=sid)).aborted == 1
    long_cached = tokens(LONG_CHUNKS * CT, 120_000)
    r = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=long_cached))  # cached without writing the bytes
    assert stub.Commit(pb.CommitRequest(reservation_id=r.reservation_id)).committed_chunks == LONG_CHUNKS
    return World(sid=sid, other_sid=other_sid, closed_sid=closed_sid, own_lease=own, foreign_lease=foreign,
                 released_lease=released, expired_lease=expired, open_res=open_res.reservation_id,
                 open_res_slots=len(open_res.slots.offsets), committed_res=committed.reservation_id,
                 aborted_res=aborted.reservation_id, cached=cached, long_cached=long_cached)


def send(channel: grpc.Channel, case: Case) -> tuple[grpc.StatusCode, str, object]:
    """Send the case's bytes as they are; (code, details, parsed reply or None)."""
    path = f"/kvcached.v1.KVCache/{case.method}"
    raw = case.raw()
    if case.method == "Session":
        call = channel.stream_stream(path, request_serializer=None, response_deserializer=None)(iter([raw]), timeout=10)
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            return e.code(), e.details() or "", None
        return call.code(), call.details() or "", None
    fn = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        resp, _ = fn.with_call(raw, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None
    return grpc.StatusCode.OK, "", RESPONSE_TYPE[case.method].FromString(resp)


def check_details(case: Case, details: str) -> str | None:
    """Why the error message is not one a person can act on, or None."""
    if not details.strip():
        return "empty details"
    if len(details) > MAX_DETAILS:
        return f"details are {len(details)} characters (over {MAX_DETAILS}): {details[:120]!r}..."
    if not all(ch.isprintable() or ch in "\n\t" for ch in details):
        return f"details have unprintable characters: {details[:200]!r}"
    if "Traceback" in details or "Exception" in details:
        return f"details leak an exception: {details[:200]!r}"
    if not any(word in details.lower() for word in case.mentions):
        return f"details name none of {case.mentions}: {details[:200]!r}"
    return None


def log_excerpt(lines: list[str]) -> str:
    """The ERROR lines and the last line (the exception) of a stretch of daemon log."""
    keep = [line.strip()[:300] for line in lines if " ERROR " in line] + [lines[-1].strip()[:300]]
    return " | ".join(dict.fromkeys(keep))


def describe(case: Case) -> str:
    raw = case.raw()
    shown = raw[:48].hex() + ("..." if len(raw) > 48 else "")
    return f"{case.name} [{case.category}] {case.method}({len(raw)} bytes: {shown}) -- {case.note}"


def test_corpus_size_and_coverage():
    """Fails if the corpus shrinks or loses a category or an RPC."""
    cases = build_corpus(World.dummy())
    s = summary(cases)
    assert s["total"] >= 200
    assert set(s["by_category"]) == set(CATEGORIES), set(CATEGORIES) ^ set(s["by_category"])
    assert all(n >= 5 for n in s["by_category"].values()), s["by_category"]
    assert set(s["by_method"]) == set(METHODS), set(METHODS) - set(s["by_method"])
    # parse errors are the biggest family, but not the whole story
    assert sum(1 for c in cases if c.code != grpc.StatusCode.INVALID_ARGUMENT) >= 150


def test_every_bad_request_is_refused_cleanly(make_daemon):
    t0 = time.monotonic()
    d = make_daemon(**DAEMON_SETTINGS)
    mine, other, gone = Client(d.socket), Client(d.socket), Client(d.socket)
    try:
        closed_sid = gone.session_id()
        gone.close()
        channel = grpc.insecure_channel(f"unix:{d.socket}")
        stub = pb_grpc.KVCacheStub(channel)
        wait_for(lambda: json.loads(stub.Stats(pb.StatsRequest()).json)["sessions_open"] == 0)
        world = set_up_world(stub, mine.session_id(), other.session_id(), closed_sid)
        cases = build_corpus(world)
        assert len(cases) >= 200
        t_setup = time.monotonic() - t0

        failures: list[str] = []
        outcomes: dict[str, dict[str, int]] = {}
        before = snapshot(stub)
        logged = len(d.output)
        for case in cases:
            code, details, reply = send(channel, case)
            problems = []
            if code != case.code:
                problems.append(f"got {code.name} {details[:300]!r}, expected {case.code.name}")
            elif code != grpc.StatusCode.OK:
                if (why := check_details(case, details)) is not None:
                    problems.append(why)
            else:
                for f, v in case.reply.items():
                    if getattr(reply, f) != v:
                        problems.append(f"reply {f}={getattr(reply, f)!r}, expected {v!r}")
            after = snapshot(stub)
            if after != before and case.method == "Session":  # the stream's cleanup runs after its status
                deadline = time.monotonic() + 10
                while after != before and time.monotonic() < deadline:
                    time.sleep(0.01)
                    after = snapshot(stub)
            if after != before:
                diff = {k: (v, dict(after)[k]) for k, v in before if dict(after)[k] != v}
                problems.append(f"state changed (before, after): {diff}")
                before = after  # report each change once
            try:
                stub.Ping(pb.PingRequest(), timeout=10)
            except grpc.RpcError as e:
                problems.append(f"Ping failed afterwards: {e.code().name} {e.details()}")
            new_log, logged = d.output[logged:], len(d.output)
            if any("Traceback" in line or " ERROR " in line for line in new_log):
                problems.append("the daemon logged an error: " + log_excerpt(new_log))
            assert d.proc is not None and d.proc.poll() is None, f"daemon died on {describe(case)}\n{d.log()[-3000:]}"
            o = outcomes.setdefault(case.category, {"cases": 0, "failed": 0})
            o["cases"] += 1
            if problems:
                o["failed"] += 1
                failures.append(f"{describe(case)}\n    " + "\n    ".join(problems))
        t_corpus = time.monotonic() - t0 - t_setup

        # still alive, still correct
        assert d.proc.poll() is None
        mine.ping()
        kv = torch.randn(2, LAYOUT.num_layers, LAYOUT.num_kv_heads, 3 * CT, LAYOUT.head_dim)
        toks = list(range(200_000, 200_000 + 3 * CT))
        assert mine.put(LAYOUT, toks, kv).stored_chunks == 3
        with mine.acquire(LAYOUT, toks) as lease:
            assert lease.matched_tokens == 3 * CT
            assert torch.equal(lease.kv(), kv)
        payloads = [bytes([i + 7]) * LAYOUT.chunk_bytes for i in range(2)]
        btoks = list(range(300_000, 300_000 + 2 * CT))
        assert mine.put_bytes(LAYOUT, btoks, payloads).stored_chunks == 2
        assert mine.get_bytes(LAYOUT, btoks) == payloads
        mine.close()
        other.close()
        assert d.stop() == 0  # a clean stop; after it the whole log has been read
        if any("Traceback" in line or " ERROR " in line for line in d.output[logged:]):
            failures.append("the daemon logged an error after the corpus: " + log_excerpt(d.output[logged:]))

        if os.environ.get("KVCACHED_WRITE_RESULTS") == "1":
            out = os.path.join(ROOT, "bench", "results", "bad_input.json")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                json.dump({**summary(cases), "outcomes_by_category": outcomes, "failed": len(failures),
                           "failures": failures, "daemon_settings": DAEMON_SETTINGS,
                           "setup_seconds": round(t_setup, 2), "corpus_seconds": round(t_corpus, 2)}, f, indent=2)
                f.write("\n")
        assert not failures, f"{len(failures)} of {len(cases)} bad requests were mishandled:\n" + "\n".join(failures)
    finally:
        mine.close()
        other.close()
