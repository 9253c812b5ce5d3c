"""Security conformance (issue #7): what one tenant can learn about, or do to, another.

Threat model. A trust domain is a socket (``[domains.NAME]``); everything reachable through one
socket is one domain's, and processes on the same socket trust each other (they share a
writable pool mapping). The attacker is a client of another domain, or a same-domain client
that tries to poison entries through the API, or a local user who is not meant to reach the
socket at all, or a network peer.

* (a) isolation on every tier: paired tests, same domain hits and other domain misses, for each
  place a chunk can live (``TIERS``) and each way it can be read (``READS``), and evicts from
  one domain that must not touch the other's chunks (``EVICTS``). A new tier gets a
  ``_place_*`` function and an entry in ``TIERS``; every read and evict case then runs on it.
* (b) timing: a domain-B client cannot tell by acquire latency whether a prompt is cached in
  domain A (ROC AUC of the two latency sets <= 0.6), while the same measurement does tell a
  same-domain hit from a miss (the positive control). The long version, with Lookup probes and
  concurrency, is ``bench/timing_probe.py``.
* (c) clients cannot supply chunk hashes: no request field can carry one (descriptor walk),
  poisoning through put / put_bytes / reserve+commit fails in the same domain and cannot reach
  another domain, hashes are keyed by a private per-daemon key, lease ids are bound to the
  session that holds them.
* (d) the Unix socket's mode and group are enforced by the kernel against a real other user.
* (e) TCP: plain TCP off loopback is refused unless explicitly allowed; with TLS, a TLS client
  is served and a plaintext one is not. (Plain TCP on loopback is tested in
  ``tests/service/test_api.py::test_tcp_on_loopback``; the settings check alone in
  ``tests/test_cli.py::test_tcp_needs_tls_unless_loopback_or_allowed``.)

What these tests do not cover: the modes of the pool segment and NVMe files (tested with the
change that derives them from the socket's access), and same-domain clients writing through
their pool mapping (a domain is one trust unit by design).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch

from kvcached.contract.keys import ChunkHasher, Namespace, load_or_create_key
from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import Client
from kvcached_client import _core
from bench.harness.daemon import Daemon
from tests.reliability.conftest import LAYOUT
from tests.requirements import require

CT = LAYOUT.chunk_tokens
N_CHUNKS = 3
FULL = N_CHUNKS * CT


# -- helpers ---------------------------------------------------------------------------------


def kv_for(tag: str, n_tokens: int = FULL) -> torch.Tensor:
    """Deterministic, recognisable KV for ``tag`` ([2, layers, kv_heads, n_tokens, head_dim])."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    return torch.randn(2, LAYOUT.num_layers, LAYOUT.num_kv_heads, n_tokens, LAYOUT.head_dim, generator=g)


def payloads(kv: torch.Tensor) -> list[bytes]:
    """Chunk payloads of ``kv`` as the bytes API carries them."""
    n = kv.shape[3] // CT
    return [kv[:, :, :, i * CT:(i + 1) * CT].contiguous().numpy().tobytes() for i in range(n)]


def from_payloads(chunks: list[bytes]) -> torch.Tensor:
    return torch.cat([torch.frombuffer(bytearray(c), dtype=torch.float32).reshape(LAYOUT.chunk_shape)
                      for c in chunks], dim=3)


def stub(sock: str) -> tuple[grpc.Channel, pb_grpc.KVCacheStub]:
    ch = grpc.insecure_channel(f"unix:{sock}")
    return ch, pb_grpc.KVCacheStub(ch)


def roc_auc(pos: list[float], neg: list[float]) -> float:
    """P(a random ``pos`` sample > a random ``neg`` sample), ties counting half: the
    Mann-Whitney U of ``pos`` divided by n_pos * n_neg (midranks for ties)."""
    allv = sorted([(v, 0) for v in pos] + [(v, 1) for v in neg])
    ranks = [0.0] * len(allv)
    i = 0
    while i < len(allv):
        j = i
        while j < len(allv) and allv[j][0] == allv[i][0]:
            j += 1
        for k in range(i, j):
            ranks[k] = (i + j + 1) / 2  # mean of the 1-based ranks i+1..j
        i = j
    r_pos = sum(r for r, (_, g) in zip(ranks, allv) if g == 0)
    u = r_pos - len(pos) * (len(pos) + 1) / 2
    return u / (len(pos) * len(neg))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def ping(channel: grpc.Channel, timeout: float = 5.0) -> str:
    """"OK" or the status code name of a Ping on ``channel``."""
    try:
        pb_grpc.KVCacheStub(channel).Ping(pb.PingRequest(), timeout=timeout)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def test_roc_auc_helper():
    assert roc_auc([2, 3, 4], [0, 1]) == 1.0
    assert roc_auc([0, 1], [2, 3, 4]) == 0.0
    assert roc_auc([1, 1], [1, 1]) == 0.5
    assert roc_auc([1, 3], [2, 2]) == 0.5


