"""Calls on the Session stream, against the real daemon: the request path's calls ride the stream
the client already holds (no unary call), answer exactly what the unary RPC answers, fail with
its status without ending the session, and fall back to unary calls where the stream cannot
take them (another call on it, a daemon that does not answer there)."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import AsyncClient, Client
from kvcached_client.errors import DeadlineExceededError, NotFoundError
from tests.service.conftest import LAYOUT

CT = LAYOUT.chunk_tokens


def unary_calls(monkeypatch, c: Client) -> list[str]:
    """The unary RPCs ``c`` makes from now on, by method name (the stream's calls are not here)."""
    calls: list[str] = []
    for name in ("AcquireReserve", "CommitRelease", "Commit", "Acquire", "Reserve", "Lookup", "Release"):
        real = getattr(c._stub, name)

        def unary(request, *a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(request, *a, **kw)

        monkeypatch.setattr(c._stub, name, unary)
    return calls


def test_a_miss_and_a_hit_make_no_unary_call(daemon, monkeypatch):
    kv = torch.randn(2, 2, 2, 3 * CT, 8)
    prompt = list(range(3 * CT + 5))
    with Client(daemon.socket) as c:
        c.warm_up()
        c.register(LAYOUT)
        unary = unary_calls(monkeypatch, c)
        with c.acquire_reserve(LAYOUT, prompt) as req:  # a miss: AcquireReserve, then Commit
            assert [s.position for s in req.reservation.slots] == [0, 1, 2]
            req.write(kv)
        assert c.lookup(LAYOUT, prompt) == 3 * CT
        req = c.acquire_reserve(LAYOUT, prompt)  # a full hit
        assert req.matched_tokens == 3 * CT and torch.equal(req.lease.kv(), kv)
        r = req.finish()
        assert (r.stored_chunks, r.cached_tokens) == (0, 3 * CT)
        with c.acquire(LAYOUT, prompt) as lease:
            assert torch.equal(lease.kv(), kv)
        assert unary == []
        c.sync()
        assert c.stats()["leases_active"] == 0


def test_the_stream_answers_what_the_unary_call_answers(daemon):
    """The same requests, once unary and once on the stream, answer the same (ids and TTLs aside)."""
    kv = torch.randn(2, 2, 2, 2 * CT, 8)
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(2 * CT)), kv)
        lid = c.register(LAYOUT)
        sid = c.session_id()
        tokens = c_pack(list(range(4 * CT)))
        req = pb.AcquireReserveRequest(layout_id=lid, tokens=tokens, session_id=sid)
        unary = c._stub.AcquireReserve(req, timeout=10)
        streamed = c._call(c._stub.AcquireReserve, req)
        for r in (unary, streamed):
            assert r.lease.matched_tokens == 2 * CT and list(r.lease.chunks.offsets) == list(unary.lease.chunks.offsets)
            assert r.reservation.cached_tokens == 2 * CT
        # the first reserved the two uncached chunks; the second finds them being written
        assert len(unary.reservation.slots.offsets) == 2 and streamed.reservation.in_flight_tokens == 2 * CT
        assert unary.lease.lease_id != streamed.lease.lease_id
        lookup = pb.LookupRequest(layout_id=lid, tokens=[tokens, c_pack(list(range(CT)))])
        assert list(c._call(c._stub.Lookup, lookup).cached_tokens) == list(c._stub.Lookup(lookup).cached_tokens) == [2 * CT, CT]


def c_pack(tokens: list[int]) -> bytes:
    from kvcached_client import _core

    return _core.pack_tokens(tokens)


def raw_stream(socket: str):
    """A bare Session stream: (send, next event, close)."""
    channel = grpc.insecure_channel(f"unix://{socket}")
    stub = pb_grpc.KVCacheStub(channel)
    q: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        yield pb.SessionRequest(client_name="raw")
        while (m := q.get()) is not None:
            yield m

    call = stub.Session(requests())

    def close():
        q.put(None)
        call.cancel()
        channel.close()

    return q.put, lambda: next(call), close, stub


