"""Cross-host failures at full length: a hung remote store, a restart storm behind the router,
and Redis Cluster resharding under load, side by side in one run.

Question: do the three cross-host failure guarantees whose bounded versions are tests still hold
when each is run for much longer, under continuous load?

1. Hung remote store (``tests/test_remote_deadline.py``): a 6-node Redis Cluster with every node
   SIGSTOPped, a single frozen Redis, and a TCP listener that accepts and never answers, each
   frozen for ``--freeze`` seconds while several client threads acquire prompts no tier holds
   (each goes to the remote). Acquire latency p50 / p99 / max while frozen against the tests'
   bound, ``remote_timeout`` x round trips + 50 ms (round trips: the fetch windows the prompt
   needs, :data:`kvcached.remotefill.FETCH_WINDOW_BYTES` each; one here, as in the tests),
   errors (target 0), and the time from SIGCONT until a chunk published before the freeze is a
   hit (target: within the tests' 15 s).
2. Restart storm (``tests/router/test_router_e2e.py``, the restart-storm test): three simulated
   hosts (real daemons publishing KV events) behind ``kvcached-router`` with its audit on; every
   daemon restarted ``--restarts`` times (SIGTERM and SIGKILL in turn; every other round 0.3 s
   apart, while the router may still be catching up) while four clients send requests sharing
   four system prompts. Wrong routes (target < 0.1 % of audited routes), failed requests
   (target 0), requests routed, and how long the router took to see each new event stream. Each
   wrong route is set beside the restarts of the host it chose: a route answered after that
   daemon's signal (the audit asks the daemons after the answer and finds a stopped one holding
   nothing), or made within 50 ms after it, is a race no router can win, counted apart from
   routes on a stale index.
3. Resharding under load (``tests/test_remote_daemons.py``, the resharding test): two daemons
   ("hosts" A and B) share a 6-node cluster (the one section 1 froze, ready again), each putting
   its own prompts and acquiring the other's (small pools: they come from the cluster) while slots
   migrate between primaries and a fourth primary joins, takes slots, gives them back and leaves
   (twice in the full run). Client errors (0), corrupt chunks (0), hits from the cluster resuming
   after every step, and acquire p50 / p99 during migrations against before them.

The servers, daemons, fleet, router and load are the tests' own (``bench/harness`` and
``bench/routing``, which the tests import; the resharding load is timed here by wrapping its
``fetch``): the bench runs them longer and measures.
Exit status 1 if a target was not met; the JSON is written either way.

    .venv/bin/python bench/cross_host.py            # ~5-5.5 min on a 2-core box
    .venv/bin/python bench/cross_host.py --quick    # ~70 s, a smoke run: the fleet of section 2
                                                    # (~30-40 s to start) starts while 1 and 3 run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: import bench

from bench._common import format_table, install_sigterm_exit, percentile, write_json
from bench.harness import redis_servers
from bench.harness import remote_hosts as hosts
from bench.harness.daemon import Daemon
from bench.harness.layouts import TINY, payload, prompt
from bench.harness.redis_servers import RedisCluster, RedisServer, cli, free_ports
from bench.routing import router
from bench.routing.fleet import SimFleet
from kvcached.contract.keys import write_new_key
from kvcached.remotefill import FETCH_WINDOW_BYTES
from kvcached.store import Store
from kvcached_client import Client

#: Targets (the tests' own bounds where they have one).
WRONG_ROUTE_PCT_MAX = 0.1
HITS_RESUME_S_MAX = 15.0  # wait_hit's default (bench/harness/remote_hosts.py), the tests' bound
STEP_HITS_RESUME_S_MAX = 30.0  # the resharding test's wait after every step


# -- 1. hung remote store ----------------------------------------------------------------------


def round_trips(chunks: int) -> int:
    """Remote round trips an acquire of ``chunks`` TINY chunks may wait for: one per fetch window
    (kvcached.remotefill.RemoteFill); the bound is ``remote_timeout`` x this + the tests' margin."""
    return max(1, math.ceil(chunks * TINY.chunk_bytes / FETCH_WINDOW_BYTES))