# -- (a) isolation conformance on every tier ----------------------------------------------------

READS = ("lookup", "acquire-promote", "acquire-direct", "get_bytes")
EVICTS = ("evict-prefix", "evict-layout", "evict-all")
CASES = READS + EVICTS  # each case gets its own prompt, so the cases of one tier share a daemon


class TierEnv:
    """A two-domain daemon whose domain A holds every case's prompt on one tier."""

    def __init__(self, name: str, daemon: Daemon, b_sock: str) -> None:
        self.name, self.daemon, self.a_sock, self.b_sock = name, daemon, daemon.socket, b_sock

    @staticmethod
    def tokens(case: str) -> list[int]:
        base = 10_000 * (CASES.index(case) + 1)  # distinct first chunk per case: no shared prefixes
        return list(range(base, base + FULL))


def _place_pool(d: Daemon) -> None:
    """Chunks in A's pool: put and nothing else."""
    with Client(d.socket) as a:
        for case in CASES:
            assert a.put(LAYOUT, TierEnv.tokens(case), kv_for(f"A/{case}")).stored_chunks == N_CHUNKS


def _place_nvme(d: Daemon) -> None:
    """Chunks only on A's NVMe tier: put, then a clean stop (it flushes) and a restart (empty pool)."""
    _place_pool(d)
    assert d.stop() == 0
    d.start()
    with Client(d.socket) as a:
        s = a.stats()
        assert s["pool"]["chunks"] == 0 and s["nvme"]["chunks"] == N_CHUNKS * len(CASES), s


#: Where a chunk can live -> how to put it (only) there. A new tier adds one line.
TIERS: dict[str, Callable[[Daemon], None]] = {"pool": _place_pool, "nvme": _place_nvme}


@pytest.fixture(scope="module", params=sorted(TIERS))
def tier(request, tmp_path_factory) -> Iterator[TierEnv]:
    root = tmp_path_factory.mktemp(f"tier-{request.param}")
    b_sock = str(root / "b.sock")
    d = Daemon(str(root), pool_bytes="4M",
               domains={"tenant_b": {"socket": b_sock, "pool_bytes": "4M", "socket_mode": "0600"}})
    try:
        d.start()
        TIERS[request.param](d)
        yield TierEnv(request.param, d, b_sock)
    finally:
        if d.proc is not None:
            d.stop(signal.SIGKILL)


def _read(c: Client, how: str, toks: list[int]) -> tuple[int, torch.Tensor | None, int]:
    """(matched tokens, what was read, chunks handed out as NVMe keys for a direct read)."""
    if how == "lookup":
        return c.lookup(LAYOUT, toks), None, 0
    if how == "get_bytes":
        chunks = c.get_bytes(LAYOUT, toks)
        return len(chunks) * CT, (from_payloads(chunks) if chunks else None), 0
    with c.acquire(LAYOUT, toks) as lease:
        direct = sum(off == _core.NVME_CHUNK for off in lease._offsets)
        out = lease.matched_tokens, (lease.kv() if lease.matched_tokens else None), direct
    c.sync()  # the release travels on the session stream: done before the caller evicts or looks
    return out


@pytest.mark.parametrize("how", READS)
def test_reads_are_isolated_on_every_tier(tier, how):
    """Same domain: a hit with A's exact bytes, from the tier under test. Other domain, same
    tokens: a miss, and nothing moved or counted as a hit there."""
    toks, x = tier.tokens(how), kv_for(f"A/{how}")
    mode = "direct" if how == "acquire-direct" else "promote"
    with Client(tier.a_sock, nvme_read=mode) as a, Client(tier.b_sock, nvme_read=mode) as b:
        before = a.stats()["counters"]
        matched, got, direct = _read(a, how, toks)
        after = a.stats()["counters"]
        assert matched == FULL  # same domain: hit
        if got is not None:
            assert torch.equal(got, x)
        promoted = after["promotions"] - before["promotions"]
        if tier.name == "nvme" and how == "acquire-direct":
            assert (direct, promoted) == (N_CHUNKS, 0)  # read from A's LMDB file by the client itself
        elif tier.name == "nvme" and how != "lookup":
            assert (direct, promoted) == (0, N_CHUNKS)  # the daemon promoted them into A's pool
        else:
            assert (direct, promoted) == (0, 0)

        b_before = b.stats()["counters"]
        assert _read(b, how, toks) == (0, None, 0)  # other domain: miss
        b_after = b.stats()["counters"]
        assert b_after["hit_tokens"] == b_before["hit_tokens"] and b_after["promotions"] == b_before["promotions"]


