"""A fleet of simulated hosts for the routing bench: N real kvcached daemons, N simhost.py servers.

Host K is a real ``kvcached serve`` process (its own Unix socket, state directory and small
host-memory pool; KV events published on ``ipc://<workdir>/hostK-events`` with replay on
``ipc://<workdir>/hostK-replay``) and one simhost.py process in front of it on a free loopback
port (the model simulated, the cache work real: see simhost.py). All daemons share one hash key
file (``kvcached.contract.keys.write_new_key``, what ``kvcachectl keygen`` writes), so the same prompt has
the same chunk hashes on every host, which a router that reads several hosts' events needs.

::

    with SimFleet(3, "/tmp/fleet", prefill_tps=20000) as fleet:
        fleet.write_config("/tmp/fleet/hosts.toml")        # for the router
        for h in fleet.hosts:
            h.url, h.daemon_socket, h.events_endpoint, h.replay_endpoint
        fleet.kill_daemon(1)                               # failure tests
        fleet.restart_daemon(1)

Teardown stops every process it started (SIGTERM, so daemons unlink their /dev/shm pool; a
daemon that had to be killed has its segments unlinked here), and checks that none is left.
``python bench/routing/fleet.py --hosts 3 --workdir /tmp/fleet`` runs one until Ctrl-C.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench.harness.daemon import BIN, POOL_LINE, pool_segments, remove_segments
from bench.routing.simhost import DEFAULT_MODEL, sim_layout
from bench.routing.tokenizer import build_tokenizer
from kvcached.contract.keys import KVLayout, write_new_key

HERE = os.path.dirname(os.path.abspath(__file__))

METRICS_LINE = re.compile(r"^  metrics: (http://\S+)")
SIMHOST_LINE = re.compile(r"^simhost \S+ listening on (http://\S+)")


@dataclass(frozen=True)
class HostDescriptor:
    """What a router needs to know about one host."""

    name: str
    url: str  # the simhost's base URL (POST {url}/v1/chat/completions)
    daemon_socket: str
    events_endpoint: str  # ZMQ PUB, vLLM's KV event wire format ("" when events are off)
    replay_endpoint: str  # ZMQ ROUTER replay
    hash_key_file: str
    domain: str
    layout: KVLayout
    metrics_url: str = ""  # the daemon's Prometheus endpoint

    def to_dict(self) -> dict:
        return {"name": self.name, "url": self.url, "daemon_socket": self.daemon_socket,
                "events_endpoint": self.events_endpoint, "replay_endpoint": self.replay_endpoint,
                "hash_key_file": self.hash_key_file, "domain": self.domain, "metrics_url": self.metrics_url,
                "layout": self.layout.to_dict()}


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Proc:
    """A child process whose output goes to a log file, with the lines matching ``patterns``
    captured (first match each) as it starts."""

    def __init__(self, name: str, argv: list[str], log_path: str, ready: re.Pattern, patterns: Sequence[re.Pattern],
                 env: dict | None = None, die_with_parent: bool = True) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        self.ready_re, self.patterns = ready, list(patterns)
        self.env = env
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.matches: dict[str, re.Match] = {}
        self.all_matches: dict[str, list[str]] = {}
        self.ready = threading.Event()
        self._pump: threading.Thread | None = None
        self.tail: list[str] = []

    def start(self) -> "_Proc":
        self.matches, self.all_matches, self.tail = {}, {}, []
        self.ready = threading.Event()
        log = open(self.log_path, "a")
        log.write(f"--- {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n")
        log.flush()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, preexec_fn=_die_with_parent if self.die_with_parent else None)
        proc, ready = self.proc, self.ready

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                self.tail = (self.tail + [line])[-50:]
                for p in self.patterns + [self.ready_re]:
                    m = p.match(line)
                    if m:
                        self.matches.setdefault(p.pattern, m)
                        self.all_matches.setdefault(p.pattern, []).append(m.group(1))
                if self.ready_re.match(line):
                    ready.set()
            proc.stdout.close()
            log.write(f"--- exit {proc.wait()}\n")
            log.close()

        self._pump = threading.Thread(target=pump, name=f"pump {self.name}", daemon=True)
        self._pump.start()
        return self

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before it was ready:\n"
                                   + "".join(self.tail))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in time:\n" + "".join(self.tail))

    def group(self, pattern: re.Pattern) -> str:
        m = self.matches.get(pattern.pattern)
        return m.group(1) if m else ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def send(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal it and wait; kills it if it does not exit in ``timeout``. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.send(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._pump is not None:
            self._pump.join(5)
        return self.proc.returncode


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string for these values
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {type(v).__name__}")


def to_toml(cfg: dict) -> str:
    """The router config as TOML: top-level keys, ``[layout]``, then one ``[[hosts]]`` per host."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in cfg.items() if not isinstance(v, (dict, list))]
    for k, v in cfg.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    for k, v in cfg.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines += ["", f"[[{k}]]"]
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in item.items() if not isinstance(vv, dict)]
                for kk, vv in item.items():
                    if isinstance(vv, dict):
                        lines += [f"[{k}.{kk}]"] + [f"{a} = {_toml_value(b)}" for a, b in vv.items()]
    return "\n".join(lines) + "\n"