def acquire_misses(store: Store, lid: object, threads: int, seconds: float, base: int,
                   pause: float = 0.001) -> tuple[list[float], list[str], int]:
    """``threads`` threads acquire 2-chunk prompts no tier holds, one after another (``pause``
    between), for ``seconds``. Returns every acquire's wall time, the errors, and how many
    acquires were served any token (none should be: nothing holds these prompts)."""
    lat: list[float] = []
    errors: list[str] = []
    served = [0]
    stop_at = time.monotonic() + seconds

    def worker(k: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            toks = prompt(2, start=base + k * 100_000_000 + i * 8)
            i += 1
            t0 = time.perf_counter()
            try:
                lease = store.acquire(lid, toks)
                lat.append(time.perf_counter() - t0)
                served[0] += lease.matched_tokens > 0
                store.release(lease.lease_id)
            except Exception as e:  # noqa: BLE001 - every error is a figure
                lat.append(time.perf_counter() - t0)
                errors.append(f"{type(e).__name__}: {e}")
            time.sleep(pause)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat, errors, served[0]


@contextlib.contextmanager
def hung_remote(kind: str, root: Path, cluster: RedisCluster) -> Iterator[tuple[list[str], bool, Callable[[], None],
                                                                              Callable[[], None]]]:
    """The remote of case ``kind``: (its nodes, cluster?, freeze, thaw)."""
    if kind == "cluster":
        yield ([f"127.0.0.1:{n.port}" for n in cluster.nodes], True,
               lambda: [n.freeze() for n in cluster.nodes], lambda: [n.thaw() for n in cluster.nodes])
    elif kind == "single":
        server = RedisServer(free_ports(1)[0], str(root / "redis")).start()
        try:
            yield [f"127.0.0.1:{server.port}"], False, server.freeze, server.thaw
        finally:
            server.stop()
    else:  # a listener that accepts and never answers: nothing to freeze
        with hosts.silent_listener() as port:
            yield [f"127.0.0.1:{port}"], False, lambda: None, lambda: None


def timed_hit(store: Store, lid: object, toks: list[int], chunks: int, timeout: float) -> float | None:
    """Seconds until ``toks`` is a full hit (the tests' wait_hit, polling every 0.1 s); None if not
    within ``timeout``."""
    t0 = time.monotonic()
    try:
        hosts.wait_hit(store, lid, toks, chunks, timeout=timeout)
    except AssertionError:
        return None
    return time.monotonic() - t0


def hung_case(kind: str, root: Path, cluster: RedisCluster, seconds: float, threads: int) -> dict:
    """One frozen remote (``kind``: the whole ``cluster`` / a single Redis / a silent listener)
    under ``threads`` acquiring threads."""
    root = root / kind
    root.mkdir(parents=True)
    rounds = round_trips(2)
    bound = hosts.TIMEOUT * rounds + hosts.MARGIN
    answers = kind != "silent"
    cluster = cluster if kind == "cluster" else None
    with hung_remote(kind, root, cluster) as (nodes, is_cluster, freeze, thaw):
        a = hosts.host(root, "a", nodes, cluster=is_cluster) if answers else None
        b = hosts.host(root, "b", nodes, cluster=is_cluster, key_from=a.config.state_dir if a else None)
        try:
            lid = b.register_layout(TINY)
            later = prompt(3, start=4_000_011)
            primaries_before = sorted(n.port for n in cluster.primaries()) if cluster else None
            if a is not None:
                a.register_layout(TINY)
                warm = prompt(4, start=11)
                a.put(lid, warm, [payload(i) for i in range(4)])
                a.put(lid, later, [payload(i, salt=1) for i in range(3)])  # b fetches it only after the thaw
                a.publisher.drain()
                hosts.wait_hit(b, lid, warm, 4)  # b's client is connected (a cluster's slot map known)
            freeze()
            try:
                lat, errors, served = acquire_misses(b, lid, threads, seconds, base=10_000_000)
            finally:
                thaw()
            remote = dataclasses.asdict(b.stats().remote)
            out: dict = {
                "nodes": len(nodes), "frozen_s": seconds, "client_threads": threads,
                "acquires": len(lat), "latency": latency_ms(lat),
                "over_bound": sum(x > bound for x in lat), "errors": len(errors), "error_samples": errors[:5],
                "served_while_frozen": served, "remote_after": remote,
            }
            if a is not None:
                out["hits_resume_s"] = timed_hit(b, lid, later, 3, HITS_RESUME_S_MAX)
                out["remote_after_resume"] = dataclasses.asdict(b.stats().remote)
                if out["hits_resume_s"] is not None:  # and a prompt published after the thaw
                    fresh = prompt(2, start=4_100_011)
                    a.put(lid, fresh, [payload(i, salt=2) for i in range(2)])
                    out["published_after_thaw_hit_s"] = timed_hit(b, lid, fresh, 2, 30.0)
                else:  # the control: does a host that never saw the freeze get that hit from this remote?
                    c = hosts.host(root, "control", nodes, cluster=is_cluster, key_from=a.config.state_dir)
                    try:
                        c.register_layout(TINY)
                        out["fresh_host_hit_s"] = timed_hit(c, lid, later, 3, HITS_RESUME_S_MAX)
                    finally:
                        c.close()
            if cluster is not None:
                cluster.wait_ready(90)
                out["primaries_changed"] = sorted(n.port for n in cluster.primaries()) != primaries_before
        finally:
            b.close()
            if a is not None:
                a.close()
    p99, mx = out["latency"]["p99_ms"], out["latency"]["max_ms"]
    out["targets"] = {
        "p99_within_bound": p99 is not None and p99 <= bound * 1e3,
        "max_within_bound": mx is not None and mx <= bound * 1e3,
        "no_errors": out["errors"] == 0,
        "nothing_served_while_frozen": served == 0,
    }
    if answers:
        out["targets"]["hits_resume_within_15s"] = out["hits_resume_s"] is not None
    return out


def run_hung(root: Path, cluster: RedisCluster, seconds: float, threads: int) -> dict:
    logging.getLogger("kvcached.remote").setLevel(logging.ERROR)  # each failed call: counted in the stats instead
    rounds = round_trips(2)
    res: dict = {"remote_timeout_s": hosts.TIMEOUT, "round_trips": rounds, "margin_s": hosts.MARGIN,
                 "bound_ms": (hosts.TIMEOUT * rounds + hosts.MARGIN) * 1e3, "cases": {}}
    for kind in ("cluster", "single", "silent"):
        t0 = time.monotonic()
        res["cases"][kind] = case = hung_case(kind, root / "hung", cluster, seconds, threads)
        case["seconds"] = time.monotonic() - t0
        print(f"  hung remote, {kind}: {case['acquires']} acquires, p99 {case['latency']['p99_ms']:.1f} ms, "
              f"max {case['latency']['max_ms']:.1f} ms, {case['errors']} errors, "
              f"hits resume {case.get('hits_resume_s')} s", flush=True)
    res["targets_met"] = all(all(c["targets"].values()) for c in res["cases"].values())
    return res


def latency_ms(xs: list[float]) -> dict:
    """p50 / p99 / max of wall times in seconds, in ms (nearest rank); None when empty."""
    s = sorted(xs)
    if not s:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(s), "p50_ms": percentile(s, 50) * 1e3, "p99_ms": percentile(s, 99) * 1e3, "max_ms": s[-1] * 1e3}


