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

from kvcached.keys import KVLayout, TokenInput
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


class AsyncClient:
    def __init__(self, socket: str | None = None, *, timeout: float = 10.0, client_name: str | None = None,
                 nvme_read: str = _core.NVME_READ_DEFAULT, placement: Any = None) -> None:
        """``nvme_read`` and ``placement``: as for :class:`~kvcached_client.Client`."""
        if nvme_read not in _core.NVME_READ_MODES:
            raise ValueError("nvme_read must be 'promote' or 'direct'")
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
        self._session_call: Any = None

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any, timeout: float | None = None) -> T:
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def session_id(self) -> str:
        call = self._session_call
        if self._session_id is None or call is None or call.done():
            call = self._stub.Session()
            try:
                await call.write(pb.SessionRequest(client_name=self.client_name))
                first = await call.read()
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            self._session_id, self._session_call = first.session_id, call
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

    async def stats(self) -> dict:
        resp = await self._call(self._stub.Stats, pb.StatsRequest())
        d = json.loads(resp.json)
        d.update(version=resp.version, uptime_seconds=resp.uptime_seconds, listen=resp.listen)
        return d

    async def ping(self) -> None:
        await self._call(self._stub.Ping, pb.PingRequest())

    async def close(self) -> None:
        if self._session_call is not None:
            self._session_call.cancel()
            self._session_call = self._session_id = None
        self._pool.close()
        self._nvme.close()
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
