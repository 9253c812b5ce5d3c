"""A real SGLang server (CPU engine, its own venv ``.venv-sglang``) with kvcached or SGLang's own
``file`` backend as its HiCache storage: what tests/sglang and bench/sglang_backend.py run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SGLANG_PY = os.path.join(ROOT, ".venv-sglang", "bin", "python")
#: Stand-ins SGLang needs to import on a CPU-only machine (kept with the SGLang tests).
SHIMS = os.path.join(ROOT, "tests", "sglang", "cpu_shims")
PAGE = 16


def sglang_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=SHIMS, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvcached_storage(socket_path: str, **extra: object) -> list[str]:
    """SGLang's flags for kvcached as its HiCache storage (the docs' launch flags)."""
    backend = {"backend_name": "kvcached", "module_path": "kvcached_client.sglang", "class_name": "KvcachedStorage",
               "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, "prefetch_threshold": PAGE,
               "socket": socket_path, "model": "test/tiny-llama@1", **extra}
    return ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(backend)]


def file_storage(directory: str) -> list[str]:
    """SGLang's own ``file`` storage backend in ``directory``."""
    return ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
            json.dumps({"file_storage_path": directory, "prefetch_threshold": PAGE})]


class Server:
    """A real SGLang server (``python -m sglang.launch_server``, CPU engine) with a HiCache storage
    backend (``storage``: :func:`kvcached_storage` or :func:`file_storage`)."""

    def __init__(self, python: str, model: str, storage: list[str], log: str, *, page: int = PAGE,
                 max_tokens: int = 4096) -> None:
        self.port, self.log = free_port(), log
        argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
                "--attention-backend", "torch_native", "--host", "127.0.0.1", "--port", str(self.port),
                "--max-total-tokens", str(max_tokens), "--disable-cuda-graph", "--skip-server-warmup",
                "--page-size", str(page), "--enable-metrics",
                "--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
                "--hicache-storage-prefetch-policy", "wait_complete", *storage]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=sglang_env(),
                                         start_new_session=True)
        end = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the SGLang server exited:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > end:
                    self.stop()
                    raise AssertionError(f"the SGLang server was not healthy in 240 s:\n{self.tail()}") from None
                time.sleep(0.5)

    def post(self, path: str, body: dict | None = None) -> dict | str:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=600) as r:
            text = r.read().decode()
        try:
            return json.loads(text)
        except ValueError:
            return text

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            return r.read().decode()

    def generate(self, text: str, tokens: int = 8) -> dict:
        out = self.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}})
        assert isinstance(out, dict) and "output_ids" in out, out
        return out

    def flush(self) -> None:
        """Empty SGLang's device and host caches (what kvcached holds stays). SGLang does not flush
        while requests are pending; its log says which, so this retries until it did."""
        done = len(self.log_lines("Cache flushed successfully"))
        for _ in range(100):
            try:
                self.post("/flush_cache")
            except urllib.error.HTTPError:  # 400 while requests or storage writes are pending
                pass
            if len(self.log_lines("Cache flushed successfully")) > done:
                return
            time.sleep(0.2)
        raise AssertionError(f"SGLang did not flush its cache:\n{self.tail()}")

    def log_lines(self, needle: str) -> list[str]:
        with open(self.log, errors="replace") as f:
            return [line for line in f if needle in line]

    def tail(self, n: int = 6000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def storage_tokens(out: dict) -> int:
    """Prompt tokens SGLang loaded from its storage tier for this response (its own count)."""
    return int((out["meta_info"].get("cached_tokens_details") or {}).get("storage", 0))


def metric(server: "Server", name: str, label: str) -> float:
    """The sum of ``name``'s samples with ``label`` on the server's /metrics."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.metrics().splitlines()
               if line.startswith(name + "{") and label in line)


def wait_chunks(socket: str, n: int, timeout: float = 120.0) -> int:
    """Until the daemon indexes ``n`` chunks (SGLang writes to storage in the background)."""
    from kvcached_client import Client

    end = time.monotonic() + timeout
    with Client(socket) as c:
        while (got := c.stats()["indexed_chunks"]) < n and time.monotonic() < end:
            time.sleep(0.1)
    return got