# -- 2. restart storm behind the router --------------------------------------------------------


class RoutedFleet:
    """Three simulated hosts behind kvcached-router with the audit on, as the router e2e tests'
    module fixtures set them up. One thread of its own starts it and, told to, stops it: the
    fleet's children die with the thread that started them (PR_SET_PDEATHSIG), so that thread
    must outlive them; it also lets ``--quick`` start the fleet while the other sections run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fleet: SimFleet | None = None
        self.url = ""
        self.router_log: collections.deque[str] = collections.deque(maxlen=200)
        self.error: BaseException | None = None
        self.start_s: float | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._own, name="fleet owner", daemon=True)

    def begin(self) -> RoutedFleet:
        self._thread.start()
        return self

    def wait(self, timeout: float = 300.0) -> SimFleet:
        if not self._ready.wait(timeout) or self.fleet is None:
            raise RuntimeError(f"the fleet did not start: {self.error!r}") from self.error
        return self.fleet

    def close(self) -> None:
        self._done.set()
        if self._thread.ident is not None:  # begun
            self._thread.join(180)

    def _own(self) -> None:
        t0 = time.monotonic()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with SimFleet(3, str(self.root / "fleet"), prefill_tps=50_000, decode_tps=400) as fleet:
                config = fleet.kvcached_router_config(audit=True, health_interval=0.3, provisional_ttl=5.0)
                self.url, proc = router.start_router(config, self.root)
                # start_router leaves its output on a pipe: read it, so the router never blocks on a full one
                threading.Thread(target=lambda: self.router_log.extend(proc.stdout), daemon=True).start()
                try:
                    self.start_s = time.monotonic() - t0
                    self.fleet = fleet
                    self._ready.set()
                    self._done.wait()
                finally:
                    proc.terminate()
                    proc.wait(20)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e
        finally:
            self.fleet = None
            self._ready.set()


def router_counters(url: str) -> dict[str, float]:
    """The router's counters the storm is judged by, summed over their labels."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    names = {"routes": "kvcached_router_routes_total", "audited": "kvcached_router_audited_routes_total",
             "unaudited": "kvcached_router_unaudited_routes_total",
             "wrong": "kvcached_router_wrong_routes_total", "failovers": "kvcached_router_failovers_total"}
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for key, name in names.items():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


