"""Starts the tests' vLLM engine processes in about 2.5 s instead of 10-25 s: it imports vLLM once
and forks a child per engine (what ``tests/vllm/engine_proc.py`` runs), like Android's zygote.

    python -m tests.vllm.zygote SOCKET

Most of a CPU engine's start is ``import vllm`` and the modules it imports while it builds the
engine (7 of 10 s measured on an idle 2-core box, more under the suite's load); a fork shares
them. The parent has no Python thread and has run no torch operation when it forks (torch's
OpenMP pool does not exist yet), and every engine of the suite runs with the environment the
zygote was started with for what is read at import (``OMP_NUM_THREADS``); the rest of each
engine's environment is set in the child before the engine reads it.

Protocol, on a ``SOCK_SEQPACKET`` Unix socket: one message per engine, JSON ``{"argv": [...],
"env": {...}, "cwd": "..."}`` with three file descriptors attached (the child's stdin, stdout,
stderr); the answer is ``{"pid": N}``. Children are reaped by the kernel (``SIGCHLD`` ignored):
a test sees an engine's end as the end of its stdout, after a last line ``KVEXIT <code>``. The zygote exits when its own stdin
closes (the test session ended or died).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

#: the child's last line on its stdout: ``KVEXIT <exit code>``
EXIT_LINE = "KVEXIT "

#: modules vLLM imports lazily while it builds a CPU engine: imported here once (about 1 s each engine)
PRELOAD = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
           "vllm.v1.executor.uniproc_executor", "vllm.model_executor.layers.quantization.online.fp8",
           "tests.vllm.engine_proc", "kvcached_client.vllm")


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: become the engine process the test asked for. Never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the engine's own children (TP workers) are waited for
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        import tempfile

        tempfile.tempdir = None  # TMPDIR is the test's now
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 is the test's pipe now
        sys.argv = list(req["argv"])
        from tests.vllm import engine_proc

        engine_proc.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the test's pipe, then the process ends
        import traceback

        traceback.print_exc()
    finally:
        try:
            print(f"{EXIT_LINE}{code}", flush=True)  # what the test has instead of a wait status
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # A fork copies only the thread that forks: there must be no other Python thread holding a lock.
    assert threading.active_count() == 1, threading.enumerate()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Bound under another name and renamed once listening: the test waits for ``path`` to exist,
    # and a connect between bind() and listen() was refused (a CI run's first fork failed so).
    srv.bind(path + ".new")
    srv.listen(16)
    os.rename(path + ".new", path)
    # The parent's end of our stdin: when it closes, stop (select on both).
    print("ready", flush=True)
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj != srv:
                if not os.read(sys.stdin.fileno(), 4096):
                    srv.close()
                    return
                continue
            conn, _ = srv.accept()
            with conn:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    srv.close()
                    conn.close()
                    _child(json.loads(msg), fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    serve(sys.argv[1])