@dataclass
class _Host:
    index: int
    name: str
    root: str
    daemon: _Proc
    simhost: _Proc
    port: int = 0
    segments: set[str] = field(default_factory=set)  # pool segments its running daemon announced
    daemon_pids: list[int] = field(default_factory=list)  # every daemon process started for it


class SimFleet:
    """N simulated hosts, each a real kvcached daemon plus a simhost.py; a context manager.

    ``daemon_settings`` overrides/extends each daemon's kvcached.toml (e.g. ``{"nvme_bytes":
    "64M"}``); ``simhost_args`` are extra simhost.py arguments. ``kv_events=False`` turns the
    daemons' KV events off. ``tokenizer_dir``: where the bench tokenizer is (built if missing;
    default ``<workdir>/tokenizer``).
    """

    def __init__(self, n_hosts: int, workdir: str, *, prefill_tps: float = 20000.0, decode_tps: float = 200.0,
                 chunk_tokens: int = 16, pool_bytes: str | int = "64M", nvme_bytes: str | int = 0,
                 kv_events: bool = True, tokenizer_dir: str | None = None, vocab_size: int = 32000,
                 model: str = DEFAULT_MODEL, daemon_settings: dict | None = None, simhost_args: Sequence[str] = (),
                 startup_timeout: float = 90.0, die_with_parent: bool = True, python: str = sys.executable) -> None:
        if n_hosts < 1:
            raise ValueError("n_hosts must be positive")
        self.n_hosts = n_hosts
        self.workdir = os.path.abspath(workdir)
        self.prefill_tps, self.decode_tps = prefill_tps, decode_tps
        self.chunk_tokens = chunk_tokens
        self.layout = sim_layout(chunk_tokens)
        self.model = model
        self.pool_bytes, self.nvme_bytes = pool_bytes, nvme_bytes
        self.kv_events = kv_events
        self.vocab_size = vocab_size
        self.tokenizer_dir = os.path.abspath(tokenizer_dir or os.path.join(self.workdir, "tokenizer"))
        self.daemon_settings = dict(daemon_settings or {})
        self.simhost_args = list(simhost_args)
        self.startup_timeout = startup_timeout
        self.die_with_parent = die_with_parent
        self.python = python
        self.hash_key_file = os.path.join(self.workdir, "hash.key")
        self._hosts: list[_Host] = []
        self._started = False
        #: Pool segments of this fleet's daemons found in /dev/shm at stop() (and unlinked then):
        #: there should be none, as every daemon is stopped with SIGTERM or cleaned up after.
        self.leftover_segments: list[str] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "SimFleet":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "SimFleet":
        os.makedirs(self.workdir, exist_ok=True)
        build_tokenizer(self.tokenizer_dir, self.vocab_size)
        if not os.path.exists(self.hash_key_file):
            write_new_key(self.hash_key_file)
        self._hosts = [self._make_host(k) for k in range(self.n_hosts)]
        self._started = True
        try:
            deadline = time.monotonic() + self.startup_timeout
            for h in self._hosts:  # all daemons start in parallel, then all simhosts
                self._start_daemon(h)
            for h in self._hosts:
                self._wait_daemon(h, deadline)
            for h in self._hosts:
                self._start_simhost(h)
            for h in self._hosts:
                self._wait_simhost(h, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process (simhosts first, then daemons, with SIGTERM) and unlink any pool
        segment a daemon left behind (one that had to be killed). Idempotent."""
        for h in self._hosts:  # signal them all, then wait: they exit in parallel
            h.simhost.send(signal.SIGTERM)
        for h in self._hosts:
            h.simhost.stop()
        for h in self._hosts:
            h.daemon.send(signal.SIGTERM)
        for h in self._hosts:
            self._stop_daemon(h, signal.SIGTERM)
        left = [p for h in self._hosts for p in (h.daemon, h.simhost) if p.alive]
        self._started = False
        # A daemon that exited by itself unlinked its pool; anything of theirs still in /dev/shm is
        # unlinked now and recorded (a test asserts there is none).
        names = sorted({n for h in self._hosts for pid in h.daemon_pids for n in pool_segments(pid)})
        remove_segments(names)
        self.leftover_segments.extend(names)
        if left:  # pragma: no cover - stop() kills what does not exit
            raise RuntimeError(f"processes left running: {[p.name for p in left]}")

    def _make_host(self, k: int) -> _Host:
        name = f"host{k}"
        root = os.path.join(self.workdir, name)
        os.makedirs(root, exist_ok=True)
        config = os.path.join(root, "kvcached.toml")
        self._write_daemon_config(k, config)
        daemon = _Proc(f"{name} daemon", [os.path.join(BIN, "kvcached"), "serve", "--config", config, "--socket",
                                          os.path.join(root, "kv.sock"), "--state-dir", os.path.join(root, "state")],
                       os.path.join(root, "daemon.log"), re.compile(r"^  (layouts):"), [POOL_LINE, METRICS_LINE],
                       die_with_parent=self.die_with_parent)
        simhost = _Proc(f"{name} simhost", [
            self.python, os.path.join(HERE, "simhost.py"), "--port", "0", "--name", name,
            "--socket", os.path.join(root, "kv.sock"), "--tokenizer", self.tokenizer_dir, "--model", self.model,
            "--prefill-tps", repr(float(self.prefill_tps)), "--decode-tps", repr(float(self.decode_tps)),
            "--chunk-tokens", str(self.chunk_tokens), *self.simhost_args],
            os.path.join(root, "simhost.log"), SIMHOST_LINE, [], die_with_parent=self.die_with_parent,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "OMP_NUM_THREADS": "1"})
        return _Host(k, name, root, daemon, simhost)

    def events_endpoint(self, k: int) -> str:
        return f"ipc://{self.workdir}/host{k}-events" if self.kv_events else ""

    def replay_endpoint(self, k: int) -> str:
        return f"ipc://{self.workdir}/host{k}-replay" if self.kv_events else ""

    def _write_daemon_config(self, k: int, path: str) -> None:
        settings: dict[str, Any] = {
            "device": "cpu", "domain": "default", "pool_bytes": self.pool_bytes, "nvme_bytes": self.nvme_bytes,
            "metrics_addr": "127.0.0.1:0", "hash_key_file": self.hash_key_file, "expire_interval": 0.5,
            "worker_threads": 2,
        }
        if self.kv_events:
            settings["kv_events_endpoint"] = self.events_endpoint(k)
            settings["kv_events_replay_endpoint"] = self.replay_endpoint(k)
        settings.update(self.daemon_settings)
        with open(path, "w") as f:
            for key, v in settings.items():
                f.write(f"{key} = {_toml_value(v)}\n")

    # -- one host's processes ----------------------------------------------------------------

    def _start_daemon(self, h: _Host) -> None:
        h.daemon.start()
        assert h.daemon.pid is not None
        h.daemon_pids.append(h.daemon.pid)

    def _wait_daemon(self, h: _Host, deadline: float) -> None:
        h.daemon.wait_ready(deadline)
        seg = h.daemon.group(POOL_LINE)
        if seg:
            h.segments.add(seg)

    def _stop_daemon(self, h: _Host, sig: int) -> int | None:
        pid = h.daemon.pid
        rc = h.daemon.stop(sig)
        if rc is not None and (rc < 0 or sig == signal.SIGKILL):  # died by a signal: it could not unlink its pool
            self._unlink_segments(h, pid)
        return rc

    def _unlink_segments(self, h: _Host, pid: int | None) -> None:
        remove_segments(set(h.segments) | (pool_segments(pid) if pid is not None else set()))
        h.segments.clear()

    def _start_simhost(self, h: _Host) -> None:
        h.simhost.start()

    def _wait_simhost(self, h: _Host, deadline: float) -> None:
        h.simhost.wait_ready(deadline)
        url = h.simhost.group(SIMHOST_LINE)
        h.port = int(url.rsplit(":", 1)[1])
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{h.name}: {url}/health did not answer")
            time.sleep(0.05)

    def _host(self, k: int) -> _Host:
        if not self._started:
            raise RuntimeError("the fleet is not running")
        return self._hosts[k]

    def kill_daemon(self, k: int, sig: int = signal.SIGKILL) -> int | None:
        """Stop host ``k``'s daemon (SIGKILL by default: a crash; its pool segment is unlinked
        here). Its simhost keeps serving, without the cache (fail open)."""
        return self._stop_daemon(self._host(k), sig)

    def start_daemon(self, k: int, timeout: float | None = None) -> None:
        """Start host ``k``'s daemon again (same socket, state directory and event endpoints;
        with ``nvme_bytes`` 0 it starts empty and its first event batch is AllBlocksCleared)."""
        h = self._host(k)
        if h.daemon.alive:
            raise RuntimeError(f"{h.name}'s daemon is running")
        self._start_daemon(h)
        self._wait_daemon(h, time.monotonic() + (timeout or self.startup_timeout))

    def restart_daemon(self, k: int, sig: int = signal.SIGTERM) -> None:
        self.kill_daemon(k, sig)
        self.start_daemon(k)

    def kill_simhost(self, k: int, sig: int = signal.SIGKILL) -> int | None:
        """Stop host ``k``'s simhost (its URL stops answering; the daemon keeps its cache)."""
        return self._host(k).simhost.stop(sig)

    def start_simhost(self, k: int, timeout: float | None = None) -> None:
        """Start host ``k``'s simhost again, on the same port (its URL does not change)."""
        h = self._host(k)
        if h.simhost.alive:
            raise RuntimeError(f"{h.name}'s simhost is running")
        argv = h.simhost.argv
        argv[argv.index("--port") + 1] = str(h.port)
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while True:  # the old socket's port may linger a moment (reuse_address covers TIME_WAIT)
            h.simhost.start()
            try:
                self._wait_simhost(h, deadline)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def restart_simhost(self, k: int, sig: int = signal.SIGTERM) -> None:
        self.kill_simhost(k, sig)
        self.start_simhost(k)

    def kill_host(self, k: int, sig: int = signal.SIGKILL) -> None:
        """Both processes of host ``k`` (a machine gone)."""
        self.kill_simhost(k, sig)
        self.kill_daemon(k, sig)

    def restart_host(self, k: int) -> None:
        h = self._host(k)
        if h.simhost.alive:
            self.kill_simhost(k, signal.SIGTERM)
        if h.daemon.alive:
            self.kill_daemon(k, signal.SIGTERM)
        self.start_daemon(k)
        self.start_simhost(k)

    # -- what a router and a bench need ------------------------------------------------------

    @property
    def hosts(self) -> list[HostDescriptor]:
        return [HostDescriptor(
            name=h.name, url=f"http://127.0.0.1:{h.port}", daemon_socket=os.path.join(h.root, "kv.sock"),
            events_endpoint=self.events_endpoint(h.index), replay_endpoint=self.replay_endpoint(h.index),
            hash_key_file=self.hash_key_file, domain=str(self.daemon_settings.get("domain", "default")),
            layout=self.layout, metrics_url=h.daemon.group(METRICS_LINE)) for h in self._hosts]

    def pids(self) -> dict[str, int | None]:
        return {p.name: p.pid for h in self._hosts for p in (h.daemon, h.simhost) if p.alive}

    def router_config(self) -> dict:
        """Hosts, tokenizer, model and layout, as a router needs them."""
        return {"model": self.model, "tokenizer": self.tokenizer_dir, "hash_key_file": self.hash_key_file,
                "simulated": True, "prefill_tps": float(self.prefill_tps), "decode_tps": float(self.decode_tps),
                "layout": self.layout.to_dict(),
                "hosts": [h.to_dict() for h in self.hosts]}

    def kvcached_router_config(self, *, policy: str = "kvcached", listen: str = "127.0.0.1:0",
                               audit: bool = False, **extra: Any) -> dict:
        """This fleet as a ``kvcached_router.config`` dict (``config_from_dict``; or dump it as TOML
        for ``kvcached-router --config``)."""
        layout = {k: v for k, v in self.layout.to_dict().items() if k != "extra"}
        return {"listen": listen, "policy": policy, "tokenizer": self.tokenizer_dir,
                "hash_key_file": self.hash_key_file, "domain": self.hosts[0].domain, "layout": layout,
                "audit": audit, **extra,
                "hosts": [{"name": h.name, "url": h.url, "events": h.events_endpoint, "replay": h.replay_endpoint,
                           "daemon_socket": h.daemon_socket} for h in self.hosts]}

    def write_router_config(self, path: str, **kw: Any) -> str:
        """:meth:`kvcached_router_config` as a TOML file for ``kvcached-router --config``."""
        with open(path, "w") as f:
            f.write(to_toml(self.kvcached_router_config(**kw)))
        return path

    def write_config(self, path: str) -> str:
        """Write :meth:`router_config` as TOML (``.toml``) or JSON (anything else); returns ``path``."""
        cfg = self.router_config()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            if path.endswith(".toml"):
                c = dict(cfg)
                c["layout"] = {k: v for k, v in c["layout"].items() if k != "extra"}
                c["hosts"] = [{k: v for k, v in h.items() if k != "layout"} for h in c["hosts"]]
                f.write(to_toml(c))
            else:
                json.dump(cfg, f, indent=2)
        os.replace(tmp, path)
        return path

    def url(self, k: int) -> str:
        return f"http://127.0.0.1:{self._host(k).port}"

    def stats(self, k: int, timeout: float = 5.0) -> dict:
        """Host ``k``'s simhost /stats."""
        with urllib.request.urlopen(self.url(k) + "/stats", timeout=timeout) as r:
            return json.load(r)

    def daemon_alive(self, k: int) -> bool:
        return self._host(k).daemon.alive

    def simhost_alive(self, k: int) -> bool:
        return self._host(k).simhost.alive

    def log(self, k: int, which: str = "daemon") -> str:
        """Host ``k``'s daemon or simhost log so far."""
        with open(os.path.join(self._hosts[k].root, f"{which}.log")) as f:
            return f.read()


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="run N simulated hosts (real kvcached daemons) until Ctrl-C")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--prefill-tps", type=float, default=20000.0)
    ap.add_argument("--decode-tps", type=float, default=200.0)
    ap.add_argument("--pool-bytes", default="64M")
    ap.add_argument("--config", help="write the router config here (.toml or .json)")
    a = ap.parse_args(argv)
    with SimFleet(a.hosts, a.workdir, prefill_tps=a.prefill_tps, decode_tps=a.decode_tps,
                  pool_bytes=a.pool_bytes) as fleet:
        if a.config:
            fleet.write_config(a.config)
        print(json.dumps(fleet.router_config(), indent=2), flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
