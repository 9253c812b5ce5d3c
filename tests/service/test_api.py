"""The gRPC surface: status codes for bad requests, health, reflection, the committed stubs."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import AsyncClient, Client
from tests.service.conftest import LAYOUT

CT = LAYOUT.chunk_tokens
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tokens(n: int, start: int = 0) -> bytes:
    import numpy as np

    return np.arange(start, start + n, dtype="<u4").tobytes()


def state(c: Client) -> tuple:
    s = c.stats()
    return (s["indexed_chunks"], s["leases_active"], s["reservations_active"], s["pool"]["free_bytes"],
            s["nvme"]["chunks"], s["layouts"])


@pytest.fixture
def ready(daemon):
    """A daemon with one registered layout, 2 cached chunks and a live session."""
    c = Client(daemon.socket)
    c.put(LAYOUT, list(range(2 * CT)), torch.zeros(2, 2, 2, 2 * CT, 8))
    lid = c.register(LAYOUT)
    sid = c.session_id()
    yield c, c._stub, lid, sid
    c.close()


def _bad_requests(lid: str, sid: str) -> list:
    big_layout = pb.Layout(model="m", num_layers=4096, num_kv_heads=64, head_dim=512, dtype="float32", chunk_tokens=128)
    return [
        ("unknown-layout", "Acquire", pb.AcquireRequest(layout_id="nope", tokens=tokens(CT)), grpc.StatusCode.NOT_FOUND),
        ("unknown-layout-lookup", "Lookup", pb.LookupRequest(layout_id="nope", tokens=[tokens(CT)]), grpc.StatusCode.NOT_FOUND),
        ("ragged-tokens", "Acquire", pb.AcquireRequest(layout_id=lid, tokens=b"\x01\x02\x03"), grpc.StatusCode.INVALID_ARGUMENT),
        ("ragged-tokens-reserve", "Reserve", pb.ReserveRequest(layout_id=lid, tokens=b"\x01" * 7), grpc.StatusCode.INVALID_ARGUMENT),
        ("ragged-tokens-lookup", "Lookup", pb.LookupRequest(layout_id=lid, tokens=[tokens(4), b"\x00"]), grpc.StatusCode.INVALID_ARGUMENT),
        ("unknown-lease", "Release", pb.ReleaseRequest(lease_ids=["lease-0000000000000000"]), grpc.StatusCode.NOT_FOUND),
        ("unknown-lease-keepalive", "KeepAlive", pb.KeepAliveRequest(lease_ids=["lease-x"]), grpc.StatusCode.NOT_FOUND),
        ("unknown-reservation", "Commit", pb.CommitRequest(reservation_id="put-x"), grpc.StatusCode.NOT_FOUND),
        ("unknown-reservation-abort", "Abort", pb.AbortRequest(reservation_ids=["put-x"]), grpc.StatusCode.NOT_FOUND),
        ("closed-session", "Acquire", pb.AcquireRequest(layout_id=lid, tokens=tokens(CT), session_id="session-gone"),
         grpc.StatusCode.FAILED_PRECONDITION),
        ("negative-ttl", "Acquire", pb.AcquireRequest(layout_id=lid, tokens=tokens(CT), ttl_seconds=-1), grpc.StatusCode.INVALID_ARGUMENT),
        ("huge-ttl", "Reserve", pb.ReserveRequest(layout_id=lid, tokens=tokens(CT), ttl_seconds=1e9), grpc.StatusCode.INVALID_ARGUMENT),
        ("empty-layout", "RegisterLayout", pb.RegisterLayoutRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        ("zero-layers", "RegisterLayout", pb.RegisterLayoutRequest(layout=pb.Layout(model="m", num_kv_heads=1, head_dim=1)),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("bad-dtype", "RegisterLayout", pb.RegisterLayoutRequest(layout=pb.Layout(model="m", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float64")),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("chunk-larger-than-block", "RegisterLayout", pb.RegisterLayoutRequest(layout=big_layout), grpc.StatusCode.INVALID_ARGUMENT),
        ("wrong-chunk-size", "PutBytes", pb.PutBytesRequest(layout_id=lid, tokens=tokens(CT, 500), chunks=[b"x" * 10]),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("too-few-chunks", "PutBytes", pb.PutBytesRequest(layout_id=lid, tokens=tokens(2 * CT, 500), chunks=[bytes(LAYOUT.chunk_bytes)]),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("commit-too-many", "Commit", None, grpc.StatusCode.INVALID_ARGUMENT),  # filled in below
        ("oversized-message", "PutBytes", pb.PutBytesRequest(layout_id=lid, tokens=tokens(CT), chunks=[bytes(600_000)]),
         grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]


@pytest.mark.parametrize("case", range(20))
def test_bad_requests_get_the_right_status_and_change_nothing(make_daemon, case):
    d = make_daemon(max_message_bytes="512K")
    with Client(d.socket) as c:
        c.put(LAYOUT, list(range(2 * CT)), torch.zeros(2, 2, 2, 2 * CT, 8))
        lid, sid = c.register(LAYOUT), c.session_id()
        lease = c.acquire(LAYOUT, list(range(CT)))
        name, method, req, code = _bad_requests(lid, sid)[case]
        if name == "commit-too-many":
            r = c._stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=tokens(CT, 900), session_id=sid))
            req = pb.CommitRequest(reservation_id=r.reservation_id, chunks=5, session_id=sid)
        before = state(c)
        with pytest.raises(grpc.RpcError) as ei:
            getattr(c._stub, method)(req, timeout=10)
        assert ei.value.code() == code, (name, ei.value.details())
        assert ei.value.details()  # a message a person can act on
        assert state(c) == before, name
        c.ping()  # still serving
        lease.release()


def test_health_and_reflection(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        r = h.Check(health_pb2.HealthCheckRequest(service="kvcached.v1.KVCache"))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"kvcached.v1.KVCache", "grpc.health.v1.Health"} <= names
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvcached.v1.KVCache")
        resp = next(refl.ServerReflectionInfo(iter([req])))
        fd = descriptor_pb2.FileDescriptorProto.FromString(resp.file_descriptor_response.file_descriptor_proto[0])
        assert fd.package == "kvcached.v1" and "Acquire" in [m.name for m in fd.service[0].method]


def test_committed_stubs_match_the_proto(tmp_path):
    """Fails when protos/ changed and scripts/gen-protos was not run, or a committed stub was edited.

    Regenerates all three modules exactly as scripts/gen-protos does (same -I and proto path, so
    the same ``source:`` lines and import paths) into a temp dir and compares bytes, all but the
    generator's version stamp in the gRPC module (``GRPC_GENERATED_VERSION``): a newer
    grpcio-tools stamps its own version and changes nothing else, and the stamp is the oldest
    grpcio the stubs load with, so the committed one must stay the floor pyproject.toml declares.
    """
    out = tmp_path / "fds.bin"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--descriptor_set_out={out}",
         "protos/kvcached/v1/kvcached.proto"],
        check=True, capture_output=True, cwd=ROOT,
    )
    tools_version = importlib.metadata.version("grpcio-tools")
    stamp = re.compile(rb"^GRPC_GENERATED_VERSION = '([^']*)'$", re.M)
    stale = []
    for name in ("kvcached_pb2.py", "kvcached_pb2_grpc.py", "kvcached_pb2.pyi"):
        with open(os.path.join(ROOT, "kvcached", "v1", name), "rb") as f:
            committed_bytes = f.read()
        fresh_bytes = (tmp_path / "kvcached" / "v1" / name).read_bytes()
        if stamp.sub(b"", fresh_bytes) != stamp.sub(b"", committed_bytes):
            stale.append(name)
    with open(os.path.join(ROOT, "kvcached", "v1", "kvcached_pb2_grpc.py"), "rb") as f:
        stamped = stamp.search(f.read())
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        floor = re.search(r'"grpcio>=([0-9.]+)"', f.read())
    assert stamped and floor and stamped.group(1).decode() == floor.group(1), (
        "the committed gRPC stubs' GRPC_GENERATED_VERSION is not the grpcio floor in pyproject.toml: generate "
        "them with grpcio-tools at that version, or raise the floor to the stamp")
    assert not stale, (
        f"kvcached/v1/{', '.join(stale)} differ from what grpcio-tools {tools_version} generates from "
        "protos/kvcached/v1/kvcached.proto: run scripts/gen-protos (and pin grpcio-tools in pyproject.toml "
        "if the generator version is what changed)"
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _strip_json_names(fresh.message_type)  # --descriptor_set_out adds them; the embedded copy omits them
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh == committed  # what is imported is what is on disk
    methods = pb.DESCRIPTOR.services_by_name["KVCache"].methods_by_name
    with grpc.insecure_channel("unix:/nonexistent") as ch:  # never connects: building a stub only
        stub = pb_grpc.KVCacheStub(ch)
        for name in ("RegisterLayout", "Acquire", "Release", "KeepAlive", "Reserve", "Commit", "Abort", "Session",
                     "GetPoolHandle", "PutBytes", "GetBytes", "Stats", "Evict", "Flush", "Drain"):
            assert name in methods and hasattr(pb_grpc.KVCacheServicer, name) and hasattr(stub, name), name


def _strip_json_names(messages) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _strip_json_names(m.nested_type)


def test_bytes_fallback_round_trip(ready):
    c, stub, lid, sid = ready
    chunks = [bytes([i]) * LAYOUT.chunk_bytes for i in range(3)]
    toks = list(range(5000, 5000 + 3 * CT))
    assert c.put_bytes(LAYOUT, toks, chunks).stored_chunks == 3
    assert c.get_bytes(LAYOUT, toks + [1]) == chunks
    assert c.stats()["leases_active"] == 0  # the fallback read leaves no lease behind


def test_in_flight_writer_is_told(ready):
    c, stub, lid, sid = ready
    t = tokens(2 * CT, 7000)
    r1 = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=t, session_id=sid))
    r2 = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=t, session_id=sid))
    assert len(r1.slots.offsets) == 2 and len(r2.slots.offsets) == 0 and r2.in_flight_tokens == 2 * CT
    stub.Commit(pb.CommitRequest(reservation_id=r1.reservation_id, session_id=sid))
    stub.Commit(pb.CommitRequest(reservation_id=r2.reservation_id, session_id=sid))
    with pytest.raises(grpc.RpcError) as ei:
        stub.Commit(pb.CommitRequest(reservation_id=r1.reservation_id, session_id=sid))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "already committed" in ei.value.details()


def test_batch_release_is_all_or_nothing(ready):
    c, stub, lid, sid = ready
    a = c.acquire(LAYOUT, list(range(CT)))
    b = c.acquire(LAYOUT, list(range(CT)))
    with pytest.raises(grpc.RpcError):
        stub.Release(pb.ReleaseRequest(lease_ids=[a.lease_id, "lease-never"], session_id=sid))
    assert c.stats()["leases_active"] == 2
    assert stub.Release(pb.ReleaseRequest(lease_ids=[a.lease_id, b.lease_id, a.lease_id], session_id=sid)).released == 2


def test_ids_are_bound_to_the_session_that_obtained_them(ready, daemon):
    """Knowing another session's lease or reservation id is not enough to release, renew,
    commit or abort it: neither from another session nor without one."""
    c, stub, lid, sid = ready
    lease = c.acquire(LAYOUT, list(range(CT)))
    r = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=tokens(2 * CT, 9100), session_id=sid))
    assert len(r.slots.offsets) == 2
    with Client(daemon.socket) as other:
        osid = other.session_id()
        for s in ("", osid):
            assert stub.Release(pb.ReleaseRequest(lease_ids=[lease.lease_id], session_id=s)).released == 0
            assert stub.Abort(pb.AbortRequest(reservation_ids=[r.reservation_id], session_id=s)).aborted == 0
            for call, req in (("KeepAlive", pb.KeepAliveRequest(lease_ids=[lease.lease_id], session_id=s)),
                              ("Commit", pb.CommitRequest(reservation_id=r.reservation_id, session_id=s))):
                with pytest.raises(grpc.RpcError) as ei:
                    getattr(stub, call)(req)
                assert ei.value.code() == grpc.StatusCode.NOT_FOUND, call
        s = c.stats()
        assert (s["leases_active"], s["reservations_active"]) == (1, 1)
    assert stub.Commit(pb.CommitRequest(reservation_id=r.reservation_id, session_id=sid)).committed_chunks == 2
    lease.release()
    c.sync()  # the release travels on the session stream
    assert c.stats()["leases_active"] == 0


def test_async_client(daemon):
    async def main() -> None:
        async with AsyncClient(daemon.socket) as c:
            kv = torch.randn(2, 2, 2, 2 * CT, 8)
            assert (await c.put(LAYOUT, list(range(2 * CT)), kv)).stored_chunks == 2
            assert await c.lookup(LAYOUT, list(range(2 * CT))) == 2 * CT
            leases = await asyncio.gather(*[c.acquire(LAYOUT, list(range(2 * CT))) for _ in range(8)])
            assert all(torch.equal(lease.chunk(1), kv[:, :, :, CT:]) for lease in leases)
            assert (await c.stats())["leases_active"] == 8
            for lease in leases:
                await lease.release()
            assert (await c.stats())["leases_active"] == 0

    asyncio.run(main())


def test_tcp_on_loopback(make_daemon):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    make_daemon(tcp_listen=f"127.0.0.1:{port}")
    with Client(f"ipv4:127.0.0.1:{port}", session=False) as c:
        c.ping()
        assert json.dumps(c.stats())


def test_daemon_side_policies(ready):
    c, stub, lid, sid = ready
    toks = tokens(2 * CT, 8000)
    r = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=toks, session_id=sid, no_store=True))
    assert len(r.slots.offsets) == 0
    stub.Commit(pb.CommitRequest(reservation_id=r.reservation_id, session_id=sid))
    r = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=toks, session_id=sid, expected_output_tokens=9000))
    assert len(r.slots.offsets) == 0  # over bypass_generation_tokens (8192): degrade to plain compute
    stub.Commit(pb.CommitRequest(reservation_id=r.reservation_id, session_id=sid))
    chunks = [bytes(LAYOUT.chunk_bytes)] * 2
    assert stub.PutBytes(pb.PutBytesRequest(layout_id=lid, tokens=toks, chunks=chunks, no_store=True)).committed_chunks == 0
    assert c.lookup(LAYOUT, toks) == 0
    r = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=toks, session_id=sid, expected_output_tokens=100))
    assert len(r.slots.offsets) == 2
    stub.Abort(pb.AbortRequest(reservation_ids=[r.reservation_id], session_id=sid))
    cached = tokens(2 * CT)  # the fixture's cached prompt
    a = stub.Acquire(pb.AcquireRequest(layout_id=lid, tokens=cached, session_id=sid, no_cache=True))
    assert a.matched_tokens == 0 and len(a.chunks.offsets) == 0
    assert stub.Acquire(pb.AcquireRequest(layout_id=lid, tokens=cached, session_id=sid)).matched_tokens == 2 * CT
