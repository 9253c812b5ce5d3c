"""The reading end of a client's Session stream, and the calls that ride on it.

A unary call opens an HTTP/2 stream of its own: headers, the message, trailers, a new handler
task in the daemon. A message on the Session stream the client already holds skips all that
(on a 2-core box an acknowledged empty message took 0.6x a ``grpc.health.v1`` check), so a
client sends its request-path calls (AcquireReserve, CommitRelease, Commit, Acquire, Reserve,
Lookup) on the stream when the daemon says it answers them there (``SessionEvent.stream_calls``).
bench/hf_path.py times a Hugging Face prefill's cache work both ways: a hit 0.88x, a miss 0.89x
of the same with unary calls; but 1.13x for a hit while another thread of the process runs
Python without pause, since a reply here crosses two threads more than a unary call's does
(gRPC's, and the reader below), each a wait for the GIL.

Threads: gRPC's sync streaming API has no read with a timeout, so one reader thread per stream
takes every event and hands each to whoever waits for it (a call's reply by ``call_id``, a
``sync()``'s ack by ``seq``); a caller waits on a condition with its own deadline. A caller
that gives up (deadline) leaves the stream as it is; when its reply comes late the reader gives
back what it granted (lease, reservation) on the stream, so nothing stays pinned until its TTL.

One call rides the stream at a time (:meth:`SessionStream.try_begin`): the daemon answers a
stream's calls in order, so a second thread's call would wait behind the first. It takes a
unary call instead, which the daemon runs beside the first.

:class:`AioSessionStream` is the same for the asyncio client: one task reads the events and
resolves each call's future; no thread is crossed.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import Any, Iterator

import grpc

from kvcached.v1 import kvcached_pb2 as pb
from kvcached_client.errors import DeadlineExceededError, from_status

#: The requests that may ride the stream -> their field in SessionRequest.call (and in
#: SessionEvent.reply).
STREAMED: dict[type, str] = {
    pb.AcquireReserveRequest: "acquire_reserve",
    pb.CommitReleaseRequest: "commit_release",
    pb.CommitRequest: "commit",
    pb.AcquireRequest: "acquire",
    pb.ReserveRequest: "reserve",
    pb.LookupRequest: "lookup",
}


def stream_kind(request: Any, stream: "SessionStream | AioSessionStream | None") -> str | None:
    """The call field ``request`` rides ``stream`` as, or None (then it is a unary call): a
    request-path call, on an open stream of a daemon that answers calls there, in that stream's
    own session (a Lookup names none)."""
    kind = STREAMED.get(type(request))
    if kind is None or stream is None or not stream.takes_calls or not stream.is_active():
        return None
    if kind != "lookup" and request.session_id != stream.session_id:
        return None
    return kind


class StreamEnded(Exception):
    """The stream ended before the call's reply came: the daemon ended the session (restart,
    shutdown), and with it everything the session held."""


class SessionStream:
    """One open Session stream: its request queue, its reader thread, the replies waited for.

    Construction opens the stream and blocks for its first event (the session id); the reader
    thread starts after it. :meth:`close` ends the request side; the daemon then ends the
    stream and the thread exits."""

    def __init__(self, stub: Any, client_name: str) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        name = client_name

        def requests() -> Iterator[pb.SessionRequest]:
            yield pb.SessionRequest(client_name=name)
            # Held open until close() (None); meanwhile it carries releases, aborts and calls.
            while (msg := self._requests.get()) is not None:
                yield msg

        self.call = stub.Session(requests())
        try:
            first = next(self.call)
        except BaseException:
            self._requests.put(None)
            raise
        self.session_id: str = first.session_id
        #: The daemon answers calls on this stream (a daemon from before they existed does not).
        self.takes_calls: bool = first.stream_calls
        self._cond = threading.Condition()
        self._replies: dict[int, list[pb.SessionEvent]] = {}  # call_id -> [] until its reply comes
        self._acked = 0
        self._ended = False
        self._ids = itertools.count(1)
        self._busy = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"kvcached-session-{self.session_id}", daemon=True)
        self._reader.start()

    # -- the request side ----------------------------------------------------------------

    def put(self, msg: pb.SessionRequest) -> None:
        self._requests.put(msg)

    def close(self) -> None:
        """End the request side (the daemon then ends the stream and releases the session)."""
        self._requests.put(None)

    def is_active(self) -> bool:
        return not self._ended and self.call.is_active()

    # -- calls ------------------------------------------------------------------------------

    def try_begin(self) -> bool:
        """Take the stream for one call; False if another thread's call is on it now."""
        return self._busy.acquire(blocking=False)

    def end(self) -> None:
        self._busy.release()

    def request(self, kind: str, request: Any, timeout: float) -> Any:
        """Send ``request`` as call ``kind`` and wait up to ``timeout`` s for its reply (the
        unary RPC's response message). Raises the error the unary call would have raised,
        :class:`~kvcached_client.errors.DeadlineExceededError` on timeout, or
        :class:`StreamEnded`. Call between :meth:`try_begin` and :meth:`end`."""
        call_id = next(self._ids)
        slot: list[pb.SessionEvent] = []
        with self._cond:
            if self._ended:
                raise StreamEnded("the session stream ended")
            self._replies[call_id] = slot
        self._requests.put(_call_message(call_id, kind, request))
        deadline = time.monotonic() + timeout
        with self._cond:
            try:
                while not slot:
                    if self._ended:
                        raise StreamEnded("the session stream ended before the daemon answered")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceededError(f"the daemon did not answer within {timeout} s")
                    self._cond.wait(left)
            finally:
                self._replies.pop(call_id, None)
        return _reply(slot[0], kind)

    def wait_acked(self, seq: int, timeout: float) -> None:
        """Wait until the daemon acknowledged message ``seq`` (returns at once if the stream
        ended: the daemon released everything). Raises DeadlineExceededError on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._acked < seq and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(f"the daemon did not acknowledge within {timeout} s")
                self._cond.wait(left)

    # -- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        try:
            for ev in self.call:
                late = None
                with self._cond:
                    if ev.call_id:
                        slot = self._replies.get(ev.call_id)
                        if slot is not None:
                            slot.append(ev)
                        else:
                            late = ev
                    if ev.acked_seq > self._acked:
                        self._acked = ev.acked_seq
                    self._cond.notify_all()
                if late is not None:
                    self._give_back(late)
        except grpc.RpcError:
            pass  # the stream ended (daemon restart, shutdown, close): the session with it
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _give_back(self, ev: pb.SessionEvent) -> None:
        """A reply nobody waits for any more (its caller's deadline passed): release the lease
        and abort the reservation it granted, so they do not stay pinned until their TTL."""
        msg = _give_back_request(ev)
        if msg is not None:
            self._requests.put(msg)


class AioSessionStream:
    """:class:`SessionStream` for grpc.aio: ``call`` is the open Session stream (its first event
    read), one task reads its events. The owner calls :meth:`close` (awaited) when done."""

    def __init__(self, call: Any, first: pb.SessionEvent) -> None:
        self.call = call
        self.session_id: str = first.session_id
        self.takes_calls: bool = first.stream_calls
        self.busy = False  # a call is on the stream (one at a time, as in SessionStream)
        self._replies: dict[int, asyncio.Future[pb.SessionEvent]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._ended = False
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def is_active(self) -> bool:
        return not self._ended and not self.call.done()

    async def request(self, kind: str, request: Any, timeout: float) -> Any:
        """As :meth:`SessionStream.request`; the caller sets and clears :attr:`busy`."""
        if self._ended:
            raise StreamEnded("the session stream ended")
        call_id = next(self._ids)
        reply: asyncio.Future[pb.SessionEvent] = asyncio.get_running_loop().create_future()
        self._replies[call_id] = reply
        try:
            async with self._write_lock:
                await self.call.write(_call_message(call_id, kind, request))
            ev = await asyncio.wait_for(reply, timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"the daemon did not answer within {timeout} s") from None
        except grpc.RpcError as e:
            raise StreamEnded(f"the session stream ended: {e}") from None
        finally:
            self._replies.pop(call_id, None)
        return _reply(ev, kind)

    async def _read(self) -> None:
        try:
            while (ev := await self.call.read()) is not grpc.aio.EOF:
                if not ev.call_id:
                    continue
                reply = self._replies.get(ev.call_id)
                if reply is None:
                    give_back = _give_back_request(ev)
                    if give_back is not None:
                        async with self._write_lock:
                            await self.call.write(give_back)
                elif not reply.done():
                    reply.set_result(ev)
        except (grpc.RpcError, asyncio.CancelledError):
            pass  # the stream ended or was closed: the session with it
        finally:
            self._ended = True
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(StreamEnded("the session stream ended before the daemon answered"))

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass


def _call_message(call_id: int, kind: str, request: Any) -> pb.SessionRequest:
    msg = pb.SessionRequest(call_id=call_id)
    getattr(msg, kind).CopyFrom(request)
    return msg


def _reply(ev: pb.SessionEvent, kind: str) -> Any:
    """A call's reply event as the unary RPC's response, or the error that RPC would have raised."""
    if ev.WhichOneof("reply") == "error":
        raise from_status(_STATUS_BY_NUMBER.get(ev.error.code, grpc.StatusCode.UNKNOWN), ev.error.details)
    return getattr(ev, kind)


def _give_back_request(ev: pb.SessionEvent) -> pb.SessionRequest | None:
    """For a reply nobody waits for any more (its caller's deadline passed): the message that
    releases the lease and aborts the reservation it granted, or None if it granted neither."""
    kind = ev.WhichOneof("reply")
    leases: list[str] = []
    aborts: list[str] = []
    if kind == "acquire_reserve":
        leases.append(ev.acquire_reserve.lease.lease_id)
        aborts.append(ev.acquire_reserve.reservation.reservation_id)
    elif kind == "acquire":
        leases.append(ev.acquire.lease_id)
    elif kind == "reserve":
        aborts.append(ev.reserve.reservation_id)
    leases, aborts = [x for x in leases if x], [x for x in aborts if x]
    return pb.SessionRequest(release_lease_ids=leases, abort_reservation_ids=aborts) if leases or aborts else None


_STATUS_BY_NUMBER = {s.value[0]: s for s in grpc.StatusCode}
