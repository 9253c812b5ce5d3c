"""A real kvcached daemon process on a Unix socket in a temporary directory (the tests' fixtures
and the benches that drive a daemon the way the tests do)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterable

BIN = os.path.dirname(sys.executable)
SHM_DIR = "/dev/shm"
#: The startup line naming a domain's host pool segment (one per domain; see kvcached/daemon.py).
POOL_LINE = re.compile(r"^  pool: host shared memory /dev/shm/([^,/\s]+),")


def pool_segments(pid: int | None = None) -> set[str]:
    """kvcached host pool segments in /dev/shm (``kvcached.<domain>.<pid>.<generation>``, named in
    kvcached/tiers/pool_shm.py): all of them, or those created by process ``pid``."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - every Linux has /dev/shm
        return set()
    return {n for n in names if n.startswith("kvcached.") and (pid is None or segment_pid(n) == pid)}


def segment_pid(name: str) -> int | None:
    """The pid of the process that created segment ``name`` (it is in the name), or None."""
    parts = name.split(".")
    return int(parts[-2]) if len(parts) >= 4 and parts[-2].isdigit() else None


def remove_segments(names: Iterable[str]) -> list[str]:
    """Unlink the named segments; returns those that were there."""
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class Daemon:
    def __init__(self, root: str, **settings: object) -> None:
        self.root = root
        self.socket = os.path.join(root, "kv.sock")
        self.state_dir = os.path.join(root, "state")
        self.config = os.path.join(root, "kvcached.toml")
        # device "cpu": the host shared-memory pool even on a GPU host ("auto" would pick CUDA there
        # and run the whole suite, shm-specific tests included, against the CUDA pool). GPU tests
        # pass device="cuda".
        self.settings = {"device": "cpu", "pool_bytes": "4M", "nvme_bytes": "64M",
                         "expire_interval": 0.1, "metrics_addr": "127.0.0.1:0"}
        self.settings.update(settings)
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []
        #: The host pool segments the running (or last) daemon process announced, one per domain.
        self.segments: set[str] = set()
        self._pump: threading.Thread | None = None

    def write_config(self) -> None:
        def value(v: object) -> str:
            return repr(v).replace("True", "true").replace("False", "false").replace("'", '"')

        with open(self.config, "w") as f:
            tables = {k: v for k, v in self.settings.items() if isinstance(v, dict)}
            for k, v in self.settings.items():
                if k not in tables:
                    f.write(f"{k} = {value(v)}\n")
            for k, sub in tables.items():  # e.g. domains = {"b": {...}} -> [domains.b]
                for name, table in sub.items():
                    f.write(f"[{k}.{name}]\n")
                    for tk, tv in table.items():
                        f.write(f"{tk} = {value(tv)}\n")

    def start(self, timeout: float = 60.0) -> "Daemon":
        self.write_config()
        self.output = []
        self.segments = set()
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "kvcached"), "serve", "--config", self.config, "--socket", self.socket,
             "--state-dir", self.state_dir],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        ready = threading.Event()
        proc = self.proc
        domains = 1 + len(self.settings.get("domains") or {})  # each one announces itself

        def pump() -> None:
            assert proc.stdout is not None
            announced = 0
            for line in proc.stdout:
                self.output.append(line)
                if m := POOL_LINE.match(line):
                    self.segments.add(m.group(1))
                if line.startswith("  layouts:"):  # the last line of a domain's startup announcement
                    announced += 1
                    if announced == domains:
                        ready.set()
            proc.stdout.close()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None:
                self._finish(self.proc.wait(), killed=False)
                raise RuntimeError("daemon did not start:\n" + "".join(self.output))
            if time.monotonic() > deadline:
                self.proc.kill()
                self._finish(self.proc.wait(), killed=True)
                raise RuntimeError(f"daemon did not start within {timeout} s:\n" + "".join(self.output))
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and wait for it. SIGKILL (or any death by a signal) leaves its pool
        segments behind, since nothing in the process could unlink them: they are unlinked here,
        once it is dead. A daemon that exits by itself must have removed its own."""
        assert self.proc is not None
        signalled = self.proc.poll() is None
        if signalled:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # hung: kill it, clean up after it, and say so
            self.proc.kill()
            self._finish(self.proc.wait(), killed=True)
            self.proc = None
            raise
        self._finish(rc, killed=signalled and sig == signal.SIGKILL)
        self.proc = None
        return rc

    def _finish(self, rc: int, *, killed: bool) -> None:
        """After the process is dead: read its last output, and unlink the segments a killed one left."""
        assert self.proc is not None
        if self._pump is not None:
            self._pump.join(10)  # EOF comes with the process's end: the log is complete after this
        if killed or rc < 0:
            remove_segments(self.segments | pool_segments(self.proc.pid))  # the pid covers unannounced ones

    @property
    def metrics_url(self) -> str:
        line = next(x for x in self.output if x.startswith("  metrics: "))
        return line.split(": ", 1)[1].strip()

    def log(self) -> str:
        return "".join(self.output)


def run_py(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a client in a separate process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
