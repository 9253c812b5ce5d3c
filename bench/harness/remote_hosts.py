"""Hosts sharing a remote tier, and the load on them: what the cross-host tests
(tests/test_remote_daemons.py, tests/test_remote_deadline.py) and bench/cross_host.py (the same
failures at full length, measured) run.

* Two real daemons ("host A" and "host B": own sockets, state dirs and pools, one hash key file)
  on a Redis Cluster, and :class:`Load`: each puts prompts of its own and acquires the other's,
  every byte checked; :func:`reshard`, :func:`settle` and :func:`node_id` move slots under it.
* In-process :class:`~kvcached.store.Store` hosts on a remote with a short deadline
  (:func:`host`, :data:`TIMEOUT`), :func:`wait_hit`, and a :func:`silent_listener` (a TCP port
  that accepts and never answers).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.harness.layouts import DAEMON_LAYOUT as LAYOUT
from bench.harness.layouts import TINY
from bench.harness.redis_servers import RedisCluster, RedisServer, cli, free_ports
from kvcached.config import StoreConfig
from kvcached.store import Store
from kvcached.contract.record import HEADER_SIZE
from kvcached.tiers.remote_redis import RemoteConfig
from kvcached_client import Client

CT = LAYOUT.chunk_tokens
CHUNKS = 4  # per prompt


def chunk(owner: str, k: int, pos: int) -> bytes:
    """The one right payload of chunk ``pos`` of prompt ``k`` of host ``owner`` (so a wrong one shows)."""
    seed = hashlib.blake2b(f"{owner}:{k}:{pos}".encode(), digest_size=32).digest()
    return (seed * (LAYOUT.chunk_bytes // len(seed) + 1))[: LAYOUT.chunk_bytes]


def tokens(owner: str, k: int) -> list[int]:
    base = (1 if owner == "a" else 2) * 10_000_000 + k * 1000
    return [base + i for i in range(CHUNKS * CT)]


def read(lease) -> list[bytes]:
    return [lease.chunk(i).contiguous().numpy().tobytes() for i in range(len(lease))]


def remote(c: Client) -> dict:
    return c.stats()["remote"]


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Load:
    """One client per host, each in its own thread, in a loop: put a new prompt of its own, then
    acquire the other host's newest prompts and check every byte it is served. Counts client
    errors (any exception), corrupt chunks, and cross-host hits over time."""

    def __init__(self, sockets: dict[str, str]) -> None:
        self.sockets = sockets
        self.errors: list[str] = []
        self.corrupt = 0
        self.newest = {name: -1 for name in sockets}  # the newest prompt each host has put
        self.cross_hits: list[tuple[float, int]] = []  # (time, chunks) served to the other host
        self.requests = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in sockets]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def check(self, owner: str, k: int, got: list[bytes]) -> None:
        """Count what prompt ``k`` of ``owner`` was served: corrupt unless every byte is right."""
        if got != [chunk(owner, k, i) for i in range(len(got))]:
            self.corrupt += 1
        if got:
            self.cross_hits.append((time.monotonic(), len(got)))

    def fetch(self, c: Client, owner: str, k: int) -> list[bytes]:
        """Acquire prompt ``k`` of ``owner``: the bytes served (none on a miss)."""
        with c.acquire(LAYOUT, tokens(owner, k)) as lease:
            return read(lease)

    def hits_since(self, t0: float) -> int:
        return sum(n for t, n in list(self.cross_hits) if t >= t0)

    def _run(self, me: str) -> None:
        other = next(n for n in self.sockets if n != me)
        k = 0
        with Client(self.sockets[me], timeout=30) as c:
            while not self._stop.is_set():
                try:
                    c.put_bytes(LAYOUT, tokens(me, k), [chunk(me, k, i) for i in range(CHUNKS)])
                    self.newest[me] = k
                    k += 1
                    j = self.newest[other]
                    for back in range(3):  # the other host's newest prompts: remote hits, or misses
                        if j - back < 0:
                            break
                        self.check(other, j - back, self.fetch(c, other, j - back))
                    self.requests += 1
                except Exception as e:  # noqa: BLE001 - every client error is a test failure
                    self.errors.append(f"{me}: {type(e).__name__}: {e}")
                time.sleep(0.02)


def node_id(port: int) -> str:
    return cli(port, "cluster", "myid").strip()


def settle(port: int, timeout: float = 30.0) -> None:
    """Until every node agrees on the slot map (``redis-cli --cluster check`` passes): the next
    administrative step refuses to run before that ("Nodes don't agree about configuration")."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cli(port, "--cluster", "check", f"127.0.0.1:{port}")
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def add_primary(cluster: RedisCluster, extra: RedisServer, via: int, timeout: float = 30.0) -> None:
    """Join the empty cluster-mode node ``extra`` to ``cluster`` as a primary (through the node on
    port ``via``), and wait until every live node lists it as one: the new node's own
    ``cluster_state:ok`` comes first, and a reshard towards it run from a node that has not heard
    of it yet is refused ("not known or not a master")."""
    settle(via)
    cli(cluster.nodes[0].port, "--cluster", "add-node", f"127.0.0.1:{extra.port}", f"127.0.0.1:{via}")
    cluster.nodes.append(extra)
    wait_for(lambda: "cluster_state:ok" in cli(extra.port, "cluster", "info"), timeout, "the new node to join")
    new = node_id(extra.port)

    def known_everywhere() -> bool:  # CLUSTER NODES lines: "<id> <addr> <flags,...> ..."
        for n in cluster.live():
            line = next((x for x in cli(n.port, "cluster", "nodes").splitlines() if x.startswith(new)), "")
            if not line or "master" not in line.split()[2].split(","):
                return False
        return True

    wait_for(known_everywhere, timeout, "every node to know the new primary")


