"""A request's cache work in at most two round trips, against the real daemon: AcquireReserve,
CommitRelease, releases on the session stream, and a put of a cached prompt in one call."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvcached.v1 import kvcached_pb2 as pb
from kvcached_client import Client
from kvcached_client.errors import InvalidArgumentError
from tests.service.conftest import LAYOUT

CT = LAYOUT.chunk_tokens


def count_calls(monkeypatch, c: Client) -> list[str]:
    """The unary RPCs ``c`` makes, by name (what is on the request's path)."""
    calls: list[str] = []
    real = c._call

    def call(method, request, timeout=None):
        calls.append(type(request).__name__.removesuffix("Request"))
        return real(method, request, timeout)

    monkeypatch.setattr(c, "_call", call)
    return calls


def test_miss_then_hit_take_one_call_each(daemon, monkeypatch):
    kv = torch.randn(2, 2, 2, 3 * CT, 8)
    prompt = list(range(3 * CT + 5))
    with Client(daemon.socket) as c:
        c.warm_up()
        c.register(LAYOUT)
        calls = count_calls(monkeypatch, c)
        with c.acquire_reserve(LAYOUT, prompt) as req:  # a miss: nothing to read, three chunks to write
            assert req.matched_tokens == 0 and not req.lease.lease_id
            assert [s.position for s in req.reservation.slots] == [0, 1, 2]
            req.write(kv)
        assert calls == ["AcquireReserve", "Commit"]
        assert c.lookup(LAYOUT, prompt) == 3 * CT
        calls.clear()
        req = c.acquire_reserve(LAYOUT, prompt)  # a full hit: read, nothing to write
        assert req.matched_tokens == 3 * CT and not req.reservation.opened
        assert torch.equal(req.lease.kv(), kv)
        r = req.finish()
        assert calls == ["AcquireReserve"]  # the release went on the session stream
        assert (r.stored_chunks, r.cached_tokens) == (0, 3 * CT)
        c.sync()
        assert c.stats()["leases_active"] == 0


def test_a_partial_hit_commits_and_releases_in_one_call(daemon, monkeypatch):
    kv = torch.randn(2, 2, 2, 4 * CT, 8)
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(2 * CT)), kv[:, :, :, : 2 * CT])
        calls = count_calls(monkeypatch, c)
        with c.acquire_reserve(LAYOUT, list(range(4 * CT))) as req:
            assert req.matched_tokens == 2 * CT
            assert [s.position for s in req.reservation.slots] == [2, 3]
            assert torch.equal(req.lease.kv(), kv[:, :, :, : 2 * CT])
            req.write(kv)
        assert calls == ["AcquireReserve", "CommitRelease"]
        s = c.stats()
        assert (s["leases_active"], s["reservations_active"]) == (0, 0)  # released by the same call
        assert c.lookup(LAYOUT, list(range(4 * CT))) == 4 * CT


def test_put_of_a_cached_prompt_is_one_call(daemon, monkeypatch):
    kv = torch.randn(2, 2, 2, 2 * CT, 8)
    with Client(daemon.socket) as c:
        assert c.put(LAYOUT, list(range(2 * CT)), kv).stored_chunks == 2
        calls = count_calls(monkeypatch, c)
        r = c.put(LAYOUT, list(range(2 * CT)), kv)
        assert calls == ["Reserve"] and (r.stored_chunks, r.cached_tokens) == (0, 2 * CT)
        assert c.stats()["reservations_active"] == 0  # no empty reservation left open


def test_policies_and_an_abandoned_request(daemon):
    kv = torch.randn(2, 2, 2, 2 * CT, 8)
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(CT)), kv[:, :, :, :CT])
        req = c.acquire_reserve(LAYOUT, list(range(2 * CT)), no_cache=True, no_store=True)
        assert req.matched_tokens == 0 and not req.reservation.opened
        req.finish()
        req = c.acquire_reserve(LAYOUT, list(range(2 * CT)))
        assert req.matched_tokens == CT and len(req.reservation.slots) == 1
        req.finish(commit=False)  # the engine gave up: release and abort, without waiting
        c.sync()
        s = c.stats()
        assert (s["leases_active"], s["reservations_active"]) == (0, 0)
        assert c.lookup(LAYOUT, list(range(2 * CT))) == CT


def test_commit_release_refuses_an_unknown_lease_and_changes_nothing(daemon):
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(CT)), torch.randn(2, 2, 2, CT, 8))
        sid = c.session_id()
        stub = c._stub
        lid = c.register(LAYOUT)
        packed = b"".join(i.to_bytes(4, "little") for i in range(2 * CT))
        resp = stub.AcquireReserve(pb.AcquireReserveRequest(layout_id=lid, tokens=packed, session_id=sid))
        assert resp.lease.lease_id and resp.reservation.reservation_id
        with pytest.raises(grpc.RpcError) as e:
            stub.CommitRelease(pb.CommitReleaseRequest(reservation_id=resp.reservation.reservation_id,
                                                       lease_ids=["lease-0000000000000000"], session_id=sid))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        s = c.stats()
        assert (s["leases_active"], s["reservations_active"]) == (1, 1)  # nothing committed, nothing released
        out = stub.CommitRelease(pb.CommitReleaseRequest(reservation_id=resp.reservation.reservation_id,
                                                         lease_ids=[resp.lease.lease_id], session_id=sid))
        assert out.released == 1 and out.commit.committed_chunks == 1


def test_a_write_takes_per_layer_kv_as_an_engine_holds_it(daemon):
    """``write`` of (keys, values) per layer stores the same bytes as the stacked tensor, and
    refuses KV of the wrong geometry before anything is written or committed."""
    kv = torch.randn(2, 2, 2, 3 * CT + 5, 8)  # [2, layers, kv_heads, tokens, head_dim]
    layers = [(kv[0, i], kv[1, i]) for i in range(2)]  # views, as a model's cache holds them
    prompt = list(range(3 * CT + 5))
    with Client(daemon.socket) as c:
        bad = [[(k, v)] for k, v in layers[:1]] + [
            [(k[:1], v) for k, v in layers],  # one KV head short
            [(k.half(), v) for k, v in layers],  # the wrong dtype
            [(k[:, : 2 * CT], v) for k, v in layers],  # shorter than the prompt's full chunks
        ]
        for kv_bad in bad:
            with c.acquire_reserve(LAYOUT, prompt) as req:
                with pytest.raises(InvalidArgumentError):
                    req.write(kv_bad)
                req.finish(commit=False)
        assert c.lookup(LAYOUT, prompt) == 0
        with c.acquire_reserve(LAYOUT, prompt) as req:
            req.write(layers)
        with c.acquire_reserve(LAYOUT, prompt, no_store=True) as req:
            assert req.matched_tokens == 3 * CT
            assert torch.equal(req.lease.kv(), kv[:, :, :, : 3 * CT])