def test_a_failing_call_keeps_the_stream_and_the_session(daemon):
    put, events, close, stub = raw_stream(daemon.socket)
    try:
        first = events()
        assert first.stream_calls and first.session_id
        lid = stub.RegisterLayout(pb.RegisterLayoutRequest(layout=_layout_proto())).layout_id
        tokens = c_pack(list(range(2 * CT)))
        put(pb.SessionRequest(call_id=1, reserve=pb.ReserveRequest(layout_id=lid, tokens=tokens)))
        ev = events()
        assert ev.call_id == 1 and ev.WhichOneof("reply") == "reserve" and len(ev.reserve.slots.offsets) == 2
        held = ev.reserve.reservation_id
        # unknown layout: NOT_FOUND; a token field that is not uint32s: INVALID_ARGUMENT; a call id
        # with no call: INVALID_ARGUMENT. Each answered, none ends the stream.
        put(pb.SessionRequest(call_id=2, acquire_reserve=pb.AcquireReserveRequest(layout_id="nope", tokens=tokens)))
        put(pb.SessionRequest(call_id=3, acquire=pb.AcquireRequest(layout_id=lid, tokens=b"\x01\x02\x03")))
        put(pb.SessionRequest(call_id=4))
        codes = {}
        for _ in range(3):
            ev = events()
            assert ev.WhichOneof("reply") == "error"
            codes[ev.call_id] = grpc.StatusCode.__members__[_name_of(ev.error.code)]
        assert codes == {2: grpc.StatusCode.NOT_FOUND, 3: grpc.StatusCode.INVALID_ARGUMENT,
                         4: grpc.StatusCode.INVALID_ARGUMENT}
        # the reservation is still the session's: commit it on the stream (nothing written: 0 chunks)
        put(pb.SessionRequest(call_id=5, commit=pb.CommitRequest(reservation_id=held, chunks=0)))
        ev = events()
        assert ev.call_id == 5 and ev.WhichOneof("reply") == "commit" and ev.commit.committed_chunks == 0
        # a session id in the request is ignored: the call acts in the stream's own session
        put(pb.SessionRequest(call_id=6, reserve=pb.ReserveRequest(layout_id=lid, tokens=tokens,
                                                                   session_id="session-of-someone-else")))
        ev = events()
        assert ev.WhichOneof("reply") == "reserve" and ev.reserve.reservation_id
    finally:
        close()
    with Client(daemon.socket) as c:  # the stream's end released its reservation
        deadline = time.monotonic() + 10
        while c.stats()["reservations_active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["reservations_active"] == 0


def _name_of(code: int) -> str:
    return next(s.name for s in grpc.StatusCode if s.value[0] == code)


def _layout_proto():
    from kvcached_client import _core

    return _core.layout_request(LAYOUT).layout


def test_stream_calls_are_in_the_rpc_latency_histogram(daemon):
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(CT)), torch.randn(2, 2, 2, CT, 8))
        for _ in range(3):
            c.acquire_reserve(LAYOUT, list(range(CT))).finish()
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    counts = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvcached_rpc_latency_seconds_count")}
    assert any('method="AcquireReserve"' in k and v >= 3 for k, v in counts.items()), counts


def test_a_call_finds_the_stream_busy_and_goes_unary(daemon, monkeypatch):
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(CT)), torch.randn(2, 2, 2, CT, 8))
        unary = unary_calls(monkeypatch, c)
        assert c._stream is not None and c._stream.try_begin()  # another thread's call is on it
        try:
            c.acquire_reserve(LAYOUT, list(range(CT))).finish()
        finally:
            c._stream.end()
        assert unary == ["AcquireReserve"]
        c.acquire_reserve(LAYOUT, list(range(CT))).finish()
        assert unary == ["AcquireReserve"]


def test_a_daemon_that_does_not_answer_on_the_stream_gets_unary_calls(daemon, monkeypatch):
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(CT)), torch.randn(2, 2, 2, CT, 8))
        assert c._stream is not None
        monkeypatch.setattr(c._stream, "takes_calls", False)  # what a daemon from before says
        unary = unary_calls(monkeypatch, c)
        req = c.acquire_reserve(LAYOUT, list(range(CT)))
        assert req.matched_tokens == CT
        req.finish()
        assert unary == ["AcquireReserve"]


