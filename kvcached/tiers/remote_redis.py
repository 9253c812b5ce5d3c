"""The remote tier: chunks shared by every host of a trust domain, in Redis (Cluster or one node).

This module is the tier's data path only (issue 17 wires it under NVMe): probe how many leading
chunks of a prompt the remote holds, fetch and verify them, publish chunks. It knows nothing of
the index or of when chunks should go there.

* One key and one value per chunk (:mod:`kvcached.contract.remote_format`), every key with a TTL
  (``ttl``) so that Redis's ``volatile-*`` eviction policies can make room.
* A probe or a fetch is one pipelined round trip per node: chained hashes give every key of a
  prompt up front, grouped by the node that owns their slot (redis-py keeps the slot map).
* **Fetches read values in place** (``fetch_into``, the default ``direct`` reader): this
  module's own connections (:mod:`kvcached.tiers.resp`) read each value with ``recv_into``
  straight into its destination (the Store's reserved pool slot), every node at once on its
  own thread, and verify it there. redis-py's reader parsed each value into a new object under
  the GIL and the Store copied it again: one core, 0.59-0.83 GB/s end to end; the direct
  reader measured 1.94-2.05x that in the same runs and 2.1x the bytes per CPU-second
  (bench/remote_tier.py). A slot in
  migration (``MOVED``/``ASK``) is read through redis-py, which follows it. TLS uses redis-py's
  reader (``RemoteRedisTier.direct`` is then False).
* **Fail-open.** Nothing here raises a Redis error to its caller: an unreachable, slow or
  failing-over Redis is a miss (``probe`` 0, ``fetch`` nothing, ``publish`` False), counted in
  ``stats`` and logged. After ``breaker_failures`` failures in a row the breaker opens and the
  tier stops calling Redis for ``breaker_cooldown`` seconds; then one call is let through
  (half-open) and success closes it again.
* **A hard deadline.** ``timeout`` bounds each round trip however redis-py spends it: every
  call runs on one of a few I/O threads and its caller waits at most ``timeout`` × the round
  trips it needs. redis-py's socket
  timeout alone does not bound a call: after one, a cluster client re-reads the slot map from
  its startup nodes, each waiting the full timeout (measured: acquires of 2.0-3.5 s with a
  0.25 s timeout while every node was frozen). A call past its deadline counts as a failure
  for the breaker (a frozen cluster opens it as a refusing one does); its thread finishes, or
  times out, on its own, and its result is dropped. When every I/O thread is still busy with
  such calls, a new call is a miss at once (``skipped_busy``) instead of queueing behind them.
* A value is served only after :func:`kvcached.contract.remote_format.decode` accepts it (MAC,
  header, length, checksum); a refused value is counted by reason, logged, and ends the fetch
  there (a chunk is only usable with its whole prefix).

Thread-safety: the redis-py clients are thread-safe (a connection pool); the direct reader's
idle connections, the counters and the breaker are guarded by one small lock. Calls block (up to
their deadline): callers run them off the event loop. A direct fetch abandoned at its deadline
is stopped (its sockets shut down, its threads waited for) before ``fetch_into`` returns, so its
caller can free the destinations at once (:class:`_Stop`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union, cast

from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta
from kvcached.contract.record import HEADER_SIZE
from kvcached.contract.remote_format import (MAC_BYTES, RemoteValueRefused, decode, encode, remote_key, value_size,
                                             verify_parts)
from kvcached.tiers.resp import ErrorReply, RespConnection

log = logging.getLogger("kvcached.remote")

if TYPE_CHECKING:  # redis is the remote extra: only a daemon with a remote tier imports it
    import redis
    import redis.cluster

#: What :func:`_make_client` builds: one Redis, or a Redis Cluster (redis-py, typed).
RedisClient = Union["redis.Redis", "redis.cluster.RedisCluster"]


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote tier is and how it behaves. ``nodes`` are ``host:port`` strings: one for a
    single Redis, several (any subset of the cluster's) with ``cluster``."""

    nodes: tuple[str, ...]
    domain: str
    cluster: bool = False
    username: str | None = None
    password: str | None = None
    ttl: float = 3600.0
    timeout: float = 0.5
    breaker_failures: int = 3
    breaker_cooldown: float = 5.0
    ssl: bool = False
    ssl_ca_certs: str | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("the remote tier needs at least one Redis node (host:port)")
        for n in self.nodes:
            host, _, port = n.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a remote node is host:port, not {n!r}")
        if self.ttl <= 0 or self.timeout <= 0 or self.breaker_cooldown < 0 or self.breaker_failures < 1:
            raise ValueError("remote ttl and timeout must be positive, the breaker's failures >= 1")