@pytest.mark.parametrize("evict", EVICTS)
def test_evicts_in_one_domain_spare_the_other_on_every_tier(tier, evict):
    """B caches the same tokens (its own bytes) and evicts them (by prefix, by layout, all): B's
    copy goes, A's chunks stay on their tier with their bytes. Then the same evict by prefix in
    A removes A's chunks: the evict does reach this tier, just not across domains."""
    toks, x, y = tier.tokens(evict), kv_for(f"A/{evict}"), kv_for(f"B/{evict}")
    with Client(tier.a_sock, nvme_read="direct") as a, Client(tier.b_sock) as b:
        lid = b.register(LAYOUT)
        assert b.put(LAYOUT, toks, y).stored_chunks == N_CHUNKS  # a miss in B: A's copy did not count
        assert b.lookup(LAYOUT, toks) == FULL
        s0 = a.stats()
        if evict == "evict-prefix":
            chunks, _ = b.evict(lid, toks[:CT])
        elif evict == "evict-layout":
            chunks, _ = b.evict(lid)
        else:
            chunks, _ = b.evict()
        assert chunks >= N_CHUNKS and b.lookup(LAYOUT, toks) == 0  # the evict worked, in B
        s1 = a.stats()
        assert (s1["pool"]["chunks"], s1["nvme"]["chunks"]) == (s0["pool"]["chunks"], s0["nvme"]["chunks"])
        matched, got, direct = _read(a, "acquire-direct", toks)
        assert matched == FULL and torch.equal(got, x)
        assert direct == (N_CHUNKS if tier.name == "nvme" else 0)  # still on the tier under test
        assert a.evict(a.register(LAYOUT), toks[:CT])[0] == N_CHUNKS  # positive control, in A
        assert a.lookup(LAYOUT, toks) == 0


# -- (b) timing ---------------------------------------------------------------------------------

#: Distinguishability bound: max(AUC, 1 - AUC) of the two latency sets.
AUC_LIMIT = 0.6


def test_acquire_latency_does_not_reveal_another_domains_cache(make_daemon, tmp_path, record_property):
    """Attacker in B acquires 2N random prompts, N of them cached in A (only), in random order
    interleaved with A's own probes of the same prompts (the positive control: hit vs miss in
    A). Interleaving in one shuffled sequence makes any drift of the (busy) box hit every set
    alike. Under no leak the attacker's AUC is 0.5 +- ~0.024 (1 sd at N = 300), so 0.6 is ~4 sd.

    The control must exceed the same bound: an 8-chunk hit pins 8 chunks and returns 8 offsets
    (~2x a miss's latency here), and if the measurement could not see that, a pass of the
    attack bound would mean nothing."""
    n, n_chunks = 300, 8
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    b_sock = str(tmp_path / "b.sock")
    # A's pool holds 16 chunks (what the fixed-block pool held here): most of A's cached prompts live
    # on NVMe, so a same-domain hit (a promotion) is plainly slower than a miss and the control
    # can see it; a hit served from the pool costs about what a miss does (both hash the prompt).
    d = make_daemon(pool_bytes=str(16 * LAYOUT.chunk_bytes), domains={"tenant_b": {"socket": b_sock, "pool_bytes": "2M"}})
    prompts = [p.astype("<u4").tobytes() for p in rng.integers(0, 2**31, size=(2 * n + 40, n_chunks * CT))]
    cached = set(rng.permutation(2 * n)[:n].tolist())
    zero = [bytes(LAYOUT.chunk_bytes)] * n_chunks
    with Client(d.socket) as a, Client(b_sock) as b:
        for i in cached:
            assert a.put_bytes(LAYOUT, prompts[i], zero).stored_chunks == n_chunks
        assert a.lookup_many(LAYOUT, prompts[:2 * n]) == [n_chunks * CT if i in cached else 0 for i in range(2 * n)]
        ends = {"A": (a.register(LAYOUT), a.session_id(), *stub(d.socket)),
                "B": (b.register(LAYOUT), b.session_id(), *stub(b_sock))}

        def probe(who: str, i: int) -> tuple[int, int]:
            lid, sid, _, st = ends[who]
            req = pb.AcquireRequest(layout_id=lid, tokens=prompts[i], session_id=sid)
            t0 = time.perf_counter_ns()
            r = st.Acquire(req, timeout=10)
            dt = time.perf_counter_ns() - t0
            st.Release(pb.ReleaseRequest(lease_ids=[r.lease_id], session_id=sid), timeout=10)  # untimed
            return dt, r.matched_tokens

        for i in range(2 * n, 2 * n + 40):  # warm-up: channels, code paths (fresh prompts, misses)
            probe("A", i), probe("B", i)
        order = [(who, i) for who in "AB" for i in range(2 * n)]
        rng.shuffle(order)
        lat: dict[tuple[str, bool], list[int]] = {(w, c): [] for w in "AB" for c in (True, False)}
        for who, i in order:
            dt, matched = probe(who, i)
            assert matched == (n_chunks * CT if who == "A" and i in cached else 0), (who, i)  # B never hits
            lat[(who, i in cached)].append(dt)
        for _, _, ch, _ in ends.values():
            ch.close()
    attack = roc_auc(lat[("B", True)], lat[("B", False)])
    control = roc_auc(lat[("A", True)], lat[("A", False)])
    med = {f"{w}/{'cached-in-A' if c else 'nowhere'}": float(np.median(v)) / 1e3 for (w, c), v in lat.items()}
    report = (f"timing (n={n} per set, seed {seed}): attack AUC {attack:.3f} (B probes: cached in A only vs "
              f"nowhere), control AUC {control:.3f} (A: hit vs miss); medians us {json.dumps(med)}")
    print(report)
    record_property("attack_auc", round(attack, 4))
    record_property("control_auc", round(control, 4))
    assert max(attack, 1 - attack) <= AUC_LIMIT, report
    assert control > AUC_LIMIT, "the measurement cannot see a same-domain hit; it proves nothing: " + report


