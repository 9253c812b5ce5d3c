"""KVCache servicer: protobuf in, store call, protobuf out.

Each handler hands one plain function (the request's checks and its store
call) to ``_run``. That runs it on the event loop's thread when it needs
neither the store lock held elsewhere nor disk I/O (most acquires, releases
and lookups), and on a worker thread otherwise, so LMDB I/O never stalls the
loop (see :mod:`kvcached.store`). Domain errors become status codes here and
only here (:data:`STATUS_OF`); a bad request never changes state (it is
checked before the store mutates anything) and never takes the daemon down.

Sessions: a client opens the ``Session`` stream and gets a random session id.
Leases and reservations made under that id are released when the stream ends
for any reason, including the client being killed: the kernel closes its
socket, gRPC cancels the stream, and the ``finally`` below runs. The stream
also carries fire-and-forget releases and aborts (a lease given back without a
commit: nobody on the request's path waits for that reply); each such message
is acknowledged with its ``seq`` once done, so a client can wait for them when
it wants to (tests, shutdown). And it carries calls (``_stream_call``): the
request path's RPCs as messages answered by ``call_id``, in order, after the
releases sent before them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

import grpc

from kvcached import __version__
from kvcached.contract.errors import ErrorKind, InvalidArgument, KvcacheError, SessionNotOpen, WouldBlock, shown
from kvcached.contract.keys import LayoutId
from kvcached.leases import LeaseId, ReservationId, SessionId
from kvcached.receipts import CommitReceipt, EvictReceipt, LeaseReceipt, ReservationReceipt
from kvcached.contract import proto
from kvcached.service import convert
from kvcached.store import DEFAULT_SESSION, Store
from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The one mapping from domain error kinds to gRPC status codes.
STATUS_OF: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

MAX_TTL = 24 * 3600.0
MAX_IDS_PER_CALL = 4096


def _ttl(ttl: float) -> float | None:
    """A request's ttl_seconds: 0 means the daemon's default (None)."""
    if ttl == 0:
        return None
    if not (0 < ttl <= MAX_TTL) or math.isnan(ttl):
        raise InvalidArgument(f"ttl_seconds must be in (0, {MAX_TTL:.0f}], got {ttl}")
    return ttl


def _ids(ids: Any, what: str) -> list[Any]:
    if len(ids) > MAX_IDS_PER_CALL:
        raise InvalidArgument(f"at most {MAX_IDS_PER_CALL} {what} per call, got {len(ids)}")
    return list(ids)


def _lease_ids(ids: Any) -> list[LeaseId]:
    return _ids(ids, "lease ids")


def _reservation_ids(ids: Any) -> list[ReservationId]:
    return _ids(ids, "reservation ids")


class KVCacheServicer(pb_grpc.KVCacheServicer):
    def __init__(self, store: Store, *, workers: int = 4, call_timeout: float = 30.0, listen: str = "",
                 bypass_generation_tokens: int = 8192, max_sessions: int = 1024,
                 max_message_bytes: int = 64 << 20) -> None:
        self.store = store
        self.max_message_bytes = max_message_bytes
        self.max_sessions = max_sessions
        self.bypass_generation_tokens = bypass_generation_tokens
        self.call_timeout = call_timeout
        self.listen = listen
        self._pool = _started_pool(workers)
        self._sessions: dict[str, str] = {}  # session id -> client name
        self._session_contexts: set[Any] = set()  # the open Session streams (end_sessions)
        self._started = time.monotonic()
        self.fallbacks = 0  # inline attempts that went to a worker thread (for stats)
        #: ``(method, seconds)`` for each call answered on a Session stream (the RPC latency
        #: histogram's, which its interceptor fills for unary calls); None: not observed.
        self.observe_call: Callable[[str, float], None] | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    async def end_sessions(self) -> int:
        """At shutdown: end every open Session stream now with UNAVAILABLE ("the daemon is
        stopping"); each handler's ``finally`` releases what its session held, and the client
        opens a new stream when the daemon is back. A Session stream never finishes by itself,
        so without this the server's drain waited out its whole grace period whenever a client
        was connected: a clean restart took 5.6 s instead of 0.6 s. Returns how many."""
        contexts = list(self._session_contexts)
        for context in contexts:
            try:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping; reconnect when it is back")
            except Exception:  # noqa: BLE001 - abort() raises to end its caller; here the caller is us
                pass
        return len(contexts)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    # -- plumbing --------------------------------------------------------------------

    async def _run(self, context: grpc.aio.ServicerContext | None, fn: Callable[[], T], *, inline: bool = False) -> T:
        """Call ``fn`` (a request's checks and its store call) and map its domain errors to
        statuses. ``inline`` tries the event loop's thread first (Store.run_inline): it
        succeeds when the call needs neither the lock held elsewhere nor disk I/O, and
        otherwise falls back, with nothing changed, to a worker thread."""
        try:
            if inline:
                try:
                    return self.store.run_inline(fn)
                except WouldBlock:
                    self.fallbacks += 1
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._pool, fn)
            return await asyncio.wait_for(fut, self.call_timeout)
        except KvcacheError as e:
            if e.kind is ErrorKind.INTERNAL:
                log.error("internal error in %s: %s", getattr(fn, "__name__", fn), e, exc_info=e,
                          extra={"event": "internal_error", "error_kind": e.kind.value})
            if context is None:  # a call on a Session stream: _stream_call answers it
                raise
            await context.abort(STATUS_OF[e.kind], str(e))
        except asyncio.TimeoutError:
            if context is None:
                raise
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._timeout_details())
        raise AssertionError("unreachable")  # pragma: no cover - abort() raises

    def _timeout_details(self) -> str:
        return f"the store did not answer within {self.call_timeout} s"

    def _session(self, session_id: str) -> SessionId:
        """The session a call names. Also runs on worker threads: a dict lookup, safe under the GIL."""
        if not session_id:
            return DEFAULT_SESSION
        if session_id not in self._sessions:
            raise SessionNotOpen(
                f"session {shown(session_id)} is not open (it ended, or the daemon restarted); open a new Session"
            )
        return SessionId(session_id)

    def _remaining(self, expires_at: float) -> float:
        return max(0.0, expires_at - time.monotonic())

    # -- RPCs --------------------------------------------------------------------------
    #
    # Each handler makes one ``_run`` call of a plain function that checks the request and calls
    # the store, so a bad request fails inside ``_run`` like a store error does, and the status
    # comes from STATUS_OF. Read a packed token field once (every read of a protobuf bytes field
    # copies it: 32 KB for an 8k-token prompt), outside the function, which may run twice (inline,
    # then on a worker thread).

    async def RegisterLayout(self, request: pb.RegisterLayoutRequest, context) -> pb.RegisterLayoutResponse:
        def register() -> tuple[LayoutId, int]:
            layout = proto.layout_from_proto(request.layout)
            return self.store.register_layout(layout), layout.chunk_bytes

        lid, chunk_bytes = await self._run(context, register)
        return pb.RegisterLayoutResponse(layout_id=lid, chunk_bytes=chunk_bytes)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        def lookup_all() -> list[int]:
            if len(request.tokens) > MAX_IDS_PER_CALL:  # counted before any prompt is copied out
                raise InvalidArgument(f"at most {MAX_IDS_PER_CALL} prompts per Lookup")
            prompts = [proto.tokens_from_proto(t) for t in request.tokens]  # all checked before any lookup
            return [self.store.lookup(LayoutId(request.layout_id), t) for t in prompts]

        return pb.LookupResponse(cached_tokens=await self._run(context, lookup_all, inline=True))

    def _bypass(self, request: Any) -> bool:
        """Per-request policy: no-store, or a long generation (degrade to plain compute)."""
        return bool(request.no_store) or request.expected_output_tokens > self.bypass_generation_tokens

    async def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        tokens = request.tokens

        def acquire() -> LeaseReceipt:
            return self.store.acquire(LayoutId(request.layout_id), proto.tokens_from_proto(tokens),
                                      self._session(request.session_id), ttl=_ttl(request.ttl_seconds),
                                      promote=not request.read_nvme_directly,
                                      max_chunks=0 if request.no_cache else None,
                                      placement=proto.placement_from_proto(request.placement))

        r = await self._run(context, acquire, inline=True)
        return convert.lease_to_proto(r, self._remaining(r.expires_at))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        def release() -> int:  # ids are bound to their session
            return self.store.release_many(_lease_ids(request.lease_ids), self._session(request.session_id))

        return pb.ReleaseResponse(released=await self._run(context, release, inline=True))

    async def KeepAlive(self, request: pb.KeepAliveRequest, context) -> pb.KeepAliveResponse:
        def renew() -> float | None:
            return self.store.renew_many(_lease_ids(request.lease_ids), self._session(request.session_id),
                                         ttl=_ttl(request.ttl_seconds))

        deadline = await self._run(context, renew, inline=True)
        return pb.KeepAliveResponse(ttl_seconds=self._remaining(deadline) if deadline is not None else 0.0)

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        tokens = request.tokens

        def reserve() -> ReservationReceipt:
            return self.store.reserve(LayoutId(request.layout_id), proto.tokens_from_proto(tokens),
                                      self._session(request.session_id), ttl=_ttl(request.ttl_seconds),
                                      store_nothing=self._bypass(request), open_empty=not request.skip_empty,
                                      placement=proto.placement_from_proto(request.placement))

        r = await self._run(context, reserve, inline=True)
        ttl = self._remaining(r.expires_at) if r.opened else 0.0
        return convert.reservation_to_proto(r, ttl, self.store.layout(r.layout_id).chunk_bytes)

    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        chunks = request.chunks if request.HasField("chunks") else None

        def commit() -> CommitReceipt:
            return self.store.commit(ReservationId(request.reservation_id), self._session(request.session_id),
                                     chunks=chunks)

        return convert.commit_to_proto(await self._run(context, commit, inline=True))

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        def abort() -> int:
            return self.store.abort_many(_reservation_ids(request.reservation_ids),
                                         self._session(request.session_id))

        return pb.AbortResponse(aborted=await self._run(context, abort, inline=True))

    async def AcquireReserve(self, request: pb.AcquireReserveRequest, context) -> pb.AcquireReserveResponse:
        tokens = request.tokens

        def both() -> tuple[LeaseReceipt, ReservationReceipt]:
            return self.store.acquire_reserve(
                LayoutId(request.layout_id), proto.tokens_from_proto(tokens), self._session(request.session_id),
                ttl=_ttl(request.lease_ttl_seconds), reservation_ttl=_ttl(request.reservation_ttl_seconds),
                promote=not request.read_nvme_directly, no_cache=request.no_cache, store_nothing=self._bypass(request),
                placement=proto.placement_from_proto(request.placement))

        lease, r = await self._run(context, both, inline=True)
        return pb.AcquireReserveResponse(
            lease=convert.lease_to_proto(lease, self._remaining(lease.expires_at) if lease.lease_id else 0.0),
            reservation=convert.reservation_to_proto(r, self._remaining(r.expires_at) if r.opened else 0.0,
                                                     self.store.layout(r.layout_id).chunk_bytes))

    async def CommitRelease(self, request: pb.CommitReleaseRequest, context) -> pb.CommitReleaseResponse:
        chunks = request.chunks if request.HasField("chunks") else None

        def both() -> tuple[CommitReceipt | None, int]:
            lease_ids = _lease_ids(request.lease_ids)
            return self.store.commit_release(ReservationId(request.reservation_id) or None, lease_ids,
                                             self._session(request.session_id), chunks=chunks)

        commit, released = await self._run(context, both, inline=True)
        return pb.CommitReleaseResponse(commit=convert.commit_to_proto(commit) if commit else None, released=released)

    async def _stream_call(self, sid: str, msg: pb.SessionRequest) -> pb.SessionEvent:
        """Answer a call a Session stream carries (``SessionRequest.call``): the unary handler of
        the same name, in the stream's own session (whatever session id the request names),
        answered with a SessionEvent carrying the same ``call_id`` and the reply or the status
        the unary call would have ended with. An error ends the call, never the stream: the
        session and all it holds stay. A message on an open stream skips what a unary call costs
        (an HTTP/2 stream, its headers and trailers, the interceptor), which is most of a hit's
        round trip (bench/hf_path.py)."""
        kind = msg.WhichOneof("call")
        if kind is None:
            return _call_error(msg.call_id, grpc.StatusCode.INVALID_ARGUMENT,
                               f"call {msg.call_id} names no call (a SessionRequest.call field)")
        handler, name = _STREAM_CALLS[kind]
        request = getattr(msg, kind)
        if kind in _CALLS_WITH_SESSION:
            request.session_id = sid
        t0 = time.perf_counter()
        try:
            ev = pb.SessionEvent(call_id=msg.call_id)
            getattr(ev, kind).CopyFrom(await handler(self, request, None))
        except KvcacheError as e:
            ev = _call_error(msg.call_id, STATUS_OF[e.kind], str(e))
        except asyncio.TimeoutError:
            ev = _call_error(msg.call_id, grpc.StatusCode.DEADLINE_EXCEEDED, self._timeout_details())
        except Exception as e:  # noqa: BLE001 - a bug in one call must not end the session it rides on
            log.error("internal error in %s on session %s's stream: %s", name, sid, e, exc_info=e,
                      extra={"event": "internal_error", "error_kind": ErrorKind.INTERNAL.value})
            ev = _call_error(msg.call_id, grpc.StatusCode.INTERNAL, f"internal error: {e}")
        if self.observe_call is not None:
            self.observe_call(name, time.perf_counter() - t0)
        return ev

    async def _stream_work(self, sid: str, msg: pb.SessionRequest) -> pb.SessionEvent:
        """A stream message's releases and aborts, in the session's name. Errors (an id that was
        never granted) are logged, not raised: nobody waits for this reply but the ack."""
        session = SessionId(sid)
        leases, aborts = list(msg.release_lease_ids)[:MAX_IDS_PER_CALL], list(msg.abort_reservation_ids)[:MAX_IDS_PER_CALL]

        def work() -> None:
            for lid in leases:
                try:
                    self.store.release(lid, session)
                except KvcacheError as e:
                    log.warning("session %s released %s on its stream: %s", sid, shown(lid), e)
            for rid in aborts:
                try:
                    self.store.abort(ReservationId(rid), session)
                except KvcacheError as e:
                    log.warning("session %s aborted %s on its stream: %s", sid, shown(rid), e)

        try:
            self.store.run_inline(work)
        except WouldBlock:
            await asyncio.get_running_loop().run_in_executor(self._pool, work)
        return pb.SessionEvent(acked_seq=msg.seq)

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest], context) -> AsyncIterator[pb.SessionEvent]:
        if len(self._sessions) >= self.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self._sessions)} sessions are open, the max_sessions limit; close idle "
                                "clients (one Client per process is enough) or raise max_sessions")
        sid = f"session-{secrets.token_hex(8)}"
        self._sessions[sid] = "?"
        self._session_contexts.add(context)
        log.info("session %s opened (peer %s)", sid, context.peer())
        try:
            yield pb.SessionEvent(session_id=sid, pool_generation=self.store.pool.generation, stream_calls=True)
            async for msg in request_iterator:
                if msg.client_name:
                    self._sessions[sid] = msg.client_name
                if msg.release_lease_ids or msg.abort_reservation_ids or msg.seq:
                    ack = await self._stream_work(sid, msg)
                    if msg.seq:  # only a message that asks for an ack gets one: a client that never
                        yield ack  # reads the stream must not fill its flow-control window with them
                if msg.call_id:  # after the message's releases: a call sees the room they gave back
                    yield await self._stream_call(sid, msg)
        finally:
            self._session_contexts.discard(context)
            name = self._sessions.pop(sid, "?")
            # Not awaited: this also runs when the stream was cancelled, and the release
            # must happen even if nobody is left to wait for it.
            # closed=True: a call of this session still on its way is refused, not left pinned.
            release = functools.partial(self.store.release_session, SessionId(sid), closed=True)
            fut = asyncio.get_running_loop().run_in_executor(self._pool, release)
            fut.add_done_callback(lambda f: _log_session_end(sid, name, f))

    async def GetPoolHandle(self, request: pb.PoolHandleRequest, context) -> pb.PoolHandle:
        nvme = self.store.nvme
        return proto.pool_handle_to_proto(self.store.pool_handle(), os.path.abspath(nvme.path) if nvme else "")

    async def PutBytes(self, request: pb.PutBytesRequest, context) -> pb.CommitResponse:
        tokens = request.tokens

        def put() -> CommitReceipt | None:
            checked, session = proto.tokens_from_proto(tokens), self._session(request.session_id)
            if self._bypass(request):
                self.store.hashes(LayoutId(request.layout_id), checked)  # still validated
                return None
            return self.store.put(LayoutId(request.layout_id), checked, list(request.chunks), session,
                                  proto.placement_from_proto(request.placement))

        c = await self._run(context, put)
        return pb.CommitResponse(committed_chunks=0) if c is None else convert.commit_to_proto(c)

    async def GetBytes(self, request: pb.GetBytesRequest, context) -> pb.GetBytesResponse:
        tokens = request.tokens

        def read() -> tuple[int, list[bytes]]:
            checked, session = proto.tokens_from_proto(tokens), self._session(request.session_id)
            # The reply must fit in one message: return the longest cached prefix that does
            # (matched_tokens says how much), rather than fail in the transport after the work.
            fits = (self.max_message_bytes - 4096) // (self.store.layout(LayoutId(request.layout_id)).chunk_bytes + 16)
            r = self.store.acquire(LayoutId(request.layout_id), checked, session, max_chunks=max(fits, 0))
            try:
                return r.matched_tokens, [bytes(self.store.read_chunk(r, i)) for i in range(len(r.offsets))]
            finally:
                self.store.release(r.lease_id)

        matched, chunks = await self._run(context, read)
        return pb.GetBytesResponse(matched_tokens=matched, chunks=chunks)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        def snapshot() -> dict:
            d = self.store.stats().to_dict()
            d["layouts_detail"] = {lid: lay.to_dict() for lid, lay in self.store.layouts().items()}
            d["sessions_open"] = len(self._sessions)
            d["draining"] = self.store.draining
            d["inline_fallbacks"] = self.fallbacks
            if request.doctor:
                d["doctor"] = self.store.doctor_facts()
            return d

        d = await self._run(context, snapshot)
        return pb.StatsResponse(json=json.dumps(d), version=__version__,
                                uptime_seconds=time.monotonic() - self._started, listen=self.listen)

    async def Evict(self, request: pb.EvictRequest, context) -> pb.EvictResponse:
        prefix = request.prefix_tokens

        def evict() -> EvictReceipt:
            if prefix:
                if not request.layout_id:
                    raise InvalidArgument("evict by prefix needs a layout_id")
                return self.store.evict_prefix(LayoutId(request.layout_id), proto.tokens_from_proto(prefix))
            return self.store.evict(LayoutId(request.layout_id) if request.layout_id else None)

        r = await self._run(context, evict)
        return pb.EvictResponse(chunks=r.chunks, bytes=r.bytes)

    async def Flush(self, request: pb.FlushRequest, context) -> pb.FlushResponse:
        return pb.FlushResponse(chunks=await self._run(context, self.store.flush))

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        flushed, leases = await self._run(context, self.store.drain)
        return pb.DrainResponse(flushed_chunks=flushed, leases_active=leases)

    async def Ping(self, request: pb.PingRequest, context) -> pb.PingResponse:
        return pb.PingResponse()


def _started_pool(workers: int) -> ThreadPoolExecutor:
    """The store's worker threads, all started now. A ThreadPoolExecutor starts them one by one as
    load first needs them; started up front, the daemon's thread count is fixed from the first
    request on, so growth in it (``kvcachectl``, the soak's check) means a leak, not warm-up."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcached-store")
    everyone = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(everyone.wait)  # each task holds its thread until all of them run
    everyone.wait(timeout=30)
    return pool


def _call_error(call_id: int, code: grpc.StatusCode, details: str) -> pb.SessionEvent:
    """A stream call's answer when it failed: the status its unary RPC would have ended with."""
    return pb.SessionEvent(call_id=call_id, error=pb.CallError(code=code.value[0], details=details))


def _log_session_end(sid: str, name: str, fut: "asyncio.Future[Any]") -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.error("releasing session %s failed: %s", sid, exc)
        return
    r = fut.result()
    event = "session_lost" if r.leases or r.reservations else "session_end"
    log.info("session %s (%s) ended: released %d leases, aborted %d reservations", sid, name, r.leases, r.reservations,
             extra={"event": event, "session_id": sid})


#: The calls a Session stream carries: ``SessionRequest.call``'s field (the same name in
#: ``SessionEvent.reply``) -> (the unary handler, its RPC name).
_STREAM_CALLS: dict[str, tuple[Callable[..., Any], str]] = {
    "acquire_reserve": (KVCacheServicer.AcquireReserve, "AcquireReserve"),
    "commit_release": (KVCacheServicer.CommitRelease, "CommitRelease"),
    "commit": (KVCacheServicer.Commit, "Commit"),
    "acquire": (KVCacheServicer.Acquire, "Acquire"),
    "reserve": (KVCacheServicer.Reserve, "Reserve"),
    "lookup": (KVCacheServicer.Lookup, "Lookup"),
}
#: Those whose request names a session (the stream's own replaces it).
_CALLS_WITH_SESSION = frozenset(_STREAM_CALLS) - {"lookup"}
