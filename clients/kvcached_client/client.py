"""Synchronous client.

::

    with Client() as c:                         # $KVCACHED_SOCKET or the default socket
        n = c.lookup(layout, token_ids)         # cached prefix length, in tokens
        with c.acquire(layout, token_ids) as lease:
            lease.matched_tokens
            lease.chunk(i)                      # zero-copy tensor view of the pool block
        c.put(layout, token_ids, kv)            # kv: [2, layers, kv_heads, n_tokens, head_dim]

Ownership: a lease's chunk views point into the shared pool. They are valid
(the daemon will not evict or change those blocks) until the lease is
released, expires, or this client's session ends; copy what you need to keep.

Sessions: the client opens one Session stream lazily. Everything it leases
or reserves is tied to that session, so if this process dies the daemon
releases it all at once. After a daemon restart the client opens a new
session and maps the new pool on its own.

Thread-safe: calls may come from several threads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import grpc

from kvcached.contract.keys import KVLayout, TokenInput
from kvcached.contract.pool import PoolHandle
from kvcached.v1 import kvcached_pb2 as pb
from kvcached.v1 import kvcached_pb2_grpc as pb_grpc
from kvcached_client import _core
from kvcached_client.errors import (
    FailedPreconditionError,
    KvcachedError,
    NotFoundError,
    PoolMappingError,
    UnavailableError,
    from_rpc_error,
)
from kvcached_client.nvme import NvmeReader
from kvcached_client.pool import PoolMap
from kvcached_client.receipts import PutReceipt, put_receipt
from kvcached_client.stream import SessionStream, StreamEnded, stream_kind

NVME_READ_DEFAULT = _core.NVME_READ_DEFAULT

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
log = logging.getLogger("kvcached_client")


class Lease(_core.LeaseBase):
    """A pinned cached prefix. Use as a context manager, or call :meth:`release`.
    ``chunk``, ``copy_chunk`` and ``kv`` read it (see :class:`kvcached_client._core.LeaseBase`)."""

    def keep_alive(self, ttl: float | None = None) -> float:
        return self._client.keep_alive([self.lease_id], ttl, session_id=self.session_id)

    def release(self) -> None:
        """Give the lease back without waiting for the daemon: the release travels on the
        session stream (:meth:`Client.sync` waits for it when that matters). Never raises for a
        lease the daemon no longer holds: if its session ended or the daemon restarted, the
        daemon already released it. On a CUDA pool it first waits for the GPU reads of the
        lease's chunks (see ``LeaseBase._sync_device``)."""
        if not self.released:
            self._sync_device()
            self.released = True
            if self.lease_id:
                self._client._release_later([self.lease_id], self.session_id)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseView(_core.LeaseBase):
    """Read access to a lease another client holds (see :meth:`Client.open_lease`).

    It does not own the lease: :meth:`release` only stops this view; the holder releases the
    lease, and must not do so before this view's reads are done (a CUDA reader synchronises
    its device first, as :meth:`Lease.release` does)."""

    def release(self, *, synced: bool = False) -> None:
        """Stop this view. ``synced``: the caller knows every GPU read of its chunks has
        completed (it waited for an event on the stream that read them), so the device-wide
        synchronisation is skipped."""
        if not self.released:
            if not synced:
                self._sync_device()
            self.released = True


class Reservation(_core.ReservationBase):
    """Chunks reserved for writing in place: write each slot's pool block, then commit.

    ``slots`` are the chunks of the prompt that were not cached and that no other writer is
    writing now; :meth:`view` is the pool block of one, a [2, layers, kv_heads, chunk_tokens,
    head_dim] tensor to fill. :meth:`commit` publishes them (the returned receipt says how
    much of the prompt is cached and durable); :meth:`abort` gives them back. A reservation
    neither committed nor aborted expires on the daemon (its TTL), or goes when this
    client's session ends. On a CUDA pool, commit synchronises the pool's device first, so
    the daemon never publishes a block whose copy is still queued.
    """

    def commit(self, release: Sequence[Lease] = (), *, chunks: int | None = None) -> PutReceipt:
        """Publish the written chunks (``chunks``: only the first N slots; the rest are given
        back); with ``release``, give those leases back in the same round trip (CommitRelease).
        A reservation that holds nothing costs no call."""
        if not self.opened:
            for lease in release:
                lease.release()
            return self.receipt()
        req = self._commit_request(release, chunks)
        if isinstance(req, pb.CommitRequest):
            return put_receipt(self._client._call(self._client._stub.Commit, req), self.in_flight_tokens)
        return put_receipt(self._client._call(self._client._stub.CommitRelease, req).commit, self.in_flight_tokens)

    def abort(self) -> None:
        """Give the slots back, without waiting (on the session stream). Never raises for a
        reservation the daemon no longer holds."""
        if self.done:
            return
        self.done = True
        self._client._release_later([], self.session_id, aborts=[self.reservation_id])