# -- (c) clients cannot supply chunk hashes ----------------------------------------------------

#: Every field of every KVCache request message, and what it is. A field a client sets is
#: token ids (hashed by the daemon with its key), an id the daemon issued, a layout
#: descriptor, a KV payload, or a policy knob / label. A new field fails the test until it is
#: classified here, so nobody adds a "client-supplied hash" field without a reviewer noticing.
REQUEST_FIELDS: dict[str, str] = {
    "RegisterLayoutRequest.layout": "layout descriptor",
    **{f"Layout.{f}": "layout descriptor" for f in (
        "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens", "lora_name", "lora_version",
        "extra", "vocab_size")},
    "Layout.ExtraEntry.key": "layout descriptor", "Layout.ExtraEntry.value": "layout descriptor",
    "LookupRequest.layout_id": "daemon-issued id", "LookupRequest.tokens": "token ids",
    "AcquireRequest.layout_id": "daemon-issued id", "AcquireRequest.tokens": "token ids",
    "AcquireRequest.session_id": "daemon-issued id", "AcquireRequest.ttl_seconds": "policy",
    "AcquireRequest.read_nvme_directly": "policy", "AcquireRequest.no_cache": "policy",
    "ReleaseRequest.lease_ids": "daemon-issued id", "ReleaseRequest.session_id": "daemon-issued id",
    "KeepAliveRequest.lease_ids": "daemon-issued id", "KeepAliveRequest.ttl_seconds": "policy",
    "KeepAliveRequest.session_id": "daemon-issued id",
    "ReserveRequest.layout_id": "daemon-issued id", "ReserveRequest.tokens": "token ids",
    "ReserveRequest.session_id": "daemon-issued id", "ReserveRequest.ttl_seconds": "policy",
    "ReserveRequest.no_store": "policy", "ReserveRequest.expected_output_tokens": "policy",
    "CommitRequest.reservation_id": "daemon-issued id", "CommitRequest.chunks": "policy",
    "AbortRequest.reservation_ids": "daemon-issued id", "AbortRequest.session_id": "daemon-issued id",
    "CommitRequest.session_id": "daemon-issued id",
    "SessionRequest.client_name": "label", "SessionRequest.release_lease_ids": "daemon-issued id",
    "SessionRequest.abort_reservation_ids": "daemon-issued id", "SessionRequest.seq": "policy",
    # a call riding the stream: its request message is the unary RPC's, whose fields are classified here
    "SessionRequest.call_id": "policy",
    **{f"SessionRequest.{f}": "unary request" for f in (
        "acquire_reserve", "commit_release", "commit", "acquire", "reserve", "lookup")},
    "ReserveRequest.skip_empty": "policy",
    "AcquireReserveRequest.layout_id": "daemon-issued id", "AcquireReserveRequest.tokens": "token ids",
    "AcquireReserveRequest.session_id": "daemon-issued id", "AcquireReserveRequest.lease_ttl_seconds": "policy",
    "AcquireReserveRequest.reservation_ttl_seconds": "policy", "AcquireReserveRequest.read_nvme_directly": "policy",
    "AcquireReserveRequest.no_cache": "policy", "AcquireReserveRequest.no_store": "policy",
    "AcquireReserveRequest.expected_output_tokens": "policy",
    "CommitReleaseRequest.reservation_id": "daemon-issued id", "CommitReleaseRequest.chunks": "policy",
    "CommitReleaseRequest.lease_ids": "daemon-issued id", "CommitReleaseRequest.session_id": "daemon-issued id",
    "PutBytesRequest.layout_id": "daemon-issued id", "PutBytesRequest.tokens": "token ids",
    "PutBytesRequest.chunks": "kv payload", "PutBytesRequest.session_id": "daemon-issued id",
    "PutBytesRequest.no_store": "policy", "PutBytesRequest.expected_output_tokens": "policy",
    "GetBytesRequest.layout_id": "daemon-issued id", "GetBytesRequest.tokens": "token ids",
    "GetBytesRequest.session_id": "daemon-issued id",
    "StatsRequest.doctor": "policy",
    # which pool slab (the client's device); a slab holds any chunk, so a wrong one only costs speed
    **{f"{m}.placement": "policy" for m in ("AcquireRequest", "ReserveRequest", "AcquireReserveRequest",
                                            "PutBytesRequest")},
    "EvictRequest.layout_id": "daemon-issued id", "EvictRequest.prefix_tokens": "token ids",
}


