"""A generated corpus of malformed and adversarial requests (issue #7, "bad input").

Every :class:`Case` is one request to one RPC of ``kvcached.v1.KVCache`` with the status
code the daemon must answer. Requests are either protobuf messages or raw bytes sent with
an identity serializer (``channel.unary_unary(path, request_serializer=None, ...)``), so
cases can carry bytes no protobuf library would produce.

The corpus is generated, not listed: every RPC x every category that applies to it x
several values or cut points. Families whose outcome depends on how protobuf parses the
bytes (truncations, wrong wire types) do not guess: each variant is parsed with the
request type's ``FromString``; a parse error must give INVALID_ARGUMENT ("cannot parse
the request as ..."), and bytes that parse are judged by :func:`predict`, a small model of
the servicer's validation order. Variants that parse into a request the daemon accepts
are dropped (a truncation that happens to be a valid shorter request is not bad input;
sending it could also change state, which the test forbids).

RegisterLayout has no model: whether a layout is valid is the daemon's own rule set, and
judging a variant with the daemon's validator (``proto.layout_from_proto``) would check the
daemon against itself: a validator that wrongly accepted a truncated layout would drop, as
"valid", the very case that should catch it. Every layout a generated RegisterLayout variant
parses into has its status written down by hand in :data:`LAYOUT_STATUSES`; a variant whose
layout is not listed fails the corpus build.

Ids of live objects (sessions, leases, reservations) exist only at run time, so the
corpus is built from a :class:`World` that the test sets up on a real daemon before its
first state snapshot. Nothing in the corpus may change that state: a mutating success
would be a bug in the corpus, and :func:`build_corpus` checks every message case against
:func:`predict` so such a mistake fails at build time, not as a puzzling daemon diff.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from kvcached.contract.keys import KVLayout
from kvcached.contract import proto
from kvcached.service.servicer import MAX_IDS_PER_CALL, MAX_TTL
from kvcached.v1 import kvcached_pb2 as pb
from tests.reliability.conftest import LAYOUT

S = grpc.StatusCode
OK, IA, NF, FP, RE = S.OK, S.INVALID_ARGUMENT, S.NOT_FOUND, S.FAILED_PRECONDITION, S.RESOURCE_EXHAUSTED

CT = LAYOUT.chunk_tokens
#: The same geometry with a declared vocabulary: token ids >= 1000 are invalid for it.
VOCAB = KVLayout("test/reliability-vocab@1", num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                 head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, chunk_tokens=CT, vocab_size=1000)

#: Daemon settings the corpus is written for (tests pass them to ``make_daemon``).
MAX_PROMPT_TOKENS = 2048
MAX_MESSAGE_BYTES = 128 * 1024
BYPASS_GENERATION_TOKENS = 8192  # the daemon default
#: Chunks of the long cached prompt: their bytes do not fit in one reply.
LONG_CHUNKS = MAX_MESSAGE_BYTES // LAYOUT.chunk_bytes + 2
DAEMON_SETTINGS = {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_message_bytes": "128K",
                   "pool_bytes": "4M"}

SERVICE = pb.DESCRIPTOR.services_by_name["KVCache"]
METHODS = [m.name for m in SERVICE.methods]
REQUEST_TYPE: dict[str, type[Message]] = {m.name: getattr(pb, m.input_type.name) for m in SERVICE.methods}
RESPONSE_TYPE: dict[str, type[Message]] = {m.name: getattr(pb, m.output_type.name) for m in SERVICE.methods}

#: Every category the corpus must cover (the test fails if one goes missing).
CATEGORIES = {
    "truncated": "valid serialized requests cut short at many points",
    "truncated-nested": "a Layout cut short inside a correctly framed RegisterLayoutRequest",
    "corrupt-wire": "bytes that are not protobuf wire format at all (bad wire types, lengths, varints, groups)",
    "wrong-wire-type": "a known field number encoded with another wire type",
    "invalid-utf8": "string fields whose bytes are not UTF-8",
    "ragged-tokens": "packed token arrays whose length is not a multiple of 4",
    "vocab-range": "token ids >= the layout's vocab_size",
    "huge-tokens": "prompts over max_prompt_tokens",
    "oversized-message": "requests over the daemon's max_message_bytes",
    "bad-ttl": "negative, NaN, infinite and over-limit TTLs",
    "bad-layout": "layout fields zero, negative-as-uint, huge, unsupported, or a chunk larger than the whole pool",
    "kv-size-mismatch": "PutBytes payload counts and sizes that do not match the layout; Commit chunk counts",
    "foreign-lease": "a live lease of another session released or kept alive under this session",
    "unknown-id": "ids that were never issued, empty ids, ids of the wrong kind",
    "double-release": "release/abort twice, commit of an aborted or committed reservation, commit without reserve",
    "closed-session": "requests naming a session that ended or never existed",
    "too-many-ids": "more ids or prompts per call than MAX_IDS_PER_CALL",
    "unicode-garbage": "control characters, bidi overrides, emoji, path and format strings as ids and names",
    "long-ids": "ids thousands of characters long (the error must not echo them whole)",
}


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    method: str
    request: Message | bytes
    code: grpc.StatusCode
    note: str
    #: For errors: at least one of these words must appear in the details (case-insensitive).
    mentions: tuple[str, ...] = ()
    #: For OK answers: fields the reply must have (e.g. {"released": 0}).
    reply: dict[str, Any] = field(default_factory=dict)

    def raw(self) -> bytes:
        return self.request if isinstance(self.request, bytes) else self.request.SerializeToString()


@dataclass
class World:
    """What the daemon holds when the corpus runs (set up before the first snapshot)."""

    sid: str  # live session of the test's client
    other_sid: str  # live session of another client
    closed_sid: str  # a session that was opened and ended
    own_lease: str  # live lease of ``sid`` on ``cached``
    foreign_lease: str  # live lease of ``other_sid`` on ``cached``
    released_lease: str
    expired_lease: str
    open_res: str  # open reservation (of ``other_sid``: ids are bound to their session) of ``open_res_slots`` chunks
    open_res_slots: int
    committed_res: str
    aborted_res: str
    lid: str = LAYOUT.layout_id
    vlid: str = VOCAB.layout_id
    cached: bytes = b""  # tokens of 2 cached chunks (layout LAYOUT)
    fresh: bytes = b""  # tokens of 2 chunks nobody caches or reserves
    long_cached: bytes = b""  # a cached prompt whose chunks together exceed max_message_bytes
    live_sessions: frozenset[str] = frozenset()
    leases: dict[str, str] = field(default_factory=dict)  # live lease id -> session
    closed_leases: dict[str, str] = field(default_factory=dict)  # closed lease id -> why
    open_reservations: dict[str, int] = field(default_factory=dict)  # id -> reserved chunks
    closed_reservations: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, KVLayout] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cached = self.cached or tokens(2 * CT)
        self.fresh = self.fresh or tokens(2 * CT, 50_000)
        self.long_cached = self.long_cached or tokens(LONG_CHUNKS * CT, 120_000)
        self.live_sessions = frozenset({self.sid, self.other_sid})
        self.leases = {self.own_lease: self.sid, self.foreign_lease: self.other_sid}
        self.closed_leases = {self.released_lease: "released", self.expired_lease: "expired"}
        self.open_reservations = {self.open_res: self.open_res_slots}
        self.closed_reservations = {self.committed_res: "committed", self.aborted_res: "aborted"}
        self.layouts = {LAYOUT.layout_id: LAYOUT, VOCAB.layout_id: VOCAB}

    @classmethod
    def dummy(cls) -> "World":
        """Plausible ids, for building the corpus without a daemon (size and coverage checks)."""
        return cls(sid="session-00000000000000a1", other_sid="session-00000000000000b2",
                   closed_sid="session-00000000000000c3", own_lease="lease-00000000000000a1",
                   foreign_lease="lease-00000000000000b2", released_lease="lease-00000000000000c3",
                   expired_lease="lease-00000000000000d4", open_res="put-00000000000000a1", open_res_slots=2,
                   committed_res="put-00000000000000b2", aborted_res="put-00000000000000c3")


def tokens(n: int, start: int = 0) -> bytes:
    return np.arange(start, start + n, dtype="<u4").tobytes()


def chunk(fill: int = 0, nbytes: int = LAYOUT.chunk_bytes) -> bytes:
    return bytes([fill % 256]) * nbytes


# -- RegisterLayout: literal statuses ----------------------------------------------------------

#: LAYOUT's fields, written out (checked against LAYOUT below), and the layout the bad-layout
#: families start from.
REL = dict(model="test/reliability@1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)
VREL = dict(REL, model="test/reliability-vocab@1", vocab_size=1000)  # VOCAB's
BAD = dict(REL, model="test/bad@1")
_M = {"model": REL["model"]}
U32 = 2**32
#: (the Layout a RegisterLayout request parses into, or None for no layout field; the status the
#: daemon must answer; why). With POOL_BLOCK_BYTES = 64 KiB.
LAYOUT_STATUSES: list[tuple[dict | None, grpc.StatusCode, str]] = [
    (None, IA, "no layout: no model"),
    ({}, IA, "an empty layout: no model"),
    # LAYOUT cut after each of its records (cuts inside a record do not parse)
    (_M, IA, "num_layers, num_kv_heads and head_dim are 0"),
    ({**_M, "num_layers": 2}, IA, "num_kv_heads and head_dim are 0"),
    ({**_M, "num_layers": 2, "num_kv_heads": 2}, IA, "head_dim is 0"),
    ({**_M, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}, OK,
     "dtype defaults to bfloat16, chunk_tokens to 128: 2x2x2x8x128x2 = 16 KiB chunks fit a 64 KiB block"),
    ({**_M, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}, OK,
     "chunk_tokens defaults to 128: 32 KiB float32 chunks fit"),
    (REL, OK, "LAYOUT itself"),
    (VREL, OK, "VOCAB itself"),
    # BAD with one field sent as the 10-byte varint of a negative int64 (a uint32 keeps its low 32 bits)
    *(({**BAD, f: U32 - k}, IA, f"{f} {U32 - k} is out of range")
      for f in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens") for k in (1, 128)),
    ({**BAD, "vocab_size": U32 - 1}, OK, "vocab_size 2^32 - 1: a valid (if silly) vocabulary"),
    ({**BAD, "vocab_size": U32 - 128}, OK, "vocab_size 2^32 - 128: a valid (if silly) vocabulary"),
]


def _layout_key(layout: pb.Layout | None) -> bytes | None:
    return None if layout is None else layout.SerializeToString(deterministic=True)


LAYOUT_STATUS: dict[bytes | None, grpc.StatusCode] = {
    _layout_key(None if f is None else pb.Layout(**f)): code for f, code, _ in LAYOUT_STATUSES
}
assert proto.layout_to_proto(LAYOUT) == pb.Layout(**REL), "LAYOUT changed: update REL and LAYOUT_STATUSES"
assert proto.layout_to_proto(VOCAB) == pb.Layout(**VREL), "VOCAB changed: update VREL and LAYOUT_STATUSES"


class NoModel(Exception):
    """:func:`predict` has no status for this request: it must come with a literal one."""


def layout_status(m: pb.RegisterLayoutRequest) -> grpc.StatusCode:
    """The written-down status of the layout a parsed RegisterLayout request carries."""
    key = _layout_key(m.layout if m.HasField("layout") else None)
    if key not in LAYOUT_STATUS:
        raise NoModel(f"no literal status for RegisterLayout of {m.layout!r}: add it to LAYOUT_STATUSES")
    return LAYOUT_STATUS[key]


# -- the model of the servicer's validation order ------------------------------------------


def predict(method: str, m: Message, w: World) -> grpc.StatusCode:
    """The status the daemon answers for a parsed request in world ``w`` (OK: accepted)."""

    def framed(*ts: bytes) -> bool:
        return all(len(t) % 4 == 0 for t in ts)

    def session(s: str) -> bool:
        return not s or s in w.live_sessions

    def ttl_ok(t: float) -> bool:
        return t == 0 or (0 < t <= MAX_TTL and not math.isnan(t))

    def toks(layout_id: str, t: bytes) -> grpc.StatusCode:
        layout = w.layouts.get(layout_id)
        if layout is None:
            return NF
        arr = np.frombuffer(t, dtype="<u4")
        if layout.vocab_size and arr.size and int(arr.max()) >= layout.vocab_size:
            return IA
        if arr.size > MAX_PROMPT_TOKENS:
            return IA
        return OK

    if method == "RegisterLayout":
        return layout_status(m)  # literal, not modelled (see the module docstring)
    if method == "Lookup":
        if not framed(*m.tokens) or len(m.tokens) > MAX_IDS_PER_CALL:
            return IA
        for t in m.tokens:
            if (c := toks(m.layout_id, t)) != OK:
                return c
        return OK
    if method in ("Acquire", "Reserve", "GetBytes", "PutBytes"):
        if not framed(m.tokens):
            return IA
        if not session(m.session_id):
            return FP
        if method in ("Acquire", "Reserve") and not ttl_ok(m.ttl_seconds):
            return IA
        if (c := toks(m.layout_id, m.tokens)) != OK:
            return c
        if method == "PutBytes" and not (m.no_store or m.expected_output_tokens > BYPASS_GENERATION_TOKENS):
            n = len(m.tokens) // 4 // w.layouts[m.layout_id].chunk_tokens
            if len(m.chunks) != n or any(len(c) != w.layouts[m.layout_id].chunk_bytes for c in m.chunks):
                return IA
        return OK
    if method in ("Release", "KeepAlive"):
        if len(m.lease_ids) > MAX_IDS_PER_CALL:
            return IA
        if m.session_id and m.session_id not in w.live_sessions:
            return FP
        if method == "Release":
            known = all(i in w.leases or i in w.closed_leases for i in m.lease_ids)
            return OK if known else NF
        if not ttl_ok(m.ttl_seconds):
            return IA
        for i in m.lease_ids:
            owner = w.leases.get(i)
            if owner is None or owner != m.session_id:  # bound to its session (empty: sessionless)
                return FP if owner is None and w.closed_leases.get(i) == "expired" else NF
        return OK
    if method == "Commit":
        if m.session_id and m.session_id not in w.live_sessions:
            return FP
        if m.reservation_id in w.open_reservations and m.session_id != w.other_sid:
            return NF  # another session's reservation reads as unknown
        if m.reservation_id in w.open_reservations:
            n = m.chunks if m.HasField("chunks") else w.open_reservations[m.reservation_id]
            return OK if 0 <= n <= w.open_reservations[m.reservation_id] else IA
        return FP if m.reservation_id in w.closed_reservations else NF
    if method == "Abort":
        if len(m.reservation_ids) > MAX_IDS_PER_CALL:
            return IA
        if m.session_id and m.session_id not in w.live_sessions:
            return FP
        known = all(i in w.open_reservations or i in w.closed_reservations for i in m.reservation_ids)
        return OK if known else NF
    if method == "Evict":
        if m.prefix_tokens:
            if not m.layout_id or not framed(m.prefix_tokens):
                return IA
            if (c := toks(m.layout_id, m.prefix_tokens)) != OK:
                return c
            return OK if len(m.prefix_tokens) // 4 >= w.layouts[m.layout_id].chunk_tokens else IA
        return OK if not m.layout_id or m.layout_id in w.layouts else NF
    return OK  # Session, GetPoolHandle, Stats, Flush, Drain, Ping: every parsed request is accepted


def expectation(method: str, raw: bytes, w: World) -> grpc.StatusCode:
    """Parse like the daemon does: a parse error is INVALID_ARGUMENT, else :func:`predict`."""
    try:
        m = REQUEST_TYPE[method].FromString(raw)
    except (DecodeError, ValueError):
        return IA
    return predict(method, m, w)


MENTIONS = {IA: (), NF: ("not registered", "no lease", "no live lease", "no reservation"),
            FP: ("session", "already", "expired"), RE: ("larger than max",)}
PARSE = ("cannot parse",)
#: For a request that parsed but is invalid, found by the model rather than written by hand.
SOME_FIELD = ("layout", "token", "chunk", "payload", "ttl", "uint32")

# -- wire-format helpers ------------------------------------------------------------------------


def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def records(data: bytes) -> list[tuple[int, int, int]]:
    """(start, end, field number) of every top-level record of well-formed wire bytes."""
    out, i = [], 0
    while i < len(data):
        start = i
        key, i = _read_varint(data, i)
        fn, wt = key >> 3, key & 7
        if wt == 0:
            _, i = _read_varint(data, i)
        elif wt == 1:
            i += 8
        elif wt == 2:
            n, i = _read_varint(data, i)
            i += n
        elif wt == 5:
            i += 4
        else:  # pragma: no cover - the corpus only splits bytes it serialized itself
            raise ValueError(f"unexpected wire type {wt}")
        out.append((start, i, fn))
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = data[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


#: The wire type each scalar kind of field is encoded with.
def wire_type_of(fd: Any) -> int:
    from google.protobuf.descriptor import FieldDescriptor as F

    if fd.type in (F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_MESSAGE):
        return 2
    if fd.type == F.TYPE_DOUBLE:
        return 1
    return 0


def encode_as(field_number: int, wire_type: int) -> bytes:
    """A field encoded with ``wire_type`` (any value; the point is the type)."""
    return tag(field_number, wire_type) + {
        0: varint(7),
        1: b"\x00\x00\x00\x00\x00\x00\xf0\x3f",  # 1.0
        2: varint(3) + b"abc",
        3: tag(field_number, 4),  # an empty group
        5: b"\x01\x00\x00\x00",
    }[wire_type]


def cut_points(data: bytes) -> list[int]:
    """Every cut in the first 8 bytes; around every record boundary (in the key, in the length,
    one byte short of the end); and 3 evenly spaced cuts inside each record's payload."""
    n = len(data)
    pts = set(range(1, min(n, 8)))
    for start, end, _ in records(data):
        pts.update((start - 1, start + 1, start + 2, end - 1))
        pts.update(start + (end - start) * k // 4 for k in (1, 2, 3))
    return sorted(p for p in pts if 0 < p < n)


# -- the corpus ------------------------------------------------------------------------------------


def base_requests(w: World) -> list[tuple[str, Message]]:
    """One valid, accepted request per RPC that has fields (what the cut and retype families start from)."""
    return [
        ("RegisterLayout", pb.RegisterLayoutRequest(layout=proto.layout_to_proto(LAYOUT))),
        ("RegisterLayout", pb.RegisterLayoutRequest(layout=proto.layout_to_proto(VOCAB))),
        ("Lookup", pb.LookupRequest(layout_id=w.lid, tokens=[w.cached, w.fresh])),
        ("Acquire", pb.AcquireRequest(layout_id=w.lid, tokens=w.cached, session_id=w.sid, ttl_seconds=60,
                                      read_nvme_directly=True, no_cache=True)),
        ("Release", pb.ReleaseRequest(lease_ids=[w.released_lease, w.own_lease], session_id=w.sid)),
        ("KeepAlive", pb.KeepAliveRequest(lease_ids=[w.own_lease], ttl_seconds=60, session_id=w.sid)),
        ("Reserve", pb.ReserveRequest(layout_id=w.lid, tokens=w.fresh, session_id=w.sid, ttl_seconds=60,
                                      no_store=True, expected_output_tokens=100)),
        ("Commit", pb.CommitRequest(reservation_id=w.open_res, chunks=1, session_id=w.other_sid)),
        ("Abort", pb.AbortRequest(reservation_ids=[w.aborted_res, w.open_res], session_id=w.other_sid)),
        ("PutBytes", pb.PutBytesRequest(layout_id=w.lid, tokens=w.fresh, chunks=[chunk(1), chunk(2)],
                                        session_id=w.sid, expected_output_tokens=10)),
        ("GetBytes", pb.GetBytesRequest(layout_id=w.lid, tokens=w.cached, session_id=w.sid)),
        ("Evict", pb.EvictRequest(layout_id=w.lid, prefix_tokens=w.cached)),
        ("Stats", pb.StatsRequest(doctor=True)),
        ("Session", pb.SessionRequest(client_name="reliability corpus")),
    ]


def _truncated(w: World) -> Iterator[Case]:
    for k, (method, msg) in enumerate(base_requests(w)):
        data = msg.SerializeToString()
        for cut in cut_points(data):
            code = expectation(method, data[:cut], w)
            if code == OK:
                continue  # the cut is a valid shorter request: not bad input
            yield Case(f"truncated-{method}-{k}-at-{cut}of{len(data)}", "truncated", method, data[:cut], code,
                       f"a valid {method} request cut after {cut} of {len(data)} bytes",
                       PARSE if _unparsable(method, data[:cut]) else MENTIONS[code] or SOME_FIELD)
    layout = proto.layout_to_proto(LAYOUT).SerializeToString()
    for cut in cut_points(layout):
        inner = layout[:cut]
        raw = tag(1, 2) + varint(len(inner)) + inner
        code = expectation("RegisterLayout", raw, w)
        if code == OK:
            continue
        yield Case(f"truncated-layout-at-{cut}of{len(layout)}", "truncated-nested", "RegisterLayout", raw, code,
                   f"the Layout cut after {cut} of {len(layout)} bytes, framed with its cut length",
                   PARSE if _unparsable("RegisterLayout", raw) else SOME_FIELD)


def _unparsable(method: str, raw: bytes) -> bool:
    try:
        REQUEST_TYPE[method].FromString(raw)
        return False
    except (DecodeError, ValueError):
        return True


CORRUPT = [
    (b"\x00", "field number 0"),
    (b"\x0e\x01", "wire type 6 (does not exist)"),
    (b"\x0f\x01", "wire type 7 (does not exist)"),
    (b"\x0c", "end-group with no group open"),
    (b"\x0b", "group opened and never closed"),
    (b"\x0b\x14", "group closed with another field's end tag"),
    (b"\x0a", "length-delimited field with no length"),
    (b"\x0a\x80\x80\x80\x80\x10", "length of 4 GiB, bytes missing"),
    (b"\x0a\x05ab", "length 5, 2 bytes present"),
    (b"\x08" + b"\xff" * 10 + b"\x01", "11-byte varint"),
    (b"\x80", "key varint cut after its first byte"),
    (b"\x80\x80\x80\x80\x10\x00", "field number 2^29 (over the maximum)"),
    (b"\x09\x00\x00\x00", "fixed64 with 3 of 8 bytes"),
    (b"\x0d\x00", "fixed32 with 1 of 4 bytes"),
]


def _corrupt_wire(w: World) -> Iterator[Case]:
    for method in METHODS:
        for k, (raw, what) in enumerate(CORRUPT):
            code = expectation(method, raw, w)
            if code == OK:
                continue
            yield Case(f"corrupt-{method}-{k}", "corrupt-wire", method, raw, code, what, PARSE)
        # The same garbage after a valid request (the parser must not accept a good prefix).
        base = dict(base_requests(w)).get(method)
        if base is not None:
            for k, (raw, what) in enumerate(CORRUPT[:6]):
                data = base.SerializeToString() + raw
                code = expectation(method, data, w)
                if code != OK:
                    yield Case(f"corrupt-suffix-{method}-{k}", "corrupt-wire", method, data, code,
                               f"a valid request followed by {what}", PARSE)


def _wrong_wire_type(w: World) -> Iterator[Case]:
    for k, (method, msg) in enumerate(base_requests(w)):
        data = msg.SerializeToString()
        recs = records(data)
        for fd in msg.DESCRIPTOR.fields:
            right = wire_type_of(fd)
            for wt in (0, 1, 2, 3, 5):
                if wt == right:
                    continue
                mine = [(s, e) for s, e, fn in recs if fn == fd.number]
                wrong = encode_as(fd.number, wt)
                if mine:  # replace the field's first record, keep the rest
                    s, e = mine[0]
                    raw = data[:s] + wrong + data[e:]
                else:
                    raw = data + wrong
                code = expectation(method, raw, w)
                if code == OK:
                    continue  # protobuf keeps a mistyped field as an unknown field: the rest was valid
                yield Case(f"wiretype-{method}-{k}-{fd.name}-wt{wt}", "wrong-wire-type", method, raw, code,
                           f"{fd.name} (field {fd.number}, wire type {right}) sent as wire type {wt}",
                           PARSE if _unparsable(method, raw) else MENTIONS[code] or SOME_FIELD)
        # The same on an otherwise empty request: every field but the wrong one is missing.
        for fd in msg.DESCRIPTOR.fields:
            wt = 0 if wire_type_of(fd) == 2 else 2
            raw = encode_as(fd.number, wt)
            code = expectation(method, raw, w)
            if code != OK:
                yield Case(f"wiretype-alone-{method}-{k}-{fd.name}", "wrong-wire-type", method, raw, code,
                           f"only {fd.name}, as wire type {wt}",
                           PARSE if _unparsable(method, raw) else MENTIONS[code] or SOME_FIELD)


BAD_UTF8 = [b"\xff\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"abc\x80", b"\xf4\x90\x80\x80"]


def _invalid_utf8(w: World) -> Iterator[Case]:
    from google.protobuf.descriptor import FieldDescriptor as F

    n = 0
    for k, (method, msg) in enumerate(base_requests(w)):
        targets: list[tuple[str, Callable[[bytes], bytes]]] = []
        data = msg.SerializeToString()
        for fd in msg.DESCRIPTOR.fields:
            if fd.type == F.TYPE_STRING:
                targets.append((fd.name, lambda bad, fd=fd: _replace(data, fd.number, bad)))
        if method == "RegisterLayout":
            layout = msg.layout.SerializeToString()
            for fd in pb.Layout.DESCRIPTOR.fields:
                if fd.type == F.TYPE_STRING:
                    def wrap(bad: bytes, fd=fd) -> bytes:
                        inner = _replace(layout, fd.number, bad)
                        return tag(1, 2) + varint(len(inner)) + inner
                    targets.append((f"layout.{fd.name}", wrap))
            # a map entry's key and value are strings too
            for j, fn in enumerate((1, 2)):
                def entry(bad: bytes, fn=fn) -> bytes:
                    e = tag(fn, 2) + varint(len(bad)) + bad
                    inner = layout + tag(9, 2) + varint(len(e)) + e
                    return tag(1, 2) + varint(len(inner)) + inner
                targets.append((f"layout.extra.{'key' if fn == 1 else 'value'}", entry))
        for name, make in targets:
            for bad in (BAD_UTF8[n % len(BAD_UTF8)], BAD_UTF8[(n + 2) % len(BAD_UTF8)]):
                n += 1
                raw = make(bad)
                code = expectation(method, raw, w)
                if code == OK:
                    continue
                yield Case(f"utf8-{method}-{k}-{name}-{bad.hex()}", "invalid-utf8", method, raw, code,
                           f"{name} is the invalid UTF-8 {bad!r}", PARSE if code == IA else MENTIONS[code])


def _replace(data: bytes, field_number: int, value: bytes) -> bytes:
    """``data`` with the first record of ``field_number`` replaced by a string/bytes record of ``value``."""
    new = tag(field_number, 2) + varint(len(value)) + value
    for s, e, fn in records(data):
        if fn == field_number:
            return data[:s] + new + data[e:]
    return data + new


def _messages(w: World) -> Iterator[Case]:
    """Hand-written families over every RPC they apply to."""
    lid, vlid, cached, fresh, sid = w.lid, w.vlid, w.cached, w.fresh, w.sid
    two = [chunk(1), chunk(2)]

    def token_requests(layout_id: str, t: bytes, session: str = "") -> list[tuple[str, Message]]:
        """The same tokens through every RPC that takes tokens."""
        n = len(t) // 4 // CT
        return [
            ("Lookup", pb.LookupRequest(layout_id=layout_id, tokens=[cached, t])),
            ("Acquire", pb.AcquireRequest(layout_id=layout_id, tokens=t, session_id=session)),
            ("Reserve", pb.ReserveRequest(layout_id=layout_id, tokens=t, session_id=session)),
            ("PutBytes", pb.PutBytesRequest(layout_id=layout_id, tokens=t, session_id=session,
                                            chunks=[chunk(3)] * min(n, 2))),
            ("GetBytes", pb.GetBytesRequest(layout_id=layout_id, tokens=t, session_id=session)),
            ("Evict", pb.EvictRequest(layout_id=layout_id, prefix_tokens=t)),
        ]

    # ragged token arrays
    for nbytes in (1, 2, 3, 5, 4 * CT + 1, 8 * CT + 3):
        for method, req in token_requests(lid, bytes(range(256)) * (nbytes // 256) + bytes(range(nbytes % 256)), sid):
            yield Case(f"ragged-{method}-{nbytes}", "ragged-tokens", method, req, IA,
                       f"{nbytes} bytes of tokens", ("uint32",))

    # token ids out of the layout's vocabulary
    for k, bad in enumerate((1000, 1001, 2**31, 2**32 - 1)):
        arr = np.arange(2 * CT, dtype="<u4")
        arr[0 if k % 2 else -1] = bad
        for method, req in token_requests(vlid, arr.tobytes(), sid):
            yield Case(f"vocab-{method}-{bad}", "vocab-range", method, req, IA,
                       f"token id {bad} with vocab_size {VOCAB.vocab_size}", ("vocab", "token"))

    # over max_prompt_tokens
    for n in (MAX_PROMPT_TOKENS + 1, MAX_PROMPT_TOKENS + CT, 4 * MAX_PROMPT_TOKENS):
        for method, req in token_requests(lid, tokens(n, 70_000)):
            if method == "PutBytes":
                req.ClearField("chunks")
            yield Case(f"huge-tokens-{method}-{n}", "huge-tokens", method, req, IA,
                       f"{n} tokens, max_prompt_tokens={MAX_PROMPT_TOKENS}", ("max_prompt_tokens",))

    # over max_message_bytes: just over the limit, and far over, through every RPC
    for over in (1, 3 * MAX_MESSAGE_BYTES):
        target = MAX_MESSAGE_BYTES + over
        for method, make in _big_requests(w).items():
            req = _sized(make, target)
            yield Case(f"oversized-{method}-{req.ByteSize()}", "oversized-message", method, req, RE,
                       f"{req.ByteSize()} bytes, max_message_bytes={MAX_MESSAGE_BYTES}", MENTIONS[RE])
        for method in ("GetPoolHandle", "Stats", "Flush", "Ping", "Drain"):
            raw = _sized_raw(target)
            yield Case(f"oversized-{method}-{len(raw)}", "oversized-message", method, raw, RE,
                       f"{len(raw)} bytes of unknown field, max_message_bytes={MAX_MESSAGE_BYTES}", MENTIONS[RE])

    # a reply that would be over max_message_bytes: GetBytes of a long cached prompt. The daemon
    # returns the longest cached prefix that fits in one reply, and says so in matched_tokens.
    fits = (MAX_MESSAGE_BYTES - 4096) // (LAYOUT.chunk_bytes + 16)
    assert fits < LONG_CHUNKS
    yield Case("oversized-reply-GetBytes", "oversized-message", "GetBytes",
               pb.GetBytesRequest(layout_id=lid, tokens=w.long_cached, session_id=sid), OK,
               f"{LONG_CHUNKS} cached chunks of {LAYOUT.chunk_bytes} bytes, max_message_bytes={MAX_MESSAGE_BYTES}: "
               "the prefix that fits", reply={"matched_tokens": fits * CT})
    yield Case("oversized-reply-GetBytes-no-session", "oversized-message", "GetBytes",
               pb.GetBytesRequest(layout_id=lid, tokens=w.long_cached + tokens(CT, 7)), OK,
               "the same with a trailing uncached chunk, no session", reply={"matched_tokens": fits * CT})

    # TTLs
    for ttl in (-1.0, -1e-300, -math.inf, math.inf, math.nan, MAX_TTL + 1, MAX_TTL * 1.0000001, 1e9, 1e308):
        for method, req in (
            ("Acquire", pb.AcquireRequest(layout_id=lid, tokens=cached, session_id=sid, ttl_seconds=ttl)),
            ("Reserve", pb.ReserveRequest(layout_id=lid, tokens=fresh, session_id=sid, ttl_seconds=ttl)),
            ("KeepAlive", pb.KeepAliveRequest(lease_ids=[w.own_lease], session_id=sid, ttl_seconds=ttl)),
        ):
            yield Case(f"ttl-{method}-{ttl!r}", "bad-ttl", method, req, IA, f"ttl_seconds={ttl!r}", ("ttl",))

    # layouts
    dims = BAD
    bad_layouts: list[tuple[str, dict, tuple[str, ...]]] = []
    for f, values in (("num_layers", (0, 4097, 2**32 - 1)), ("num_kv_heads", (0, 4097, 2**32 - 1)),
                      ("head_dim", (0, 65537, 2**32 - 1)), ("chunk_tokens", (65537, 2**31, 2**32 - 1))):
        for v in values:
            bad_layouts.append((f"{f}={v}", {f: v}, ("layout",)))
    for v in (65536, 32768, 16385):  # valid alone, but one chunk is larger than the whole 4 MiB pool
        bad_layouts.append((f"chunk_tokens={v}-over-pool", {"chunk_tokens": v}, ("whole pool",)))
    bad_layouts.append(("max-dims-over-pool", {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 65536,
                                               "chunk_tokens": 65536}, ("whole pool",)))
    for dt in ("float64", "FLOAT16", "int4", " bfloat16", "bfloat16\x00", "ｂｆｌｏａｔ１６", "🙂", "torch.float16"):
        bad_layouts.append((f"dtype={dt!r}", {"dtype": dt}, ("dtype",)))
    for model in ("", "x" * 513, "🙂" * 513, "\x00" * 513, "\u202e" * 600):
        bad_layouts.append((f"model-{len(model)}x{model[:1]!r}", {"model": model}, ("model",)))
    bad_layouts.append(("all-zero", {"model": "m", "num_layers": 0, "num_kv_heads": 0, "head_dim": 0}, ("layout",)))
    for name, change, words in bad_layouts:
        layout = pb.Layout(**{**dims, **change})
        yield Case(f"layout-{name}", "bad-layout", "RegisterLayout", pb.RegisterLayoutRequest(layout=layout), IA,
                   f"RegisterLayout with {name}", words)
    # negative numbers, as a client with signed ints would encode them (10-byte varints of -1, -128)
    # (vocab_size too would wrap, to 2**32 - 1 or - 128: a valid, if silly, vocabulary; not bad input)
    for f in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
        for v in (-1, -128):
            number = pb.Layout.DESCRIPTOR.fields_by_name[f].number
            inner = _replace_varint(pb.Layout(**dims).SerializeToString(), number, v % 2**64)
            raw = tag(1, 2) + varint(len(inner)) + inner
            yield Case(f"layout-{f}={v}", "bad-layout", "RegisterLayout", raw, IA,
                       f"{f} sent as the int64 varint of {v} (parses as uint32 {v % 2**32})", ("layout",))
    yield Case("commit-chunks=-1", "kv-size-mismatch", "Commit",
               pb.CommitRequest(reservation_id=w.open_res, session_id=w.other_sid).SerializeToString()
               + tag(2, 0) + varint(2**64 - 1), IA,
               "chunks sent as the int64 varint of -1", ("chunk",))
    yield Case("layout-missing", "bad-layout", "RegisterLayout", pb.RegisterLayoutRequest(), IA,
               "RegisterLayout without a layout", ("model",))

    # KV payload sizes and counts
    cb = LAYOUT.chunk_bytes
    payloads = {
        "none": [], "one-of-two": [chunk(1)], "short-second": [chunk(1), chunk(2, cb - 1)],
        "long-second": [chunk(1), chunk(2, cb + 1)], "empty-first": [b"", chunk(2)],
        "tiny-first": [b"x" * 10, chunk(2)], "halves": [chunk(1, cb // 2)] * 2, "empty-second": [chunk(1), b""],
        "double-first": [chunk(1, 2 * cb), chunk(2)], "all-empty": [b"", b""], "one-byte-each": [b"\x00", b"\x00"],
    }
    for name, chunks in payloads.items():
        yield Case(f"kv-{name}", "kv-size-mismatch", "PutBytes",
                   pb.PutBytesRequest(layout_id=lid, tokens=fresh, chunks=chunks, session_id=sid), IA,
                   f"PutBytes of 2 chunks with payloads {[len(c) for c in chunks]}", ("chunk", "payload"))
    yield Case("kv-two-of-three", "kv-size-mismatch", "PutBytes",
               pb.PutBytesRequest(layout_id=lid, tokens=tokens(3 * CT, 60_000), chunks=two), IA,
               "3 full chunks, 2 payloads", ("chunk", "payload"))
    yield Case("kv-three-for-two", "kv-size-mismatch", "PutBytes",
               pb.PutBytesRequest(layout_id=lid, tokens=fresh, chunks=[chunk(1), chunk(2), chunk(3)]), IA,
               "2 full chunks, 3 payloads: an extra payload is refused, not ignored", ("chunk", "payload"))
    yield Case("kv-partial-tail-with-payload", "kv-size-mismatch", "PutBytes",
               pb.PutBytesRequest(layout_id=lid, tokens=tokens(2 * CT + 3, 60_000), chunks=[chunk(1), chunk(2), chunk(3)]),
               IA, "a payload for the partial last chunk (which is never cached)", ("chunk", "payload"))
    yield Case("kv-partial-tail", "kv-size-mismatch", "PutBytes",
               pb.PutBytesRequest(layout_id=lid, tokens=tokens(2 * CT + 3, 60_000), chunks=[chunk(1)]), IA,
               "2 full chunks and a partial one, 1 payload", ("chunk", "payload"))
    yield Case("kv-cached-prompt-short", "kv-size-mismatch", "PutBytes",
               pb.PutBytesRequest(layout_id=lid, tokens=cached, chunks=[chunk(1, cb - 4), chunk(2)]), IA,
               "payload sizes are checked even when the prompt is already cached", ("chunk", "payload"))
    yield Case("kv-vocab-layout-short", "kv-size-mismatch", "PutBytes",
               pb.PutBytesRequest(layout_id=vlid, tokens=tokens(2 * CT), chunks=[chunk(1), chunk(2, 7)]), IA,
               "wrong payload size for the vocab layout", ("chunk", "payload"))
    for n in (w.open_res_slots + 1, 64, 2**31, 2**32 - 1):
        yield Case(f"commit-{n}-chunks", "kv-size-mismatch", "Commit",
                   pb.CommitRequest(reservation_id=w.open_res, chunks=n, session_id=w.other_sid), IA,
                   f"commit {n} chunks of a reservation of {w.open_res_slots}", ("chunk",))

    # a live lease of another session
    fl = w.foreign_lease
    yield Case("foreign-release", "foreign-lease", "Release", pb.ReleaseRequest(lease_ids=[fl], session_id=sid), OK,
               "another session's live lease is left alone", reply={"released": 0})
    yield Case("foreign-release-twice", "foreign-lease", "Release",
               pb.ReleaseRequest(lease_ids=[fl, fl], session_id=sid), OK, "twice in one call", reply={"released": 0})
    yield Case("foreign-release-with-unknown", "foreign-lease", "Release",
               pb.ReleaseRequest(lease_ids=[fl, "lease-ffffffffffffffff"], session_id=sid), NF,
               "one never-granted id fails the whole batch", MENTIONS[NF])
    for ttl in (0.0, 1.0, 600.0):
        yield Case(f"foreign-keepalive-{ttl}", "foreign-lease", "KeepAlive",
                   pb.KeepAliveRequest(lease_ids=[fl], session_id=sid, ttl_seconds=ttl), NF,
                   "another session's lease cannot be kept alive under this session", MENTIONS[NF])
    yield Case("foreign-keepalive-with-own", "foreign-lease", "KeepAlive",
               pb.KeepAliveRequest(lease_ids=[w.own_lease, fl], session_id=sid), NF,
               "all or nothing: the foreign id fails the batch", MENTIONS[NF])
    yield Case("foreign-keepalive-other-way", "foreign-lease", "KeepAlive",
               pb.KeepAliveRequest(lease_ids=[w.own_lease], session_id=w.other_sid), NF,
               "this session's lease under the other session's id", MENTIONS[NF])
    yield Case("foreign-release-other-way", "foreign-lease", "Release",
               pb.ReleaseRequest(lease_ids=[w.own_lease], session_id=w.other_sid), OK,
               "this session's lease released under the other session's id", reply={"released": 0})

    # ids that were never issued, empty ids, ids of the wrong kind
    wrong_ids = {"empty": "", "nope": "nope", "lease-shaped": "lease-ffffffffffffffff",
                 "put-shaped": "put-ffffffffffffffff", "session-id": sid, "layout-id": lid,
                 "padded": f" {w.own_lease} ", "upper": w.own_lease.upper()}
    for name, i in wrong_ids.items():
        yield Case(f"unknown-release-{name}", "unknown-id", "Release", pb.ReleaseRequest(lease_ids=[i]), NF,
                   f"lease id {i!r}", MENTIONS[NF])
        yield Case(f"unknown-keepalive-{name}", "unknown-id", "KeepAlive", pb.KeepAliveRequest(lease_ids=[i]), NF,
                   f"lease id {i!r}", MENTIONS[NF])
        j = {"padded": f" {w.open_res} ", "upper": w.open_res.upper(), "lease-shaped": w.own_lease}.get(name, i)
        yield Case(f"unknown-commit-{name}", "unknown-id", "Commit", pb.CommitRequest(reservation_id=j), NF,
                   f"reservation id {j!r}", MENTIONS[NF])
        yield Case(f"unknown-abort-{name}", "unknown-id", "Abort", pb.AbortRequest(reservation_ids=[w.aborted_res, j]),
                   NF, f"reservation id {j!r} after a known one", MENTIONS[NF])
    bad_lids = {"empty": "", "nope": "nope", "upper": lid.upper(), "short": lid[:-1], "padded": lid + " ",
                "vocab-swapped": vlid[::-1]}
    for name, layout_id in bad_lids.items():
        for method, req in token_requests(layout_id, cached, sid):
            if method == "Evict" and not layout_id:
                code, words = IA, ("layout_id",)  # evict by prefix needs a layout id
            else:
                code, words = NF, ("not registered",)
            yield Case(f"unknown-layout-{method}-{name}", "unknown-id", method, req, code,
                       f"layout id {layout_id!r}", words)
    for name in ("nope", "upper"):
        yield Case(f"unknown-layout-Evict-all-{name}", "unknown-id", "Evict", pb.EvictRequest(layout_id=bad_lids[name]),
                   NF, "evict a whole layout that is not registered", ("not registered",))

    # twice, and in the wrong order
    rl, el = w.released_lease, w.expired_lease
    for name, ids, session in (("released", [rl], ""), ("released-twice", [rl, rl], ""), ("expired", [el], ""),
                               ("released-in-session", [rl], sid), ("released-and-expired", [rl, el], sid)):
        yield Case(f"double-release-{name}", "double-release", "Release",
                   pb.ReleaseRequest(lease_ids=ids, session_id=session), OK, "release is idempotent",
                   reply={"released": 0})
    yield Case("keepalive-released", "double-release", "KeepAlive", pb.KeepAliveRequest(lease_ids=[rl]), NF,
               "keep-alive of a released lease", MENTIONS[NF])
    yield Case("keepalive-expired", "double-release", "KeepAlive", pb.KeepAliveRequest(lease_ids=[el]), FP,
               "keep-alive of an expired lease", ("expired",))
    yield Case("keepalive-expired-in-session", "double-release", "KeepAlive",
               pb.KeepAliveRequest(lease_ids=[el], session_id=sid), FP, "keep-alive of an expired lease", ("expired",))
    for name, ids in (("aborted", [w.aborted_res]), ("committed", [w.committed_res]),
                      ("aborted-twice", [w.aborted_res] * 2), ("both", [w.committed_res, w.aborted_res])):
        yield Case(f"double-abort-{name}", "double-release", "Abort", pb.AbortRequest(reservation_ids=ids), OK,
                   "abort is idempotent", reply={"aborted": 0})
    for rid, why in ((w.aborted_res, "aborted"), (w.committed_res, "committed")):
        for chunks in (None, 0, 1):
            req = pb.CommitRequest(reservation_id=rid) if chunks is None else pb.CommitRequest(reservation_id=rid,
                                                                                                chunks=chunks)
            yield Case(f"commit-{why}-{chunks}", "double-release", "Commit", req, FP,
                       f"commit of an {why} reservation (chunks={chunks})", ("already",))
    for name, rid in (("lease-id", w.own_lease), ("released-lease", rl), ("session-id", sid)):
        yield Case(f"commit-without-reserve-{name}", "double-release", "Commit", pb.CommitRequest(reservation_id=rid),
                   NF, f"commit of {name}, no reservation was made", ("no reservation",))

    # sessions that ended or never existed
    gone = {"closed": w.closed_sid, "never": "session-0000000000000000", "upper": sid.upper(), "nul": sid + "\x00",
            "emoji": "🙂"}
    for name, s in gone.items():
        for method, req in (
            ("Acquire", pb.AcquireRequest(layout_id=lid, tokens=cached, session_id=s)),
            ("Reserve", pb.ReserveRequest(layout_id=lid, tokens=fresh, session_id=s)),
            ("PutBytes", pb.PutBytesRequest(layout_id=lid, tokens=fresh, chunks=two, session_id=s)),
            ("GetBytes", pb.GetBytesRequest(layout_id=lid, tokens=cached, session_id=s)),
            ("Release", pb.ReleaseRequest(lease_ids=[w.own_lease], session_id=s)),
            ("KeepAlive", pb.KeepAliveRequest(lease_ids=[w.own_lease], session_id=s)),
        ):
            yield Case(f"session-{name}-{method}", "closed-session", method, req, FP, f"session id {s!r}", ("session",))
    yield Case("session-closed-Release-none", "closed-session", "Release", pb.ReleaseRequest(session_id=w.closed_sid),
               FP, "no ids, but a closed session", ("session",))
    yield Case("session-closed-PutBytes-no-store", "closed-session", "PutBytes",
               pb.PutBytesRequest(layout_id=lid, tokens=fresh, session_id=w.closed_sid, no_store=True), FP,
               "no_store does not skip the session check", ("session",))

    # too many ids per call
    for n in (MAX_IDS_PER_CALL + 1, 4500, 5400):  # 5400 ids of 22 characters still fit 128 KiB
        yield Case(f"too-many-release-{n}", "too-many-ids", "Release",
                   pb.ReleaseRequest(lease_ids=[w.own_lease] * n), IA, f"{n} lease ids", ("at most",))
        yield Case(f"too-many-keepalive-{n}", "too-many-ids", "KeepAlive",
                   pb.KeepAliveRequest(lease_ids=[w.own_lease] * n), IA, f"{n} lease ids", ("at most",))
        yield Case(f"too-many-abort-{n}", "too-many-ids", "Abort",
                   pb.AbortRequest(reservation_ids=[w.open_res] * n), IA, f"{n} reservation ids", ("at most",))
        yield Case(f"too-many-lookup-{n}", "too-many-ids", "Lookup",
                   pb.LookupRequest(layout_id=lid, tokens=[b""] * n), IA, f"{n} prompts", ("at most",))
    yield Case("at-limit-release-unknown", "too-many-ids", "Release",
               pb.ReleaseRequest(lease_ids=["lease-x"] * MAX_IDS_PER_CALL), NF,
               f"exactly {MAX_IDS_PER_CALL} ids is allowed (then the unknown id is the error)", MENTIONS[NF])

    # unicode and injection garbage as ids (names are checked under bad-layout)
    garbage = ["\u202eevil", "\x00", "\ufeff", "🙂🙂", "a\u0301", "\U0010ffff", "\t\n\r", "' OR 1=1 --",
               "../../etc/passwd", "%s%n%x", "\x1b[31mred", "名前"]
    for k, g in enumerate(garbage):
        yield Case(f"unicode-layout-{k}", "unicode-garbage", "Acquire", pb.AcquireRequest(layout_id=g, tokens=cached),
                   NF, f"layout id {g!r}", ("not registered",))
        yield Case(f"unicode-lease-{k}", "unicode-garbage", "Release", pb.ReleaseRequest(lease_ids=[g]), NF,
                   f"lease id {g!r}", MENTIONS[NF])
        yield Case(f"unicode-reservation-{k}", "unicode-garbage", "Commit", pb.CommitRequest(reservation_id=g), NF,
                   f"reservation id {g!r}", MENTIONS[NF])
        yield Case(f"unicode-session-{k}", "unicode-garbage", "Reserve",
                   pb.ReserveRequest(layout_id=lid, tokens=fresh, session_id=g), FP, f"session id {g!r}", ("session",))
        yield Case(f"unicode-dtype-{k}", "unicode-garbage", "RegisterLayout",
                   pb.RegisterLayoutRequest(layout=pb.Layout(**{**dims, "dtype": g})), IA, f"dtype {g!r}", ("dtype",))

    # very long ids: the answer must still be the right code with a readable message
    for n in (2000, 20_000):
        long = "x" * n
        for method, req, code in (
            ("Acquire", pb.AcquireRequest(layout_id=long, tokens=cached), NF),
            ("Lookup", pb.LookupRequest(layout_id=long, tokens=[cached]), NF),
            ("Release", pb.ReleaseRequest(lease_ids=[long]), NF),
            ("KeepAlive", pb.KeepAliveRequest(lease_ids=[long]), NF),
            ("Commit", pb.CommitRequest(reservation_id=long), NF),
            ("Abort", pb.AbortRequest(reservation_ids=[long]), NF),
            ("GetBytes", pb.GetBytesRequest(layout_id=lid, tokens=cached, session_id=long), FP),
            ("RegisterLayout", pb.RegisterLayoutRequest(layout=pb.Layout(**{**dims, "dtype": long})), IA),
        ):
            yield Case(f"long-id-{method}-{n}", "long-ids", method, req, code, f"an id of {n} characters",
                       MENTIONS[code] or ("dtype",))


def _replace_varint(data: bytes, field_number: int, value: int) -> bytes:
    new = tag(field_number, 0) + varint(value)
    for s, e, fn in records(data):
        if fn == field_number:
            return data[:s] + new + data[e:]
    return data + new


def _big_requests(w: World) -> dict[str, Callable[[int], Message]]:
    """Per RPC with a string/bytes field: a request whose payload is ``n`` bytes."""
    lid, sid = w.lid, w.sid
    return {
        "RegisterLayout": lambda n: pb.RegisterLayoutRequest(layout=pb.Layout(model="m" * n, num_layers=1,
                                                                              num_kv_heads=1, head_dim=1)),
        "Lookup": lambda n: pb.LookupRequest(layout_id=lid, tokens=[bytes(n // 4 * 4)]),
        "Acquire": lambda n: pb.AcquireRequest(layout_id=lid, tokens=bytes(n // 4 * 4), session_id=sid),
        "Release": lambda n: pb.ReleaseRequest(lease_ids=["l" * n]),
        "KeepAlive": lambda n: pb.KeepAliveRequest(lease_ids=["l" * n]),
        "Reserve": lambda n: pb.ReserveRequest(layout_id=lid, tokens=bytes(n // 4 * 4), session_id=sid),
        "Commit": lambda n: pb.CommitRequest(reservation_id="r" * n),
        "Abort": lambda n: pb.AbortRequest(reservation_ids=["r" * n]),
        "Session": lambda n: pb.SessionRequest(client_name="c" * n),
        "PutBytes": lambda n: pb.PutBytesRequest(layout_id=lid, tokens=tokens(2 * CT, 60_000), chunks=[bytes(n)]),
        "GetBytes": lambda n: pb.GetBytesRequest(layout_id=lid, tokens=bytes(n // 4 * 4), session_id=sid),
        "Evict": lambda n: pb.EvictRequest(layout_id=lid, prefix_tokens=bytes(n // 4 * 4)),
    }


def _sized(make: Callable[[int], Message], target: int) -> Message:
    """``make(n)`` with the smallest n whose serialized size is at least ``target``."""
    n = target
    while make(n).ByteSize() > target and n > 0:
        n -= max(1, make(n).ByteSize() - target)
    while make(n).ByteSize() < target:
        n += 1
    return make(n)


def _sized_raw(target: int) -> bytes:
    """An unknown length-delimited field (number 15) of ``target`` bytes in all."""
    n = target - 1 - len(varint(target))
    while 1 + len(varint(n)) + n < target:
        n += 1
    return tag(15, 2) + varint(n) + bytes(n)


def build_corpus(w: World) -> list[Case]:
    cases, seen = [], set()
    for c in (*_messages(w), *_truncated(w), *_corrupt_wire(w), *_wrong_wire_type(w), *_invalid_utf8(w)):
        key = (c.method, c.raw())
        if key not in seen:  # the same bytes to the same RPC count once
            seen.add(key)
            cases.append(c)
    names = Counter(c.name for c in cases)
    dupes = [n for n, k in names.items() if k > 1]
    assert not dupes, f"duplicate case names: {dupes[:5]}"
    for c in cases:
        assert c.category in CATEGORIES, c.name
        if c.category == "oversized-message":
            continue  # refused before parsing; the model does not see sizes
        try:
            got = expectation(c.method, c.raw(), w)
        except NoModel:
            assert c.method == "RegisterLayout", c.name
            continue  # a hand-written layout case: its literal status is the one to check the daemon against
        assert got == c.code, f"corpus bug: {c.name} expects {c.code.name} but the model says {got.name}"
        if c.code != OK:
            assert c.mentions, c.name
    # Drain and Flush last: if one were ever accepted, it would change what later cases see.
    return sorted(cases, key=lambda c: c.method in ("Drain", "Flush"))


def summary(cases: Sequence[Case]) -> dict[str, Any]:
    return {
        "total": len(cases),
        "by_category": dict(sorted(Counter(c.category for c in cases).items())),
        "by_status": dict(sorted(Counter(c.code.name for c in cases).items())),
        "by_method": dict(sorted(Counter(c.method for c in cases).items())),
    }