class ReservationView(Reservation):
    """Write access to a reservation another client holds (see :meth:`Client.open_reservation`):
    :meth:`view` its slots; the holder commits or aborts."""

    def commit(self, release: Sequence[Lease] = (), *, chunks: int | None = None) -> PutReceipt:
        raise FailedPreconditionError("a reservation view cannot commit: the client that reserved commits")

    def abort(self) -> None:
        self.done = True  # stops this view; the holder's reservation is untouched


class CacheRequest(_core.CacheRequestBase):
    """One request's cache work in two round trips (see :meth:`Client.acquire_reserve`):
    ``lease`` pins the cached prefix (read it with ``lease.chunk(i)``/``lease.kv()``),
    ``reservation`` holds pool room for the uncached full chunks after it (write them with
    :meth:`write`, or ``reservation.view(slot)``). :meth:`finish` commits what was written and
    releases the lease in one call; without a commit the release costs no wait at all.
    """

    lease: Lease
    reservation: Reservation

    def finish(self, *, commit: bool = True) -> PutReceipt:
        """Commit what :meth:`write` stored (unless ``commit`` is False: abort it) and release
        the lease: one round trip with something to commit, none otherwise."""
        if commit:
            return self.reservation.commit(release=[self.lease])
        self.reservation.abort()
        self.lease.release()
        return self.reservation.receipt()

    def __enter__(self) -> "CacheRequest":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self.reservation.done or not self.lease.released:
            self.finish(commit=exc_type is None)


