"""LMCache's Redis-cluster connector as a contender of bench/remote_tier.py: a throwaway venv with
LMCache (:func:`setup_lmcache_venv`, never the project's venv), and a child process in it that the
bench drives over a pipe (:class:`LMCacheProc`: one JSON command, one JSON answer).

Run as a file, this module is that child (:func:`lmcache_child`); it then imports only the standard
library, torch, redis-py and LMCache, all from the throwaway venv.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

PROTO_PREFIX = "@@remote_tier "




def lmcache_child() -> int:
    """Serve commands (JSON lines on stdin), answer on the original stdout; logs go to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    cmd: dict = {}

    def say(obj: dict) -> None:
        proto.write(PROTO_PREFIX + json.dumps({**obj, "id": cmd.get("id")}) + "\n")
        proto.flush()

    try:
        import asyncio

        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.redis_connector import RedisClusterConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    except Exception as e:  # noqa: BLE001 - reported to the parent
        say({"error": f"import: {type(e).__name__}: {e}"})
        return 1
    try:
        import lmcache
        import redis
        import redis.utils

        versions = {"lmcache": getattr(lmcache, "__version__", None), "torch": torch.__version__,
                    "redis_py": redis.__version__, "hiredis": bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))}
    except Exception:  # noqa: BLE001
        versions = {}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="lmcache-loop", daemon=True).start()

    def run(coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    state: dict = {}
    say({"ready": True, "versions": versions})
    for line in sys.stdin:
        cmd = {}
        try:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "exit":
                break
            if op == "setup":
                nodes = [tuple(n) for n in cmd["nodes"]]
                nbytes = cmd["chunk_bytes"]
                n = cmd["n"]
                in_flight = cmd["max_in_flight"]
                gib = max(0.25, (in_flight + n // 4 + 4) * nbytes / 1024**3)
                url = "redis-cluster://" + ",".join(f"{h}:{p}" for h, p in nodes)
                cfg = LMCacheEngineConfig.from_defaults(chunk_size=cmd["chunk_tokens"], local_cpu=False,
                                                        max_local_cpu_size=gib, remote_url=url)
                meta = LMCacheMetadata(model_name=cmd["model"], world_size=1, local_world_size=1, worker_id=0,
                                       local_worker_id=0, kv_dtype=torch.bfloat16,
                                       kv_shape=(cmd["num_layers"], 2, cmd["chunk_tokens"], cmd["num_kv_heads"],
                                                 cmd["head_dim"]), chunk_size=cmd["chunk_tokens"])
                be = LocalCPUBackend(cfg, meta)
                conn = RedisClusterConnector(list(nodes), "", "", loop, be)
                if conn.full_chunk_size_bytes != nbytes:
                    raise RuntimeError(f"LMCache chunk is {conn.full_chunk_size_bytes} bytes, not {nbytes}")
                keys = [CacheEngineKey(cmd["model"], 1, 0, 10_000 + i, torch.bfloat16) for i in range(n)]
                first = None
                for i, k in enumerate(keys):
                    m = be.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
                    data = os.urandom(nbytes)
                    if i == 0:
                        first = data
                    mv = m.byte_array if isinstance(m.byte_array, memoryview) else memoryview(m.byte_array)
                    if mv.format != "B":
                        mv = mv.cast("B")
                    mv[:] = data
                    run(conn.put(k, m))
                    m.ref_count_down()
                got = run(conn.get(keys[0]))
                ok = got is not None and bytes(got.byte_array) == first
                if got is not None:
                    got.ref_count_down()
                state = {"be": be, "conn": conn, "keys": keys, "nbytes": nbytes}
                say({"ok": True, "verified": ok, "chunk_bytes": nbytes, "local_cpu_gib": gib})
            elif op == "run":
                t, k, calls = cmd["threads"], cmd["per_call"], cmd["calls"]
                conn, keys = state["conn"], state["keys"]
                n = len(keys)

                async def worker(ti: int) -> int:
                    got = 0
                    for ci in range(calls):
                        start = (ti * k + ci * k * t) % n
                        ks = [keys[(start + j) % n] for j in range(k)]
                        if k == 1:
                            o = await conn.get(ks[0])
                            objs = [o] if o is not None else []
                        else:
                            objs = await conn.batched_get_non_blocking("bench", ks)
                        got += len(objs)
                        for o in objs:
                            o.ref_count_down()
                    return got

                async def all_workers() -> list[int]:
                    return await asyncio.gather(*(worker(i) for i in range(t)))

                gc.disable()
                c0, t0 = time.process_time(), time.perf_counter()
                counts = run(all_workers())
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                gc.enable()
                say({"ok": True, "seconds": dt, "cpu_s": cpu, "chunks": sum(counts),
                     "bytes": sum(counts) * state["nbytes"]})
            elif op == "cleanup":
                conn, keys = state["conn"], state["keys"]

                async def delete_all() -> None:
                    for k in keys:
                        await conn.cluster.delete(k.to_string() + "kv_bytes")
                        await conn.cluster.delete(k.to_string() + "metadata")

                run(delete_all())
                # Not conn.close(): its priority-queue executor's shutdown(wait=True) never returns
                # here (LMCache 0.5.6); closing the cluster client and the allocator is enough.
                try:
                    run(conn.cluster.aclose(), timeout=10)
                except Exception:  # noqa: BLE001
                    pass
                try:
                    state["be"].close()
                except Exception:  # noqa: BLE001
                    pass
                state = {}
                gc.collect()
                say({"ok": True})
            else:
                say({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which skips the rows
            say({"error": f"{type(e).__name__}: {e}"})
    return 0


class LMCacheProc:
    """The parent's handle on the child (one JSON command, one JSON answer)."""

    def __init__(self, python: str, log_dir: str) -> None:
        self.log_path = os.path.join(log_dir, "lmcache_child.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=tempfile.gettempdir(),
                                     env=env)
        self._answers: queue.Queue = queue.Queue()
        self._next_id = 0
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTO_PREFIX):
                self._answers.put(json.loads(line[len(PROTO_PREFIX):]))
        self._answers.put({"error": f"the LMCache child exited ({self.proc.poll()})"})

    def answer(self, timeout: float, want_id: int | None = None) -> dict:
        """The next answer (to command ``want_id``: late answers to earlier commands are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                a = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return {"error": f"no answer from the LMCache child within {timeout:.0f} s"}
            child_gone = a.get("id") is None and "exited" in a.get("error", "")
            if want_id is None or a.get("id") == want_id or child_gone:
                return a

    def call(self, timeout: float = 120.0, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self._next_id += 1
        try:
            self.proc.stdin.write(json.dumps({**cmd, "id": self._next_id}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            return {"error": f"the LMCache child is gone: {e}"}
        return self.answer(timeout, self._next_id)

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(timeout=10, op="exit")
                self.proc.wait(10)
        except (subprocess.TimeoutExpired, OSError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def setup_lmcache_venv(venv: str, cap_s: float = 600.0) -> dict:
    """pip download lmcache, then a fresh venv (no system site packages): torch==2.13.0, lmcache.
    Returns what happened; ``error`` holds pip's error line when something failed."""
    t0 = time.monotonic()
    out: dict = {"attempted": True}
    dl = os.path.join(tempfile.gettempdir(), "lmc")

    def left() -> float:
        return max(1.0, cap_s - (time.monotonic() - t0))

    def pip_error(text: str) -> str:
        errs = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("ERROR")]
        return errs[-1] if errs else (text.strip().splitlines() or ["(no output)"])[-1]

    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "lmcache", "--no-deps", "-d", dl],
                           capture_output=True, text=True, timeout=left())
        if r.returncode != 0:
            out["error"] = "pip download lmcache: " + pip_error(r.stdout + r.stderr)
            return out
        wheels = sorted(f for f in os.listdir(dl) if f.startswith("lmcache"))
        out["downloaded"] = wheels
        base = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
        if not os.path.exists(base):
            base = os.path.join(sys.base_prefix, "bin", "python3")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([base, "-m", "venv", venv], check=True, capture_output=True, timeout=left())
        py = os.path.join(venv, "bin", "python")
        for what in (["torch==2.13.0"], [os.path.join(dl, wheels[-1])]):
            r = subprocess.run([py, "-m", "pip", "install", *what], capture_output=True, text=True, timeout=left())
            if r.returncode != 0:
                out["error"] = f"pip install {os.path.basename(what[0])}: " + pip_error(r.stdout + r.stderr)
                return out
        out["installed"] = True
    except subprocess.TimeoutExpired:
        out["error"] = f"setup did not finish within the {cap_s:.0f} s cap"
    except (OSError, subprocess.CalledProcessError, IndexError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    return out


if __name__ == "__main__":
    sys.path.pop(0)  # this directory: nothing in it may stand in for a package LMCache imports
    sys.exit(lmcache_child())