@dataclass
class RemoteStats:
    hits: int = 0  # chunks fetched and verified
    misses: int = 0  # chunks looked for and not there (or not usable)
    bytes_fetched: int = 0
    bytes_published: int = 0
    published: int = 0
    errors: int = 0  # calls that failed (connection, timeout, cluster down), deadlines missed included
    deadline_missed: int = 0  # calls abandoned at their deadline (their thread still inside redis-py)
    skipped_busy: int = 0  # calls not made: every I/O thread was still in an abandoned call
    skipped_open: int = 0  # calls not made because the breaker was open
    refused: dict[str, int] = field(default_factory=dict)  # values not served, by reason
    breaker_opened: int = 0
    demoted: int = 0  # chunks sent when they left this host's last local tier
    refreshed: int = 0  # chunks leaving it that the remote already held: only their TTL renewed


class Breaker:
    """Closed -> (``failures`` in a row) -> open for ``cooldown`` s -> half-open: one trial call."""

    def __init__(self, failures: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.cooldown = cooldown
        self._clock = clock
        self._row = 0
        self._opened_at: float | None = None
        self._trial = False

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half_open" if self._clock() - self._opened_at >= self.cooldown else "open"

    def allow(self) -> bool:
        """Whether a call may go out now (in half-open, only one at a time)."""
        if self._opened_at is None:
            return True
        if self._clock() - self._opened_at < self.cooldown or self._trial:
            return False
        self._trial = True
        return True

    def success(self) -> None:
        self._row = 0
        self._opened_at = None
        self._trial = False

    def cancel(self) -> None:
        """The call :meth:`allow` let out never went out (no I/O thread was free): if it was the
        half-open trial, let the next call be it. Without this a trial that found every thread
        still stuck in calls abandoned during a long freeze held the breaker half-open for good."""
        self._trial = False

    def failure(self) -> bool:
        """Count a failure; True if this opened the breaker."""
        self._row += 1
        reopened = self._opened_at is not None and self._trial
        self._trial = False
        if reopened or (self._opened_at is None and self._row >= self.failures):
            self._opened_at = self._clock()
            return True
        return False


class RemoteRedisTier:
    def __init__(self, config: RemoteConfig, mac_key: bytes, *, clock: Callable[[], float] = time.monotonic,
                 client: RedisClient | None = None, reader: str = "direct") -> None:
        """``reader``: how fetches read values. ``direct`` (the default): this module's own sockets
        (:mod:`kvcached.tiers.resp`), each value read straight into its destination; redis-py
        still keeps the cluster's slot map and serves redirections. ``redis-py``: its pipelines,
        each value parsed into a new object, then copied (the reader before; TLS always uses it)."""
        if reader not in ("direct", "redis-py"):
            raise ValueError(f"reader is direct or redis-py, not {reader!r}")
        self.config = config
        #: Whether fetches read values straight into their destinations (see ``fetch_into``).
        self.direct = reader == "direct" and not config.ssl
        self._idle: dict[tuple[str, int], list[RespConnection]] = {}  # direct reader's connections, by node
        self._key = mac_key
        self._lock = threading.Lock()
        self.stats = RemoteStats()
        self.breaker = Breaker(config.breaker_failures, config.breaker_cooldown, clock)
        self._client = client  # made on first use: a cluster client connects when made, and may fail
        self._connecting = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="kvcached-remote")
        self._io_free = threading.BoundedSemaphore(IO_THREADS)
        self._readers = ThreadPoolExecutor(max_workers=NODE_READERS, thread_name_prefix="kvcached-remote-read")

    def close(self) -> None:
        self._io.shutdown(wait=False)
        self._readers.shutdown(wait=False)
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise
            pass

    def available(self) -> bool:
        """False while the breaker is open (a call now would be skipped)."""
        with self._lock:
            return self.breaker.state != "open"

    # -- the data path ---------------------------------------------------------------------------

    def probe(self, layout_id: LayoutId, hashes: Sequence[ChunkHash]) -> int:
        """How many leading chunks of ``hashes`` the remote holds (0 when it cannot tell)."""
        if not hashes:
            return 0
        found = self._pipelined("probe", lambda p: [p.exists(self._name(layout_id, h)) for h in hashes])
        if found is None:
            return 0
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def fetch(self, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int) -> list[memoryview]:
        """The verified payloads of the leading chunks of ``hashes`` the remote holds, in order;
        stops at the first one missing or refused. Returns within ``timeout`` (one round trip)."""
        if not self.direct:
            return self._fetch_parsed(layout_id, hashes, chunk_bytes)
        bufs: dict[int, memoryview] = {}

        def dest(i: int) -> memoryview:
            bufs[i] = memoryview(bytearray(chunk_bytes))
            return bufs[i]

        return [bufs[i] for i in range(self.fetch_into(layout_id, hashes, chunk_bytes, dest))]

    def fetch_into(self, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int,
                   dest: Callable[[int], memoryview | None]) -> int:
        """Like :meth:`fetch`, but chunk ``i``'s payload is written into ``dest(i)``: the number of
        leading chunks of ``hashes`` now there, verified. Returns within ``timeout``.

        Ownership: ``dest`` is called (on a remote I/O thread) once for each chunk the remote
        holds, in no particular order, just before its bytes arrive; it returns where they go,
        ``chunk_bytes`` long, or None to take no more chunks from that one on. A destination
        past the returned count holds garbage. When this returns, nothing writes into any
        destination any more, also after a deadline: the call's sockets are shut down and its
        thread waited for (see :class:`_Stop`), so the caller may free or reuse them at once."""
        if not hashes:
            return 0
        if not self.direct:
            payloads = self._fetch_parsed(layout_id, hashes, chunk_bytes)
            for i, p in enumerate(payloads):
                d = dest(i)
                if d is None:
                    return i
                d[:] = p
            return len(payloads)
        stop = _Stop()
        got = self._call("fetch", lambda client: self._read_direct(client, layout_id, hashes, chunk_bytes, dest, stop),
                         stop=stop)
        n = 0 if got is None else got[0]
        with self._lock:
            self.stats.hits += n
            self.stats.misses += len(hashes) - n
            self.stats.bytes_fetched += n * chunk_bytes
        return n

    def _fetch_parsed(self, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int) -> list[memoryview]:
        """:meth:`fetch` through redis-py: each value parsed into an object, then verified."""
        if not hashes:
            return []
        names = [self._name(layout_id, h) for h in hashes]
        values = self._pipelined("fetch", lambda p: [p.get(n) for n in names])
        out = [] if values is None else self._leading_decoded(values, hashes, layout_id, chunk_bytes)
        with self._lock:
            self.stats.hits += len(out)
            self.stats.misses += len(hashes) - len(out)
            self.stats.bytes_fetched += sum(len(p) for p in out)
        return out

    def _leading_decoded(self, values: Sequence[bytes | None], hashes: Sequence[ChunkHash], layout_id: LayoutId,
                         chunk_bytes: int) -> list[memoryview]:
        """The verified payloads of the leading values redis-py returned (views into them); stops
        at the first one missing or refused (counted and logged)."""
        out: list[memoryview] = []
        for h, v in zip(hashes, values):
            if v is None:
                break
            try:
                out.append(decode(v, h, layout_id, self._key, chunk_bytes))
            except RemoteValueRefused as e:
                self._refused(h, e)
                break
        return out

    def _refused(self, h: ChunkHash, e: RemoteValueRefused) -> None:
        with self._lock:
            self.stats.refused[e.reason] = self.stats.refused.get(e.reason, 0) + 1
        log.warning("remote chunk %s refused: %s", h.hex()[:16], e,
                    extra={"event": "remote_refused", "reason": e.reason})

    def _read_direct(self, client: RedisClient, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int,
                     dest: Callable[[int], memoryview | None], stop: _Stop) -> list[int]:
        """The direct reader's fetch, on an I/O thread: ``[n]``, the leading chunks verified.

        One pipeline per node that owns some of the keys (redis-py's slot map says which), all
        sent before any is read, then every node read at once (this thread and a helper per
        further node: socket reads and BLAKE3 release the GIL); each value lands in ``dest(i)``
        and is verified there. Keys a node redirects (a slot migrating) are asked again through
        redis-py, which follows the redirection and refreshes its map. Connections are made
        before the writing starts, so that :meth:`_Stop.stop` never waits for a connect."""
        names = [self._name(layout_id, h).encode() for h in hashes]
        by_node: dict[tuple[str, int], list[int]] = {}
        for i, name in enumerate(names):
            by_node.setdefault(self._node_of(client, name), []).append(i)
        conns = {addr: self._connection(addr) for addr in by_node}
        fill = _Fill(self, layout_id, hashes, chunk_bytes, dest, stop)
        clean = False
        if not stop.begin(conns.values()):
            for c in conns.values():
                c.close()
            raise DeadlineMissed("abandoned before it started")
        try:
            for addr, idx in by_node.items():
                conns[addr].send_many([names[i] for i in idx])
            work = [(conns[addr], idx) for addr, idx in by_node.items()]
            helpers = [self._readers.submit(fill.read_node, c, idx) for c, idx in work[1:]]
            failed: list[BaseException] = []
            try:
                fill.read_node(*work[0])
            except BaseException as e:  # noqa: BLE001 - raised below, once every helper is done
                failed.append(e)
            for f in helpers:  # each ends: its pipeline read to the end, or its socket shut by stop()
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001
                    failed.append(e)
            if failed:
                raise failed[0]
            clean = True
        finally:
            stop.end()
            for addr, c in conns.items():
                if clean:
                    self._release(addr, c)
                else:
                    c.close()
        n = fill.leading()
        if n < len(hashes) and isinstance(fill.replies.get(n), ErrorReply):
            err = fill.replies[n]
            assert isinstance(err, ErrorReply)
            if not err.redirect:
                raise RemoteReplyError(f"Redis answered a GET with: {err.message}")
            n += self._redirected(layout_id, hashes, n, chunk_bytes, dest, stop)
        return [n]

    def _redirected(self, layout_id: LayoutId, hashes: Sequence[ChunkHash], start: int, chunk_bytes: int,
                    dest: Callable[[int], memoryview | None], stop: _Stop) -> int:
        """Chunks ``start..`` again through redis-py (a slot in migration: MOVED / ASK), copied into
        their destinations; how many of them arrived, verified."""
        values = self._connected().pipeline(transaction=False)
        for h in hashes[start:]:
            values.get(self._name(layout_id, h))
        payloads = self._leading_decoded(values.execute(), hashes[start:], layout_id, chunk_bytes)
        if not stop.begin(()):
            raise DeadlineMissed("abandoned while redis-py followed a redirection")
        try:
            for j, payload in enumerate(payloads):
                stop.local_begin()
                try:
                    d = dest(start + j)
                finally:
                    stop.local_end()
                if d is None:
                    return j
                d[:] = payload
            return len(payloads)
        finally:
            stop.end()

    def _node_of(self, client: RedisClient, name: bytes) -> tuple[str, int]:
        if not self.config.cluster:
            host, _, port = self.config.nodes[0].rpartition(":")
            return host, int(port)
        node = cast("redis.cluster.RedisCluster", client).get_node_from_key(name)  # cluster config: a cluster client
        return node.host, int(node.port)

    def _connection(self, addr: tuple[str, int]) -> RespConnection:
        with self._lock:
            idle = self._idle.get(addr)
            if idle:
                return idle.pop()
        return RespConnection(addr[0], addr[1], timeout=self.config.timeout, username=self.config.username,
                              password=self.config.password)

    def _release(self, addr: tuple[str, int], conn: RespConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(addr, [])
            if len(idle) < IO_THREADS:
                idle.append(conn)
                return
        conn.close()

    def publish(self, chunks: Sequence[tuple[ChunkMeta, bytes | memoryview]]) -> bool:
        """Store ``chunks`` (meta, payload), each with the TTL; False if Redis could not be reached."""
        if not chunks:
            return True
        sent = self._set_many("publish", [(self._name(m.layout_id, m.chunk_hash), m, p) for m, p in chunks])
        if sent is None:
            return False
        with self._lock:
            self.stats.published += sent
        return True

    def demote(self, chunks: Sequence[tuple[ChunkMeta, bytes | memoryview]]) -> bool:
        """Make sure the remote holds ``chunks``, which are leaving this host's last local tier:
        one round trip renews the TTL of those it already has (``EXPIRE``, no payload sent),
        a second sends only the others. False if Redis could not be reached."""
        if not chunks:
            return True
        ttl = max(1, int(self.config.ttl))
        names = [self._name(m.layout_id, m.chunk_hash) for m, _ in chunks]
        held = self._pipelined("demote", lambda p: [p.expire(k, ttl) for k in names])
        if held is None:
            return False
        todo = [(k, m, payload) for k, (m, payload), h in zip(names, chunks, held) if not h]
        with self._lock:
            self.stats.refreshed += len(chunks) - len(todo)
        if not todo:
            return True
        sent = self._set_many("demote", todo)
        if sent is None:
            return False
        with self._lock:
            self.stats.demoted += sent
        return True

    def _set_many(self, what: str, items: Sequence[tuple[str, ChunkMeta, bytes | memoryview]]) -> int | None:
        """SET each (key, meta, payload) as an encoded value with the TTL; the number sent, or None."""
        ttl = max(1, int(self.config.ttl))
        values = [(k, encode(m, payload, self._key)) for k, m, payload in items]
        # A batch of large chunks is several windows' worth of bytes: its bound grows with them.
        rounds = 1 + sum(len(v) for _, v in values) // ROUND_TRIP_BYTES
        if self._pipelined(what, lambda p: [p.set(k, v, ex=ttl) for k, v in values], rounds=rounds) is None:
            return None
        with self._lock:
            self.stats.bytes_published += sum(len(v) for _, v in values)
        return len(values)

    # -- troubleshooting -------------------------------------------------------------------------

    def doctor(self) -> dict[str, Any]:
        """Facts for ``kvcachectl doctor``: is the remote reachable, does the ACL keep this domain
        to its prefix, and will Redis make room by itself (its maxmemory policy). Each probe is one
        command bounded by ``timeout``, past the breaker; nothing here raises."""
        import redis

        domain = self.config.domain
        facts: dict[str, Any] = {"nodes": list(self.config.nodes), "cluster": self.config.cluster,
                                 "username": self.config.username, "breaker_state": self.breaker.state,
                                 "errors": self.stats.errors, "refused": dict(self.stats.refused)}
        try:
            c = self._connected()
            t0 = time.perf_counter()
            c.ping()
            facts["rtt_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - unreachable is a verdict, not an error
            facts.update(reachable=False, error=f"{type(e).__name__}: {e}")
            return facts
        facts["reachable"] = True
        probe = f"doctor:{os.getpid()}:{time.monotonic_ns()}"
        try:  # the domain's own prefix: must be writable (publishing needs it)
            c.set(f"kvc:{domain}:{probe}", b"1", ex=5)
            facts["own_prefix_writable"] = True
        except redis.exceptions.NoPermissionError:
            facts["own_prefix_writable"] = False
        except Exception as e:  # noqa: BLE001
            facts["own_prefix_writable"], facts["error"] = False, f"{type(e).__name__}: {e}"
        try:  # just outside it (the prefix kvc:<domain>:* does not match kvc:<domain>~...): must be refused
            c.set(f"kvc:{domain}~{probe}", b"1", ex=5)
            facts["foreign_prefix_writable"] = True
        except redis.exceptions.NoPermissionError:
            facts["foreign_prefix_writable"] = False
        except Exception:  # noqa: BLE001
            facts["foreign_prefix_writable"] = None
        try:
            info = c.info("memory")
            per_node = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
            facts["maxmemory"] = [int(n.get("maxmemory", 0)) for n in per_node]
            facts["maxmemory_policy"] = sorted({str(n.get("maxmemory_policy", "")) for n in per_node})
        except redis.exceptions.NoPermissionError:
            facts["maxmemory_policy"] = None  # this ACL user may not run INFO
        except Exception:  # noqa: BLE001
            facts["maxmemory_policy"] = None
        return facts

    # -- internals -----------------------------------------------------------------------------

    def _connected(self) -> RedisClient:
        """The redis-py client, made on first use (one, however many threads ask at once)."""
        client = self._client
        if client is None:
            with self._connecting:
                client = self._client
                if client is None:
                    client = self._client = _make_client(self.config)
        return client

    def _name(self, layout_id: LayoutId, h: ChunkHash) -> str:
        return remote_key(self.config.domain, layout_id, h)

    def _pipelined(self, what: str, queue: Callable[[Any], object], *, rounds: int = 1) -> list[Any] | None:
        """Run the commands ``queue`` adds to a pipeline (one round trip: redis-py's cluster
        pipeline writes to every node, then reads every node); None (counted, logged) on any
        failure or past ``timeout`` × ``rounds``."""
        def run(client: RedisClient) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            queue(pipe)
            return pipe.execute()

        return self._call(what, run, rounds=rounds)

    def _bounded(self, op: Callable[[RedisClient], list[Any]], rounds: int, stop: _Stop | None = None) -> list[Any]:
        """``op(client)`` on an I/O thread, waited for ``timeout`` × ``rounds``; raises
        :class:`DeadlineMissed` past it (after ``stop.stop()``: the call writes nothing any more),
        :class:`IOBusy` when no thread is free. The time the call spends in its caller's
        ``dest`` (a local reservation, which may wait for room) is not Redis's: the deadline
        moves on by it (``stop.local_seconds()``)."""
        if not self._io_free.acquire(blocking=False):
            raise IOBusy("every remote I/O thread is still in an abandoned call")

        def run() -> list[Any]:
            try:
                return op(self._connected())  # connecting (a cluster's slot map) is inside the bound
            finally:
                self._io_free.release()

        try:
            future = self._io.submit(run)
        except RuntimeError:  # shut down (closing)
            self._io_free.release()
            raise IOBusy("the remote tier is closing") from None
        wait = self.config.timeout * max(1, rounds)
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic() + (stop.local_seconds() if stop is not None else 0.0)
            if left <= 0:
                break
            try:
                return future.result(timeout=left)
            except FutureTimeout:
                pass  # past the deadline, unless the call was in local work meanwhile: look again
        if stop is not None:
            stop.stop()
        raise DeadlineMissed(f"no answer within {wait:.3f} s (the remote timeout x {rounds} round trip(s))")

    def _call(self, what: str, op: Callable[[RedisClient], list[Any]], *, rounds: int = 1,
              stop: _Stop | None = None) -> list[Any] | None:
        """``op(client)``, past the breaker, within its deadline; None (counted, logged) on any failure."""
        with self._lock:
            if not self.breaker.allow():
                self.stats.skipped_open += 1
                return None
        try:
            result = self._bounded(op, rounds, stop)
        except IOBusy:
            with self._lock:
                self.stats.skipped_busy += 1
                self.breaker.cancel()
            return None
        except Exception as e:  # noqa: BLE001 - fail-open: any Redis trouble is a miss
            stale = None
            with self._lock:
                self.stats.errors += 1
                self.stats.deadline_missed += isinstance(e, DeadlineMissed)
                opened = self.breaker.failure()
                if opened:
                    self.stats.breaker_opened += 1
                    stale, self._client = self._client, None
            if stale is not None:
                # The half-open trial starts from a fresh client made from the configured nodes:
                # a cluster client drops the nodes it could not reach from its startup list, so
                # after the whole cluster was down it could otherwise never find it again.
                try:
                    stale.close()
                except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                    pass
            # str(e), not e: a log record that kept the exception would keep its traceback's
            # frames, and with them the pool views a publish was sending.
            log.warning("remote %s failed: %s: %s%s", what, type(e).__name__, str(e),
                        "; the breaker is open" if opened else "",
                        extra={"event": "remote_error", "op": what})
            del e
            return None
        with self._lock:
            self.breaker.success()
        return result


#: The bytes one round trip carries within ``timeout`` (a fetch window is this size; a larger
#: publish batch gets one more ``timeout`` per this many bytes).
ROUND_TRIP_BYTES = 64 << 20

#: Threads that run remote calls: enough for the publisher, the demotions and a few acquires at
#: once; more would only pile up behind a frozen Redis.
IO_THREADS = 4

#: Threads that read a direct fetch's further nodes while its I/O thread reads the first.
NODE_READERS = 2 * IO_THREADS


class _Stop:
    """How a direct fetch abandoned at its deadline is stopped before its caller frees the buffers
    it was writing into (pool slots another chunk may get next).

    The call brackets everything that writes into a destination with :meth:`begin` / :meth:`end`.
    The caller's :meth:`stop` shuts the call's sockets down, so a read blocked on a frozen Redis
    returns at once, and waits until the call is out of its bracket; a call not yet in it never
    enters (``begin`` answers False). The wait is short: the bracket holds no connect and no
    redis-py call, only reads of sockets that are now shut, copies, hashing and ``dest`` calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stopped = False
        self._conns: list[RespConnection] = []
        self._outside = threading.Event()
        self._outside.set()
        self._local_total = 0.0  # seconds spent in the caller's dest() so far
        self._local_since: float | None = None  # when the dest() call now running began

    def local_begin(self) -> None:
        self._local_since = time.monotonic()

    def local_end(self) -> None:
        since, self._local_since = self._local_since, None
        if since is not None:
            self._local_total += time.monotonic() - since

    def local_seconds(self) -> float:
        """Time spent in the caller's own work so far, the call in progress included."""
        since = self._local_since
        return self._local_total + (time.monotonic() - since if since is not None else 0.0)

    def begin(self, conns: Iterable[RespConnection]) -> bool:
        with self._lock:
            if self.stopped:
                return False
            self._conns.extend(conns)
            self._outside.clear()
            return True

    def end(self) -> None:
        self._outside.set()

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            conns = list(self._conns)
        for c in conns:
            c.shutdown()
        self._outside.wait()


class _Fill:
    """One direct fetch's state, shared by the threads that read its nodes: which chunks arrived
    verified, the first one known to be unusable (no destination is asked for past it), each
    key's reply. ``dest`` is called under a lock: one call at a time, whichever thread asks."""

    def __init__(self, tier: RemoteRedisTier, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int,
                 dest: Callable[[int], memoryview | None], stop: _Stop) -> None:
        self.tier, self.layout_id, self.hashes, self.chunk_bytes = tier, layout_id, hashes, chunk_bytes
        self.dest, self.stop = dest, stop
        self.ok = [False] * len(hashes)
        self.refused: dict[int, RemoteValueRefused] = {}  # counted by leading(): only the one that ends the prefix
        self.replies: dict[int, int | ErrorReply | None] = {}
        self._limit = len(hashes)
        self._lock = threading.Lock()

    def read_node(self, conn: RespConnection, idx: list[int]) -> None:
        """Read one node's replies (to the GETs of chunks ``idx``, sent already)."""
        header, tag = memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(MAC_BYTES))
        vsize = value_size(self.chunk_bytes)
        h, lid, key = self.hashes, self.layout_id, self.tier._key

        def sink(j: int, n: int, conn: RespConnection) -> None:
            i = idx[j]
            d = self._dest(i)
            if d is None:
                conn.skip(n)
                return
            if n == vsize:
                conn.read_into(header)
                conn.read_into(d)
                conn.read_into(tag)
                self.ok[i] = self._verified(i, lambda: verify_parts(header, d, tag, h[i], lid, key))
            else:  # another size: the whole value, checked as the redis-py reader checks it
                value = memoryview(bytearray(n))
                conn.read_into(value)
                payload: list[memoryview] = []
                self.ok[i] = self._verified(i, lambda: payload.append(decode(value, h[i], lid, key, self.chunk_bytes)))
                if self.ok[i]:
                    d[:] = payload[0]
            if not self.ok[i]:
                self._unusable(i)

        for j, r in enumerate(conn.read_many(len(idx), sink)):
            self.replies[idx[j]] = r
            if r is None or isinstance(r, ErrorReply):
                self._unusable(idx[j])

    def leading(self) -> int:
        """How many leading chunks arrived verified. A refused value that ends them is counted
        and logged here, once: the nodes are read at once, so values past it may have been
        checked (and refused) too, and the redis-py reader would never have looked at those."""
        n = 0
        while n < len(self.ok) and self.ok[n]:
            n += 1
        refused = self.refused.get(n)
        if refused is not None:
            self.tier._refused(self.hashes[n], refused)
        return n

    def _verified(self, i: int, check: Callable[[], object]) -> bool:
        try:
            check()
        except RemoteValueRefused as e:
            self.refused[i] = e
            return False
        return True

    def _dest(self, i: int) -> memoryview | None:
        with self._lock:
            if i >= self._limit or self.stop.stopped:
                return None
            self.stop.local_begin()
            try:
                d = self.dest(i)
            finally:
                self.stop.local_end()
            if d is None:
                self._limit = min(self._limit, i)
            return d

    def _unusable(self, i: int) -> None:
        with self._lock:
            self._limit = min(self._limit, i)


class RemoteReplyError(Exception):
    """Redis answered a fetch's GET with an error that no redirection explains (an ACL refusal)."""


class DeadlineMissed(Exception):
    """A remote call did not finish within its bound (counted as a failure)."""


class IOBusy(Exception):
    """Every remote I/O thread is still inside a call abandoned at its deadline."""


def _make_client(config: RemoteConfig) -> RedisClient:
    import redis  # the remote extra; only a daemon with a remote tier needs it
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries: redis-py's default retries a refused connection three times with a backoff
    # (3.2 s per call here with a 0.3 s timeout), which would stall every acquire while Redis is
    # down until the breaker opens. One attempt, bounded by ``timeout``, is a miss; a cluster
    # client re-reads the slot map on its next call after a failover.
    common: dict[str, Any] = dict(username=config.username, password=config.password,
                                  socket_timeout=config.timeout, socket_connect_timeout=config.timeout,
                                  retry=Retry(NoBackoff(), 0))
    if config.ssl:
        common.update(ssl=True, ssl_ca_certs=config.ssl_ca_certs)
    nodes = [(n.rpartition(":")[0], int(n.rpartition(":")[2])) for n in config.nodes]
    if config.cluster:
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **common)
    host, port = nodes[0]
    return redis.Redis(host=host, port=port, **common)