class StormLoad:
    """The storm test's four clients: requests sharing four system prompts, each answer checked
    for a 200; every request's (start, seconds, status) kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.requests: list[tuple[float, float, int]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(clients)]

    def start(self) -> StormLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, k: int) -> None:
        j = 0
        while not self._stop.is_set():
            body = router.chat(router.words(400 + (j % 4), 160), router.words(500 + k * 1000 + j, 8))
            t0 = time.monotonic()
            try:
                code, _, r = router.post(self.url + "/v1/chat/completions", body)
            except Exception as e:  # noqa: BLE001 - a request that raised failed
                code, r = 0, {"error": f"{type(e).__name__}: {e}"}
            self.requests.append((t0, time.monotonic() - t0, code))
            if code != 200:
                self.failures.append(f"{code}: {str(r)[:300]}")
            j += 1


class StreamWatch:
    """Polls the router's /router/state every 50 ms: when it saw each host's new event stream."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StreamWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def restarts_seen(self, host: str, after: float) -> float | None:
        """The first poll after ``after`` whose restart count for ``host`` is above the last one before it."""
        before = max((s[host] for t, s in self.seen if t <= after), default=0)
        return next((t for t, s in self.seen if t > after and s[host] > before), None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                st = router.state(self.url)
                self.seen.append((time.monotonic(), {h: v["events_restarts"] or 0 for h, v in st.items()}))
            except (OSError, ValueError):
                pass
            time.sleep(0.05)


#: A wrong route made this soon after its chosen daemon was signalled could not have known (the
#: router hears of a stopped daemon when its event stream drops, within milliseconds).
SIGNAL_RACE_S = 0.05


def explain_wrong(row: dict, restarts: list[dict], answered_within_s: float) -> dict:
    """A wrong route from the router's decision log, beside the restart of the host it chose that
    was signalled nearest to it: ``signal_offset_s`` (negative: the route came first) and
    ``since_ready_s`` (negative: the new daemon was not ready yet), and a class:

    * ``signal_race``: the daemon was signalled at most ``answered_within_s`` (the storm's p99
      request time) after the route, so the audit, which asks every daemon once the answer is
      back, found it gone (holding nothing); or at most :data:`SIGNAL_RACE_S` before it;
    * ``while_down``: later, before the new daemon was ready;
    * ``after_ready``: within 10 s of the new daemon being ready, the router's index said more
      than it held (the stale-index failure the router's design is about);
    * ``no_restart_near``: none of these."""
    mine = [r for r in restarts if r["host"] == row["host"]]
    out = {"host": row["host"], "reason": row["reason"], "index_chunks": row.get("index_chunks"),
           "oracle_tokens": row.get("oracle_tokens"), "loads": row.get("loads"), "class": "no_restart_near"}
    if not mine:
        return out
    near = min(mine, key=lambda r: abs(row["t"] - r["wall0"]))
    offset = row["t"] - near["wall0"]
    before = [r for r in mine if r["wall0"] <= row["t"]]
    last = before[-1] if before else None
    since_ready = None if last is None else row["t"] - last["wall0"] - last["ready_s"]
    if -max(answered_within_s, SIGNAL_RACE_S) <= offset <= SIGNAL_RACE_S:
        out["class"] = "signal_race"
    elif since_ready is not None and since_ready < 0:
        out["class"] = "while_down"
    elif since_ready is not None and since_ready < 10.0:
        out["class"] = "after_ready"
    out.update(signal=near["signal"], signal_offset_s=offset, since_ready_s=since_ready)
    return out


def run_storm(owner: RoutedFleet, rounds: int) -> dict:
    """Every daemon restarted ``rounds`` times under the storm test's load."""
    fleet = owner.wait()
    url = owner.url
    names = [h.name for h in fleet.hosts]
    before = router_counters(url)
    watch = StreamWatch(url).start()
    wall_start = time.time()
    load = StormLoad(url).start()
    restarts: list[dict] = []
    t_start = time.monotonic()
    try:
        time.sleep(1.0)
        for rnd in range(rounds):
            pause = 1.0 if rnd % 2 == 0 else 0.3  # odd rounds: while the router may still be catching up
            for k, name in enumerate(names):
                sig = signal.SIGKILL if (k + rnd) % 2 else signal.SIGTERM
                t0, wall0 = time.monotonic(), time.time()
                fleet.restart_daemon(k, sig)
                restarts.append({"round": rnd, "host": name, "signal": sig.name, "t0": t0, "wall0": wall0,
                                 "ready_s": time.monotonic() - t0, "pause_after_s": pause})
                time.sleep(pause)
        time.sleep(1.0)
    finally:
        load.stop()
    storm_s = time.monotonic() - t_start
    t_end = time.monotonic()
    router.wait(lambda: all(h["healthy"] for h in router.state(url).values()), 20, "every host healthy again")
    healthy_s = time.monotonic() - t_end
    sent = len(load.requests)
    # The audit runs after each answer: wait until it has caught up with every route of the storm.
    deadline_t = time.monotonic() + 30
    while True:
        after = router_counters(url)
        judged = after["audited"] + after["unaudited"] - before["audited"] - before["unaudited"]
        if judged >= after["routes"] - before["routes"] or time.monotonic() > deadline_t:
            break
        time.sleep(0.2)
    watch.stop()
    for r in restarts:
        seen = watch.restarts_seen(r["host"], r["t0"])
        r["router_saw_new_stream_after_ready_s"] = None if seen is None else seen - r["t0"] - r["ready_s"]
        r["t0"] = r["t0"] - t_start
    # The router keeps its last 10,000 decisions: a longer storm's first wrong routes are not explained.
    wrong_rows = [w for w in router.get(url + "/router/decisions?wrong=1&limit=10000") if w["t"] >= wall_start]
    request_latency = latency_ms([d for _, d, _ in load.requests])
    explained = [explain_wrong(w, restarts, (request_latency["p99_ms"] or 0.0) / 1e3) for w in wrong_rows]
    classes = collections.Counter(w["class"] for w in explained)
    delta = {k: after[k] - before[k] for k in after}
    wrong_pct = 100.0 * delta["wrong"] / delta["audited"] if delta["audited"] else None
    by_sig = {s: [r["ready_s"] for r in restarts if r["signal"] == s] for s in ("SIGTERM", "SIGKILL")}
    seen_s = [s for r in restarts if (s := r["router_saw_new_stream_after_ready_s"]) is not None]
    out = {
        "hosts": len(names), "restarts_per_daemon": rounds, "restarts": len(restarts), "client_threads": 4,
        "fleet_start_s": owner.start_s, "storm_s": storm_s, "requests_sent": sent,
        "requests_per_s": sent / storm_s if storm_s else None,
        "failed_requests": len(load.failures), "failure_samples": load.failures[:5],
        "routed": delta["routes"], "audited": delta["audited"], "unaudited": delta["unaudited"],
        "wrong_routes": delta["wrong"],
        "wrong_route_pct": wrong_pct, "failovers": delta["failovers"],
        "request_latency": request_latency,
        "restart_to_ready": {s: latency_ms(v) for s, v in by_sig.items()},
        "router_saw_new_stream_after_ready": latency_ms(seen_s), "restarts_the_router_never_saw":
            sum(r["router_saw_new_stream_after_ready_s"] is None for r in restarts),
        "all_healthy_after_s": healthy_s, "restart_log": restarts,
        "wrong_routes_in_decision_log": len(wrong_rows), "wrong_routes_by_class": dict(classes),
        "wrong_route_pct_without_signal_races": 100.0 * (delta["wrong"] - classes["signal_race"]) / delta["audited"]
        if delta["audited"] else None,
        "wrong_routes_explained": explained[:40],
    }
    out["targets"] = {
        "wrong_routes_below_0.1pct": wrong_pct is not None and wrong_pct < WRONG_ROUTE_PCT_MAX,
        "no_failed_requests": not load.failures,
        "every_request_routed_and_audited": (delta["routes"] == sent
                                             and delta["audited"] + delta["unaudited"] >= delta["routes"]),
    }
    out["targets_met"] = all(out["targets"].values())
    print(f"  restart storm: {sent} requests, {len(load.failures)} failed, {delta['wrong']:.0f} of "
          f"{delta['audited']:.0f} audited routes wrong ({wrong_pct if wrong_pct is not None else float('nan'):.3f} %)",
          flush=True)
    return out


# -- 3. resharding and a node added and removed under load -------------------------------------


class TimedLoad(hosts.Load):
    """The resharding test's load (``Load``: each host puts its prompts and acquires the other's,
    every byte checked), with each acquire's (start, wall time) kept."""

    def __init__(self, sockets: dict[str, str]) -> None:
        super().__init__(sockets)
        self.acquires: list[tuple[float, float]] = []

    def fetch(self, c: Client, owner: str, k: int) -> list[bytes]:
        t0 = time.monotonic()
        got = super().fetch(c, owner, k)
        self.acquires.append((t0, time.monotonic() - t0))
        return got


def reshard_plan(quick: bool) -> list[tuple]:
    """Steps: ("move", src, dst, slots) between primaries p0..p2 and the joining node "x", or
    ("add",) / ("remove",) the joining node. Every primary ends with the slots it started with."""
    if quick:
        return [("move", "p0", "p1", 500), ("add",), ("move", "p1", "x", 500), ("move", "x", "p0", 500),
                ("remove",)]
    ring = [("move", "p0", "p1", 2000), ("move", "p1", "p2", 2000), ("move", "p2", "p0", 2000)]
    return (ring + ring
            + [("add",), ("move", "p0", "x", 1500), ("move", "p1", "x", 1500), ("move", "x", "p2", 3000), ("remove",)]
            + [("add",), ("move", "p2", "x", 3000), ("move", "x", "p0", 1500), ("move", "x", "p1", 1500), ("remove",)])


def reshard_hosts(root: Path, cluster: RedisCluster) -> tuple[Daemon, Daemon]:
    """Hosts A and B as the resharding test makes them: one hash key, the cluster, small pools."""
    key = str(root / "domain.key")
    write_new_key(key)
    nodes = ",".join(f"{h}:{p}" for h, p in cluster.startup_nodes)
    out: list[Daemon] = []
    try:
        for name in ("a", "b"):
            (root / name).mkdir()
            out.append(Daemon(str(root / name), hash_key_file=key, remote_nodes=nodes, remote_cluster=True,
                              remote_timeout=0.3, pool_bytes="2M", nvme_bytes=0).start())
    except BaseException:
        for d in out:
            d.stop()
        raise
    return out[0], out[1]


def remote_failed_lines(d: Daemon) -> list[str]:
    """The daemon's log lines for remote calls that failed (fail-open misses, not client errors)."""
    return [line.strip() for line in list(d.output) if "remote " in line and " failed:" in line]


def run_step(step: tuple, cluster: RedisCluster, ports: dict[str, int], root: Path) -> None:
    """One step of :func:`reshard_plan`, with the resharding test's helpers."""
    p0 = ports["p0"]
    if step[0] == "move":
        _, src, dst, slots = step
        hosts.reshard(cluster, ports[src], ports[dst], slots)
    elif step[0] == "add":
        extra = RedisServer(free_ports(1)[0], str(root / f"extra-{time.monotonic_ns()}"),
                            extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                   "--cluster-node-timeout", "2000"]).start()
        hosts.add_primary(cluster, extra, via=p0)
        ports["x"] = extra.port
    else:  # remove: it holds no slots any more
        extra = next(n for n in cluster.nodes if n.port == ports["x"])
        hosts.settle(p0)
        cli(cluster.nodes[0].port, "--cluster", "del-node", f"127.0.0.1:{p0}", hosts.node_id(extra.port))
        cluster.nodes.remove(extra)
        extra.stop()
        del ports["x"]


