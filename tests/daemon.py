"""A real kvcached daemon process on a Unix socket in a temporary directory, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

BIN = os.path.dirname(sys.executable)


class Daemon:
    def __init__(self, root: str, **settings: object) -> None:
        self.root = root
        self.socket = os.path.join(root, "kv.sock")
        self.state_dir = os.path.join(root, "state")
        self.config = os.path.join(root, "kvcached.toml")
        self.settings = {"pool_bytes": "4M", "pool_block_bytes": "64K", "nvme_bytes": "64M", "expire_interval": 0.1,
                         "metrics_addr": "127.0.0.1:0"}
        self.settings.update(settings)
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []

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
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "kvcached"), "serve", "--config", self.config, "--socket", self.socket,
             "--state-dir", self.state_dir],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("  layouts:"):  # the last line of the startup announcement
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("daemon did not start:\n" + "".join(self.output))
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self.proc = None
        return rc

    @property
    def metrics_url(self) -> str:
        line = next(x for x in self.output if x.startswith("  metrics: "))
        return line.split(": ", 1)[1].strip()

    def log(self) -> str:
        return "".join(self.output)


def run_py(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a client in a separate process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
