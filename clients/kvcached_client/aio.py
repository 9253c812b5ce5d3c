"""asyncio client: the same operations as :class:`kvcached_client.Client`, awaitable.

::

    async with AsyncClient() as c:
        async with await c.acquire(layout, token_ids) as lease:
            lease.chunk(0)
        await c.put(layout, token_ids, kv)

Copying KV into or out of the mapped pool is plain memory traffic and runs
inline; only the control calls are awaited. So does reading a chunk that a
lease left on NVMe (``nvme_read="direct"``, the default, as for
:class:`~kvcached_client.Client`): it copies from the LMDB file's page cache,
which is disk I/O on the event loop's thread when the page cache is cold.
An application that cannot afford that passes ``nvme_read="promote"``, and
the daemon copies such chunks into the pool before the acquire returns.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, TypeVar

import grpc

from kvcached.contract.keys import KVLayout, TokenInput
from kvcached.contract.pool import PoolHandle
from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import _core
from kvcached_client.errors import (
    FailedPreconditionError,
    NotFoundError,
    PoolMappingError,
    UnavailableError,
    from_rpc_error,
)
from kvcached_client.nvme import NvmeReader
from kvcached_client.pool import PoolMap
from kvcached_client.receipts import PutReceipt, put_receipt
from kvcached_client.stream import AioSessionStream, StreamEnded, stream_kind

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
log = logging.getLogger("kvcached_client")


class AsyncLease(_core.LeaseBase):
    """A pinned cached prefix; ``async with`` it, or await :meth:`release`. ``chunk``,
    ``copy_chunk`` and ``kv`` read it synchronously (see :class:`kvcached_client._core.LeaseBase`)."""

    async def keep_alive(self, ttl: float | None = None) -> float:
        return await self._client.keep_alive([self.lease_id], ttl, session_id=self.session_id)

    async def release(self) -> None:
        """Give the lease back; never raises for a lease the daemon no longer holds. On a CUDA
        pool it first waits, on the caller's thread as the lease reads do, for the GPU reads of
        the lease's blocks (see ``LeaseBase._sync_device``)."""
        if not self.released:
            self._sync_device()
            self.released = True
            try:
                await self._client.release([self.lease_id], session_id=self.session_id)
            except _core.GONE:
                pass

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class AsyncLeaseView(_core.LeaseBase):
    """Read access to a lease another client holds (see :meth:`AsyncClient.open_lease`); as
    :class:`kvcached_client.client.LeaseView`."""

    async def release(self, *, synced: bool = False) -> None:
        """Stop this view (``synced``: as for :meth:`kvcached_client.client.LeaseView.release`)."""
        if not self.released:
            if not synced:
                self._sync_device()
            self.released = True


class AsyncReservation(_core.ReservationBase):
    """:class:`kvcached_client.client.Reservation`, with ``commit`` and ``abort`` awaited."""

    async def commit(self, release: Sequence[AsyncLease] = (), *, chunks: int | None = None) -> PutReceipt:
        """Publish the written chunks (``chunks``: only the first N); with ``release``, give those
        leases back in the same round trip. A reservation that holds nothing costs no call."""
        if not self.opened:
            for lease in release:
                await lease.release()
            return self.receipt()
        req = self._commit_request(release, chunks)
        c = self._client
        if isinstance(req, pb.CommitRequest):
            return put_receipt(await c._call(c._stub.Commit, req), self.in_flight_tokens)
        return put_receipt((await c._call(c._stub.CommitRelease, req)).commit, self.in_flight_tokens)

    async def abort(self) -> None:
        """Give the slots back. Never raises for a reservation the daemon no longer holds."""
        if self.done:
            return
        self.done = True
        try:
            await self._client._call(self._client._stub.Abort, pb.AbortRequest(
                reservation_ids=[self.reservation_id], session_id=self.session_id))
        except _core.GONE:
            pass  # its session or daemon is gone, and the reservation with it