def test_no_request_field_can_carry_a_chunk_hash():
    from google.protobuf.descriptor import FieldDescriptor as F

    seen: dict[str, int] = {}

    def walk(msg, prefix: str) -> None:
        for f in msg.fields:
            name = f"{prefix}.{f.name}"
            seen[name] = f.type
            if f.type == F.TYPE_MESSAGE:
                walk(f.message_type, f"{f.message_type.containing_type.name}.{f.message_type.name}"
                     if f.message_type.containing_type else f.message_type.name)

    service = pb.DESCRIPTOR.services_by_name["KVCache"]
    for m in service.methods:
        walk(m.input_type, m.input_type.name)
    unclassified = sorted(set(seen) - set(REQUEST_FIELDS))
    assert not unclassified, f"classify these request fields in REQUEST_FIELDS: {unclassified}"
    assert not set(REQUEST_FIELDS) - set(seen), "REQUEST_FIELDS lists fields that no longer exist"
    # Where a hash could hide: any bytes field. They are token ids (hashed by the daemon) or KV payloads.
    byte_fields = sorted(n for n, t in seen.items() if t == F.TYPE_BYTES)
    assert byte_fields and all(REQUEST_FIELDS[n] in ("token ids", "kv payload") for n in byte_fields), byte_fields
    assert not [n for n in seen if re.search(r"hash|digest|nvme_key", n, re.I)]
    # Daemon-issued ids are strings the daemon made; layout ids name a geometry, not content.
    assert all(seen[n] == F.TYPE_STRING for n, kind in REQUEST_FIELDS.items() if kind == "daemon-issued id")
    # A call on the Session stream is a whole unary request message, walked (and classified) as its own type.
    assert all(seen[n] == F.TYPE_MESSAGE for n, kind in REQUEST_FIELDS.items() if kind == "unary request")
    # Chunk hashes do leave the daemon (the LMDB keys of a direct NVMe read), but only in responses.
    assert "nvme_keys" in pb.ChunkLocations.DESCRIPTOR.fields_by_name


