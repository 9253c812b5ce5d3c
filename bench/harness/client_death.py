"""Client death: client processes holding leases and reservations (reserved, partly
written, never committed) are SIGKILLed at random points; everything they pinned must come back.

* With a session (the default), the daemon sees the Session stream end and releases the dead
  client's leases and aborts its reservations at once.
* Without a session (``Client(session=False)``), nothing tells the daemon; the lease and
  reservation TTLs release them.

Either way: ``leases_active`` and ``reservations_active`` drop to 0, no chunk is left marked
in flight (a new writer can reserve every prompt the dead ones were writing), no torn chunk is
visible (every committed byte is right), and the pool is fully reclaimable (evict everything ->
``free_bytes == capacity_bytes``, then one put fills the whole pool).

The holder processes (:func:`holder_main`), :func:`kill_round` and :func:`ttl_round` serve both
``tests/reliability/test_client_death.py`` and ``bench/crash_loop.py --mode client-death``.
"""

from __future__ import annotations

import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from typing import Any

from bench.harness.crash import ROOT, chunk_bytes_of, chunk_payload, kv_tensor, prompt_tokens
from bench.harness.daemon import Daemon
from bench.harness.layouts import RELIABILITY_LAYOUT as LAYOUT

CT = LAYOUT.chunk_tokens
#: The servicer's line for a session that ended holding pins (its client went away).
SESSION_LOST = re.compile(r"session \S+ \(.*\) ended: released (?:[1-9]\d*) leases")
SETTINGS = {"pool_bytes": "512K", "nvme_bytes": "64M"}


def holder_main(sock: str, mode: str, seed: int, w: int, record: str) -> None:
    """A client that pins things, then either sleeps ("hold", "ttl") or keeps working ("churn")
    until it is killed. Every prompt it is about to reserve is appended to ``record`` first."""
    import grpc

    from kvcached.v1 import kvcached_pb2 as pb
    from kvcached_client import Client, KvcachedError, _core

    rng = random.Random(seed)
    ttl = 3.0 if mode == "ttl" else None
    c = Client(sock, session=mode != "ttl")
    rec = open(record, "a", buffering=1)  # noqa: SIM115 - the process is killed with it open
    shared, own = prompt_tokens(199, 0), prompt_tokens(100 + w, 0)
    c.put(LAYOUT, shared, kv_tensor(shared))
    c.put(LAYOUT, own, kv_tensor(own))
    taken = time.monotonic()  # CLOCK_MONOTONIC, the daemon's clock too: no pin below expires before taken + TTL
    leases = [c.acquire(LAYOUT, shared, ttl=ttl), c.acquire(LAYOUT, own, ttl=ttl), c.acquire(LAYOUT, own, ttl=ttl)]
    lid = c.register(LAYOUT)
    reservations: list[tuple[str, str]] = []  # (id, the session it was made under)
    j = 1

    def reserve(j: int) -> None:
        toks = prompt_tokens(100 + w, j)
        rec.write(f"{j}\n")
        sid = c.session_id()
        r = c._stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=_core.pack_tokens(toks),
                                              session_id=sid, ttl_seconds=ttl or 3600))
        slots = _core.locations(r.slots)
        if slots:
            c._ensure_pool(r.pool_generation)
            # write only some of the reserved chunks: the client dies half-way through a put
            _core.write_slots(c._pool, LAYOUT, slots[: rng.randint(0, len(slots))], kv_tensor(toks))
        reservations.append((r.reservation_id, sid))

    while not reservations:  # at least one open reservation with blocks behind it
        reserve(j)
        j += 1
    print(f"HOLD {len(leases)} {len(reservations)} {taken!r}", flush=True)
    if mode in ("hold", "ttl"):
        time.sleep(600)
        return
    while True:  # churn: every moment is a possible kill point
        try:
            op = rng.random()
            if op < 0.25:
                toks = prompt_tokens(100 + w, j)
                rec.write(f"{j}\n")
                j += 1
                c.put(LAYOUT, toks, kv_tensor(toks))
            elif op < 0.5:
                toks = prompt_tokens(100 + w, rng.randrange(j)) if rng.random() < 0.7 else shared
                lease = c.acquire(LAYOUT, toks, ttl=ttl)
                for i in range(len(lease)):
                    assert chunk_bytes_of(lease, i) == chunk_payload(toks, i)
                leases.append(lease)
                if len(leases) > 4:
                    leases.pop(rng.randrange(len(leases))).release()
            elif op < 0.75:
                reserve(j)
                j += 1
                if len(reservations) > 2:  # finish one: commit or abort
                    rid, sid = reservations.pop(0)
                    if rng.random() < 0.5:
                        c._stub.Abort(pb.AbortRequest(reservation_ids=[rid], session_id=sid))
                    else:
                        c._stub.Commit(pb.CommitRequest(reservation_id=rid, chunks=0, session_id=sid))
            else:
                leases[rng.randrange(len(leases))].keep_alive(ttl)
        except (KvcachedError, grpc.RpcError):  # e.g. RESOURCE_EXHAUSTED when the others pin the whole pool
            time.sleep(0.01)