class AsyncReservationView(AsyncReservation):
    """Write access to a reservation another client holds (see
    :meth:`AsyncClient.open_reservation`): :meth:`view` its slots; the holder commits."""

    async def commit(self, release: Sequence[AsyncLease] = (), *, chunks: int | None = None) -> PutReceipt:
        raise FailedPreconditionError("a reservation view cannot commit: the client that reserved commits")

    async def abort(self) -> None:
        self.done = True  # stops this view; the holder's reservation is untouched


class AsyncCacheRequest(_core.CacheRequestBase):
    """:class:`kvcached_client.client.CacheRequest`, with ``finish`` awaited; ``async with`` it."""

    lease: AsyncLease
    reservation: AsyncReservation

    async def finish(self, *, commit: bool = True) -> PutReceipt:
        """Commit what :meth:`write` stored (unless ``commit`` is False: abort it) and release
        the lease: one round trip with something to commit."""
        if commit:
            return await self.reservation.commit(release=[self.lease])
        await self.reservation.abort()
        await self.lease.release()
        return self.reservation.receipt()

    async def __aenter__(self) -> "AsyncCacheRequest":
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if not self.reservation.done or not self.lease.released:
            await self.finish(commit=exc_type is None)


class AsyncClient:
    """:class:`kvcached_client.Client` over grpc.aio: the same calls, each awaited (a test
    compares their public surfaces). Releases and aborts are awaited RPCs here, not messages on
    the session stream, so :meth:`sync` has nothing to wait for; the request path's calls ride
    the stream as in Client (``stream_calls``)."""

    def __init__(self, socket: str | None = None, *, timeout: float = 10.0, client_name: str | None = None,
                 session: bool = True, nvme_read: str = _core.NVME_READ_DEFAULT, placement: Any = None,
                 stream_calls: bool = True) -> None:
        """``session``, ``nvme_read``, ``placement`` and ``stream_calls``: as for
        :class:`~kvcached_client.Client` (here a call on the stream crosses no thread: one task
        reads the stream's events)."""
        if nvme_read not in _core.NVME_READ_MODES:
            raise ValueError("nvme_read must be 'promote' or 'direct'")
        self._use_session = session
        self.stream_calls = stream_calls
        self.nvme_read = nvme_read
        self.target = _core.target(socket)
        self.timeout = timeout
        self.client_name = client_name or f"pid {os.getpid()} (asyncio)"
        self._channel = grpc.aio.insecure_channel(self.target, options=_core.CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self.placement = _core.placement_of(placement)
        self._pool = PoolMap(self.placement)
        self._nvme = NvmeReader()
        self._handle: pb.PoolHandle | None = None
        self._layouts: dict[KVLayout, str] = {}
        self._session_id: str | None = None
        self._stream: AioSessionStream | None = None

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any, timeout: float | None = None) -> T:
        """``await method(request)``, or the same call on the session stream (as Client._call)."""
        stream = self._stream
        kind = stream_kind(request, stream) if self.stream_calls else None
        if kind is not None and stream is not None and not stream.busy:
            stream.busy = True
            try:
                return await stream.request(kind, request, timeout or self.timeout)
            except StreamEnded as e:
                if kind != "lookup":  # what the call was for went with the session: _with_session reopens once
                    raise FailedPreconditionError(f"session {stream.session_id} ended: {e}") from None
            finally:
                stream.busy = False
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def session_id(self) -> str:
        """This client's session id, opening the session stream if needed ("" without sessions)."""
        if not self._use_session:
            return ""
        stream = self._stream
        if self._session_id is None or stream is None or not stream.is_active():
            call = self._stub.Session()
            try:
                await call.write(pb.SessionRequest(client_name=self.client_name))
                first = await call.read()
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            if stream is not None:
                await stream.close()
            self._stream = AioSessionStream(call, first)
            self._session_id = first.session_id
        return self._session_id

    async def _with_session(self, fn: Callable[[str], Awaitable[T]]) -> tuple[T, str]:
        """``(await fn(session_id), session_id)``, reopening the session once (see Client)."""
        sid = await self.session_id()
        try:
            return await fn(sid), sid
        except FailedPreconditionError as e:
            if "session" not in e.details:
                raise
            self._session_id = None
            sid = await self.session_id()
            return await fn(sid), sid

    async def _layout_id(self, layout: KVLayout) -> str:
        lid = self._layouts.get(layout)
        if lid is None:
            lid = (await self._call(self._stub.RegisterLayout, _core.layout_request(layout))).layout_id
            self._layouts[layout] = lid
        return lid

    async def _with_layout(self, layout: KVLayout, fn: Callable[[str], Awaitable[T]]) -> T:
        try:
            return await fn(await self._layout_id(layout))
        except NotFoundError as e:
            if "layout" not in e.details:
                raise
            self._layouts.pop(layout, None)
            return await fn(await self._layout_id(layout))

    async def _ensure_pool(self, generation: str) -> None:
        if self._pool.generation != generation:
            h = await self._call(self._stub.GetPoolHandle, pb.PoolHandleRequest())
            if h.generation != generation:  # restarted since the lease/reservation: its offsets are void
                raise UnavailableError("the daemon restarted during this call; retry")
            self._handle = h
            self._pool.ensure(_core.handle_from_proto(h))
            if self._nvme.path is not None and self._nvme.path != h.nvme_path:
                self._nvme.close()

    async def register(self, layout: KVLayout) -> str:
        return await self._layout_id(layout)

    async def lookup(self, layout: KVLayout, tokens: TokenInput) -> int:
        return (await self.lookup_many(layout, [tokens]))[0]

    async def lookup_many(self, layout: KVLayout, prompts: Sequence[TokenInput]) -> list[int]:
        packed = [_core.pack_tokens(t) for t in prompts]
        resp = await self._with_layout(
            layout, lambda lid: self._call(self._stub.Lookup, pb.LookupRequest(layout_id=lid, tokens=packed)))
        return list(resp.cached_tokens)

    async def acquire(self, layout: KVLayout, tokens: TokenInput, *, ttl: float | None = None) -> AsyncLease:
        """Pin the cached prefix of ``tokens``; the returned lease maps its chunks. Falls back
        to ``nvme_read="promote"`` for good when the NVMe tier cannot be opened (see Client)."""
        packed = _core.pack_tokens(tokens)

        def go(lid: str) -> Awaitable[tuple[pb.AcquireResponse, str]]:
            return self._with_session(lambda sid: self._call(self._stub.Acquire, pb.AcquireRequest(
                layout_id=lid, tokens=packed, session_id=sid, ttl_seconds=ttl or 0, read_nvme_directly=direct,
                placement=self.placement)))

        direct = self.nvme_read == "direct"
        resp, sid = await self._with_layout(layout, go)
        lease = AsyncLease(self, layout, resp)
        lease.session_id = sid
        if lease._offsets:
            try:
                await self._ensure_pool(resp.pool_generation)
                if direct and resp.chunks.nvme_keys and self._nvme.path is None:
                    assert self._handle is not None
                    self._nvme.open(self._handle.nvme_path)
            except PoolMappingError as e:
                await lease.release()
                if not direct or not resp.chunks.nvme_keys:
                    raise
                log.warning("cannot read the NVMe tier directly (%s); letting the daemon promote chunks instead", e)
                self.nvme_read = "promote"
                return await self.acquire(layout, tokens, ttl=ttl)
            except BaseException:
                await lease.release()
                raise
        return lease

    def _sid(self, session_id: str | None) -> str:
        return session_id if session_id is not None else (self._session_id or "")

    async def release(self, lease_ids: Sequence[str], *, session_id: str | None = None) -> int:
        req = pb.ReleaseRequest(lease_ids=list(lease_ids), session_id=self._sid(session_id))
        return (await self._call(self._stub.Release, req)).released

    async def keep_alive(self, lease_ids: Sequence[str], ttl: float | None = None, *,
                         session_id: str | None = None) -> float:
        req = pb.KeepAliveRequest(lease_ids=list(lease_ids), ttl_seconds=ttl or 0, session_id=self._sid(session_id))
        return (await self._call(self._stub.KeepAlive, req)).ttl_seconds

    async def open_lease(self, ticket: _core.LeaseTicket) -> AsyncLeaseView:
        """:meth:`kvcached_client.Client.open_lease`, awaitable."""
        resp = pb.AcquireResponse.FromString(ticket.response)
        view = AsyncLeaseView(self, ticket.layout, resp)
        if view._offsets:
            await self._ensure_pool(resp.pool_generation)
            if resp.chunks.nvme_keys and self._nvme.path is None:
                assert self._handle is not None
                self._nvme.open(self._handle.nvme_path)
        return view

    async def open_reservation(self, ticket: _core.ReservationTicket) -> AsyncReservationView:
        """:meth:`kvcached_client.Client.open_reservation`, awaitable."""
        resp = pb.ReserveResponse.FromString(ticket.response)
        view = AsyncReservationView(self, ticket.layout, resp, "")
        if view.slots:
            await self._ensure_pool(resp.pool_generation)
        return view

    async def reserve(self, layout: KVLayout, tokens: TokenInput, *, skip_empty: bool = False,
                      ttl: float | None = None, map_pool: bool = True, placement: str | None = None
                      ) -> AsyncReservation:
        """:meth:`kvcached_client.Client.reserve`, awaitable."""
        packed = _core.pack_tokens(tokens)
        where = self.placement if placement is None else placement

        def reserve(lid: str) -> Awaitable[tuple[pb.ReserveResponse, str]]:
            return self._with_session(lambda sid: self._call(self._stub.Reserve, pb.ReserveRequest(
                layout_id=lid, tokens=packed, session_id=sid, skip_empty=skip_empty, ttl_seconds=ttl or 0,
                placement=where)))

        r, sid = await self._with_layout(layout, reserve)
        res = AsyncReservation(self, layout, r, sid)
        if res.slots and map_pool:
            try:
                await self._ensure_pool(r.pool_generation)
            except BaseException:
                await res.abort()
                raise
        return res

    async def acquire_reserve(self, layout: KVLayout, tokens: TokenInput, *, no_cache: bool = False,
                              no_store: bool = False, ttl: float | None = None,
                              reservation_ttl: float | None = None, map_pool: bool = True,
                              placement: str | None = None) -> AsyncCacheRequest:
        """:meth:`kvcached_client.Client.acquire_reserve`, awaitable: one AcquireReserve call."""
        packed = _core.pack_tokens(tokens)
        direct = self.nvme_read == "direct"
        where = self.placement if placement is None else placement

        def go(lid: str) -> Awaitable[tuple[pb.AcquireReserveResponse, str]]:
            return self._with_session(lambda sid: self._call(self._stub.AcquireReserve, pb.AcquireReserveRequest(
                layout_id=lid, tokens=packed, session_id=sid, lease_ttl_seconds=ttl or 0,
                reservation_ttl_seconds=reservation_ttl or 0, read_nvme_directly=direct, no_cache=no_cache,
                no_store=no_store, placement=where)))

        resp, sid = await self._with_layout(layout, go)
        lease = AsyncLease(self, layout, resp.lease)
        lease.session_id = sid
        res = AsyncReservation(self, layout, resp.reservation, sid)
        if not map_pool:
            return AsyncCacheRequest(self, lease, res)
        try:
            if lease._offsets or res.slots:
                await self._ensure_pool(resp.lease.pool_generation or resp.reservation.pool_generation)
            if lease._offsets and direct and resp.lease.chunks.nvme_keys and self._nvme.path is None:
                assert self._handle is not None
                self._nvme.open(self._handle.nvme_path)
        except BaseException:
            await res.abort()
            await lease.release()
            raise
        return AsyncCacheRequest(self, lease, res)

    async def sync(self, timeout: float | None = None) -> None:
        """:meth:`kvcached_client.Client.sync`: here every release and abort was an awaited call,
        done when it returned, so there is nothing to wait for."""

    async def put(self, layout: KVLayout, tokens: TokenInput, kv: "torch.Tensor") -> PutReceipt:
        """:meth:`kvcached_client.Client.put`, awaitable."""
        packed = _core.pack_tokens(tokens)
        _core.validate_kv(layout, kv, len(packed) // 4)

        def reserve(lid: str) -> Awaitable[tuple[pb.ReserveResponse, str]]:
            return self._with_session(lambda sid: self._call(self._stub.Reserve, pb.ReserveRequest(
                layout_id=lid, tokens=packed, session_id=sid, skip_empty=True, placement=self.placement)))

        r, sid = await self._with_layout(layout, reserve)
        if not r.reservation_id:  # nothing to write (all cached, in flight, or no room): one call
            return PutReceipt(0, r.cached_tokens, r.durable_tokens, r.in_flight_tokens, r.write_through,
                              r.not_reserved_tokens, r.not_reserved_reason)
        if r.slots.offsets:
            try:
                await self._ensure_pool(r.pool_generation)
                _core.write_slots(self._pool, layout, _core.locations(r.slots), kv)
            except BaseException:
                try:
                    await self._call(self._stub.Abort, pb.AbortRequest(reservation_ids=[r.reservation_id],
                                                                       session_id=sid))
                except _core.GONE:
                    pass  # its session or daemon is gone, and the reservation with it
                raise
        resp = await self._call(self._stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id, session_id=sid))
        receipt = put_receipt(resp, r.in_flight_tokens)
        return dataclasses.replace(receipt, not_stored_tokens=r.not_reserved_tokens,
                                   not_stored_reason=r.not_reserved_reason)

    async def put_bytes(self, layout: KVLayout, tokens: TokenInput, chunks: Sequence[bytes]) -> PutReceipt:
        """:meth:`kvcached_client.Client.put_bytes` (the KV bytes over gRPC: slow), awaitable."""
        packed = _core.pack_tokens(tokens)
        resp = await self._with_layout(layout, lambda lid: self._call(
            self._stub.PutBytes, pb.PutBytesRequest(layout_id=lid, tokens=packed, chunks=list(chunks),
                                                    placement=self.placement)))
        return put_receipt(resp)

    async def get_bytes(self, layout: KVLayout, tokens: TokenInput) -> list[bytes]:
        """:meth:`kvcached_client.Client.get_bytes` (copied over gRPC: slow), awaitable."""
        packed = _core.pack_tokens(tokens)
        resp = await self._with_layout(layout, lambda lid: self._call(
            self._stub.GetBytes, pb.GetBytesRequest(layout_id=lid, tokens=packed)))
        return list(resp.chunks)

    async def pool_handle(self) -> PoolHandle:
        return _core.handle_from_proto(await self._call(self._stub.GetPoolHandle, pb.PoolHandleRequest()))

    async def warm_up(self) -> None:
        """Open the session and map the pool now, not on the first acquire or put."""
        await self.session_id()
        msg = await self._call(self._stub.GetPoolHandle, pb.PoolHandleRequest())
        await self._ensure_pool(msg.generation)

    async def stats(self, *, doctor: bool = False) -> dict:
        """The daemon's counters; ``doctor`` adds the troubleshooting probes (``d["doctor"]``)."""
        resp = await self._call(self._stub.Stats, pb.StatsRequest(doctor=doctor))
        d = json.loads(resp.json)
        d.update(version=resp.version, uptime_seconds=resp.uptime_seconds, listen=resp.listen)
        return d

    async def ping(self) -> None:
        await self._call(self._stub.Ping, pb.PingRequest())

    async def evict(self, layout_id: str = "", prefix: TokenInput | None = None) -> tuple[int, int]:
        """:meth:`kvcached_client.Client.evict`, awaitable."""
        packed = _core.pack_tokens(prefix) if prefix is not None else b""
        r = await self._call(self._stub.Evict, pb.EvictRequest(layout_id=layout_id, prefix_tokens=packed))
        return r.chunks, r.bytes

    async def flush(self) -> int:
        return (await self._call(self._stub.Flush, pb.FlushRequest(), timeout=max(self.timeout, 300))).chunks

    async def drain(self) -> tuple[int, int]:
        r = await self._call(self._stub.Drain, pb.DrainRequest(), timeout=max(self.timeout, 300))
        return r.flushed_chunks, r.leases_active

    @property
    def pool_maps(self) -> int:
        """How many times this client mapped a pool (once per daemon generation)."""
        return self._pool.maps

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream, self._session_id = None, None
        self._pool.close()
        self._nvme.close()
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
