"""Locust users replaying the Mooncake conversation trace through kvcached-router.

Run by ``bench/routing/run.py`` (which starts the simulated fleet and the router), or by hand:

    ROUTING_USERS=1000 locust -f bench/routing/locustfile.py --headless --users 1000 \\
        --spawn-rate 50 --run-time 180s --host http://127.0.0.1:8000

Each user replays whole conversations of the trace, in order (``workload.Workload.user_sessions``),
waiting the trace's arrival gaps times ``ROUTING_TIME_SCALE`` between its requests, and sends
streaming ``/v1/chat/completions``. Its time to first byte is reported to Locust as a ``TTFT``
request next to the whole response, and every request is logged (``ROUTING_LOG``, JSON lines:
time, TTFT, host, prompt and cached tokens) for the runner's per-window figures.

Environment: ``ROUTING_USERS`` (sessions dealt, = --users), ``ROUTING_TRACE`` (a trace file),
``ROUTING_LIMIT`` (trace lines), ``ROUTING_SKIP`` (lines before them: the runner's warm-up
replayed them), ``ROUTING_TIME_SCALE``, ``ROUTING_WORDS_PER_BLOCK``,
``ROUTING_LOG``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque

import gevent
from locust import HttpUser, constant, events, task

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a file: import bench

from bench.routing.workload import Workload, trace_path

_limit = int(os.environ.get("ROUTING_LIMIT", "0")) or None
WORKLOAD = Workload(os.environ.get("ROUTING_TRACE") or trace_path(), limit=_limit,
                    skip=int(os.environ.get("ROUTING_SKIP", "0")),
                    words_per_block=int(os.environ.get("ROUTING_WORDS_PER_BLOCK", "32")))
SESSIONS = deque(WORKLOAD.user_sessions(int(os.environ.get("ROUTING_USERS", "100")),
                                        time_scale=float(os.environ.get("ROUTING_TIME_SCALE", "1.0"))))
_log_path = os.environ.get("ROUTING_LOG")
_log = open(_log_path, "a", buffering=1) if _log_path else None
_log_lock = threading.Lock()


def _record(**row: object) -> None:
    if _log is not None:
        with _log_lock:
            _log.write(json.dumps(row) + "\n")


class TraceUser(HttpUser):
    wait_time = constant(0)  # the trace's gaps are slept in the task

    def on_start(self) -> None:
        session = SESSIONS.popleft() if SESSIONS else None
        self._requests = iter(session) if session is not None else iter(())

    @task
    def next_request(self) -> None:
        try:
            think, req = next(self._requests)
        except StopIteration:  # this user's conversations are done
            gevent.sleep(3600)
            return
        gevent.sleep(think)
        body = WORKLOAD.chat_body(req, "sim", stream=True)
        t0 = time.perf_counter()
        started = time.time()
        first = None
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat (whole response)") as r:
            for piece in r.iter_content(chunk_size=None):
                if first is None and piece:
                    first = time.perf_counter()
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
            elif first is None:
                r.failure("empty response")
            else:
                r.success()
        ok = r.status_code == 200 and first is not None
        ttft_ms = ((first or time.perf_counter()) - t0) * 1e3
        events.request.fire(request_type="TTFT", name="chat", response_time=ttft_ms, response_length=0,
                            exception=None if ok else RuntimeError(f"HTTP {r.status_code}"), context={})
        _record(t=started, ttft_ms=ttft_ms, ok=ok, status=r.status_code, host=r.headers.get("X-Simhost"), route=r.headers.get("X-Kvcached-Route"),
                prompt_tokens=int(r.headers.get("X-Prompt-Tokens", 0) or 0),
                cached_tokens=int(r.headers.get("X-Cached-Tokens", 0) or 0), trace_index=req.index)