def _spawn_holder(sock: str, mode: str, seed: int, w: int, record: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "clients"), env.get("PYTHONPATH", "")])
    code = ("import sys; from bench.harness.client_death import holder_main; "
            "holder_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])")
    return subprocess.Popen([sys.executable, "-c", code, sock, mode, str(seed), str(w), record], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_line(p: subprocess.Popen, timeout: float) -> str:
    assert p.stdout is not None
    r, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if r else ""
    if not line.startswith("HOLD"):
        p.kill()
        raise AssertionError(f"holder did not get to HOLD: {line!r}\n{p.communicate()[1][-3000:]}")
    return line


def wait_until(pred: Any, timeout: float, step: float = 0.01) -> float:
    """Seconds until ``pred()`` held; raises after ``timeout``. Timeouts here are generous (a busy
    2-core box stalls for seconds): what the tests prove comes from counters and ordering, not
    from how fast the wait ended."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


def pins(c: Any) -> tuple[int, int, int, int]:
    s = c.stats()
    return s["leases_active"], s["reservations_active"], s["pool"]["leased_chunks"], s["pool"]["reserved_chunks"]


#: The counters that say who released a pin: a session's end, or a TTL.
RELEASE_COUNTERS = ("leases_session_released", "leases_expired", "reservations_expired")


def released_by(c: Any, since: dict) -> dict[str, int]:
    now = c.stats()["counters"]
    return {k: now[k] - since[k] for k in RELEASE_COUNTERS}


def reap(procs: list) -> None:
    """Kill what is still running and close every pipe (no zombie, no ResourceWarning)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def check_reclaimed(c: Any, records: list[str], ws: list[int]) -> dict:
    """After the dead clients' pins are gone: no chunk in flight, no torn chunk, pool reclaimable."""
    from kvcached.v1 import kvcached_pb2 as pb
    from kvcached_client import _core

    lid = c.register(LAYOUT)
    prompts = [prompt_tokens(100 + w, int(j)) for w, path in zip(ws, records)
               for j in sorted(set(open(path).read().split()))]
    in_flight = checked = wrong = 0
    for toks in prompts:
        with c.acquire(LAYOUT, toks) as lease:  # what the dead clients committed is whole and right
            for i in range(len(lease)):
                checked += 1
                wrong += chunk_bytes_of(lease, i) != chunk_payload(toks, i)
        r = c._stub.Reserve(pb.ReserveRequest(layout_id=lid, tokens=_core.pack_tokens(toks)))
        in_flight += r.in_flight_tokens  # a dead writer's mark left behind would block this prompt forever
        c._stub.Abort(pb.AbortRequest(reservation_ids=[r.reservation_id]))
    assert pins(c) == (0, 0, 0, 0)
    c.evict()
    pool = c.stats()["pool"]
    free_after_evict, total = pool["free_bytes"], pool["capacity_bytes"]
    n = total // LAYOUT.chunk_bytes  # chunks the pool holds (a packed pool of n * chunk_bytes holds n)
    big = [(1 << 31) + k for k in range(n * CT)]  # one prompt as long as the pool has room for chunks
    stored = c.put(LAYOUT, big, kv_tensor(big)).stored_chunks
    with c.acquire(LAYOUT, big) as lease:
        full = lease.matched_tokens == n * CT
        ends_right = all(chunk_bytes_of(lease, i) == chunk_payload(big, i) for i in (0, n // 2, n - 1))
    return {"prompts": len(prompts), "in_flight_tokens": in_flight, "chunks_checked": checked, "chunks_wrong": wrong,
            "free_bytes_after_evict": free_after_evict, "capacity_bytes": total, "fill_stored": stored,
            "fill_whole": full and ends_right}


def kill_round(d: Daemon, root: str, *, n: int, seed: int, round_no: int = 0) -> dict:
    """``n`` session clients, half holding still and half working, SIGKILLed in random order at
    random moments; returns how long the daemon took to release everything, and the checks."""
    from kvcached_client import Client

    rng = random.Random(seed)
    modes = ["hold"] * (n // 2) + ["churn"] * (n - n // 2)
    rng.shuffle(modes)
    ws = [round_no * n + i for i in range(n)]
    records = [os.path.join(root, f"reserved.{w}") for w in ws]
    procs = [_spawn_holder(d.socket, m, seed * 100 + i, w, rec)
             for i, (m, w, rec) in enumerate(zip(modes, ws, records))]
    try:
        for p in procs:
            _wait_line(p, 120)
        with Client(d.socket, session=False) as c:
            leases, reservations, _, _ = pins(c)
            assert leases >= 3 * n and reservations >= n, (leases, reservations)  # all of them hold pins now
            log_before = len(SESSION_LOST.findall(d.log()))
            counters0 = c.stats()["counters"]
            order = list(range(n))
            rng.shuffle(order)
            kinds = []
            for i in order:
                # a holder is killed while holding still; a churner somewhere inside an operation
                time.sleep(rng.uniform(0.0, 0.4) if modes[i] == "churn" else rng.uniform(0.0, 0.1))
                procs[i].send_signal(signal.SIGKILL)
                rc = procs[i].wait()
                assert rc == -signal.SIGKILL, \
                    f"holder {i} ({modes[i]}) died by itself:\n{procs[i].stderr.read()[-3000:]}"
                kinds.append(modes[i])
            released_s = wait_until(lambda: pins(c)[:2] == (0, 0), 30)
            released = released_by(c, counters0)  # by the sessions' ends, not by a TTL
            wait_until(lambda: c.stats()["sessions_open"] == 0, 30)

            def ended() -> int:
                return len(SESSION_LOST.findall(d.log())) - log_before

            try:  # each line is logged once its session's pins are released, then read by the pump
                wait_until(lambda: ended() >= n, 30)
            except AssertionError:
                pass  # the count says how many came
            sessions_ended = ended()
            out = check_reclaimed(c, records, ws)
    finally:
        reap(procs)
    out.update(kills=n, kill_kinds=kinds, held_leases=leases, held_reservations=reservations,
               released_s=released_s, released_by=released, sessions_ended_logged=sessions_ended)
    return out


def assert_reclaimed(out: dict) -> None:
    assert out["in_flight_tokens"] == 0, out
    assert out["chunks_wrong"] == 0, out
    assert out["free_bytes_after_evict"] == out["capacity_bytes"], out
    assert out["fill_stored"] == out["capacity_bytes"] // LAYOUT.chunk_bytes and out["fill_whole"], out


def ttl_round(d: Daemon, root: str, *, seed: int = 5, w0: int = 140) -> dict:
    """A session-less client (3 s TTLs) and a session client, both holding 3 leases and one
    half-written reservation, SIGKILLed together: the session's pins go at once, the others
    stay until their TTL, then go too."""
    from kvcached_client import Client

    recs = [os.path.join(root, f"reserved.{w0}"), os.path.join(root, f"reserved.{w0 + 1}")]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_spawn_holder(d.socket, "hold", seed + 1, w0 + 1, recs[1]))
        _wait_line(procs[0], 120)
        procs.append(_spawn_holder(d.socket, "ttl", seed, w0, recs[0]))  # session=False, 3 s TTLs
        taken = float(_wait_line(procs[1], 120).split()[3])  # its pins expire no earlier than taken + 3 s
        with Client(d.socket, session=False) as c:
            before = pins(c)[:2]
            counters0 = c.stats()["counters"]
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.wait()
            t_kill = time.monotonic()
            # Watch from the kill on, one consistent Stats snapshot at a time. The session client's
            # 3 leases and reservation go together when the daemon sees its session end (counted in
            # leases_session_released); what is left is the session-less client's, which must stay
            # (3, 1) until their TTL. Nothing is waited out: the first snapshot where they are short
            # is compared with when they were taken.
            session_s = kept = first_drop = None
            deadline = t_kill + 30
            while True:
                s = c.stats()
                now = time.monotonic()
                session_over = s["counters"]["leases_session_released"] - counters0["leases_session_released"] == 3
                theirs = (s["leases_active"] - (0 if session_over else 3),
                          s["reservations_active"] - (0 if session_over else 1))
                if session_over and session_s is None:
                    session_s, kept = now - t_kill, theirs
                if theirs != (3, 1) and first_drop is None:
                    first_drop = now
                if session_over and theirs == (0, 0):
                    break
                assert now < deadline, f"pins left 30 s after the kill: {theirs}, session over: {session_over}"
                time.sleep(0.01)
            ttl_s = now - t_kill
            counters = c.stats()["counters"]
            out = check_reclaimed(c, recs, [w0, w0 + 1])
    finally:
        reap(procs)
    out.update(held_before=before, kept_after_session_release=kept, session_released_s=session_s,
               sessionless_kept_s=first_drop - taken, ttl_released_s=ttl_s,
               leases_session_released=counters["leases_session_released"] - counters0["leases_session_released"],
               leases_expired=counters["leases_expired"] - counters0["leases_expired"],
               reservations_expired=counters["reservations_expired"] - counters0["reservations_expired"])
    return out
