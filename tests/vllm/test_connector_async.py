"""The connector in real vLLM CPU engines, where requests are short, salted, queued, aborted
and preempted: nothing is released before the copies it covers are reported, leases outlive a
long queue, tenants never share chunks, and loads run asynchronously (``load_mode="async"``:
vLLM parks the request in WAITING_FOR_REMOTE_KVS until every rank reports the copy).

vLLM's CPU build forces async *scheduling* off, so the orderings it produces (a step's abort
racing the previous step's load) are tested one level down (test_scheduler.py); async
*loading* does not depend on it and is tested here.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvcached.contract.keys import KVLayout
from kvcached_client import Client
from tests.vllm.conftest import assert_nothing_pinned, daemon_stats, prompt
from tests.vllm.faults import HOLD_FILE_ENV
from tests.vllm.test_connector import CHUNK

pytestmark = pytest.mark.slow

ASYNC = {"load_mode": "async"}


def one_token_requests_store_their_chunks(e, vdaemon, reference) -> None:
    """A request that finishes in the step that computed its prompt (max_tokens=1, as a TTFT
    probe or a classifier sends) stores its chunks: they used to be given back, because the
    request ended before the worker's report of the step reached the scheduler side (the daemon
    then indexed 0 chunks here)."""
    p, q = prompt(600, 20), prompt(520, 21)
    assert e.generate([p, q], max_tokens=1)["tokens"] == reference([p, q], max_tokens=1)
    assert daemon_stats(vdaemon)["indexed_chunks"] == 4 + 4
    e.call(op="reset")
    r = e.generate([p, q], max_tokens=1)
    assert r["num_cached"] == [4 * CHUNK, 4 * CHUNK], r
    assert r["tokens"] == reference([p, q], max_tokens=1) and r["live_attempts"] == 0


def test_tenants_with_different_salts_never_share_chunks(vdaemon, engines, reference):
    """(First, on the same engine: 1-token requests store their chunks.) vLLM's ``cache_salt`` isolates tenants: a request with a salt never matches chunks stored
    with another salt or none, an unsalted one never matches salted chunks, and a salted replay
    gets exactly the hits an unsalted replay of the same prompts gets. ``reset`` empties vLLM's
    own prefix cache between rounds, so every cached token below came from kvcached."""
    p1 = prompt(600, 22)
    p2 = p1[:300] + prompt(300, 23)  # shares 2 whole chunks with p1
    want = reference([p1, p2])
    e = engines(vdaemon.socket)
    one_token_requests_store_their_chunks(e, vdaemon, reference)

    def round_(salt: str | None) -> tuple[int, dict]:
        e.call(op="reset")
        before = e.call(op="reset")["scheduler"].get("load_tokens", 0)
        r = e.generate([p1, p2], salt=salt)
        assert r["tokens"] == want, salt
        return r["scheduler"].get("load_tokens", 0) - before, r

    assert round_("tenant-a")[0] == 0  # stores under tenant-a
    assert round_("tenant-b")[0] == 0  # another tenant: nothing of tenant-a's
    assert round_(None)[0] == 0  # unsalted: nothing salted (and stores unsalted)
    salted, rs = round_("tenant-a")
    unsalted, ru = round_(None)
    assert salted == unsalted > 0, (rs, ru)
    assert rs["num_cached"] == ru["num_cached"] == [4 * CHUNK, 4 * CHUNK], (rs, ru)
    assert round_("tenant-b")[0] > 0  # tenant-b's own chunks, stored by its first round
    assert_nothing_pinned(vdaemon)


def test_async_load_and_abort_while_the_copy_is_in_flight(vdaemon, engines, reference, tmp_path):
    """Loads between steps: the request waits in WAITING_FOR_REMOTE_KVS, the worker reports the
    copy, the request runs from the loaded prefix. Aborted while the copy is still reported as
    running, its lease stays pinned until the report comes; then everything is released."""
    p = prompt(600, 24)
    want = reference([p])
    hold = str(tmp_path / "hold")
    e = engines(vdaemon.socket, extra=ASYNC, connector="tests.vllm.faults:HoldCopyReports", env={HOLD_FILE_ENV: hold})
    assert e.generate([p])["num_cached"] == [0]  # stored
    e.call(op="reset")
    r = e.generate([p])
    assert r["num_cached"] == [4 * CHUNK] and r["tokens"] == [want[0]] and r["worker"]["failed_blocks"] == 0

    e.call(op="reset")
    open(hold, "w").close()
    e.call(op="add", id="r1", prompt=p)
    for _ in range(200):  # until its lookup landed and vLLM parked it for the load
        st = e.call(op="step")
        if st["waiting_for_kv"] == ["r1"]:
            break
        time.sleep(0.005)
    assert st["waiting_for_kv"] == ["r1"], st
    e.call(op="step", n=3)  # the copy is done, but not reported: as a GPU's still running
    assert daemon_stats(vdaemon)["leases_active"] == 1
    e.call(op="abort", ids=["r1"])
    st = e.call(op="step")
    assert daemon_stats(vdaemon)["leases_active"] == 1, "released while the copy may still run"
    assert st["live_attempts"] == 1 and st["unfinished"]  # vLLM keeps stepping for the report
    os.unlink(hold)
    st = e.call(op="drain")
    assert st["live_attempts"] == 0 and st["tracked_requests"] == 0 and not st["unfinished"]
    assert_nothing_pinned(vdaemon)
    r = e.generate([p])  # and the engine serves on
    assert r["tokens"] == [want[0]]


def test_a_request_queued_past_the_lease_ttl_keeps_its_hit(vdaemon, engines, reference):
    """One request at a time (``--max-num-seqs 1``): the second waits behind a long generation,
    longer than its lease's TTL (0.5 s here), while another client fills the pool with other
    chunks. Its lease is renewed while it waits, so its chunks stay pinned and it loads all of
    them, exactly. (Unrenewed, the flood evicts them and their pool blocks hold other chunks.)"""
    p, long_ = prompt(600, 25), prompt(200, 26)
    want = reference([p])
    e = engines(vdaemon.socket, extra={"lease_ttl_s": 0.5, **ASYNC}, args=["--max-num-seqs", "1"])
    assert e.generate([p])["num_cached"] == [0]
    e.call(op="reset")
    lay = KVLayout(model="flood@test", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=CHUNK)
    stop = threading.Event()

    def flood() -> None:  # after the TTL: 2.5x the pool (16 MiB of 128 KiB chunks) of other chunks
        time.sleep(0.75)
        with Client(vdaemon.socket) as c:
            for i in range(320):
                if stop.is_set():
                    return
                c.put(lay, prompt(CHUNK, 1000 + i), torch.full((2, 2, 2, CHUNK, 32), float(i)))

    e.call(op="add", id="long", prompt=long_, max_tokens=1800, ignore_eos=True)
    e.call(op="step", n=3)  # the long request holds the only seat (added together, either could go first)
    added = e.call(op="add", id="hit", prompt=p)["t"]
    t = threading.Thread(target=flood)
    t.start()
    try:
        st = e.call(op="drain")
    finally:
        stop.set()
        t.join()
    # The case under test: the hit waited (in the engine's clock) past its lease's TTL, twice over.
    queued = st["finished"]["long"]["t"] - added
    assert st["finished"]["hit"]["t"] > st["finished"]["long"]["t"], "the hit did not wait behind the long request"
    assert queued > 1.0, f"the long request took {queued:.2f} s: too short to outlive the lease"
    assert st["finished"]["hit"]["num_cached"] == 4 * CHUNK and st["finished"]["hit"]["tokens"] == want[0], (
        st["finished"]["hit"], st["scheduler"], st["worker"])
    assert st["scheduler"].get("lease_renewals", 0) >= 1 and st["worker"]["expired_leases"] == 0, st["scheduler"]
    assert_nothing_pinned(vdaemon, settle_s=0)  # at once: a leaked lease of a 0.5 s TTL would be gone by then


def test_preempted_requests_reload_and_match(vdaemon, engines, reference):
    """A KV cache of 18 blocks for 4 requests that each grow to 6: vLLM preempts and resumes
    them (a resumed request starts over and may load again). Tokens stay exact and nothing stays
    pinned."""
    ps = [prompt(520, 30 + i) for i in range(4)]
    want = reference(ps, max_tokens=200)
    e = engines(vdaemon.socket, extra=ASYNC, args=["--kv-bytes", str(18 * 128 * 1024), "--max-model-len", "1024"])
    e.generate(ps, max_tokens=1)  # the prompts are stored
    before = e.call(op="reset")["scheduler"]
    r = e.generate(ps, max_tokens=200, ignore_eos=False)
    assert r["tokens"] == want
    sched = r["scheduler"]
    assert sched.get("preemptions", 0) - before.get("preemptions", 0) >= 1, sched  # the case under test happened
    assert sched["load_tokens"] - before.get("load_tokens", 0) >= 4 * 4 * CHUNK
    assert r["live_attempts"] == 0 and r["tracked_requests"] == 0
    assert_nothing_pinned(vdaemon)
