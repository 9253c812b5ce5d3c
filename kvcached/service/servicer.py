"""KVCache servicer: protobuf in, store call, protobuf out.

Every store call runs on a worker thread (the store may do LMDB I/O under its
lock; see :mod:`kvcached.store`), so the event loop only parses, dispatches
and answers. Domain errors become status codes here and only here
(:data:`STATUS_OF`); a bad request never changes state (the store validates
before it mutates) and never takes the daemon down.

Sessions: a client opens the ``Session`` stream and gets a random session id.
Leases and reservations made under that id are released when the stream ends
for any reason, including the client being killed: the kernel closes its
socket, gRPC cancels the stream, and the ``finally`` below runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

import grpc

from kvcached import __version__
from kvcached.errors import ErrorKind, KvcacheError, WouldBlock, shown
from kvcached.leases import ReservationId, SessionId
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
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcached-store")
        self._sessions: dict[str, str] = {}  # session id -> client name
        self._started = time.monotonic()
        self.fallbacks = 0  # inline attempts that went to a worker thread (for stats)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    # -- plumbing --------------------------------------------------------------------

    async def _run(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any, inline: bool = False, **kw: Any
    ) -> T:
        """Call the store. ``inline`` tries the event loop's thread first (Store.run_inline):
        it succeeds when the call needs neither the lock held elsewhere nor disk I/O, and
        otherwise falls back, with nothing changed, to a worker thread."""
        try:
            if inline:
                try:
                    return self.store.run_inline(fn, *args, **kw)
                except WouldBlock:
                    self.fallbacks += 1
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._pool, lambda: fn(*args, **kw))
            return await asyncio.wait_for(fut, self.call_timeout)
        except KvcacheError as e:
            if e.kind is ErrorKind.INTERNAL:
                log.error("internal error in %s: %s", getattr(fn, "__name__", fn), e, exc_info=e,
                          extra={"event": "internal_error", "error_kind": e.kind.value})
            await context.abort(STATUS_OF[e.kind], str(e))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the store did not answer within {self.call_timeout} s")
        raise AssertionError("unreachable")  # pragma: no cover - abort() raises

    async def _invalid(self, context: grpc.aio.ServicerContext, message: str) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def _session(self, context: grpc.aio.ServicerContext, session_id: str) -> SessionId:
        if not session_id:
            return DEFAULT_SESSION
        if session_id not in self._sessions:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {shown(session_id)} is not open (it ended, or the daemon restarted); open a new Session",
            )
        return SessionId(session_id)

    async def _ttl(self, context: grpc.aio.ServicerContext, ttl: float) -> float | None:
        if ttl == 0:
            return None
        if not (0 < ttl <= MAX_TTL) or math.isnan(ttl):
            await self._invalid(context, f"ttl_seconds must be in (0, {MAX_TTL:.0f}], got {ttl}")
        return ttl

    async def _ids(self, context: grpc.aio.ServicerContext, ids: Any, what: str) -> list[str]:
        if len(ids) > MAX_IDS_PER_CALL:
            await self._invalid(context, f"at most {MAX_IDS_PER_CALL} {what} per call, got {len(ids)}")
        return list(ids)

    def _remaining(self, expires_at: float) -> float:
        return max(0.0, expires_at - time.monotonic())

    # -- RPCs --------------------------------------------------------------------------

    async def RegisterLayout(self, request: pb.RegisterLayoutRequest, context) -> pb.RegisterLayoutResponse:
        try:
            layout = convert.layout_from_proto(request.layout)
        except KvcacheError as e:
            await context.abort(STATUS_OF[e.kind], str(e))
        lid = await self._run(context, self.store.register_layout, layout)
        return pb.RegisterLayoutResponse(layout_id=lid, chunk_bytes=layout.chunk_bytes)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        if len(request.tokens) > MAX_IDS_PER_CALL:  # counted before any prompt is copied out
            await self._invalid(context, f"at most {MAX_IDS_PER_CALL} prompts per Lookup")
        prompts = [await self._tokens(context, t) for t in request.tokens]

        def lookup_all() -> list[int]:
            return [self.store.lookup(request.layout_id, t) for t in prompts]

        return pb.LookupResponse(cached_tokens=await self._run(context, lookup_all, inline=True))

    def _bypass(self, request: Any) -> bool:
        """Per-request policy: no-store, or a long generation (degrade to plain compute)."""
        return bool(request.no_store) or request.expected_output_tokens > self.bypass_generation_tokens

    async def _tokens(self, context: grpc.aio.ServicerContext, tokens: bytes) -> bytes:
        """A request's packed token field, checked once. Read the field only through this: every
        read of a protobuf bytes field copies it (32 KB for an 8k-token prompt)."""
        try:
            return convert.tokens_from_proto(tokens)
        except KvcacheError as e:
            await context.abort(STATUS_OF[e.kind], str(e))
        raise AssertionError("unreachable")  # pragma: no cover - abort() raises

    async def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        tokens = await self._tokens(context, request.tokens)
        session = await self._session(context, request.session_id)
        ttl = await self._ttl(context, request.ttl_seconds)
        r = await self._run(context, self.store.acquire, request.layout_id, tokens, session, ttl=ttl,
                            promote=not request.read_nvme_directly, max_chunks=0 if request.no_cache else None,
                            inline=True)
        return convert.lease_to_proto(r, self._remaining(r.expires_at))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        ids = await self._ids(context, request.lease_ids, "lease ids")
        session = await self._session(context, request.session_id)  # ids are bound to their session

        return pb.ReleaseResponse(released=await self._run(context, self.store.release_many, ids, session, inline=True))

    async def KeepAlive(self, request: pb.KeepAliveRequest, context) -> pb.KeepAliveResponse:
        ids = await self._ids(context, request.lease_ids, "lease ids")
        session = await self._session(context, request.session_id)
        ttl = await self._ttl(context, request.ttl_seconds)

        deadline = await self._run(context, self.store.renew_many, ids, session, ttl=ttl, inline=True)
        return pb.KeepAliveResponse(ttl_seconds=self._remaining(deadline) if deadline is not None else 0.0)

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        tokens = await self._tokens(context, request.tokens)
        session = await self._session(context, request.session_id)
        ttl = await self._ttl(context, request.ttl_seconds)
        r = await self._run(context, self.store.reserve, request.layout_id, tokens, session, ttl=ttl,
                            store_nothing=self._bypass(request), inline=True)
        return convert.reservation_to_proto(r, self._remaining(r.expires_at), self.store.layout(r.layout_id).chunk_bytes)

    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        chunks = request.chunks if request.HasField("chunks") else None
        session = await self._session(context, request.session_id)
        c = await self._run(context, self.store.commit, ReservationId(request.reservation_id), session, chunks=chunks,
                            inline=True)
        return pb.CommitResponse(committed_chunks=c.committed_chunks, cached_tokens=c.cached_tokens)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        ids = await self._ids(context, request.reservation_ids, "reservation ids")
        session = await self._session(context, request.session_id)
        return pb.AbortResponse(aborted=await self._run(context, self.store.abort_many, ids, session, inline=True))

    async def Session(self, request_iterator: AsyncIterator[pb.SessionRequest], context) -> AsyncIterator[pb.SessionEvent]:
        if len(self._sessions) >= self.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self._sessions)} sessions are open, the max_sessions limit; close idle "
                                "clients (one Client per process is enough) or raise max_sessions")
        sid = f"session-{secrets.token_hex(8)}"
        self._sessions[sid] = "?"
        log.info("session %s opened (peer %s)", sid, context.peer())
        try:
            yield pb.SessionEvent(session_id=sid, pool_generation=self.store.pool.generation)
            async for msg in request_iterator:
                if msg.client_name:
                    self._sessions[sid] = msg.client_name
        finally:
            name = self._sessions.pop(sid, "?")
            # Not awaited: this also runs when the stream was cancelled, and the release
            # must happen even if nobody is left to wait for it.
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self.store.release_session, SessionId(sid))
            fut.add_done_callback(lambda f: _log_session_end(sid, name, f))

    async def GetPoolHandle(self, request: pb.PoolHandleRequest, context) -> pb.PoolHandle:
        nvme = self.store.nvme
        return convert.pool_handle_to_proto(self.store.pool_handle(), os.path.abspath(nvme.path) if nvme else "")

    async def PutBytes(self, request: pb.PutBytesRequest, context) -> pb.CommitResponse:
        tokens = await self._tokens(context, request.tokens)
        session = await self._session(context, request.session_id)
        if self._bypass(request):
            await self._run(context, self.store.hashes, request.layout_id, tokens)  # still validated
            return pb.CommitResponse(committed_chunks=0)
        c = await self._run(context, self.store.put, request.layout_id, tokens, list(request.chunks), session)
        return pb.CommitResponse(committed_chunks=c.committed_chunks, cached_tokens=c.cached_tokens)

    async def GetBytes(self, request: pb.GetBytesRequest, context) -> pb.GetBytesResponse:
        tokens = await self._tokens(context, request.tokens)
        session = await self._session(context, request.session_id)

        def read() -> tuple[int, list[bytes]]:
            # The reply must fit in one message: return the longest cached prefix that does
            # (matched_tokens says how much), rather than fail in the transport after the work.
            fits = (self.max_message_bytes - 4096) // (self.store.layout(request.layout_id).chunk_bytes + 16)
            r = self.store.acquire(request.layout_id, tokens, session, max_chunks=max(fits, 0))
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
        if request.prefix_tokens:
            if not request.layout_id:
                await self._invalid(context, "evict by prefix needs a layout_id")
            prefix = await self._tokens(context, request.prefix_tokens)
            r = await self._run(context, self.store.evict_prefix, request.layout_id, prefix)
        else:
            r = await self._run(context, self.store.evict, request.layout_id or None)
        return pb.EvictResponse(chunks=r.chunks, bytes=r.bytes)

    async def Flush(self, request: pb.FlushRequest, context) -> pb.FlushResponse:
        return pb.FlushResponse(chunks=await self._run(context, self.store.flush))

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        flushed, leases = await self._run(context, self.store.drain)
        return pb.DrainResponse(flushed_chunks=flushed, leases_active=leases)

    async def Ping(self, request: pb.PingRequest, context) -> pb.PingResponse:
        return pb.PingResponse()


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
