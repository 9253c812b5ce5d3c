"""KvcachedConnector in real vLLM CPU engines against the real daemon (issue 14).

Each engine is its own process (a fresh engine has nothing in vLLM's own prefix cache, so any
cached token it reports came through the connector). The tiny model's chunks are 128 tokens,
one vLLM block each; a 600-token prompt has 4 whole chunks (512 tokens).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.vllm.conftest import assert_nothing_pinned, daemon_stats, prompt
from tests.vllm.faults import KILL_FILE_ENV

pytestmark = pytest.mark.slow

CHUNK = 128


def test_fresh_engine_in_another_process_reuses_whole_chunks(vdaemon, engines, reference):
    full, half = prompt(600, 1), None
    half = full[:300] + prompt(300, 2)  # shares its first 300 tokens: 2 whole chunks
    want = reference([full, half])

    a = engines(vdaemon.socket)
    ra = a.generate([full])
    assert ra["tokens"] == [want[0]] and ra["num_cached"] == [0]  # a miss: computed, then stored
    assert daemon_stats(vdaemon)["indexed_chunks"] == 4
    a.close()

    b = engines(vdaemon.socket)  # fresh engine, fresh process: nothing in vLLM's own cache
    rb = b.generate([full])
    assert rb["num_cached"] == [4 * CHUNK]  # every whole chunk, from kvcached
    assert rb["tokens"] == [want[0]]
    assert rb["scheduler"]["load_tokens"] == 4 * CHUNK and rb["worker"]["failed_blocks"] == 0
    rh = b.generate([half])
    assert rh["num_cached"] == [2 * CHUNK] and rh["tokens"] == [want[1]]
    assert rb["fail_open"] == {} and rh["tracked_requests"] == 0
    assert_nothing_pinned(vdaemon)


def test_two_engines_at_once_reuse_each_others_chunks(vdaemon, engines, reference):
    p1, p2 = prompt(600, 3), prompt(700, 4)
    want = reference([p1, p2])
    a, b = engines(vdaemon.socket), engines(vdaemon.socket)
    assert a.generate([p1])["num_cached"] == [0]
    rb = b.generate([p1])  # A's chunks
    assert rb["num_cached"] == [4 * CHUNK] and rb["tokens"] == [want[0]]
    assert b.generate([p2])["num_cached"] == [0]
    ra = a.generate([p2])  # B's chunks
    assert ra["num_cached"] == [5 * CHUNK] and ra["tokens"] == [want[1]]
    # both at once, interleaved in one batch each: no double store, identical tokens
    p3 = prompt(400, 5)
    r3a, r3b = a.generate([p3, p1]), b.generate([p3, p2])
    assert r3a["tokens"] == reference([p3, p1]) and r3b["tokens"] == reference([p3, p2])
    assert r3b["num_cached"][0] == 3 * CHUNK  # p3 was stored by A a moment ago
    assert_nothing_pinned(vdaemon)


def test_no_store_and_no_cache(vdaemon, engines, reference):
    p = prompt(600, 6)
    want = reference([p])
    e = engines(vdaemon.socket)
    r = e.generate([p], kv={"kvcached": {"no_store": True}})
    assert r["tokens"] == want and daemon_stats(vdaemon)["indexed_chunks"] == 0  # nothing stored
    e.generate([p])  # now stored
    assert daemon_stats(vdaemon)["indexed_chunks"] == 4
    e.call(op="reset")
    r = e.generate([p], kv={"kvcached": {"no_cache": True}})
    assert r["num_cached"] == [0] and r["tokens"] == want  # nothing loaded
    assert r["scheduler"].get("loads", 0) == 0
    e.call(op="reset")
    assert e.generate([p])["num_cached"] == [4 * CHUNK]  # the policy was per request
    assert_nothing_pinned(vdaemon)


def test_no_daemon_serves_without_the_cache(tmp_path, engines, reference):
    p = prompt(600, 7)
    e = engines(str(tmp_path / "nobody-listens.sock"))
    r1, r2 = e.generate([p]), e.generate([prompt(300, 8)])
    assert r1["tokens"] == reference([p]) and r2["tokens"] == reference([prompt(300, 8)])
    assert r1["num_cached"] == [0]
    assert sum(r2["fail_open"].values()) >= 1  # counted
    assert e.output().count("serving without the cache") >= 1  # and said, once per kind of failure
    assert e.output().count("serving without the cache") <= 3
    # at start, once: which path it tried and how to point it elsewhere
    assert e.output().count(f"no daemon answers at unix:{tmp_path / 'nobody-listens.sock'}") == 1, e.output()[-3000:]
    assert "$KVCACHED_SOCKET" in e.output()


def test_daemon_killed_between_lookup_and_load(vdaemon, engines, reference, tmp_path):
    p, q = prompt(600, 9), prompt(500, 10)
    want = reference([p, q])
    kill_file = str(tmp_path / "kill-pid")
    e = engines(vdaemon.socket, connector="tests.vllm.faults:KillDaemonBeforeAcquire", env={KILL_FILE_ENV: kill_file})
    assert e.generate([p])["num_cached"] == [0]
    e.call(op="reset")
    with open(kill_file, "w") as f:
        f.write(str(vdaemon.proc.pid))
    before = e.generate([prompt(300, 11)])["worker"]  # (counters so far)
    e.call(op="reset")
    r = e.generate([p])  # AcquireReserve pinned 4 chunks; the daemon dies before the load
    assert not os.path.exists(kill_file), "the fault did not fire"
    assert r["tokens"] == [want[0]]  # the same tokens
    # The lease's chunks stay mapped in the worker and nobody can reuse them (a restarted daemon
    # makes a new pool), so the load reads them; had it failed, its blocks would have gone back
    # to vLLM as load errors and been recomputed. Either way all 4 are accounted for.
    w = r["worker"]
    assert (w["loaded_blocks"] - before["loaded_blocks"]) + (w["failed_blocks"] - before["failed_blocks"]) == 4
    vdaemon.stop(signal.SIGKILL)  # reap the dead daemon (and unlink its pool segment)
    vdaemon.start()
    r = e.generate([q])  # the engine keeps serving (with the cache, or without while it reconnects)
    assert r["tokens"] == [want[1]]
    # ... and uses the cache again once its client has reconnected (gRPC's backoff, then the
    # connector's retry_s of 0.2 s here): q stored by one request, loaded by the next.
    deadline = time.monotonic() + 30
    while True:
        e.call(op="reset")
        r = e.generate([q])
        assert r["tokens"] == [want[1]]
        if r["num_cached"] == [3 * CHUNK] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r["num_cached"] == [3 * CHUNK], r
    assert r["tracked_requests"] == 0
    assert_nothing_pinned(vdaemon)


def test_a_configuration_the_connector_cannot_serve_stops_the_engine_at_start(tiny_model, vdaemon, tmp_path):
    """A set-up the connector cannot serve exactly stops the engine at start with a clear
    message; it never gets to fail a request. Here a chunk that is not whole vLLM blocks; the
    model kinds refused the same way (state-space layers, chunked-local attention, ...) are
    tests/vllm/test_spec.py's, through the same check."""
    from tests.vllm.conftest import Engine

    with pytest.raises(AssertionError, match="engine exited") as refused:  # it never became ready
        Engine(tiny_model, str(tmp_path), vdaemon.socket, extra={"chunk_tokens": 100})
    out = str(refused.value)
    assert "engine exited (0)" not in out  # a failure's exit code
    assert "kvcached connector" in out and "chunk_tokens=100" in out, out[-3000:]
