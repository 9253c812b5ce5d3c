"""Crash loop: does a SIGKILLed kvcached lose or corrupt anything it promised, and do clients
come back by themselves? And does a SIGKILLed client leave anything pinned?

Question 1 (``--mode crash``, default part of ``both``): under a put/acquire/flush load from
several client processes, SIGKILL the daemon >= 20 times at random moments and restart it.
After every restart and at the end: is every *durable* chunk (acknowledged as on NVMe by a
write-through Commit's ``durable_tokens``, or a later Flush returned in write-back mode) found
with identical bytes?
Is any wrong byte ever served (every byte any client reads is checked against a deterministic
payload)? Right after a restart with the clients paused, does the rebuilt index equal the LMDB
file (counts, and a Lookup of every prompt ever written vs its leading chunks on NVMe)? How
many UNAVAILABLE errors do clients see while the daemon is down, and how long after it is back
until each client's next call succeeds, with no reconnect call (same ``Client`` object)?
One daemon with two trust domains covers both durability modes with every kill: ``default``
is write-back + Flush, ``wt`` is write-through.

Question 2 (``--mode client-death``): client processes holding leases and half-written
reservations, some holding still and some in the middle of operations, are SIGKILLed in
random order; how long until the daemon has released every pin (session end), is any chunk
left in flight or torn, and is the pool fully reclaimable (evict all -> every pool byte free, one
put fills the whole pool)? Plus a session-less client, released by the TTL.

The workload and the checks are ``bench/harness/crash.py`` and ``bench/harness/client_death.py``,
which ``tests/reliability/test_crash.py`` and ``test_client_death.py`` run in bounded versions. Exit status 1 if any check failed; the JSON is written either way.

    .venv/bin/python bench/crash_loop.py            # ~4-5 min on a 2-core box
    .venv/bin/python bench/crash_loop.py --quick    # 3 kills, 1 client-death round
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import format_table, install_sigterm_exit, write_json
from bench.harness import client_death as death
from bench.harness import crash
from bench.harness.daemon import Daemon


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs) if xs else None, "max": xs[-1] if xs else None,
            "min": xs[0] if xs else None}


def run_crash(args: argparse.Namespace) -> tuple[dict, list[str]]:
    root = tempfile.mkdtemp(prefix="kvc-crash-")
    try:
        loop = crash.CrashLoop(root, workers=args.workers, kills=args.kills, seed=args.seed,
                               load_s=(0.5, 2.0), down_s=(0.1, 1.0), quiesce_every=2, bytes_sample=args.bytes_sample,
                               nvme_bytes="512M", nvme_read=args.nvme_read, log=print)
        r = loop.run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failures = []
    try:
        crash.assert_contract(r)
    except AssertionError as e:
        failures.append(f"crash: {e}")
    t0 = r["restarts"][0]["t_kill"]
    restarts = []
    for rec in r["restarts"]:
        d = rec["durable"]
        row = {"kill": rec["kill"], "at_s": rec["t_kill"] - t0, "down_s": rec["down_s"],
               "daemon_start_s": rec["start_s"], "quiesced": rec["quiesced"], "durable_prompts": d["durable_prompts"],
               "durable_chunks": d["unique_durable_chunks"], "found": d["unique_found_chunks"],
               "lost": d["lost_chunks"],
               "bytes_checked_chunks": d["bytes_checked_chunks"], "wrong_bytes_chunks": d["mismatches"]}
        if "index" in rec:
            i = rec["index"]
            row.update(index_equals_nvme=i["equal"] and i["lookup_disagree"] == 0, indexed=i["indexed"],
                       nvme_chunks=i["nvme_chunks"], lmdb_keys=i["lmdb_keys"], prompts_looked_up=i["prompts"],
                       lookups_disagreeing=i["lookup_disagree"])
        restarts.append(row)
    out = {
        "kills": r["kills"],
        "kills_survived": sum(1 for x in restarts if x["lost"] == 0 and x["wrong_bytes_chunks"] == 0
                              and x.get("index_equals_nvme", True)),
        "workers": r["workers"],
        "seconds": r["seconds"],
        "chunks_written": r["chunks_written"],
        "chunks_read_and_checked_by_workers": r["chunks_read_by_workers"],
        "durable_chunks_final": r["restarts"][-1]["durable"]["unique_durable_chunks"],
        "durable_chunks_verified_per_restart": [x["found"] for x in restarts],
        "chunks_lost": r["chunks_lost"],
        "corrupt_chunks_served": r["corrupt_served"],
        "index_checks": len(r["index_checks"]),
        "index_checks_equal": sum(1 for i in r["index_checks"] if i["equal"] and i["lookup_disagree"] == 0),
        "recovery_s": _stats(r["recovery_s"]),
        "recovery_under_load_s": _stats(r["recovery_under_load_s"]),
        "unrecovered": r["unrecovered"],
        "unavailable_while_down": r["unavailable_while_down"],
        "unavailable_while_down_total": sum(r["unavailable_while_down"]),
        "unavailable_outside_outages": r["unavailable_outside_outages"],
        "client_errors": r["errors"],
        "unexpected_errors": r["unexpected_errors"],
        "worker_counters": r["counters"],
        "restarts": restarts,
    }
    return out, failures


def run_client_death(args: argparse.Namespace) -> tuple[dict, list[str]]:
    root = tempfile.mkdtemp(prefix="kvc-death-")
    rounds, failures = [], []
    try:
        d = Daemon(root, **death.SETTINGS).start()
        try:
            n_rounds = max(1, args.client_kills // args.per_round)
            for k in range(n_rounds):
                out = death.kill_round(d, root, n=args.per_round, seed=args.seed * 1000 + k, round_no=k)
                print(f"client-death round {k + 1}: {out['kills']} clients killed ({', '.join(out['kill_kinds'])}) "
                      f"holding {out['held_leases']} leases, {out['held_reservations']} reservations; all released "
                      f"in {out['released_s'] * 1e3:.1f} ms; in flight left {out['in_flight_tokens']}, torn "
                      f"{out['chunks_wrong']}/{out['chunks_checked']}, pool bytes free after evict "
                      f"{out['free_bytes_after_evict']}/{out['capacity_bytes']}, fill stored {out['fill_stored']} chunks")
                try:
                    death.assert_reclaimed(out)
                    assert out["released_s"] < 2.0 and out["sessions_ended_logged"] == out["kills"], out
                except AssertionError as e:
                    failures.append(f"client-death round {k + 1}: {e}")
                rounds.append(out)
            ttl = death.ttl_round(d, root)
            print(f"session-less client: pins kept {ttl['kept_after_session_release']} after the session client's "
                  f"went in {ttl['session_released_s'] * 1e3:.1f} ms; TTL released them {ttl['ttl_released_s']:.2f} s "
                  f"after the kill")
            try:
                death.assert_reclaimed(ttl)
                assert ttl["kept_after_session_release"] == (3, 1) and ttl["leases_expired"] == 3, ttl
            except AssertionError as e:
                failures.append(f"client-death ttl: {e}")
        finally:
            d.stop(signal.SIGKILL)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    released = [r["released_s"] for r in rounds]
    out = {
        "clients_killed": sum(r["kills"] for r in rounds) + 2,
        "rounds": rounds,
        "release_after_last_kill_s": _stats(released),
        "leases_held_at_kill": sum(r["held_leases"] for r in rounds),
        "reservations_held_at_kill": sum(r["held_reservations"] for r in rounds),
        "in_flight_tokens_left": sum(r["in_flight_tokens"] for r in rounds) + ttl["in_flight_tokens"],
        "torn_chunks": sum(r["chunks_wrong"] for r in rounds) + ttl["chunks_wrong"],
        "chunks_checked": sum(r["chunks_checked"] for r in rounds),
        "pool_fully_reclaimed": all(r["free_bytes_after_evict"] == r["capacity_bytes"] and r["fill_whole"]
                                    for r in rounds + [ttl]),
        "ttl": ttl,
    }
    return out, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["both", "crash", "client-death"], default="both")
    ap.add_argument("--kills", type=int, default=24, help="daemon SIGKILLs (>= 20 for the full run)")
    ap.add_argument("--workers", type=int, default=3, help="client processes loading the daemon")
    ap.add_argument("--client-kills", type=int, default=24, help="client processes SIGKILLed (session clients)")
    ap.add_argument("--per-round", type=int, default=6, help="client processes per client-death round")
    ap.add_argument("--bytes-sample", type=int, default=300,
                    help="durable prompts whose bytes are read back after each restart (all of them at the end)")
    ap.add_argument("--nvme-read", choices=["mixed", "promote", "direct"], default="mixed",
                    help="how workers and the checker read NVMe-only chunks (mixed: some workers each way)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="3 kills, one client-death round; writes crash_loop.quick.json")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    if args.quick:
        args.kills, args.workers, args.client_kills, args.per_round, args.bytes_sample = 3, 2, 4, 4, 50
    install_sigterm_exit()
    t0 = time.monotonic()
    payload: dict = {"question": __doc__.split("\n\n")[0], "settings": vars(args).copy()}
    failures: list[str] = []
    if args.mode in ("both", "crash"):
        payload["crash"], f = run_crash(args)
        failures += f
    if args.mode in ("both", "client-death"):
        payload["client_death"], f = run_client_death(args)
        failures += f
    payload["seconds"] = time.monotonic() - t0
    payload["failures"] = failures
    payload["all_checks_passed"] = not failures

    print()
    if "crash" in payload:
        c = payload["crash"]
        rows = [
            ["daemon SIGKILLs survived", f"{c['kills_survived']} / {c['kills']}"],
            ["chunks written (both modes)", c["chunks_written"]],
            ["chunks read + checked by workers", c["chunks_read_and_checked_by_workers"]],
            ["durable chunks at the end (verified, bytes read)", c["durable_chunks_final"]],
            ["durable chunks verified per restart (min / max)",
             f"{min(c['durable_chunks_verified_per_restart'])} / {max(c['durable_chunks_verified_per_restart'])}"],
            ["durable chunks lost", c["chunks_lost"]],
            ["corrupt chunks served", c["corrupt_chunks_served"]],
            ["index == NVMe checks passed", f"{c['index_checks_equal']} / {c['index_checks']}"],
            ["client recovery after restart, median / max (s) [a]",
             f"{c['recovery_s']['median']:.3f} / {c['recovery_s']['max']:.3f}" if c["recovery_s"]["n"] else "-"],
            ["  restarts under load only, median / max (s)",
             f"{c['recovery_under_load_s']['median']:.3f} / {c['recovery_under_load_s']['max']:.3f}"
             if c["recovery_under_load_s"]["n"] else "-"],
            ["UNAVAILABLE errors while down (total; min per outage)",
             f"{c['unavailable_while_down_total']}; {min(c['unavailable_while_down'])}"],
            ["UNAVAILABLE outside outages / unexpected errors",
             f"{c['unavailable_outside_outages']} / {c['unexpected_errors']}"],
        ]
        print(format_table(["daemon crash loop", "value"], rows))
        print("[a] from the moment clients may call the new daemon to each (worker, domain)'s next successful "
              "call: the daemon's ready line (restarts under load; 0 = back before the ready line was read) or "
              "the end of the pause (restarts with the workers paused for the index check)")
        print()
    if "client_death" in payload:
        d = payload["client_death"]
        rel = d["release_after_last_kill_s"]
        rows = [
            ["client processes SIGKILLed", d["clients_killed"]],
            ["leases / reservations they held", f"{d['leases_held_at_kill']} / {d['reservations_held_at_kill']}"],
            ["all pins released after the last kill, median / max (ms)",
             f"{rel['median'] * 1e3:.1f} / {rel['max'] * 1e3:.1f}"],
            ["in-flight tokens left behind", d["in_flight_tokens_left"]],
            ["torn chunks (of checked)", f"{d['torn_chunks']} / {d['chunks_checked']}"],
            ["pool fully reclaimable every round", d["pool_fully_reclaimed"]],
            ["session-less client released by TTL after (s)", f"{d['ttl']['ttl_released_s']:.2f}"],
        ]
        print(format_table(["client death", "value"], rows))
        print()
    name = "crash_loop.quick" if args.quick else "crash_loop"
    path = write_json(name, payload, args.out)
    print(f"wrote {path} in {payload['seconds']:.0f} s")
    for f in failures:
        print("FAILED:", f[:2000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