def reshard(cluster: RedisCluster, src: int, dst: int, slots: int) -> None:
    """Move ``slots`` hash slots from the primary on port ``src`` to the one on ``dst``, key by
    key (MIGRATING / IMPORTING, MIGRATE: clients meet ASK and then MOVED while it runs)."""
    settle(src)
    cli(cluster.nodes[0].port, "--cluster", "reshard", f"127.0.0.1:{src}", "--cluster-from", node_id(src),
        "--cluster-to", node_id(dst), "--cluster-slots", str(slots), "--cluster-yes", timeout=120)


# -- in-process hosts on a remote with a short deadline -------------------------------------------

TIMEOUT = 0.25
MARGIN = 0.05  # the bound's allowance for thread hand-offs on a loaded 2-core box


def host(tmp_path: Path, name: str, nodes: list[str], *, cluster: bool = False, key_from: str | None = None) -> Store:
    state = str(tmp_path / name)
    if key_from is not None:
        os.makedirs(state, exist_ok=True)
        shutil.copy(os.path.join(key_from, "hash.key"), os.path.join(state, "hash.key"))
    cfg = StoreConfig(state_dir=state, pool_bytes=TINY.chunk_bytes * 64,
                      nvme_bytes=(TINY.chunk_bytes + HEADER_SIZE) * 128, writeback=False,
                      remote=RemoteConfig(nodes=tuple(nodes), domain="d", cluster=cluster, timeout=TIMEOUT,
                                          breaker_failures=3, breaker_cooldown=0.5))
    return Store(cfg)


def wait_hit(store: Store, lid, toks, chunks: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        lease = store.acquire(lid, toks)
        matched = lease.matched_tokens
        store.release(lease.lease_id)
        if matched == chunks * TINY.chunk_tokens:
            return
        assert time.monotonic() < deadline, f"no remote hit within {timeout} s after the remote came back"
        time.sleep(0.1)


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a full queue, a black hole)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", free_ports(1)[0]))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                held.append(conn)  # kept open, never read or written
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        srv.close()
