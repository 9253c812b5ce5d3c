"""kvcached-router in front of three simulated hosts (bench/routing: each a real kvcached daemon
publishing KV events, behind an OpenAI-compatible stand-in for the model): it routes a prompt to
the host holding its prefix, spreads a hot prefix under load, streams, survives a dead host
without failing a request, and follows a daemon restart."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.error
import urllib.request

import pytest

from bench.routing.fleet import SimFleet
from bench.routing.router import chat, get, post, start_router, state, wait, words

pytestmark = pytest.mark.slow  # real daemons, simulated hosts and a router, seconds each: run first (tests/conftest.py)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    with SimFleet(3, str(root), prefill_tps=50_000, decode_tps=400) as f:
        yield f


@pytest.fixture(scope="module")
def router(fleet, tmp_path_factory):
    url, proc = start_router(fleet.kvcached_router_config(audit=True, health_interval=0.3, provisional_ttl=5.0),
                             tmp_path_factory.mktemp("router"))
    yield url
    proc.terminate()
    proc.wait(20)


def test_a_prompt_goes_where_its_prefix_is_cached(router):
    system = words(1, 200)
    code, h1, r1 = post(router + "/v1/chat/completions", chat(system, words(2, 40)))
    assert code == 200
    first = h1["X-Simhost"]
    for k in range(3, 6):  # follow-ups sharing the system prompt: the same host, found cached
        code, h, r = post(router + "/v1/chat/completions", chat(system, words(k, 40)))
        assert code == 200 and h["X-Simhost"] == first
        assert h["X-Kvcached-Route"] == "cache"  # and the answer says why it went there
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192  # the system prompt's full chunks
    code, h, r = post(router + "/v1/chat/completions", chat(system, words(5, 40), stream=True))
    assert code == 200 and h["X-Simhost"] == first and r["raw"].rstrip().endswith("data: [DONE]")
    metrics = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
    assert 'kvcached_router_routes_total{host="%s",policy="kvcached",reason="cache"}' % first in metrics
    assert "kvcached_router_wrong_routes_total 0.0" in metrics  # audited against every daemon's Lookup


def test_a_hot_prefix_spreads_within_the_load_bound(router):
    system = words(50, 300)
    post(router + "/v1/chat/completions", chat(system, "warm"))
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        res = list(ex.map(lambda k: post(router + "/v1/chat/completions", chat(system, words(60 + k, 30))), range(24)))
    assert all(code == 200 for code, _, _ in res)
    hosts = [h["X-Simhost"] for _, h, _ in res]
    assert len(set(hosts)) >= 2, hosts  # not everything herded onto the host that had it first


def test_a_dead_host_is_skipped_and_no_request_fails_then_it_comes_back(router, fleet):
    system = words(90, 200)
    code, h, _ = post(router + "/v1/chat/completions", chat(system, "first"))
    owner = h["X-Simhost"]
    k = [x.name for x in fleet.hosts].index(owner)
    fleet.kill_simhost(k)
    try:
        for j in range(5):  # before and after the health check notices: every request is answered
            code, h, _ = post(router + "/v1/chat/completions", chat(system, words(91 + j, 20)))
            assert code == 200 and h["X-Simhost"] != owner
        wait(lambda: not state(router)[owner]["healthy"], 10, "the router to mark the host down")
    finally:
        fleet.start_simhost(k)
    wait(lambda: state(router)[owner]["healthy"], 20, "the host to be put back")


def test_a_daemon_restart_updates_the_index(router, fleet):
    system = words(120, 200)
    code, h, _ = post(router + "/v1/chat/completions", chat(system, "x"))
    owner = h["X-Simhost"]
    k = [x.name for x in fleet.hosts].index(owner)
    before = state(router)[owner]
    assert before["indexed_chunks"] > 0
    fleet.restart_daemon(k)  # no NVMe tier in this fleet: the new daemon starts empty
    wait(lambda: state(router)[owner]["events_restarts"] > before["events_restarts"], 20,
         "the router to see the daemon's new stream")
    from kvcached_client import Client

    with Client(fleet.hosts[k].daemon_socket) as c:
        assert c.stats()["indexed_chunks"] == 0
    assert state(router)[owner]["indexed_chunks"] == 0  # forgotten, as the daemon forgot
    code, h, r = post(router + "/v1/chat/completions", chat(system, "y"))
    assert code == 200
    if h["X-Simhost"] == owner:  # sent there only as a balance decision, and found nothing cached
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_request_the_router_cannot_read_is_still_forwarded(router):
    """Fail open: a body that is not JSON (or has no prompt) is not the router's to refuse; the
    engine answers it, and the router counts it."""
    req = urllib.request.Request(router + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    assert status not in (500, 502, 503) and status == 400  # the engine's own answer
    code, h, r = post(router + "/v1/completions", {"model": "sim", "prompt": "w1 w2 w3 w4", "max_tokens": 2})
    assert code == 200 and r["usage"]["prompt_tokens"] == 4
    metrics = urllib.request.urlopen(router + "/metrics", timeout=10).read().decode()
    assert 'kvcached_router_fail_open_total{reason="JSONDecodeError"} 1.0' in metrics


def test_the_audit_counts_a_real_wrong_route(fleet, tmp_path):
    """A route is wrong when another host's daemon holds more of the prompt than the chosen one.
    Made for real: a second router that never hears host B's KV events (their endpoints point
    nowhere), B's daemon holding a whole system prompt (served by B directly), A's holding its
    first chunks (known to the router). The router sends the prompt to A for its cache; the audit
    asks every daemon and must count the route wrong. Mutation: make the audit never report ->
    this fails (the rest of the suite's "0 wrong routes" checks would still pass)."""
    config = fleet.kvcached_router_config(audit=True, health_interval=0.3, provisional_ttl=0.5)
    a, b = config["hosts"][0]["name"], config["hosts"][1]["name"]
    config["hosts"][1]["events"] = f"ipc://{tmp_path}/nobody-events"
    config["hosts"][1]["replay"] = f"ipc://{tmp_path}/nobody-replay"
    system = words(300, 240)
    code, _, _ = post(fleet.url(1) + "/v1/chat/completions", chat(system, "direct to b"))
    assert code == 200
    code, _, _ = post(fleet.url(0) + "/v1/chat/completions", chat(words(300, 60), "direct to a"))
    assert code == 200
    url, proc = start_router(config, tmp_path)
    try:
        wait(lambda: state(url)[a]["indexed_chunks"] > 0 and state(url)[b]["indexed_chunks"] == 0, 20,
             "the router to know A's chunks and none of B's")
        # B must be a candidate when the route is chosen (a host the health check lost on a
        # loaded box is not one, and the audit rightly ignores it).
        wait(lambda: all(h["healthy"] for h in state(url).values()), 20, "both hosts healthy")
        code, h, _ = post(url + "/v1/chat/completions", chat(system, "through the router"))
        assert code == 200 and h["X-Simhost"] == a, h.get("X-Simhost")
        try:
            wait(lambda: get(url + "/router/decisions?wrong=1"), 20, "the audit to report the wrong route")
        except AssertionError as e:
            raise AssertionError(f"{e}; the router's decisions: {get(url + '/router/decisions')}") from None
        row = get(url + "/router/decisions?wrong=1")[-1]
        assert row["oracle_tokens"][b] > row["oracle_tokens"][a], row
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert "kvcached_router_wrong_routes_total 1.0" in metrics
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_route_whose_daemon_does_not_answer_the_audit_is_unaudited_not_wrong(fleet, tmp_path):
    """The audit's other side: the chosen host's daemon cannot answer (here its socket path is
    wrong; in a restart storm it stopped just after the route), so the audit cannot judge the
    route. Set up as the wrong-route test above, where it would count wrong: B holds the whole
    prompt, A (chosen) "holds nothing" when its silence reads as 0 tokens."""
    config = fleet.kvcached_router_config(audit=True, health_interval=0.3, provisional_ttl=0.5)
    a = config["hosts"][0]["name"]
    config["hosts"][0]["daemon_socket"] = str(tmp_path / "no-daemon.sock")
    config["hosts"][1]["events"] = f"ipc://{tmp_path}/nobody-events"
    config["hosts"][1]["replay"] = f"ipc://{tmp_path}/nobody-replay"
    system = words(300, 250)
    assert post(fleet.url(1) + "/v1/chat/completions", chat(system, "direct to b"))[0] == 200
    assert post(fleet.url(0) + "/v1/chat/completions", chat(words(300, 70), "direct to a"))[0] == 200
    url, proc = start_router(config, tmp_path)
    try:
        wait(lambda: state(url)[a]["indexed_chunks"] > 0, 20, "the router to know A's chunks")
        code, h, _ = post(url + "/v1/chat/completions", chat(system, "through the router"))
        assert code == 200 and h["X-Simhost"] == a, h.get("X-Simhost")

        def counted() -> str:
            m = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            return m if "kvcached_router_unaudited_routes_total 1.0" in m else ""

        wait(counted, 10, "the audit to give up on the route")
        metrics = counted()
        assert "kvcached_router_wrong_routes_total 0.0" in metrics and "kvcached_router_audited_routes_total 0.0" in metrics
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_chosen_daemon_that_answers_the_audit_late_is_unaudited_and_holds_the_request_back_at_most_briefly(
        fleet, tmp_path):
    """The audit asks the chosen daemon before the request is forwarded (else a fast host has
    stored the prompt before a slow answer, and the route reads right). A daemon that never
    answers (a socket that accepts and stays silent) holds the request back AUDIT_WAIT_S, no
    more; the route is then counted unaudited, not judged on an answer that came too late."""
    import socket as socketlib

    from kvcached_router.server import AUDIT_WAIT_S

    silent = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    silent.bind(str(tmp_path / "silent.sock"))
    silent.listen(16)
    config = fleet.kvcached_router_config(audit=True, health_interval=0.3, provisional_ttl=0.5)
    a = config["hosts"][0]["name"]
    config["hosts"][0]["daemon_socket"] = str(tmp_path / "silent.sock")
    for h in config["hosts"][1:]:
        h["daemon_socket"] = str(tmp_path / "silent.sock")
    assert post(fleet.url(0) + "/v1/chat/completions", chat(words(310, 70), "direct to a"))[0] == 200
    url, proc = start_router(config, tmp_path)
    try:
        wait(lambda: state(url)[a]["indexed_chunks"] > 0, 20, "the router to know A's chunks")
        t0 = time.monotonic()
        code, h, _ = post(url + "/v1/chat/completions", chat(words(310, 250), "through the router"))
        took = time.monotonic() - t0
        assert code == 200 and h["X-Simhost"] == a, h.get("X-Simhost")
        assert took >= AUDIT_WAIT_S, took  # it waited for the answer, as long as allowed

        def counted() -> str:
            m = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            return m if "kvcached_router_unaudited_routes_total 1.0" in m else ""

        wait(counted, 15, "the audit to give up on the route")
        assert "kvcached_router_wrong_routes_total 0.0" in counted()
        row = get(url + "/router/decisions")[-1]
        assert row.get("audit_late") is True and row.get("audit") and "wrong" not in row, row
    finally:
        proc.terminate()
        proc.wait(20)
        silent.close()


def test_a_restart_storm_under_load_fails_no_request_and_routes_stay_right(router, fleet):
    """Every daemon restarted twice (SIGTERM and SIGKILL in turn; the second round while the
    router may still be catching up with the first) while four clients send requests sharing a
    few system prompts: no request fails, and the audit finds few routes wrong (< 1 % asserted,
    the figure printed; see the bound below). Before a
    stopping daemon closed its event stream first and the router counted a host whose stream
    dropped as holding nothing, a quarter of the storm's routes were wrong (sent, on the old
    stream's word, to hosts whose daemons were down or draining); with either half undone,
    24-25 % again (measured)."""
    import signal as sig
    import threading

    before = get(router + "/router/decisions?limit=100000")
    stop = threading.Event()
    failures: list[str] = []
    sent = [0]

    def client(k: int) -> None:
        j = 0
        while not stop.is_set():
            code, _, r = post(router + "/v1/chat/completions", chat(words(400 + (j % 4), 160), words(500 + k * 1000 + j, 8)))
            if code != 200:
                failures.append(f"{code}: {r}")
            sent[0] += 1
            j += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        for rnd in range(2):
            for k in range(len(fleet.hosts)):
                fleet.restart_daemon(k, sig.SIGKILL if (k + rnd) % 2 else sig.SIGTERM)
                time.sleep(0.3 if rnd else 1.0)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == [], failures[:5]
    assert sent[0] >= 40
    wait(lambda: all(h["healthy"] for h in state(router).values()), 20, "every host healthy again")
    storm = get(router + "/router/decisions?limit=100000")[len(before):]
    wrong = sum(1 for r in storm if r.get("wrong"))
    print(f"restart storm: {sent[0]} requests, {len(storm)} routes, {wrong} audited wrong")
    # The target is < 0.1 % (measured 0.05 % on an idle box, 0.11 % once in a loaded CI run: the
    # rest are routes made on provisional entries while a restarted daemon's engine client is
    # still reconnecting). The bound here guards the failure mode (25 % before) with room for load.
    assert len(storm) == sent[0] and wrong < 0.01 * len(storm), f"{wrong} of {len(storm)} routes wrong"