def test_same_domain_poisoning_through_the_api_fails(make_daemon):
    """A stores prompt P with bytes X. A same-domain attacker M puts P with Y (put, put_bytes),
    reserves+commits P, races A's in-flight write of another prompt, and extends P: every reader
    still sees X on every chunk A wrote; M only adds chunks that did not exist."""
    d = make_daemon()
    toks, x, y = list(range(FULL)), kv_for("X"), kv_for("Y")
    with Client(d.socket) as a, Client(d.socket) as m, Client(d.socket) as reader:
        assert a.put(LAYOUT, toks, x).stored_chunks == N_CHUNKS
        assert m.put(LAYOUT, toks, y).stored_chunks == 0
        assert m.put_bytes(LAYOUT, toks, payloads(y)).stored_chunks == 0
        ch, st = stub(d.socket)
        with ch:
            lid, sid = m.register(LAYOUT), m.session_id()
            r = st.Reserve(pb.ReserveRequest(layout_id=lid, tokens=_core.pack_tokens(toks), session_id=sid))
            assert len(r.slots.offsets) == 0 and r.cached_tokens == FULL  # nothing of P to write
            assert st.Commit(pb.CommitRequest(reservation_id=r.reservation_id, session_id=sid)).committed_chunks == 0

            # A's write of Q is in flight: M's puts of Q are skipped, A's commit lands X.
            q = list(range(50_000, 50_000 + FULL))
            ra = st.Reserve(pb.ReserveRequest(layout_id=lid, tokens=_core.pack_tokens(q), session_id=a.session_id()))
            assert len(ra.slots.offsets) == N_CHUNKS
            assert m.put(LAYOUT, q, y).stored_chunks == 0 and m.put_bytes(LAYOUT, q, payloads(y)).stored_chunks == 0
            a._ensure_pool(ra.pool_generation)
            # M learned A's reservation id: committing or aborting it anyway is refused, so M
            # cannot publish blocks before A wrote them (they would read as zeros).
            for s in (sid, ""):
                with pytest.raises(grpc.RpcError) as e:
                    st.Commit(pb.CommitRequest(reservation_id=ra.reservation_id, session_id=s))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                assert st.Abort(pb.AbortRequest(reservation_ids=[ra.reservation_id], session_id=s)).aborted == 0
            _core.write_slots(a._pool, LAYOUT, _core.locations(ra.slots), x)
            commit = pb.CommitRequest(reservation_id=ra.reservation_id, session_id=a.session_id())
            assert st.Commit(commit).committed_chunks == N_CHUNKS

        longer = toks + list(range(90_000, 90_000 + CT))
        assert m.put(LAYOUT, longer, torch.cat([y, kv_for("Y+", CT)], dim=3)).stored_chunks == 1  # only the new chunk
        for prompt in (toks, q):
            with reader.acquire(LAYOUT, prompt) as lease:
                assert lease.matched_tokens == FULL and torch.equal(lease.kv(), x)
            assert torch.equal(from_payloads(reader.get_bytes(LAYOUT, prompt)), x)
        with reader.acquire(LAYOUT, longer) as lease:
            assert torch.equal(lease.kv()[:, :, :, :FULL], x)
            assert torch.equal(lease.kv()[:, :, :, FULL:], kv_for("Y+", CT))


def test_other_domain_cannot_poison_or_preempt(make_daemon, tmp_path):
    """Same tokens stored in B, after A (overwrite attempt) and before A (pre-poisoning): each
    domain reads its own bytes, and B's earlier copy does not stop A from storing its own."""
    b_sock = str(tmp_path / "b.sock")
    d = make_daemon(domains={"tenant_b": {"socket": b_sock}})
    p1, p2 = list(range(FULL)), list(range(70_000, 70_000 + FULL))
    with Client(d.socket) as a, Client(b_sock) as b:
        assert a.put(LAYOUT, p1, kv_for("A1")).stored_chunks == N_CHUNKS
        assert b.put(LAYOUT, p1, kv_for("B1")).stored_chunks == N_CHUNKS  # a miss in B: B cannot see or overwrite A's
        assert b.put_bytes(LAYOUT, p2, payloads(kv_for("B2"))).stored_chunks == N_CHUNKS  # B first ...
        assert a.put(LAYOUT, p2, kv_for("A2")).stored_chunks == N_CHUNKS  # ... A still stores its own
        for c, who in ((a, "A"), (b, "B")):
            for p, tag in ((p1, "1"), (p2, "2")):
                with c.acquire(LAYOUT, p) as lease:
                    assert torch.equal(lease.kv(), kv_for(who + tag)), (who, tag)
                assert torch.equal(from_payloads(c.get_bytes(LAYOUT, p)), kv_for(who + tag))


