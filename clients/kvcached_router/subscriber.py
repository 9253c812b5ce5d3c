"""Following one daemon's KV event stream, gap-free, into its :class:`HostIndex`.

On start the subscriber connects its SUB socket, then asks the replay socket for everything
from sequence 0 (the daemon's start snapshot and what followed, as far as its buffer reaches),
and from then on applies live batches in sequence order. Batches that arrive live while a
replay runs are held and applied after it, skipping those the replay covered.

* A gap (a batch numbered past the next expected one: the PUB dropped messages) triggers a
  replay from the first missing number.
* A sequence number lower than expected with a newer timestamp means the daemon restarted (its
  numbers start again at 0, with AllBlocksCleared and a snapshot): the index is cleared and
  replayed from 0. Lower with an older timestamp is a batch a replay already applied.
* If the replay cannot fill a hole (the buffer no longer holds it, or there is no replay
  socket), the index is cleared (``holes``): forgetting is safe, a wrong "held" is not, and the
  daemon's following events rebuild it.
* When the connection to the daemon's PUB socket drops (the daemon stopped, crashed, or is
  restarting), the index is marked stale at once (ZMQ's socket monitor): the router counts the
  host as holding nothing until a batch arrives again. Without this, a restart storm routed a
  quarter of its requests to hosts whose daemons were down, on what their old streams had said.

Runs in the router's event loop (``zmq.asyncio``); ``lag`` is the age of the newest batch's
timestamp when it was applied.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from kvcached.contract.events import decoder
from kvcached_router.index import HostIndex

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventSubscriber:
    def __init__(self, name: str, index: HostIndex, events: str, replay: str = "", *,
                 ctx: zmq.asyncio.Context | None = None, replay_timeout: float = 5.0) -> None:
        self.name = name
        self.index = index
        self.events_endpoint = events
        self.replay_endpoint = replay
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._decode = decoder().decode
        self.replay_timeout = replay_timeout
        self.next_seq = 0  # the next batch number this index needs
        self.batches = 0
        self.replays = 0
        self.holes = 0
        self.restarts = 0
        self.disconnects = 0  # times the PUB connection dropped (the index went stale)
        self.lag = 0.0
        self.last_ts = 0.0  # the newest batch timestamp applied (tells a restart from a late duplicate)
        self.synced = asyncio.Event()  # set once the first replay (or first batch) is in
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"events-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        watch = asyncio.get_running_loop().create_task(self._watch(monitor), name=f"events-monitor-{self.name}")
        sub.connect(self.events_endpoint)
        try:
            await self._catch_up(0)
            self.synced.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                await self._on_batch(int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a stream we cannot follow is a stream we forget
            log.exception("KV events of host %s: subscriber stopped", self.name,
                          extra={"event": "router_events_error", "host": self.name})
            self.index.clear()
        finally:
            watch.cancel()
            try:
                sub.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(0)
            sub.close(0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Mark the index stale when the PUB connection drops (the daemon is gone for now)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and not self.index.stale:
                self.disconnects += 1
                self.index.stale = True
                log.warning("host %s: its daemon's KV event stream disconnected; counting it as holding nothing "
                            "until the stream resumes", self.name, extra={"event": "router_events_down", "host": self.name})

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        if seq == self.next_seq:
            self._apply(seq, self._decode(payload))
        elif seq > self.next_seq:  # we missed some: get them (this one included) from the replay
            await self._catch_up(self.next_seq)
        else:
            batch = self._decode(payload)
            if batch.ts <= self.last_ts:
                return  # a batch a replay already applied, arriving live late
            # Numbers went down but time went up: the daemon restarted (a new stream from 0, which
            # begins with AllBlocksCleared and a snapshot).
            self.restarts += 1
            log.info("host %s: its daemon restarted (KV event sequence back to %d)", self.name, seq,
                     extra={"event": "router_host_restarted", "host": self.name})
            self.index.clear()
            self.next_seq = 0
            self.last_ts = 0.0
            if seq == 0:
                self._apply(seq, batch)
            else:
                await self._catch_up(0)

    def _apply(self, seq: int, batch: object) -> None:
        self.index.stale = False  # the stream is back: what it says holds again
        self.index.apply(batch.events)  # type: ignore[attr-defined]
        self.next_seq = seq + 1
        self.batches += 1
        self.last_ts = max(self.last_ts, batch.ts)  # type: ignore[attr-defined]
        self.lag = max(0.0, time.time() - batch.ts)  # type: ignore[attr-defined]

    async def _catch_up(self, start: int) -> None:
        """Replay from ``start``; if that leaves a hole, forget what we knew."""
        if not self.replay_endpoint:
            if start > 0:
                self._hole(start)
            return
        self.replays += 1
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        first_seen: int | None = None
        try:
            await req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await req.poll(int(self.replay_timeout * 1000)):
                    log.warning("host %s: no KV event replay answer in %.0f s", self.name, self.replay_timeout,
                                extra={"event": "router_replay_timeout", "host": self.name})
                    break
                frames = await req.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if first_seen is None:
                    first_seen = seq
                    if seq > self.next_seq:  # the buffer starts after what we need: a hole
                        self._hole(self.next_seq)
                        self.next_seq = seq
                if seq == self.next_seq:
                    self._apply(seq, self._decode(frames[3]))
        finally:
            req.close(0)

    def _hole(self, missing: int) -> None:
        self.holes += 1
        log.warning("host %s: KV events from %d are lost; forgetting its chunks until it reports them again",
                    self.name, missing, extra={"event": "router_events_hole", "host": self.name})
        self.index.clear()