class Client:
    def __init__(
        self,
        socket: str | None = None,
        *,
        timeout: float = 10.0,
        client_name: str | None = None,
        session: bool = True,
        nvme_read: str = NVME_READ_DEFAULT,
        placement: "str | torch.device | None" = None,
        stream_calls: bool = True,
    ) -> None:
        """``nvme_read``: how chunks found only on NVMe reach this process. "promote": the
        daemon copies them into the pool; "direct": this process reads the LMDB file itself
        (same host, access to the state directory). The default is the faster one as measured
        by bench/chunk_read.py.

        ``placement``: the device this process computes on (a ``torch.device``, a GPU UUID, or
        ``host:K``). On a daemon with a pool slab per GPU, the chunks it stores go to that GPU's
        slab, and that slab is the one mapped at once. None: unplaced (the daemon picks).

        ``stream_calls``: send the request path's calls on the session stream this client holds
        (see :mod:`kvcached_client.stream`) rather than as unary RPCs. Faster for a caller whose
        process has no other busy Python thread (bench/hf_path.py); a call made from a thread
        beside a busy one (an engine's scheduler) waits for the GIL on each of the two more
        threads its reply crosses, and there unary calls are faster."""
        if nvme_read not in _core.NVME_READ_MODES:
            raise ValueError("nvme_read must be 'promote' or 'direct'")
        self.nvme_read = nvme_read
        self.target = _core.target(socket)
        self.timeout = timeout
        self.client_name = client_name or f"pid {os.getpid()}"
        self._channel = grpc.insecure_channel(self.target, options=_core.CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVCacheStub(self._channel)
        self.placement = _core.placement_of(placement)
        self._pool = PoolMap(self.placement)
        self._nvme = NvmeReader()
        self._handle: pb.PoolHandle | None = None
        self._layouts: dict[KVLayout, str] = {}
        self._lock = threading.Lock()
        self._use_session = session
        self.stream_calls = stream_calls
        self._session_id: str | None = None
        self._stream: SessionStream | None = None
        self._seq = 0
        self._unsynced = False  # releases or aborts sent on the stream since the last sync()

    # -- plumbing ----------------------------------------------------------------------

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        """``method(request)``, or the same call on the session stream when it may ride there (see
        :mod:`kvcached_client.stream`): a request-path call of this client's current session,
        and no other call of this client on the stream now."""
        stream = self._stream
        kind = stream_kind(request, stream) if self.stream_calls else None
        if kind is not None and stream is not None and stream.try_begin():
            try:
                return stream.request(kind, request, timeout or self.timeout)
            except StreamEnded as e:
                if kind != "lookup":  # what the call was for went with the session: _with_session reopens once
                    raise FailedPreconditionError(f"session {stream.session_id} ended: {e}") from None
            finally:
                stream.end()
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def session_id(self) -> str:
        """This client's session id, opening the session stream if needed."""
        if not self._use_session:
            return ""
        with self._lock:
            if self._session_id is not None and self._session_alive():
                return self._session_id
            self._open_session()
            assert self._session_id is not None
            return self._session_id

    def _session_alive(self) -> bool:
        return self._stream is not None and self._stream.is_active()

    def _open_session(self) -> None:
        if self._stream is not None:
            # The old stream ended (daemon restart): let its request iterator return, or the gRPC
            # thread consuming it stays blocked on its queue forever, one per restart.
            self._stream.close()
        try:
            stream = SessionStream(self._stub, self.client_name)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self._session_id, self._stream = stream.session_id, stream

    def _with_session(self, fn: Callable[[str], T]) -> tuple[T, str]:
        """``(fn(session_id), session_id)``; if the daemon no longer knows the session (it
        restarted), reopen once. The id is returned because what ``fn`` obtained (a lease, a
        reservation) is bound to it: releases and commits must name it."""
        sid = self.session_id()
        try:
            return fn(sid), sid
        except FailedPreconditionError as e:
            if "session" not in e.details:
                raise
            with self._lock:
                self._session_id = None
            sid = self.session_id()
            return fn(sid), sid

    def _layout_id(self, layout: KVLayout) -> str:
        lid = self._layouts.get(layout)
        if lid is None:
            lid = self._call(self._stub.RegisterLayout, _core.layout_request(layout)).layout_id
            self._layouts[layout] = lid
        return lid

    def _with_layout(self, layout: KVLayout, fn: Callable[[str], T]) -> T:
        """Run ``fn(layout_id)``; re-register once if the daemon forgot the layout (restart without NVMe)."""
        try:
            return fn(self._layout_id(layout))
        except NotFoundError as e:
            if "layout" not in e.details:
                raise
            self._layouts.pop(layout, None)
            return fn(self._layout_id(layout))

    def _ensure_pool(self, generation: str) -> None:
        if self._pool.generation != generation:
            msg = self._call(self._stub.GetPoolHandle, pb.PoolHandleRequest())
            if msg.generation != generation:  # restarted since the lease/reservation: its offsets are void
                raise UnavailableError("the daemon restarted during this call; retry")
            self._handle = msg
            self._pool.ensure(_core.handle_from_proto(msg))
            if self._nvme.path is not None and self._nvme.path != msg.nvme_path:
                self._nvme.close()

    # -- API -------------------------------------------------------------------------------

    def register(self, layout: KVLayout) -> str:
        return self._layout_id(layout)

    def lookup(self, layout: KVLayout, tokens: TokenInput) -> int:
        """Cached prefix length in tokens. Pins nothing."""
        return self.lookup_many(layout, [tokens])[0]

    def lookup_many(self, layout: KVLayout, prompts: Sequence[TokenInput]) -> list[int]:
        packed = [_core.pack_tokens(t) for t in prompts]
        resp = self._with_layout(
            layout, lambda lid: self._call(self._stub.Lookup, pb.LookupRequest(layout_id=lid, tokens=packed))
        )
        return list(resp.cached_tokens)

    def acquire(self, layout: KVLayout, tokens: TokenInput, *, ttl: float | None = None) -> Lease:
        """Pin the cached prefix of ``tokens``; the returned lease maps its chunks."""
        packed = _core.pack_tokens(tokens)

        def go(lid: str) -> tuple[pb.AcquireResponse, str]:
            return self._with_session(lambda sid: self._call(self._stub.Acquire, pb.AcquireRequest(
                layout_id=lid, tokens=packed, session_id=sid, ttl_seconds=ttl or 0, read_nvme_directly=direct,
                placement=self.placement)))

        direct = self.nvme_read == "direct"
        resp, sid = self._with_layout(layout, go)
        lease = Lease(self, layout, resp)
        lease.session_id = sid
        if lease._offsets:
            try:
                self._ensure_pool(resp.pool_generation)
                if direct and resp.chunks.nvme_keys and self._nvme.path is None:
                    assert self._handle is not None
                    self._nvme.open(self._handle.nvme_path)
            except PoolMappingError as e:
                lease.release()
                if not direct or not resp.chunks.nvme_keys:
                    raise
                log.warning("cannot read the NVMe tier directly (%s); letting the daemon promote chunks instead", e)
                self.nvme_read = "promote"
                return self.acquire(layout, tokens, ttl=ttl)
            except BaseException:
                lease.release()
                raise
        return lease

    def _sid(self, session_id: str | None) -> str:
        """The session an id was obtained under: given, else this client's current one."""
        return session_id if session_id is not None else (self._session_id or "")

    def release(self, lease_ids: Sequence[str], *, session_id: str | None = None) -> int:
        req = pb.ReleaseRequest(lease_ids=list(lease_ids), session_id=self._sid(session_id))
        return self._call(self._stub.Release, req).released

    def open_lease(self, ticket: _core.LeaseTicket) -> LeaseView:
        """Read access to a lease held by another client of this daemon (:meth:`Lease.ticket`):
        maps the pool (and opens the LMDB file for chunks read from NVMe directly) as an
        acquire would. Raises :class:`UnavailableError` if the daemon restarted since the lease
        was granted (its chunks are gone), :class:`PoolMappingError` if the pool cannot be
        mapped here."""
        resp = pb.AcquireResponse.FromString(ticket.response)
        view = LeaseView(self, ticket.layout, resp)
        if view._offsets:
            self._ensure_pool(resp.pool_generation)
            if resp.chunks.nvme_keys and self._nvme.path is None:
                assert self._handle is not None
                self._nvme.open(self._handle.nvme_path)
        return view

    def open_reservation(self, ticket: _core.ReservationTicket) -> ReservationView:
        """Write access to a reservation held by another client of this daemon
        (:meth:`Reservation.ticket`): maps the pool as a reserve would. No call to the daemon
        unless the pool is not mapped yet; raises :class:`UnavailableError` if the daemon
        restarted since (the slots are gone)."""
        resp = pb.ReserveResponse.FromString(ticket.response)
        view = ReservationView(self, ticket.layout, resp, "")
        if view.slots:
            self._ensure_pool(resp.pool_generation)
        return view

    def reserve(self, layout: KVLayout, tokens: TokenInput, *, skip_empty: bool = False, ttl: float | None = None,
                map_pool: bool = True, placement: str | None = None) -> Reservation:
        """Reserve the full chunks of ``tokens`` that are not cached yet, to write in place
        (see :class:`Reservation`); :meth:`put` is reserve, write, commit. ``skip_empty``: open
        no reservation when there is nothing to write (then commit costs no call). ``ttl``: the
        reservation's (default the daemon's); ``map_pool=False``: see :meth:`acquire_reserve`;
        ``placement``: the writer's device when it is not this client's (a holder reserving for
        a writer in another process)."""
        packed = _core.pack_tokens(tokens)
        where = self.placement if placement is None else placement

        def reserve(lid: str) -> tuple[pb.ReserveResponse, str]:
            return self._with_session(lambda sid: self._call(self._stub.Reserve, pb.ReserveRequest(
                layout_id=lid, tokens=packed, session_id=sid, skip_empty=skip_empty, ttl_seconds=ttl or 0,
                placement=where)))

        r, sid = self._with_layout(layout, reserve)
        res = Reservation(self, layout, r, sid)
        if res.slots and map_pool:
            try:
                self._ensure_pool(r.pool_generation)
            except BaseException:
                res.abort()
                raise
        return res

    def acquire_reserve(self, layout: KVLayout, tokens: TokenInput, *, no_cache: bool = False,
                        no_store: bool = False, ttl: float | None = None,
                        reservation_ttl: float | None = None, map_pool: bool = True,
                        placement: str | None = None) -> CacheRequest:
        """A request's first round trip: pin the cached prefix of ``tokens`` and reserve pool room
        for its uncached full chunks (one AcquireReserve call). ``no_cache``: serve nothing from
        the cache; ``no_store``: reserve nothing. Finish it with :meth:`CacheRequest.finish`.
        ``map_pool=False``: for a holder that only hands tickets to readers and writers in other
        processes (vLLM's scheduler): this client maps nothing (no CUDA context here) and cannot
        read or write the chunks itself; ``placement`` then names that reader's and writer's
        device (default: this client's)."""
        packed = _core.pack_tokens(tokens)
        direct = self.nvme_read == "direct"
        where = self.placement if placement is None else placement

        def go(lid: str) -> tuple[pb.AcquireReserveResponse, str]:
            return self._with_session(lambda sid: self._call(self._stub.AcquireReserve, pb.AcquireReserveRequest(
                layout_id=lid, tokens=packed, session_id=sid, lease_ttl_seconds=ttl or 0,
                reservation_ttl_seconds=reservation_ttl or 0, read_nvme_directly=direct, no_cache=no_cache,
                no_store=no_store, placement=where)))

        resp, sid = self._with_layout(layout, go)
        lease = Lease(self, layout, resp.lease)
        lease.session_id = sid
        res = Reservation(self, layout, resp.reservation, sid)
        if not map_pool:
            return CacheRequest(self, lease, res)
        try:
            if lease._offsets or res.slots:
                self._ensure_pool(resp.lease.pool_generation or resp.reservation.pool_generation)
            if lease._offsets and direct and resp.lease.chunks.nvme_keys and self._nvme.path is None:
                assert self._handle is not None
                self._nvme.open(self._handle.nvme_path)
        except BaseException:
            res.abort()
            lease.release()
            raise
        return CacheRequest(self, lease, res)

    def _release_later(self, lease_ids: Sequence[str], session_id: str, *, aborts: Sequence[str] = ()) -> None:
        """Releases and aborts nobody waits for: sent on the session stream they were granted
        under. If that session is gone (daemon restart, closed client), so are they."""
        with self._lock:
            alive = self._stream is not None and self._session_id == session_id and self._session_alive()
            if alive:
                assert self._stream is not None
                self._stream.put(pb.SessionRequest(release_lease_ids=list(lease_ids),
                                                        abort_reservation_ids=list(aborts)))
                self._unsynced = True
                return
        if session_id:
            return  # that session ended: the daemon released everything it held
        try:  # sessionless: the plain RPCs
            if lease_ids:
                self.release(lease_ids, session_id="")
            if aborts:
                self._call(self._stub.Abort, pb.AbortRequest(reservation_ids=list(aborts)))
        except _core.GONE:
            pass

    def sync(self, timeout: float | None = None) -> None:
        """Wait until the daemon has done every release and abort this client sent on its
        session stream (callers that need the pool room back now). :meth:`stats`, :meth:`evict`,
        :meth:`flush` and :meth:`drain` do it first, so they see this client's own releases.
        Returns at once if the session ended (the daemon released everything); raises
        DeadlineExceededError after ``timeout`` s (default: the client's timeout)."""
        with self._lock:
            self._unsynced = False
            stream = self._stream
            if stream is None or not self._session_alive():
                return
            self._seq += 1
            seq = self._seq
            stream.put(pb.SessionRequest(seq=seq))
        stream.wait_acked(seq, self.timeout if timeout is None else timeout)

    def _sync_own(self) -> None:
        if self._unsynced:
            self.sync()

    def keep_alive(self, lease_ids: Sequence[str], ttl: float | None = None, *, session_id: str | None = None) -> float:
        req = pb.KeepAliveRequest(lease_ids=list(lease_ids), ttl_seconds=ttl or 0, session_id=self._sid(session_id))
        return self._call(self._stub.KeepAlive, req).ttl_seconds

    def put(self, layout: KVLayout, tokens: TokenInput, kv: "torch.Tensor") -> PutReceipt:
        """Store the full chunks of ``kv`` that are not cached yet.

        ``kv`` is [2, layers, kv_heads, n_tokens, head_dim] in the layout's dtype. Chunks
        already cached, or being written by another client right now, are skipped. The
        receipt says how many chunks were stored and how much of the prompt is cached and
        durable (on NVMe) now; see :class:`kvcached_client.receipts.PutReceipt`.
        """
        packed = _core.pack_tokens(tokens)
        _core.validate_kv(layout, kv, len(packed) // 4)
        stored = 0
        while True:
            res = self.reserve(layout, packed, skip_empty=True)
            if not res.opened:  # all cached, in flight, or no room at all: one call
                r = res.receipt()
                break
            try:
                _core.write_slots(self._pool, layout, res.slots, kv)
            except BaseException:
                res.abort()
                raise
            r = res.commit()
            stored += r.stored_chunks
            # A prompt bigger than the free pool streams through: what was committed can now be
            # demoted, so the rest gets room on the next reservation.
            if not res.not_reserved_tokens or not r.stored_chunks:
                break
        if res.not_reserved_tokens:
            log.info("put stored %d chunks; %d tokens found no room: %s", stored, res.not_reserved_tokens,
                     res.not_reserved_reason)
        return dataclasses.replace(r, stored_chunks=stored, not_stored_tokens=res.not_reserved_tokens,
                                   not_stored_reason=res.not_reserved_reason)

    def put_bytes(self, layout: KVLayout, tokens: TokenInput, chunks: Sequence[bytes]) -> PutReceipt:
        """Fallback for processes that cannot map the pool: the KV bytes travel over gRPC (slow)."""
        packed = _core.pack_tokens(tokens)
        resp = self._with_layout(layout, lambda lid: self._call(
            self._stub.PutBytes, pb.PutBytesRequest(layout_id=lid, tokens=packed, chunks=list(chunks),
                                                    placement=self.placement)))
        return put_receipt(resp)

    def get_bytes(self, layout: KVLayout, tokens: TokenInput) -> list[bytes]:
        """Fallback read: the cached prefix's chunk payloads, copied over gRPC (slow)."""
        packed = _core.pack_tokens(tokens)
        resp = self._with_layout(layout, lambda lid: self._call(
            self._stub.GetBytes, pb.GetBytesRequest(layout_id=lid, tokens=packed)))
        return list(resp.chunks)

    def pool_handle(self) -> PoolHandle:
        return _core.handle_from_proto(self._call(self._stub.GetPoolHandle, pb.PoolHandleRequest()))

    def warm_up(self) -> None:
        """Open the session and map the pool now rather than on the first acquire or put (an
        engine calls this at start, so its first request does not pay for them)."""
        self.session_id()
        msg = self._call(self._stub.GetPoolHandle, pb.PoolHandleRequest())
        self._ensure_pool(msg.generation)

    def stats(self, *, doctor: bool = False) -> dict:
        """The daemon's counters; ``doctor`` adds the troubleshooting probes (``d["doctor"]``)."""
        self._sync_own()
        import json

        resp = self._call(self._stub.Stats, pb.StatsRequest(doctor=doctor))
        d = json.loads(resp.json)
        d.update(version=resp.version, uptime_seconds=resp.uptime_seconds, listen=resp.listen)
        return d

    def ping(self) -> None:
        self._call(self._stub.Ping, pb.PingRequest())

    def evict(self, layout_id: str = "", prefix: TokenInput | None = None) -> tuple[int, int]:
        """Drop unpinned chunks: all, one layout's, or (with ``prefix``) prompts starting with it."""
        self._sync_own()
        packed = _core.pack_tokens(prefix) if prefix is not None else b""
        r = self._call(self._stub.Evict, pb.EvictRequest(layout_id=layout_id, prefix_tokens=packed))
        return r.chunks, r.bytes

    def flush(self) -> int:
        self._sync_own()
        return self._call(self._stub.Flush, pb.FlushRequest(), timeout=max(self.timeout, 300)).chunks

    def drain(self) -> tuple[int, int]:
        self._sync_own()
        r = self._call(self._stub.Drain, pb.DrainRequest(), timeout=max(self.timeout, 300))
        return r.flushed_chunks, r.leases_active

    @property
    def pool_maps(self) -> int:
        """How many times this client mapped a pool (once per daemon generation)."""
        return self._pool.maps

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream.call.cancel()
            self._session_id, self._stream = None, None
        self._pool.close()
        self._nvme.close()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CacheRequest", "Client", "Lease", "LeaseView", "Reservation", "ReservationView", "KvcachedError",
           "PutReceipt"]