def run_resharding(root: Path, cluster: RedisCluster, baseline_s: float, quick: bool) -> dict:
    """The resharding test's hosts and load on ``cluster``, through :func:`reshard_plan`."""
    root = root / "reshard"
    root.mkdir(parents=True)
    cluster.wait_ready(90)
    a = b = None
    load = None
    original = list(cluster.nodes)
    try:
        a, b = reshard_hosts(root, cluster)
        load = TimedLoad({"a": a.socket, "b": b.socket}).start()
        with Client(a.socket) as ca, Client(b.socket) as cb:
            def cluster_hits() -> int:
                return hosts.remote(ca)["hits"] + hosts.remote(cb)["hits"]

            hosts.wait_for(lambda: load.hits_since(0) > 0, 20, "cross-host hits before resharding")
            t_base = time.monotonic()
            time.sleep(baseline_s)
            primaries = [n.port for n in cluster.primaries()]
            ports = {f"p{i}": p for i, p in enumerate(primaries)}
            steps: list[dict] = []
            for step in reshard_plan(quick):
                t0 = time.monotonic()
                run_step(step, cluster, ports, root)
                t1 = time.monotonic()
                hits0 = cluster_hits()
                try:
                    hosts.wait_for(lambda: cluster_hits() > hits0, STEP_HITS_RESUME_S_MAX, "cluster hits")
                    resumed = time.monotonic() - t1
                except AssertionError:
                    resumed = None
                steps.append({"step": " ".join(map(str, step)), "start": t0, "end": t1, "seconds": t1 - t0,
                              "hits_resumed_s": resumed})
                print(f"  reshard step {step}: {t1 - t0:.1f} s, cluster hits again after {resumed} s", flush=True)
            t_end = time.monotonic()
            remote_after = {"a": hosts.remote(ca), "b": hosts.remote(cb)}
    finally:
        if load is not None:
            load.stop()
        remote_failures = [] if a is None else remote_failed_lines(a) + remote_failed_lines(b)
        for d in (a, b):
            if d is not None and d.proc is not None:
                d.stop()
        for n in cluster.nodes:
            if n not in original:  # a joining node a failed step left behind
                n.stop()
        cluster.nodes = original
    moves = [(s["start"], s["end"]) for s in steps if s["step"].startswith("move")]
    before = [d for t, d in load.acquires if t_base <= t < steps[0]["start"]]
    during = [d for t, d in load.acquires if any(s <= t <= e for s, e in moves)]
    lat_before, lat_during = latency_ms(before), latency_ms(during)
    out = {
        "baseline_s": steps[0]["start"] - t_base, "migrations": len(moves),
        "slots_moved": sum(int(s["step"].split()[3]) for s in steps if s["step"].startswith("move")),
        "nodes_added_and_removed": sum(s["step"] == "add" for s in steps),
        "steps_s": t_end - steps[0]["start"], "requests": load.requests, "acquires": len(load.acquires),
        "client_errors": len(load.errors), "error_samples": load.errors[:5], "corrupt_chunks": load.corrupt,
        "cross_host_hits": sum(n for _, n in load.cross_hits),
        "refused_by_hosts": sum(sum(r["refused"].values()) for r in remote_after.values()),
        "remote_after": remote_after, "remote_failure_samples": remote_failures[:10],
        "acquire_before": lat_before, "acquire_during_migrations": lat_during,
        "p50_during_over_before": ratio_or_none(lat_during["p50_ms"], lat_before["p50_ms"]),
        "p99_during_over_before": ratio_or_none(lat_during["p99_ms"], lat_before["p99_ms"]),
        "hits_resumed_after_step": latency_ms([s["hits_resumed_s"] for s in steps if s["hits_resumed_s"] is not None]),
        "steps": [{k: v for k, v in s.items() if k not in ("start", "end")} for s in steps],
    }
    out["targets"] = {
        "no_client_errors": out["client_errors"] == 0,
        "no_corrupt_chunks": load.corrupt == 0 and out["refused_by_hosts"] == 0,
        "hits_resume_after_every_step": all(s["hits_resumed_s"] is not None for s in steps),
    }
    out["targets_met"] = all(out["targets"].values())
    return out


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- report --------------------------------------------------------------------------------------


