"""SIGHUP while clients run: valid and invalid settings files in turn, four client threads doing
acquire, put, keep-alive and release the whole time. No RPC fails; every settings snapshot the
daemon reports (``stats()["settings"]``, read in one piece) is wholly the old set or wholly the
new one, never a mix; every lease's TTL is one of the sets'; an invalid file changes nothing;
the daemon ends on the last valid set."""

from __future__ import annotations

import signal
import threading
import time

from kvcached.contract.keys import KVLayout
from kvcached_client import Client

LAYOUT = KVLayout("test/reload@1", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", chunk_tokens=4)
SET_A = {"lease_ttl": 30.0, "reservation_ttl": 20.0, "cache_ttl": 600.0}
SET_B = {"lease_ttl": 60.0, "reservation_ttl": 40.0, "cache_ttl": 1200.0}
BAD = {"lease_ttl": 45.0, "reservation_ttl": -1.0, "cache_ttl": 900.0}  # one bad value: the whole file refused


def test_reloads_under_load_are_atomic_and_an_invalid_file_keeps_the_old_set(make_daemon):
    d = make_daemon(**SET_A)
    errors: list[str] = []
    snapshots: list[dict] = []
    lease_ttls: list[float] = []
    stop = threading.Event()

    def client_loop(k: int) -> None:
        try:
            with Client(d.socket) as c:
                n = 0
                while not stop.is_set():
                    toks = [k * 100_000 + n * 8 + i for i in range(8)]
                    c.put_bytes(LAYOUT, toks, [bytes([k, n % 256]) * (LAYOUT.chunk_bytes // 2)] * 2)
                    lease = c.acquire(LAYOUT, toks)
                    lease_ttls.append(lease.keep_alive())
                    lease.release()
                    if n % 5 == 0:
                        snapshots.append(c.stats()["settings"])
                    n += 1
        except Exception as e:  # noqa: BLE001 - every failure is the test's finding
            errors.append(f"client {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    applied = refused = 0
    try:
        for i, values in enumerate([SET_B, BAD, SET_A, BAD, SET_B, SET_A, BAD, SET_B]):
            d.settings.update(values)
            d.write_config()
            before = d.log().count("reloaded:"), d.log().count("reload refused")
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while (d.log().count("reloaded:"), d.log().count("reload refused")) == before:
                assert time.monotonic() < deadline, "no reload logged"
                time.sleep(0.02)
            if values is BAD:
                refused += 1
            else:
                applied += 1
            time.sleep(0.3)  # the clients run on this set (or, after BAD, on the one before)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    log = d.log()
    assert errors == [], errors[:5]
    assert log.count("reload refused") == refused and log.count("reloaded:") == applied
    assert "Traceback" not in log
    sets = [{k: s[k] for k in SET_A} for s in snapshots]
    assert len(sets) >= 20 and all(s in (SET_A, SET_B) for s in sets), [s for s in sets if s not in (SET_A, SET_B)][:3]
    assert {s["lease_ttl"] for s in sets} == {30.0, 60.0}  # both sets were seen in effect
    assert lease_ttls and all(round(t) in (30, 60) for t in lease_ttls), sorted({round(t, 1) for t in lease_ttls})[:5]
    with Client(d.socket) as c:
        final = c.stats()["settings"]
    assert {k: final[k] for k in SET_B} == SET_B  # the last valid file's
    assert d.proc.poll() is None