def test_chunk_hashes_are_keyed_by_a_private_per_daemon_key(make_daemon, tmp_path):
    """The key file is 0600; the daemon's chunk identities (seen as the LMDB keys of a direct NVMe
    read) are the keyed chain under exactly that key; another key (another daemon) gives other
    hashes for the same tokens, so nobody without the key can precompute them."""
    k1 = load_or_create_key(str(tmp_path / "one.key"))
    k2 = load_or_create_key(str(tmp_path / "two.key"))
    for name in ("one.key", "two.key"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    assert k1 != k2 and load_or_create_key(str(tmp_path / "one.key")) == k1
    toks = _core.pack_tokens(list(range(FULL)))

    def chain(key: bytes, domain: str = "default") -> list[bytes]:
        h = ChunkHasher(key)
        return h.chain(h.root(Namespace(domain, LAYOUT)), toks, CT)

    assert chain(k1) == chain(k1) and all(u != v for u, v in zip(chain(k1), chain(k2)))
    assert all(u != v for u, v in zip(chain(k1), chain(k1, "tenant_b")))  # and per domain

    d = make_daemon()
    key_file = os.path.join(d.state_dir, "hash.key")
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and os.stat(key_file).st_uid == os.getuid()
    with Client(d.socket) as a:
        a.put(LAYOUT, list(range(FULL)), kv_for("k"))
    assert d.stop() == 0
    d.start()
    with Client(d.socket) as a:
        ch, st = stub(d.socket)
        with ch:
            r = st.Acquire(pb.AcquireRequest(layout_id=a.register(LAYOUT), tokens=toks, read_nvme_directly=True))
            st.Release(pb.ReleaseRequest(lease_ids=[r.lease_id]))
    issued = list(r.chunks.nvme_keys)
    with open(key_file, "rb") as f:
        daemon_key = f.read()
    assert issued == chain(daemon_key)
    assert all(u != v for u, v in zip(issued, chain(k1)))


def test_lease_ids_are_unguessable_and_session_bound(make_daemon, tmp_path):
    """H holds a lease. M (another session, same domain) releasing or renewing it, under M's
    session or under none, does nothing; from domain B the id is unknown; neighbouring ids are
    unknown too. Ids carry 64 random bits, and knowing one is still not enough: ids are bound to
    the session that obtained them."""
    b_sock = str(tmp_path / "b.sock")
    d = make_daemon(domains={"tenant_b": {"socket": b_sock}})
    toks = list(range(FULL))
    with Client(d.socket) as h, Client(d.socket) as m, Client(b_sock) as _b:
        h.put(LAYOUT, toks, kv_for("lease"))
        lease = h.acquire(LAYOUT, toks, ttl=60)
        lid = lease.lease_id
        ch, st = stub(d.socket)
        ch_b, st_b = stub(b_sock)
        with ch, ch_b:
            msid = m.session_id()
            for s in (msid, ""):
                assert st.Release(pb.ReleaseRequest(lease_ids=[lid], session_id=s)).released == 0
                with pytest.raises(grpc.RpcError) as e:
                    st.KeepAlive(pb.KeepAliveRequest(lease_ids=[lid], session_id=s, ttl_seconds=3600))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
            for req in (pb.ReleaseRequest(lease_ids=[lid]), pb.KeepAliveRequest(lease_ids=[lid])):
                with pytest.raises(grpc.RpcError) as e:
                    (st_b.Release if isinstance(req, pb.ReleaseRequest) else st_b.KeepAlive)(req)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND  # another domain never granted it
            guess = lid[:-1] + ("0" if lid[-1] != "0" else "1")
            with pytest.raises(grpc.RpcError) as e:
                st.Release(pb.ReleaseRequest(lease_ids=[guess], session_id=msid))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert h.stats()["leases_active"] == 1
        assert 0 < lease.keep_alive(30) <= 30  # still H's, still live
        assert torch.equal(lease.kv(), kv_for("lease"))
        m.close()  # M's session ending takes nothing of H's with it
        ended = re.compile(rf"session {re.escape(msid)} \(.*\) ended: released 0 leases")
        deadline = time.monotonic() + 30  # the daemon logs the end once it has released the session's pins
        while not ended.search(d.log()):
            assert time.monotonic() < deadline, f"M's session end was never logged:\n{d.log()[-2000:]}"
            time.sleep(0.02)
        assert h.stats()["leases_active"] == 1
        lease.release()
        ids = []
        for _ in range(64):
            with h.acquire(LAYOUT, toks) as other:
                ids.append(other.lease_id)
        assert len(set(ids)) == len(ids)
        rand = [re.fullmatch(r"[a-z]+-([0-9a-f]{16})", i) for i in ids]
        assert all(rand), ids[:3]  # prefix + 16 hex digits = 64 random bits (secrets.token_hex(8))
        assert len({r.group(1)[:4] for r in rand}) > 32  # not a counter


# -- (d) socket permissions, enforced by the kernel --------------------------------------------

CHILD = r"""
import errno, json, os, socket, sys
import grpc
from kvcached.v1 import kvcached_pb2 as pb, kvcached_pb2_grpc as pb_grpc
uid, gid, groups, paths = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
# Drop every privilege before touching the sockets (imports done above, as root: the
# interpreter's own files may not be readable by the target user).
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
assert (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) == (uid, uid, gid, gid)
assert sorted(os.getgroups()) == sorted(set(groups)), os.getgroups()
out = {}
for path in paths:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        raw = "connected"
    except OSError as e:
        raw = errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()
    ch = grpc.insecure_channel("unix:" + path)
    try:
        pb_grpc.KVCacheStub(ch).Ping(pb.PingRequest(), timeout=5)
        rpc = "OK"
    except grpc.RpcError as e:
        rpc = e.code().name
    ch.close()
    out[path] = [raw, rpc]
print(json.dumps(out))
"""


def _other_group() -> str:
    """An existing group that neither nobody nor nogroup is in."""
    nobody = pwd.getpwnam("nobody")
    for name in ("daemon", "bin", "sys", "adm"):
        try:
            g = grp.getgrnam(name)
        except KeyError:
            continue
        if g.gr_gid not in (0, nobody.pw_gid) and "nobody" not in g.gr_mem:
            return name
    pytest.fail("no usable system group (daemon, bin, sys, adm) to own the socket")


def test_socket_mode_and_group_are_enforced_against_another_user():
    """Socket 0660 group G: a process running as nobody is refused (EACCES / UNAVAILABLE) unless
    G is among its groups, then it connects and pings. Domain B's socket (0600, same group) refuses
    even the member of G. The children drop uid, gid and supplementary groups themselves."""
    require(os.geteuid() == 0, "needs root to run clients as another user (CI runs as root)")
    nobody = pwd.getpwnam("nobody")
    group = _other_group()
    gid = grp.getgrnam(group).gr_gid
    root = tempfile.mkdtemp(prefix="kvc-sec-")  # not under pytest's 0700 tmp dir: nobody must traverse it
    os.chmod(root, 0o711)
    d = Daemon(root, socket_mode="0660", socket_group=group,
               domains={"tenant_b": {"socket": os.path.join(root, "b.sock"), "socket_mode": "0600"}})
    try:
        d.start()
        a_sock, b_sock = d.socket, os.path.join(root, "b.sock")
        for path, mode in ((a_sock, 0o660), (b_sock, 0o600)):
            st = os.stat(path)
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, os.getuid(), gid), path

        def child(groups: list[int]) -> dict:
            r = subprocess.run([sys.executable, "-c", CHILD, str(nobody.pw_uid), str(nobody.pw_gid), json.dumps(groups),
                                a_sock, b_sock], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return {k: tuple(v) for k, v in json.loads(r.stdout).items()}

        outsider = child([])
        assert outsider[a_sock] == ("EACCES", "UNAVAILABLE"), outsider
        assert outsider[b_sock] == ("EACCES", "UNAVAILABLE"), outsider
        member = child([gid])
        assert member[a_sock] == ("connected", "OK"), member
        assert member[b_sock] == ("EACCES", "UNAVAILABLE"), member  # 0600: the group does not help
        with grpc.insecure_channel(f"unix:{b_sock}") as ch:
            assert ping(ch) == "OK"  # the owner (root here) is served: the refusals were permissions
    finally:
        if d.proc is not None:
            d.stop(signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


# -- (e) TCP -----------------------------------------------------------------------------------


def _non_loopback_ipv4() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the outgoing address
        ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    except OSError:
        return None
    finally:
        s.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "non-loopback-ip"])
