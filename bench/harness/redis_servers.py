"""Real Redis servers for the remote-tier tests and benches, on free loopback ports in a temporary
directory, torn down afterwards; never the shared server on 6379: a standalone ``redis-server``. Or a Redis
Cluster of 3 primaries + 3 replicas (the reference deployment).

Each server runs with ``--save ""`` and no AOF (nothing is written to disk but its log and the
cluster's nodes file), and ``--protected-mode no`` on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from bench.harness.ports import free_ports

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
__all__ = ["REDIS_CLI", "REDIS_SERVER", "RedisCluster", "RedisServer", "cli", "free_ports", "missing", "redis_cpu_s"]


def missing() -> str | None:
    """Why the Redis servers cannot run here (redis-py, redis-server or redis-cli missing), or None."""
    try:
        import redis  # noqa: F401
    except ImportError:  # pragma: no cover - the bench extra has it
        return "redis-py missing: scripts/setup installs it with the bench extra"
    if not (REDIS_SERVER and REDIS_CLI):
        return "redis-server / redis-cli missing (Debian's redis-server package)"
    return None


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    port: int
    directory: str
    proc: subprocess.Popen | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "RedisServer":
        os.makedirs(self.directory, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_SERVER or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--dir", self.directory,
             "--logfile", os.path.join(self.directory, "redis.log"), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start:\n{self.log()[-2000:]}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log")) as f:
                return f.read()
        except OSError:
            return ""

    def freeze(self) -> None:
        """SIGSTOP: a frozen host (connections stay open, nothing answers)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (a crashed node)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()  # a frozen process would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def redis_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the Redis servers have used so far (their /proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def cli(port: int, *args: str, timeout: float = 30.0) -> str:
    r = subprocess.run([REDIS_CLI or "redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)}: {r.stdout}{r.stderr}")
    return r.stdout


@dataclass
class RedisCluster:
    """Six nodes on free ports: three primaries, each with one replica (``redis-cli --cluster
    create --cluster-replicas 1``), ``cluster-node-timeout`` 2 s so a killed primary fails over
    within seconds."""

    directory: str
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def start(self, size: int = 6, timeout: float = 90.0) -> "RedisCluster":
        try:
            for p in free_ports(size):
                node = RedisServer(p, os.path.join(self.directory, str(p)),
                                   extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                          "--cluster-node-timeout", "2000"])
                self.nodes.append(node.start())
            cli(self.nodes[0].port, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas", "1", "--cluster-yes", timeout=timeout)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 90.0, primaries: int = 3) -> None:
        """Until every live node reports cluster_state:ok, ``primaries`` primaries hold the slots,
        and every primary that has a live replica has it attached and in sync: only then can a
        replica take over when its primary dies."""
        deadline = time.monotonic() + timeout
        while True:
            if self._ready(primaries):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become ready:\n"
                                   + "\n".join(n.log()[-1500:] for n in self.live()))
            time.sleep(0.2)

    def _ready(self, primaries: int) -> bool:
        try:
            live = self.live()
            if not all("cluster_state:ok" in cli(n.port, "cluster", "info") for n in live):
                return False
            roles = [cli(n.port, "info", "replication") for n in live]
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        masters = [r for r in roles if "role:master" in r]
        replicas = [r for r in roles if "role:slave" in r]
        return (len(masters) == primaries and all("master_link_status:up" in r for r in replicas)
                and sum(int(r.split("connected_slaves:")[1].split()[0]) for r in masters) == len(replicas))

    def primaries(self) -> list[RedisServer]:
        """The live nodes that are primaries now (after a failover, a former replica is one)."""
        out = []
        for n in self.live():
            try:
                if "role:master" in cli(n.port, "info", "replication"):
                    out.append(n)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        return out

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
