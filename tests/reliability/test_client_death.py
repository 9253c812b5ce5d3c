"""Client death: client processes holding leases and reservations (reserved, partly written,
never committed) are SIGKILLed at random points; everything they pinned must come back, at once
when they had a session, by the TTLs when not (the checks are stated in
``bench/harness/client_death.py``, which holds the holder processes, :func:`kill_round` and
:func:`ttl_round`, shared with ``bench/crash_loop.py --mode client-death``).
"""

from __future__ import annotations

import signal

from bench.harness.client_death import SETTINGS, assert_reclaimed, kill_round, ttl_round
from bench.harness.daemon import Daemon


def test_killed_session_clients_release_every_pin_at_once(tmp_path):
    d = Daemon(str(tmp_path), **SETTINGS).start()
    try:
        out = kill_round(d, str(tmp_path), n=6, seed=11)
    finally:
        d.stop(signal.SIGKILL)
    print(out)
    assert sorted(out["kill_kinds"]) == ["churn"] * 3 + ["hold"] * 3
    # The sessions' ends did it, not a TTL (30 s for leases here, 3600 s for reservations): nothing
    # expired, and it took well under the lease TTL (measured: a few ms).
    assert out["released_by"]["leases_expired"] == 0 and out["released_by"]["reservations_expired"] == 0, out
    assert out["released_by"]["leases_session_released"] > 0, out
    assert out["released_s"] < 10.0, out
    assert out["sessions_ended_logged"] == 6, d.log()[-3000:]
    assert out["chunks_checked"] > 0 and out["prompts"] >= 6, out
    assert_reclaimed(out)


def test_killed_sessionless_client_is_released_by_the_ttl(tmp_path):
    d = Daemon(str(tmp_path), **SETTINGS).start()
    try:
        out = ttl_round(d, str(tmp_path))
    finally:
        d.stop(signal.SIGKILL)
    print(out)
    assert out["held_before"] == (6, 2)
    # the session client's pins: by its session's end (its leases' TTL is 30 s), well within that
    assert out["leases_session_released"] == 3 and out["session_released_s"] < 10.0, out
    # the session-less client's: kept whole until their 3 s TTL ran out, then expired by it
    assert out["sessionless_kept_s"] >= 3.0, out
    assert out["leases_expired"] == 3 and out["reservations_expired"] == 1, out
    assert_reclaimed(out)
