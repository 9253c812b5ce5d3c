"""The KV event stream on the wire: ZMQ PUB, plus a ROUTER socket that replays, as vLLM does.

Wire format (the one ``vllm/distributed/kv_events.py`` speaks, so its subscribers, and the
routers built on them, read this stream unchanged):

* PUB frames ``[topic, sequence number (8 bytes, big-endian), msgpack(batch)]``; a batch is
  ``[ts, [events...], data_parallel_rank]`` (:mod:`kvcached.events`). Sequence numbers count
  batches from 0 with no gaps. While idle, an empty batch every ``heartbeat`` seconds lets
  subscribers notice a gap, a restart (numbers from 0 again) or lag without waiting for traffic.
* Replay: a DEALER/REQ sends the first sequence number it wants (8 bytes, big-endian) to the
  ROUTER endpoint and gets every buffered batch from there as ``[topic, seq, payload]``, then an
  end marker ``["", -1 (8 bytes, signed), ""]``. The last ``buffer_batches`` batches are kept.

One thread owns both sockets (ZMQ sockets are not thread-safe): it waits for the event log's
wake-up (or a replay request), takes what accumulated, and sends it as one batch of at most
``max_batch_events`` events. PUB never blocks: a subscriber that falls behind its high-water
mark loses messages, sees the gap in the sequence numbers and asks for a replay.

The stream carries prompt token ids, so it is off unless configured, and bound to an ``ipc://``
path or loopback TCP unless ``kv_events_allow_remote`` says otherwise.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from kvcached.contract.events import EventBatch, encoder
from kvcached.events import KvEventLog

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str  # e.g. "ipc:///run/kvcached/kv-events" or "tcp://127.0.0.1:5557"
    replay_endpoint: str = ""
    topic: str = ""
    buffer_batches: int = 10_000
    max_batch_events: int = 4096
    hwm: int = 100_000
    allow_remote: bool = False
    heartbeat: float = 2.0  # s: an empty batch when nothing else was sent (0: none)

    def __post_init__(self) -> None:
        for ep in (self.endpoint, self.replay_endpoint):
            if ep:
                check_endpoint(ep, self.allow_remote)
        if self.buffer_batches < 1 or self.max_batch_events < 1:
            raise ValueError("kv_events buffer_batches and max_batch_events must be >= 1")


def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    """An ``ipc://`` path, or ``tcp://`` on a loopback address unless ``allow_remote``."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc" and rest:
        return
    if scheme != "tcp" or ":" not in rest:
        raise ValueError(f"a KV event endpoint is ipc://PATH or tcp://HOST:PORT, not {endpoint!r}")
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise ValueError(f"refusing to publish KV events (they carry prompt token ids) on {endpoint}: use an ipc:// "
                         "path or loopback, or set kv_events_allow_remote = true on a trusted network")


class KvEventPublisher:
    def __init__(self, source: KvEventLog, config: KvEventsConfig, *, ctx: zmq.Context | None = None) -> None:
        self.source = source
        self.config = config
        self._ctx = ctx or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._encode = encoder().encode
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.next_seq = 0
        self._last_sent = time.monotonic()
        self.events_sent = 0
        self.replays = 0
        self.pub_endpoint = ""
        self.replay_endpoint = ""

    def start(self) -> "KvEventPublisher":
        """Bind the sockets (in the thread that will own them) and start publishing; raises if a
        socket cannot be bound."""
        self._thread = threading.Thread(target=self._run, name="kvcached-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Publish what is left, then close the sockets."""
        self._stop.set()
        self.source.wakeup.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.bind(self.config.endpoint)
            self.pub_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            replay = None
            if self.config.replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.config.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                stopping = self._stop.is_set()
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                self._publish_pending(pub)
                if stopping:
                    return
                if replay is not None:  # wait for either a replay request or new events
                    if not self.source.wakeup.is_set():
                        replay.poll(20)
                else:
                    self.source.wakeup.wait(min(0.5, self.config.heartbeat or 0.5))
        except Exception:  # noqa: BLE001 - a publisher bug must not take the daemon down
            log.exception("the KV event publisher stopped", extra={"event": "kv_events_error"})
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _publish_pending(self, pub: zmq.Socket) -> None:
        events = self.source.take()
        if not events:
            beat = self.config.heartbeat
            if beat <= 0 or time.monotonic() - self._last_sent < beat:
                return
            events = [None]  # type: ignore[list-item]  # one empty batch: lets subscribers see lag, gaps and restarts while idle
        step = self.config.max_batch_events
        for i in range(0, len(events), step):
            part = [e for e in events[i: i + step] if e is not None]
            payload = self._encode(EventBatch(time.time(), part, 0))
            seq = self.next_seq
            self.next_seq += 1
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.events_sent += len(part)
        self._last_sent = time.monotonic()

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed KV event replay request (%d frames)", len(frames),
                        extra={"event": "kv_events_replay_refused"})
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.replays += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
