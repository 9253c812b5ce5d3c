"""A real kvcached daemon process on a Unix socket in a directory of its own: the one harness of the
tests' fixtures and of every bench that starts a daemon (``Daemon``; ``Daemon.temp`` for a bench's
daemon on the daemon's own defaults), and the host pool segments such processes leave in /dev/shm."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping

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


#: The settings a test daemon starts with unless it says otherwise: the host shared-memory pool even
#: on a GPU host ("auto" would pick CUDA there and run the whole suite, shm-specific tests included,
#: against the CUDA pool; GPU tests pass device="cuda"), small tiers, a quick expiry sweep.
TEST_DEFAULTS: dict[str, object] = {"device": "cpu", "pool_bytes": "4M", "nvme_bytes": "64M",
                                    "expire_interval": 0.1}
#: Python that starts ``kvcached serve`` in a ``python -c`` child (after a prelude: what-if patches).
_SERVE = "import sys; from kvcached.cli import kvcached_main; sys.exit(kvcached_main())"


class Daemon:
    """A real ``kvcached serve`` process on a Unix socket in ``root`` (``kv.sock``, ``state/``,
    ``kvcached.toml``), for the tests' fixtures and the benches alike.

    ``settings`` are :class:`kvcached.settings.DaemonSettings` fields, written to the TOML file on
    :meth:`start`; a dict value becomes tables (``domains={"b": {...}}`` -> ``[domains.b]``). A test
    daemon starts from :data:`TEST_DEFAULTS`; :meth:`temp` (the benches') from the daemon's own
    defaults, as a user's would, in a temporary directory of its own. Every daemon gets an
    ephemeral metrics port, so several run at once.

    Its stdout and stderr are read into memory by a thread (:meth:`log`); :meth:`start` returns
    once every trust domain has announced itself (the block ending ``  layouts:``), and the
    announced host pool segments are kept in :attr:`segments`. :meth:`stop` is idempotent and
    unlinks the segments of a daemon that died by a signal, which nothing in it could do. As a
    context manager it is started on entry and closed on exit (stopped; ``root`` removed if
    :meth:`temp` made it), also on error.
    """

    def __init__(self, root: str, *, test_defaults: bool = True, prelude: str | None = None,
                 **settings: object) -> None:
        self.root = root
        self.socket = os.path.join(root, "kv.sock")
        self.state_dir = os.path.join(root, "state")
        self.config = os.path.join(root, "kvcached.toml")
        self.settings: dict[str, object] = {**(TEST_DEFAULTS if test_defaults else {}),
                                            "metrics_addr": "127.0.0.1:0", **settings}
        self.prelude = prelude
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.output: list[str] = []
        #: The host pool segments the running (or last) daemon process announced, one per domain.
        self.segments: set[str] = set()
        self._pump: threading.Thread | None = None
        self._owns_root = False

    @classmethod
    def temp(cls, settings: Mapping[str, object], *, prefix: str = "kvc-bench-",
             prelude: str | None = None) -> Daemon:
        """A daemon on exactly ``settings`` (the daemon's defaults for the rest) in a new temporary
        directory, removed by :meth:`close`."""
        d = cls(tempfile.mkdtemp(prefix=prefix), test_defaults=False, prelude=prelude, **settings)
        d._owns_root = True
        return d

    @property
    def nvme_path(self) -> str:
        """The LMDB environment of the default trust domain."""
        return os.path.join(self.state_dir, "nvme", str(self.settings.get("domain", "default")))

    def write_config(self) -> None:
        def value(v: object) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            return repr(v) if isinstance(v, (int, float)) else json.dumps(v if isinstance(v, list) else str(v))

        os.makedirs(self.root, exist_ok=True)
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

    def command(self) -> list[str]:
        script = os.path.join(BIN, "kvcached")
        if self.prelude:
            base = [sys.executable, "-c", self.prelude + "\n" + _SERVE]
        else:
            base = [script] if os.path.exists(script) else [sys.executable, "-c", _SERVE]
        return base + ["serve", "--config", self.config, "--socket", self.socket, "--state-dir", self.state_dir]

    def start(self, timeout: float = 120.0) -> Daemon:
        self.write_config()
        self.output = []
        self.segments = set()
        self.exit_code = None
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True)
        ready = threading.Event()
        proc = self.proc
        domains = 1 + len(self.settings.get("domains") or {})  # type: ignore[arg-type]  # each one announces itself

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
                raise RuntimeError(f"daemon did not start: it exited with {self.exit_code}:\n" + self.log())
            if time.monotonic() > deadline:
                self.proc.kill()
                self._finish(self.proc.wait(), killed=True)
                raise RuntimeError(f"daemon did not start within {timeout} s:\n" + self.log())
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Signal the daemon and wait for it; returns its exit status (0: a clean stop), or the last
        one if it was already stopped. SIGKILL (or any death by a signal) leaves its pool segments
        behind, since nothing in the process could unlink them: they are unlinked here, once it is
        dead. A daemon that exits by itself must have removed its own. One that does not stop
        within ``timeout`` is killed, cleaned up after, and the TimeoutExpired raised."""
        if self.proc is None:
            return self.exit_code
        signalled = self.proc.poll() is None
        if signalled:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # hung: kill it, clean up after it, and say so
            self.proc.kill()
            self._finish(self.proc.wait(), killed=True)
            raise
        self._finish(rc, killed=signalled and sig == signal.SIGKILL)
        return rc

    def _finish(self, rc: int, *, killed: bool) -> None:
        """After the process is dead: read its last output, and unlink the segments a killed one left."""
        assert self.proc is not None
        if self._pump is not None:
            self._pump.join(10)  # EOF comes with the process's end: the log is complete after this
        if killed or rc < 0:
            remove_segments(self.segments | pool_segments(self.proc.pid))  # the pid covers unannounced ones
        self.exit_code = rc
        self.proc = None

    def close(self) -> None:
        """Stop the daemon if it runs, and remove ``root`` if :meth:`temp` made it."""
        try:
            self.stop()
        finally:
            if self._owns_root:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Daemon:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def metrics_url(self) -> str:
        line = next(x for x in self.output if x.startswith("  metrics: "))
        return line.split(": ", 1)[1].strip()

    def log(self) -> str:
        return "".join(self.output)


def run_py(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a client in a separate process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