def test_threads_share_the_stream_and_unary_calls(daemon):
    """Several threads, one client: every request gets its own prompt's KV back, whichever way
    its calls went, and nothing stays held."""
    with Client(daemon.socket) as c:
        c.register(LAYOUT)
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                for i in range(15):
                    prompt = [k * 100_000 + i * 1000 + t for t in range(2 * CT)]
                    kv = torch.full((2, 2, 2, 2 * CT, 8), float(k * 100 + i))
                    with c.acquire_reserve(LAYOUT, prompt) as req:
                        req.write(kv)
                    with c.acquire_reserve(LAYOUT, prompt) as req:
                        assert req.matched_tokens == 2 * CT and torch.equal(req.lease.kv(), kv)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        c.sync()
        s = c.stats()
        assert (s["leases_active"], s["reservations_active"]) == (0, 0)


def test_a_call_past_its_deadline_gives_back_what_it_was_granted(daemon):
    """The daemon is stopped (SIGSTOP) while a call waits: the call raises DeadlineExceeded after
    the client's timeout, and when the daemon runs again its late reply's lease and reservation
    are given back on the stream, not left pinned until their TTL."""
    with Client(daemon.socket, timeout=1.0) as c:
        c.put(LAYOUT, list(range(CT)), torch.randn(2, 2, 2, CT, 8))
        c.sync()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                c.acquire_reserve(LAYOUT, list(range(3 * CT)))  # a hit of one chunk, two reserved
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            c.sync()
            s = c.stats()
            if (s["leases_active"], s["reservations_active"]) == (0, 0):
                break
            time.sleep(0.05)
        assert (s["leases_active"], s["reservations_active"]) == (0, 0), s
        req = c.acquire_reserve(LAYOUT, list(range(CT)))  # the stream still works
        assert req.matched_tokens == CT
        req.finish()


def test_a_forgotten_layout_is_registered_again_through_the_stream(daemon, monkeypatch):
    """The stream's NOT_FOUND reaches the client's re-register path as the unary one did."""
    with Client(daemon.socket) as c:
        c.register(LAYOUT)
        c._layouts[LAYOUT] = "a-layout-id-the-daemon-never-gave"
        unary = unary_calls(monkeypatch, c)
        with pytest.raises(NotFoundError):  # the stream's error, as the unary call's
            c._call(c._stub.Acquire, pb.AcquireRequest(layout_id="a-layout-id-the-daemon-never-gave",
                                                       tokens=c_pack([1]), session_id=c.session_id()))
        req = c.acquire_reserve(LAYOUT, list(range(CT)))
        assert len(req.reservation.slots) == 1
        req.finish(commit=False)
        assert unary == []


def test_the_async_client_calls_on_the_stream_too(daemon, monkeypatch):
    kv = torch.randn(2, 2, 2, 2 * CT, 8)
    prompt = list(range(2 * CT))

    async def main() -> None:
        async with AsyncClient(daemon.socket) as c:
            await c.register(LAYOUT)
            await c.session_id()
            unary = unary_calls(monkeypatch, c)
            async with await c.acquire_reserve(LAYOUT, prompt) as req:  # a miss, then its commit
                req.write(kv)
            req = await c.acquire_reserve(LAYOUT, prompt)
            assert req.matched_tokens == 2 * CT and torch.equal(req.lease.kv(), kv)
            await req.finish()
            assert await c.lookup(LAYOUT, prompt) == 2 * CT
            assert unary == ["Release"]  # the async client's release is an awaited unary call
            c.stream_calls = False
            await (await c.acquire_reserve(LAYOUT, prompt)).finish()
            assert unary == ["Release", "AcquireReserve", "Release"]
            assert (await c.stats())["leases_active"] == 0

    asyncio.run(main())


def test_an_async_call_past_its_deadline_gives_back_what_it_was_granted(daemon):
    async def main() -> None:
        async with AsyncClient(daemon.socket, timeout=1.0) as c:
            await c.put(LAYOUT, list(range(CT)), torch.randn(2, 2, 2, CT, 8))
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(DeadlineExceededError):
                    await c.acquire_reserve(LAYOUT, list(range(3 * CT)))
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s = await c.stats()
                if (s["leases_active"], s["reservations_active"]) == (0, 0):
                    break
                await asyncio.sleep(0.05)
            assert (s["leases_active"], s["reservations_active"]) == (0, 0), s
            req = await c.acquire_reserve(LAYOUT, list(range(CT)))
            assert req.matched_tokens == CT
            await req.finish()

    asyncio.run(main())
