"""Fuzz harness (issue #7, "bad input"), with hypothesis.

Three parts:

(a) ``test_fuzzed_bytes_to_every_rpc``: random bytes, and random mutations (bit flips,
    truncations, splices of two requests, inserted junk) of valid serialized requests,
    sent as raw bytes to every RPC of one real daemon. Each answer is OK or one of
    INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION / RESOURCE_EXHAUSTED / OUT_OF_RANGE,
    never INTERNAL or UNKNOWN; the daemon answers Ping after every request; at the end it
    is alive, stops cleanly, and its whole log holds no traceback. ``Drain`` is left out on purpose: a mutation
    that still parses would drain the daemon, after which UNAVAILABLE is the correct answer
    to everything (the deterministic corpus in :mod:`tests.reliability.corpus` sends Drain
    only bytes that cannot parse).
(b) ``test_decoding_*``: random layouts and token arrays through the decoding functions of
    :mod:`kvcached.service.convert` and :func:`kvcached.contract.keys.normalize_tokens`: they return
    a well-formed value or raise a :class:`kvcached.contract.errors.KvcacheError` subclass, never
    another exception. A pool handle is either refused with
    :class:`kvcached.contract.errors.InvalidPoolHandle` or one a client can map (:func:`mappable`,
    the rules written out here), field for field.
(c) The store-operations half of the harness is the stateful test in
    ``tests/test_store_stateful.py`` (random sequences of acquire/reserve/commit/abort/
    release/evict/expire checked against a reference model); it is not repeated here.

CI runs few examples. A long fuzz, e.g. overnight::

    KVCACHED_FUZZ_EXAMPLES=100000 .venv/bin/python -m pytest tests/reliability/test_fuzz.py -q

(and the stateful half: ``KVCACHED_FUZZ_EXAMPLES`` does not reach it; raise its
``max_examples`` in tests/test_store_stateful.py for a long run). Hypothesis prints the
smallest failing input; no example database is written.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from typing import Any

import grpc
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvcached.contract.errors import InvalidPoolHandle, KvcacheError
from kvcached.contract.keys import DTYPE_SIZES, KVLayout, normalize_tokens
from kvcached.contract import proto
from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import Client
from tests.reliability.conftest import LAYOUT
from tests.reliability.corpus import CT, DAEMON_SETTINGS, METHODS, VOCAB, World, base_requests, chunk, tokens

EXAMPLES = int(os.environ.get("KVCACHED_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

S = grpc.StatusCode
ALLOWED = {S.OK, S.INVALID_ARGUMENT, S.NOT_FOUND, S.FAILED_PRECONDITION, S.RESOURCE_EXHAUSTED, S.OUT_OF_RANGE}
FUZZED_METHODS = [m for m in METHODS if m != "Drain"]

# -- (a) bytes to a real daemon ------------------------------------------------------------------


def _mutate(data: st.DataObject, base: bytes, seeds: list[bytes]) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "insert", "delete", "same"]), label="mutation")
    if not base:
        kind = "insert"
    if kind == "flip":
        b = bytearray(base)
        for bit in data.draw(st.lists(st.integers(0, len(b) * 8 - 1), min_size=1, max_size=8), label="bits"):
            b[bit // 8] ^= 1 << (bit % 8)
        return bytes(b)
    if kind == "truncate":
        return base[: data.draw(st.integers(0, len(base) - 1), label="cut")]
    if kind == "splice":
        other = data.draw(st.sampled_from(seeds), label="other")
        i = data.draw(st.integers(0, len(base)), label="i")
        j = data.draw(st.integers(0, len(other)), label="j")
        return base[:i] + other[j:]
    if kind == "insert":
        i = data.draw(st.integers(0, len(base)), label="at")
        return base[:i] + data.draw(st.binary(min_size=1, max_size=24), label="junk") + base[i:]
    if kind == "delete":
        i = data.draw(st.integers(0, len(base) - 1), label="from")
        j = data.draw(st.integers(i + 1, min(len(base), i + 24)), label="to")
        return base[:i] + base[j:]
    return base


def _send(channel: grpc.Channel, method: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
    path = f"/kvcached.v1.KVCache/{method}"
    try:
        if method == "Session":
            call = channel.stream_stream(path, request_serializer=None, response_deserializer=None)(iter([raw]),
                                                                                                 timeout=10)
            for _ in call:
                pass
            return call.code(), call.details() or ""
        channel.unary_unary(path, request_serializer=None, response_deserializer=None)(raw, timeout=10)
        return S.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def test_fuzzed_bytes_to_every_rpc(make_daemon):
    d = make_daemon(**DAEMON_SETTINGS)
    with Client(d.socket) as c:
        sid = c.session_id()
        channel = grpc.insecure_channel(f"unix:{d.socket}")
        stub = pb_grpc.KVCacheStub(channel)
        lid = stub.RegisterLayout(pb.RegisterLayoutRequest(layout=proto.layout_to_proto(LAYOUT))).layout_id
        stub.RegisterLayout(pb.RegisterLayoutRequest(layout=proto.layout_to_proto(VOCAB)))
        stub.PutBytes(pb.PutBytesRequest(layout_id=lid, tokens=tokens(2 * CT), chunks=[chunk(1), chunk(2)]))
        lease = stub.Acquire(pb.AcquireRequest(layout_id=lid, tokens=tokens(2 * CT), session_id=sid)).lease_id
        res = stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=tokens(2 * CT, 90_000), session_id=sid))
        w = World.dummy()
        w = World(sid=sid, other_sid=w.other_sid, closed_sid=w.closed_sid, own_lease=lease, foreign_lease=lease,
                  released_lease=w.released_lease, expired_lease=w.expired_lease, open_res=res.reservation_id,
                  open_res_slots=len(res.slots.offsets), committed_res=w.committed_res, aborted_res=w.aborted_res)
        seeds: dict[str, list[bytes]] = {m: [] for m in FUZZED_METHODS}
        for method, msg in base_requests(w):
            seeds[method].append(msg.SerializeToString())
        for method in seeds:
            seeds[method].append(b"")  # the empty request is valid for every RPC
        every = [s for v in seeds.values() for s in v]
        seen: dict[str, int] = {}

        @FUZZ
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            method = data.draw(st.sampled_from(FUZZED_METHODS), label="method")
            if data.draw(st.booleans(), label="random"):
                raw = data.draw(st.binary(max_size=256), label="bytes")
            else:
                raw = _mutate(data, data.draw(st.sampled_from(seeds[method]), label="base"), every)
            code, details = _send(channel, method, raw)
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in ALLOWED, (method, raw.hex(), code, details)
            if code != S.OK:
                assert details.strip(), (method, raw.hex(), code)
            stub.Ping(pb.PingRequest(), timeout=10)
            assert d.proc is not None and d.proc.poll() is None, (method, raw.hex(), d.log()[-3000:])

        fuzz()
        assert d.proc.poll() is None
        assert json.loads(stub.Stats(pb.StatsRequest()).json)["draining"] is False
        payloads = [chunk(i + 40) for i in range(2)]
        assert c.put_bytes(LAYOUT, list(range(500_000, 500_000 + 2 * CT)), payloads).stored_chunks == 2
        assert c.get_bytes(LAYOUT, list(range(500_000, 500_000 + 2 * CT))) == payloads
        channel.close()
    assert d.stop() == 0  # a clean stop; after it the whole log has been read
    errors = [line for line in d.output if "Traceback" in line or " ERROR " in line]
    assert not errors, errors[:5]
    # The mutations reach past the parser: not every answer is a parse error.
    print("fuzz answers:", seen)
    if EXAMPLES >= 100:
        assert len(seen) >= 3, seen


# -- (b) the decoding functions ------------------------------------------------------------------

uint32 = st.one_of(st.integers(0, 70_000), st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 4096, 4097, 65536, 65537,
                                                                                     2**31, 2**32 - 1]))
short_text = st.text(max_size=40)
layouts = st.builds(
    pb.Layout,
    model=st.one_of(short_text, st.text(min_size=500, max_size=600), st.just("org/model@rev")),
    num_layers=uint32, num_kv_heads=uint32, head_dim=uint32,
    dtype=st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), short_text),
    chunk_tokens=uint32,
    lora_name=short_text, lora_version=short_text,
    extra=st.dictionaries(short_text, short_text, max_size=4),
    vocab_size=uint32,
)


@FUZZ
@given(layouts)
def test_decoding_layouts(msg: pb.Layout) -> None:
    try:
        layout = proto.layout_from_proto(msg)
    except KvcacheError:
        return
    assert isinstance(layout, KVLayout) and layout.chunk_bytes > 0
    assert len(layout.layout_id) == 32
    assert proto.layout_from_proto(proto.layout_to_proto(layout)) == layout  # a stable round trip


@FUZZ
@given(st.binary(max_size=4096))
def test_decoding_packed_tokens(raw: bytes) -> None:
    try:
        out = proto.tokens_from_proto(raw)
    except KvcacheError:
        assert len(raw) % 4
        return
    assert out == raw and len(out) % 4 == 0


INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "<u4", ">u4", ">i8"]
OTHER_DTYPES = ["float32", "float64", "bool", "complex64"]
ints = st.integers(-(2**70), 2**70)
token_inputs = st.one_of(
    st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(-5, 5)), max_size=64),
    st.lists(ints, max_size=16),
    st.lists(st.one_of(ints, st.floats(allow_nan=True), st.none(), st.text(max_size=3), st.booleans()), max_size=8),
    hnp.arrays(st.sampled_from(INT_DTYPES), hnp.array_shapes(min_dims=0, max_dims=2, max_side=16)),
    hnp.arrays(st.sampled_from(OTHER_DTYPES), st.integers(0, 16)),
    st.binary(max_size=256),
    st.binary(max_size=256).map(bytearray),
    st.binary(max_size=256).map(memoryview),
    st.tuples(st.sampled_from("bBhHiIlLqQ"), st.lists(st.integers(0, 127), max_size=32)).map(lambda t: array(*t)),
    st.tuples(st.sampled_from("fd"), st.lists(st.floats(allow_nan=False, width=32), max_size=8))
    .map(lambda t: array(*t)),
    st.text(max_size=8),
)


@FUZZ
@given(token_inputs, st.one_of(st.just(0), st.integers(1, 2**33)))
def test_decoding_token_arrays(tokens_in: Any, vocab_size: int) -> None:
    try:
        out = normalize_tokens(tokens_in, vocab_size)
    except KvcacheError:
        return
    assert isinstance(out, bytes) and len(out) % 4 == 0
    ids = np.frombuffer(out, dtype="<u4")
    if vocab_size and ids.size:
        assert int(ids.max()) < vocab_size
    if isinstance(tokens_in, list) and all(type(t) is int for t in tokens_in):
        assert ids.tolist() == tokens_in  # ints are never wrapped or truncated silently


#: Names around the edges of "one file name under /dev/shm", next to random text.
shm_names = st.one_of(short_text, st.sampled_from(["kvcached.default.1.abc", "", ".", "..", "../../etc/passwd", "a/b",
                                                  "/kvcached", "x\0y", "n" * 255, "n" * 256, "é" * 128]))
pool_handles = st.builds(
    pb.PoolHandle, kind=st.sampled_from(["shm", "cuda", "", "tpu", "SHM"]), name=shm_names,
    ipc_handle=st.one_of(st.binary(max_size=80), st.binary(min_size=64, max_size=64)),
    block_bytes=st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 1 << 20)),
    num_blocks=st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 1 << 16)),
    size_bytes=st.one_of(st.just(0), st.integers(0, 2**64 - 1), st.integers(0, 1 << 30)),
    align_bytes=st.one_of(st.just(0), st.just(64), st.integers(0, 2**64 - 1)),
    generation=short_text, device_uuid=short_text, ipc_size_bytes=st.integers(0, 2**64 - 1), device_index=uint32,
    event_handle=st.one_of(st.just(b""), st.binary(max_size=80)), event_sync_required=st.booleans(),
)


def mappable(msg: pb.PoolHandle) -> bool:
    """What a handle must satisfy for a client to map it, written out here (not the decoder's code).
    A packed pool's handle says size_bytes (a multiple of align_bytes); an older daemon's said
    block_bytes x num_blocks, which is still accepted when size_bytes is 0."""
    if msg.size_bytes:
        nbytes, aligned = msg.size_bytes, msg.align_bytes > 0 and msg.size_bytes % msg.align_bytes == 0
    else:
        nbytes, aligned = msg.block_bytes * msg.num_blocks, True
    common = msg.kind in ("shm", "cuda") and 0 < nbytes < 2**63 and aligned and msg.generation != ""
    if not common:
        return False
    if msg.kind == "shm":  # one file name directly under /dev/shm, never a path
        name = msg.name
        return 0 < len(name.encode()) <= 255 and "/" not in name and "\0" not in name and name not in (".", "..")
    return (len(msg.ipc_handle) == 64 and len(msg.event_handle) in ((64,) if msg.event_sync_required else (0, 64))
            and msg.device_uuid != "" and msg.ipc_size_bytes >= nbytes)


@FUZZ
@given(pool_handles)
def test_decoding_pool_handles(msg: pb.PoolHandle) -> None:
    """Every handle is either refused with InvalidPoolHandle or one a client can map, field for field."""
    try:
        h = proto.pool_handle_from_proto(msg)
    except InvalidPoolHandle as e:
        assert not mappable(msg), f"a mappable handle was refused: {e}"
        assert str(e).startswith("the daemon's pool handle is unusable: "), e
        return
    assert mappable(msg), f"an unusable handle was accepted: {msg}"
    size = msg.size_bytes or msg.block_bytes * msg.num_blocks
    assert (h.kind, h.name, h.size_bytes, h.generation) == (msg.kind, msg.name, size, msg.generation)
    assert h.align_bytes == (msg.align_bytes if msg.size_bytes else msg.block_bytes) and h.nbytes == size
    if h.kind == "shm":
        assert h.cuda is None and os.path.dirname(os.path.join("/dev/shm", h.name)) == "/dev/shm"
    else:
        assert h.cuda is not None and len(h.cuda.handle) == 64 and h.cuda.size_bytes >= h.nbytes
        assert h.cuda.device_uuid == msg.device_uuid and h.cuda.event_sync_required == msg.event_sync_required
    assert proto.pool_handle_from_proto(proto.pool_handle_to_proto(h)) == h  # a stable round trip


@pytest.mark.parametrize("fields, why", [
    ({"kind": "tpu", "num_blocks": 0}, "kind"),
    ({"kind": ""}, "kind"),
    ({"block_bytes": 0}, "a pool of 0 bytes"),
    ({"num_blocks": 0}, "a pool of 0 bytes"),
    ({"size_bytes": 4100, "align_bytes": 64}, "not a multiple of its alignment"),
    ({"size_bytes": 4096, "align_bytes": 0}, "not a multiple of its alignment"),
    ({"block_bytes": 2**40, "num_blocks": 2**40}, "more than"),
    ({"generation": ""}, "generation"),
    ({"name": ""}, "segment name"),
    ({"name": "../../etc/passwd"}, "segment name"),
    ({"name": "/kvcached.default.1.abc"}, "segment name"),
    ({"name": ".."}, "segment name"),
    ({"name": "n" * 256}, "segment name"),
    ({"kind": "cuda", "ipc_handle": b"\1" * 63}, "IPC handle of 63 bytes"),
    ({"kind": "cuda", "ipc_handle": b""}, "IPC handle of 0 bytes"),
    ({"kind": "cuda", "event_handle": b"\2" * 8}, "event handle of 8 bytes"),
    ({"kind": "cuda", "event_handle": b"", "event_sync_required": True}, "event_sync_required"),
    ({"kind": "cuda", "device_uuid": ""}, "device_uuid"),
    ({"kind": "cuda", "ipc_size_bytes": 4095}, "fewer than"),
])
def test_unusable_pool_handles_are_refused(fields: dict, why: str) -> None:
    good = dict(kind="shm", name="kvcached.default.1.abc", block_bytes=512, num_blocks=8, generation="abc",
                ipc_handle=b"\1" * 64, device_uuid="GPU-1234", ipc_size_bytes=4096, event_handle=b"\2" * 64,
                event_sync_required=True)
    assert proto.pool_handle_from_proto(pb.PoolHandle(**good)).nbytes == 4096  # the control: valid as it is
    assert proto.pool_handle_from_proto(pb.PoolHandle(**{**good, "kind": "cuda"})).cuda is not None
    with pytest.raises(InvalidPoolHandle, match=re.escape(why)):
        proto.pool_handle_from_proto(pb.PoolHandle(**{**good, **fields}))
