"""Fixtures for the SGLang backend's tests: SGLang's own venv, a tiny random Llama, real servers.

SGLang lives in ``.venv-sglang`` (``scripts/setup`` with ``KVCACHED_SGLANG=cpu`` builds it, as it
installs vLLM's CPU build), not in the project's venv: its pins (torch, transformers, the CUDA
stack) conflict with vLLM's. So the tests here run SGLang in subprocesses: its real server, and
``inside/check_backend.py`` under SGLang's Python. Both get the test-only CPU shims of
``cpu_shims/`` (read its README: they are not a claim that SGLang supports CPU).
"""

from __future__ import annotations

import os
import subprocess
from typing import Iterator

import pytest

from bench.harness.sglang_server import (PAGE, SGLANG_PY, Server, kvcached_storage, metric, sglang_env, storage_tokens,
                                  wait_chunks)
from tests.requirements import require

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
__all__ = ["HERE", "PAGE", "ROOT", "metric", "sglang_env", "storage_tokens", "wait_chunks"]  # the SGLang tests' helpers


@pytest.fixture(scope="session")
def sglang_python() -> str:
    ok = os.path.exists(SGLANG_PY) and subprocess.run(
        [SGLANG_PY, "-c", "import sglang, kvcached_client"], capture_output=True, env=sglang_env()).returncode == 0
    require(ok, "SGLang's venv (.venv-sglang) is missing; KVCACHED_SGLANG=cpu ./scripts/setup builds it")
    return SGLANG_PY


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, sglang_python) -> str:
    from kvcached_client.vllm.random_model import build

    return build(str(tmp_path_factory.mktemp("sglang-llama")))


@pytest.fixture
def sglang_server(sglang_python, tiny_model, tmp_path) -> Iterator:
    servers: list[Server] = []

    def start(socket_path: str, name: str = "sglang", **extra: object) -> Server:
        s = Server(sglang_python, tiny_model, kvcached_storage(socket_path, **extra), str(tmp_path / f"{name}.log"))
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()