def fmt(v: object, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def summary_rows(payload: dict) -> list[list[object]]:
    rows: list[list[object]] = []
    hung = payload.get("hung_remote")
    if hung:
        bound = hung["bound_ms"]
        for kind, c in hung["cases"].items():
            lat = c["latency"]
            rows.append([f"hung {kind}: acquire p50 / p99 / max ms ({lat['n']})",
                         f"{fmt(lat['p50_ms'], 2)} / {fmt(lat['p99_ms'])} / {fmt(lat['max_ms'])}",
                         f"<= {bound:.0f}", c["targets"]["p99_within_bound"] and c["targets"]["max_within_bound"]])
            rows.append([f"hung {kind}: errors / served while frozen", f"{c['errors']} / {c['served_while_frozen']}",
                         "0 / 0", c["targets"]["no_errors"] and c["targets"]["nothing_served_while_frozen"]])
            if "hits_resume_s" in c:
                got = fmt(c["hits_resume_s"], 2)
                if c["hits_resume_s"] is None:  # say whether the remote could serve it (the control)
                    got = f"none in {HITS_RESUME_S_MAX:.0f} s (a fresh host: {fmt(c.get('fresh_host_hit_s'), 2)} s)"
                rows.append([f"hung {kind}: hits resume after SIGCONT, s", got,
                             f"<= {HITS_RESUME_S_MAX:.0f}", c["targets"]["hits_resume_within_15s"]])
    storm = payload.get("restart_storm")
    if storm:
        rows.append([f"storm: wrong routes ({storm['restarts']} restarts)",
                     f"{storm['wrong_routes']:.0f} / {storm['audited']:.0f} = {fmt(storm['wrong_route_pct'], 3)} %",
                     f"< {WRONG_ROUTE_PCT_MAX} %", storm["targets"]["wrong_routes_below_0.1pct"]])
        by = storm["wrong_routes_by_class"]
        rows.append(["storm: wrong routes by class", ", ".join(f"{k} {v}" for k, v in sorted(by.items())) or "-",
                     "", ""])
        rows.append(["storm: wrong routes without signal races",
                     f"{fmt(storm['wrong_route_pct_without_signal_races'], 3)} %", "", ""])
        rows.append(["storm: failed / sent / routed",
                     f"{storm['failed_requests']} / {storm['requests_sent']} / {storm['routed']:.0f}",
                     "0 failed", storm["targets"]["no_failed_requests"]
                     and storm["targets"]["every_request_routed_and_audited"]])
        seen = storm["router_saw_new_stream_after_ready"]
        rows.append(["storm: router sees a new stream after ready, p50 / max s",
                     f"{fmt(seconds(seen['p50_ms']), 2)} / {fmt(seconds(seen['max_ms']), 2)}", "", ""])
    rs = payload.get("resharding")
    if rs:
        rows.append([f"reshard: errors / corrupt ({rs['migrations']} migrations, {rs['slots_moved']} slots)",
                     f"{rs['client_errors']} / {rs['corrupt_chunks']}", "0 / 0",
                     rs["targets"]["no_client_errors"] and rs["targets"]["no_corrupt_chunks"]])
        hr = rs["hits_resumed_after_step"]
        rows.append(["reshard: hits again after a step, p50 / max s",
                     f"{fmt(seconds(hr['p50_ms']), 2)} / {fmt(seconds(hr['max_ms']), 2)}",
                     f"every step, <= {STEP_HITS_RESUME_S_MAX:.0f}", rs["targets"]["hits_resume_after_every_step"]])
        b, d = rs["acquire_before"], rs["acquire_during_migrations"]
        rows.append(["reshard: acquire p50 / p99 ms, before", f"{fmt(b['p50_ms'], 2)} / {fmt(b['p99_ms'], 2)}", "", ""])
        rows.append(["reshard: acquire p50 / p99 ms, during",
                     f"{fmt(d['p50_ms'], 2)} / {fmt(d['p99_ms'], 2)} "
                     f"({fmt(rs['p50_during_over_before'], 2)}x / {fmt(rs['p99_during_over_before'], 2)}x)", "", ""])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run; writes cross_host.quick.json")
    ap.add_argument("--freeze", type=float, default=None, help="seconds each remote stays frozen (20; quick 3)")
    ap.add_argument("--threads", type=int, default=4, help="acquiring client threads while frozen")
    ap.add_argument("--restarts", type=int, default=None, help="restarts per daemon in the storm (5; quick 1)")
    ap.add_argument("--baseline", type=float, default=None, help="seconds of load before resharding (20; quick 3)")
    ap.add_argument("--only", default="hung,storm,reshard", help="sections to run (comma-separated)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    args.freeze = args.freeze if args.freeze is not None else (3.0 if args.quick else 20.0)
    args.restarts = args.restarts if args.restarts is not None else (1 if args.quick else 5)
    args.baseline = args.baseline if args.baseline is not None else (3.0 if args.quick else 20.0)
    only = set(args.only.split(","))
    why = redis_servers.missing()
    if why:
        print(f"cross_host: {why}", file=sys.stderr)
        return 2
    install_sigterm_exit()
    t0 = time.monotonic()
    payload: dict = {"question": __doc__.split("\n\n")[1], "quick": args.quick, "settings": vars(args).copy()}
    if args.quick:
        payload["note"] = ("a smoke run: the router fleet starts while the other sections run, so their "
                           "latencies include that load")
    root = Path(tempfile.mkdtemp(prefix="kvc-cross-host-"))
    owner = RoutedFleet(root / "storm") if "storm" in only else None
    cluster = None
    try:
        if owner is not None and args.quick:
            owner.begin()  # its ~40 s start (three engines' imports) overlaps sections 1 and 3
        if only & {"hung", "reshard"}:  # one cluster for both: frozen first, then resharded
            cluster = RedisCluster(str(root / "cluster")).start()
        if "hung" in only:
            print("hung remote store", flush=True)
            payload["hung_remote"] = run_hung(root, cluster, args.freeze, args.threads)
        if "reshard" in only:
            print("resharding and a node added and removed under load", flush=True)
            payload["resharding"] = run_resharding(root, cluster, args.baseline, args.quick)
        if owner is not None:
            print("restart storm behind the router", flush=True)
            if not args.quick:
                owner.begin()
            payload["restart_storm"] = run_storm(owner, args.restarts)
    finally:
        if cluster is not None:
            cluster.stop()
        if owner is not None:
            owner.close()
        shutil.rmtree(root, ignore_errors=True)
    payload["seconds"] = time.monotonic() - t0
    sections = {k: payload[k]["targets_met"] for k in ("hung_remote", "restart_storm", "resharding") if k in payload}
    payload["targets_met"] = sections
    payload["all_targets_met"] = all(sections.values())
    print()
    print(format_table(["cross-host check", "measured", "target", "met"], summary_rows(payload)))
    name = "cross_host.quick" if args.quick else "cross_host"
    path = write_json(name, payload, args.out)
    print(f"wrote {path} in {payload['seconds']:.0f} s")
    return 0 if payload["all_targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