def test_plain_tcp_off_loopback_refuses_to_start(tmp_path, host):
    if host == "non-loopback-ip":
        host = _non_loopback_ipv4() or "192.0.2.1"  # TEST-NET-1 if the box has none: refused before binding anyway
    port = free_port()
    d = Daemon(str(tmp_path), tcp_listen=f"{host}:{port}")
    try:
        with pytest.raises(RuntimeError, match="daemon did not start"):
            d.start(timeout=60)
        assert d.exit_code not in (None, 0) and d.proc is None  # its whole output is read by now
        assert f"tcp_listen = '{host}:{port}': refusing plain TCP" in d.log() and "tls_cert" in d.log(), d.log()
        assert not os.path.exists(d.socket)  # refused before anything was bound
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop(signal.SIGKILL)


def test_plain_tcp_off_loopback_starts_when_explicitly_allowed(make_daemon):
    port = free_port()
    make_daemon(tcp_listen=f"0.0.0.0:{port}", allow_insecure_tcp=True)
    targets = ["127.0.0.1"] + ([ip] if (ip := _non_loopback_ipv4()) else [])
    for host in targets:
        with grpc.insecure_channel(f"{host}:{port}") as ch:
            assert ping(ch) == "OK", host


def _self_signed(tmp_path) -> tuple[str, str]:
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    require(shutil.which("openssl"),
            "no openssl CLI to make a test certificate (and python 'cryptography' is not a dependency)")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=kvcached.test", "-keyout", key, "-out", cert,
                    "-addext", "subjectAltName=DNS:kvcached.test,DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_on_tcp_serves_tls_clients_only(make_daemon, tmp_path):
    """Off loopback with a cert and key (no allow_insecure_tcp): the daemon starts, a client that
    trusts the cert pings, a plaintext client and a client that does not trust the cert cannot."""
    cert, key = _self_signed(tmp_path)
    port = free_port()
    make_daemon(tcp_listen=f"0.0.0.0:{port}", tls_cert=cert, tls_key=key)
    with open(cert, "rb") as f:
        trusted = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(f"127.0.0.1:{port}", trusted) as ch:
        assert ping(ch) == "OK"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert ping(ch) == "UNAVAILABLE"
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials()) as ch:  # system roots only
        assert ping(ch) == "UNAVAILABLE"
