"""The connector's scheduler side: how much of each prompt kvcached has, leases, the plan.

Runs on vLLM's scheduler thread, the thread that schedules every request of the engine, so no
hook here waits for the daemon while the engine has work: every call to it runs on the
connector's own threads, and a hook only looks at answers that have already landed. The one wait
is on a step vLLM scheduled nothing for while lookups are in flight (:meth:`_wait_idle`).

Two round trips per request:

* ``on_new_request``: one **AcquireReserve** per tensor-parallel rank starts as soon as vLLM has
  the request, the ranks' calls side by side: it pins the cached prefix (a lease: the daemon
  will not evict or overwrite those chunks) and reserves pool room for the prompt's uncached
  full chunks. ``get_num_new_matched_tokens`` answers "not yet" (``None``) until every rank's
  answer has landed; vLLM asks again on its next step. The hit is whole chunks, cut to whole
  vLLM blocks and to at least one prompt token left to compute.
* ``update_state_after_alloc`` plans the load of the leased chunks into the blocks vLLM
  allocated (no call). ``build_connector_meta`` hands the worker the :class:`LoadPlan` and, for
  the reserved chunks that are whole by the end of the step, a :class:`SavePlan`.
* ``update_connector_output``: the worker reports each plan once per rank when its copies have
  completed. A lease is released (on the session stream: no round trip) once its loads are
  reported; once a rank's reserved chunks are all written, one **Commit** publishes them.

When a request finishes, the whole chunks it computed past its prompt (its answer) are stored
too, so the next turn of a conversation hits them (:meth:`SchedulerSide._store_answer`): one
**Reserve** per rank once the prompt's Commit has landed, a ``finish`` save plan, and a Commit;
vLLM keeps the request's blocks until every rank reports the plan in ``get_finished``.

Loads are asynchronous by default on CUDA engines (``(n, True)``: vLLM parks the request in
WAITING_FOR_REMOTE_KVS, the worker copies on a side stream after the step's forward is
launched and reports the request in ``get_finished``), synchronous on CPU engines, where the
copy is a memcpy on the cores that would otherwise run the forward and waiting one more step
costs more than it saves (``load_mode``, README "Use with vLLM").

**Nothing is released or committed before the worker says the copies it was given are done.**
A request that finishes, is aborted or is preempted *retires* its attempt: the leases and
reservations stay held until every rank has reported every plan it was handed, then the
leases are released, what was written is committed and the rest given back. Until then
``has_pending_push_work`` keeps vLLM stepping, so the reports come even on an idle engine.

**Leases are renewed while they are needed.** A lease is granted with the daemon's TTL when the
request arrives; a request that waits in vLLM's queue longer than that would load blocks the
daemon may have given to other chunks. The scheduler renews (one KeepAlive for the attempt's
ranks) once a third of the TTL has passed, and each plan carries the deadline it knows of; a
worker refuses a plan past it (failed blocks: recomputed), and a lease that could not be renewed
serves nothing.

Fail open: a daemon that is absent, restarting or refusing makes the request run without
the cache (0 external tokens), logs once, counts ``kvcached_client_fail_open_total`` and
makes the next requests skip the daemon for ``retry_s`` (so a dead daemon costs nothing per
request). A lease that covers less than was promised to vLLM becomes failed blocks in the
plan; the worker reports them to vLLM, which recomputes them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvcached.contract.keys import KVLayout
from kvcached_client._core import LeaseTicket, ReservationTicket
from kvcached_client.client import CacheRequest, Client, Reservation
from kvcached_client.errors import DeadlineExceededError, KvcachedError, UnavailableError
from kvcached_client.failopen import FailOpen
from kvcached_client.policy import CachePolicy
from kvcached_client.vllm.config import ConnectorConfig
from kvcached_client.vllm.plan import KvcachedMetadata, KvcachedWorkerMetadata, LoadPlan, SavePlan
from kvcached_client.vllm.protocols import (
    VllmBlocks,
    VllmConnectorOutput,
    VllmRequest,
    VllmSchedulerOutput,
)
from kvcached_client.vllm.spec import request_cacheable, with_lora, with_salt

log = logging.getLogger("vllm.kvcached")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL

#: daemon trouble: skip the daemon for a while. Other errors only fail the one request.
_TRIPS = (UnavailableError, DeadlineExceededError, TimeoutError)


def policy_of(request: VllmRequest) -> CachePolicy:
    """The request's cache policy: ``kv_transfer_params={"kvcached": {"no_store": true,
    "no_cache": true}}`` (what the X-Cache-Control middleware sets), and the long-generation
    bypass from ``max_tokens``."""
    params = getattr(request, "kv_transfer_params", None) or {}
    mine = params.get("kvcached") if isinstance(params, dict) else None
    mine = mine if isinstance(mine, dict) else {}
    policy = CachePolicy(no_store=bool(mine.get("no_store")), no_cache=bool(mine.get("no_cache")))
    sp = getattr(request, "sampling_params", None)
    max_tokens = getattr(sp, "max_tokens", None) if sp is not None else None
    return policy.with_expected_output(max_tokens) if max_tokens else policy


@dataclass
class _Attempt:
    """One AcquireReserve of a request (per rank: its lease and its reservation) and the plans
    handed to the workers for it. Lives until every plan is reported and everything it holds is
    released, committed or given back, which may be after its request is gone."""

    key: int
    req_id: str
    cache: list[CacheRequest]  # per tensor-parallel rank
    matched: int  # tokens every rank's lease covers
    lease_ttl: float
    lease_deadline: float  # monotonic; the daemon may end the leases from then on
    leases_held: bool = True
    lease_lost: bool = False  # a renewal failed: the leases may be gone
    renewal: "concurrent.futures.Future[float] | None" = None
    renewal_sent: float = 0.0
    written: list[int] = field(default_factory=list)  # per rank: reserved chunks written up to here (-1: failed)
    committed: list[bool] = field(default_factory=list)  # per rank: its reservation is closed
    #: per rank, where its reserved chunks are written (None: nothing for it); () once the attempt
    #: stores nothing more (given up: its room may be gone)
    save_tickets: tuple[ReservationTicket | None, ...] = ()
    reserved_at: float = 0.0  # when the reservations were granted (their TTL runs from there)
    loads_out: list[int] = field(default_factory=list)  # per rank: load plans handed out, not reported
    saves_out: list[int] = field(default_factory=list)  # per rank: save plans handed out, not reported
    load_done: bool = False  # its load (if any) is reported by every rank: the leases may go
    commits: "list[concurrent.futures.Future[None]]" = field(default_factory=list)  # its Commits in flight
    retired: bool = False  # its request finished or was preempted

    @property
    def in_flight(self) -> bool:
        return any(self.loads_out) or any(self.saves_out)


class Phase(enum.Enum):
    """Where a request stands on the scheduler side: the phase of its :class:`_Req` (see there)."""

    NEW = "new"
    BYPASS = "bypass"
    LOOKING_UP = "looking up"
    LEASED = "leased"
    LOOKUP_FAILED = "lookup failed"
    STORING_ANSWER = "storing its answer"
    DONE = "done"


#: The transitions a request's phase may make (:meth:`SchedulerSide._to`). Preempted, a request
#: starts over (NEW), and looks up again once vLLM resumes it; a BYPASS one stays BYPASS.
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.LOOKING_UP, Phase.NEW, Phase.STORING_ANSWER, Phase.DONE}),
    Phase.BYPASS: frozenset({Phase.DONE}),
    Phase.LOOKING_UP: frozenset({Phase.LEASED, Phase.LOOKUP_FAILED, Phase.NEW, Phase.STORING_ANSWER, Phase.DONE}),
    Phase.LEASED: frozenset({Phase.NEW, Phase.STORING_ANSWER, Phase.DONE}),
    Phase.LOOKUP_FAILED: frozenset({Phase.NEW, Phase.STORING_ANSWER, Phase.DONE}),
    Phase.STORING_ANSWER: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}

#: The phases in which the request's lookup has an outcome (``matched`` is known).
_LANDED = frozenset({Phase.LEASED, Phase.LOOKUP_FAILED})


@dataclass(eq=False)
class _Req:
    """One request vLLM gave the scheduler side, from its first hook to its end.

    ``phase`` is where it stands (:class:`Phase`; the transitions: :data:`_NEXT`):

    * ``NEW``: known (``on_new_request``, or vLLM's first ask), no lookup yet. It starts on the
      spot unless the daemon is being skipped (``retry_s`` after a failure): then on a later ask.
    * ``BYPASS`` (from the start, for good): it never uses the cache: its KV does not follow from
      its token ids (``skip``: multimodal inputs, prompt embeddings), or its policy neither reads
      nor stores.
    * ``LOOKING_UP``: its AcquireReserves are in flight (``lookup``, one future per rank); vLLM is
      told "not yet".
    * ``LEASED``: they landed: ``attempt`` holds every rank's lease and reservation, ``matched``
      is what the leases cover. The loads into its blocks and the saves of its computed chunks go
      out from here (``pending``, ``saved_chunks``, a second reservation in ``store``).
    * ``LOOKUP_FAILED``: the lookup failed or timed out (counted, fail open): it runs without
      the cache (``matched`` 0, no attempt).
    * ``STORING_ANSWER``: finished; the whole chunks of its answer are being stored
      (:class:`_Finishing`), vLLM keeping its blocks until the workers have copied them.
    * ``DONE``: finished, aborted, or the engine closed. Nothing more happens to it.

    A preemption retires its attempt and takes it back to ``NEW`` (``BYPASS`` stays); it looks up
    again when vLLM resumes it. Loads and saves are not phases of the request: they overlap (a
    hit's load and the saves of the prompt's other chunks go out in the same step) and are counted
    per plan on the :class:`_Attempt`, which outlives the request until every plan is reported.
    """

    req_id: str
    tokens: Sequence[int]  # the prompt's token ids (vLLM's; never changed)
    n_prompt: int
    policy: CachePolicy
    layouts: tuple[KVLayout, ...]  # per tensor-parallel rank, with the request's LoRA and salt
    skip: str | None = None  # why this request does not use the cache at all (then BYPASS)
    phase: Phase = Phase.NEW
    lookup: "list[concurrent.futures.Future[CacheRequest]] | None" = None  # per rank (LOOKING_UP)
    lookup_started: float = 0.0
    attempt: _Attempt | None = None  # LEASED
    matched: int = 0  # tokens the request may load (all ranks): LEASED
    no_more_loads: bool = False  # a load failed: ask for none again
    local_computed: int = 0  # vLLM's own (block-aligned) prefix-cache hit at the last ask
    pending: LoadPlan | None = None  # planned, not yet handed to the worker
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    saved_chunks: int = 0  # chunks already handed to the worker to write
    saved_blocks: int = 0  # whole blocks already handed to the worker to write (sliding-window engines)
    sched_s: float = 0.0  # time spent for it on the scheduler thread
    hit_tokens: int = 0  # tokens loaded from kvcached (for the counters)
    store: "_Attempt | None" = None  # a later reservation for its chunks (see _reserve_again), else attempt's
    rereserve: "list[concurrent.futures.Future[Reservation]] | None" = None  # per rank, in flight
    n_whole_chunks: int = 0  # whole chunks in the prompt (what a store can write at most)
    rereserves: int = 0

    @property
    def saves_over(self) -> bool:
        """Nothing more of this prompt will be stored until vLLM resumes it after a preemption
        (which starts its saves over): every whole chunk handed out, or nothing to store with. Its
        decode steps then cost the scheduler side one dict lookup."""
        if self.rereserve is not None:
            return False
        if self.skip or self.saved_chunks >= self.n_whole_chunks:
            return True
        att = self.store or self.attempt  # None once the lookup failed: nothing to store with
        return self.phase in _LANDED and (att is None or att.retired or not att.save_tickets)


@dataclass(eq=False)
class _Finishing:
    """A finished request whose answer's chunks are being stored: vLLM keeps its blocks until
    every rank reported the plan (``finish``) that copies them."""

    st: _Req
    block_ids: tuple[tuple[int, ...], ...]  # per group, the blocks of its whole chunks
    tokens: list[int]  # the sequence whose whole chunks are stored
    held: "list[_Attempt]"  # the prompt's attempts: the Reserve waits for their Commits
    since: float
    reserve: "list[concurrent.futures.Future[Reservation]] | None" = None  # per rank


class _NoLease:
    """The lease slot of a store-only attempt (a second reservation): nothing pinned."""

    lease_id = ""
    matched_tokens = 0
    ttl_seconds = 0.0
    session_id = ""

    def release(self) -> None:
        pass


_NO_LEASE: Any = _NoLease()


def _abort_late(fut: "concurrent.futures.Future[Reservation]") -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().abort()


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layouts: tuple[KVLayout, ...], block_size: int,
                 client_factory: Callable[[], Client], clock: Callable[[], float] = time.monotonic,
                 *, async_load: bool = False, window: int = 0) -> None:
        self.cfg = cfg
        self.layouts = layouts
        self.block_size = block_size
        self.chunk_tokens = layouts[0].chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // block_size
        self.async_load = async_load
        #: the smallest sliding window of the engine's layers (0: none). Such layers lose blocks as a
        #: request advances: each step's computed blocks are stored as they are computed, and a
        #: finished request's answer is not stored
        self.window = window
        self.windowed = window > 0
        #: every rank has the same layout (an MLA latent): one rank's reservation gets the chunks
        self.replicated = len(layouts) > 1 and len(set(layouts)) == 1
        self._finishing: dict[str, _Finishing] = {}
        self._placements = [""] * len(layouts)  # each rank's device (set_placements)
        self._client_factory = client_factory
        self._client: Client | None = None
        self._clock = clock
        self._reqs: dict[str, _Req] = {}
        self._attempts: dict[int, _Attempt] = {}  # live attempts, by key (the retired included)
        self._keys = itertools.count(1)
        self._pending: list[_Req] = []  # requests with a planned load not handed out yet
        self._looking: set[_Req] = set()  # requests whose lookup is in flight
        self._retry_at = 0.0
        self._illegal_seen: set[tuple[Phase, Phase]] = set()  # illegal phase moves logged so far (_to)
        self.fail = FailOpen("vllm")
        #: connector time on the scheduler thread per finished request (seconds), newest last
        self.request_seconds: collections.deque[float] = collections.deque(maxlen=100_000)
        #: the same, not yet handed to vLLM's connector stats (drained by :mod:`~kvcached_client.vllm.stats`)
        self.unreported_seconds: collections.deque[float] = collections.deque(maxlen=10_000)
        self.stats: collections.Counter[str] = collections.Counter()
        #: time the scheduler thread waited for lookups on steps vLLM scheduled nothing for (:meth:`_wait_idle`)
        self.idle_wait_seconds = 0.0
        # Calls to the daemon run here, off the scheduler thread: a blocking gRPC call releases
        # the GIL while it waits (grpc's own futures cost more to issue, ~1 ms, than a whole
        # call). One thread per rank, so a TP engine's per-rank AcquireReserves run side by side.
        self._bg = concurrent.futures.ThreadPoolExecutor(max(2, len(layouts)), thread_name_prefix="kvcached-scheduler")

    # -- plumbing ------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def _daemon_down(self) -> bool:
        return self._clock() < self._retry_at

    def _failed(self, op: str, error: BaseException) -> None:
        self.fail.failed(op, error)
        self.stats[f"{op}_failures"] += 1
        if isinstance(error, _TRIPS):
            self._retry_at = self._clock() + self.cfg.retry_s

    def _state(self, request: VllmRequest) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            skip = request_cacheable(request)  # None: it has prompt token ids
            # Packed for the wire on the connector's threads, not here (10 us per 600 tokens).
            tokens: Sequence[int] = () if skip else request.prompt_token_ids or ()
            lora = getattr(request, "lora_request", None)
            salt = getattr(request, "cache_salt", None)
            policy = policy_of(request)
            bypass = bool(skip) or not (policy.read or policy.should_store(len(tokens)))
            st = _Req(request.request_id, tokens, len(tokens), policy,
                      tuple(with_salt(with_lora(lay, lora), salt) for lay in self.layouts), skip,
                      Phase.BYPASS if bypass else Phase.NEW)
            st.n_whole_chunks = len(tokens) // self.chunk_tokens if policy.should_store(len(tokens)) else 0
            self._reqs[request.request_id] = st
        return st

    def _to(self, st: _Req, phase: Phase) -> None:
        """Move the request to ``phase``. A move :data:`_NEXT` does not allow is a bug of the
        connector: logged (at error level the first time for each pair of phases) and counted in
        ``stats["illegal_transitions"]``, and made all the same, the fields it came with being
        set already: the request goes on as the fields say, never failed because of the cache."""
        if phase not in _NEXT[st.phase]:
            self.stats["illegal_transitions"] += 1
            first = (st.phase, phase) not in self._illegal_seen
            self._illegal_seen.add((st.phase, phase))
            log.log(logging.ERROR if first else logging.DEBUG,
                    "kvcached connector: request %s moved from phase %r to %r, which the connector does not "
                    "expect (a bug; the request goes on)", st.req_id, st.phase.value, phase.value)
        st.phase = phase

    def check_daemon(self) -> None:
        """At engine start: register the layouts, so a daemon that refuses them (a chunk larger
        than its pool blocks, ...) is reported once, loudly, instead of per request. A daemon
        that is not running is only a warning: the engine serves without it until it comes."""
        try:
            for lay in self.layouts:
                self.client.register(lay)
            self.client.session_id()  # leases are bound to it: open it now, not on the first hit
        except UnavailableError as e:
            log.warning("kvcached connector: no daemon answers at %s (%s); the engine runs without the cache "
                        "until one does. Start it (./scripts/serve, or systemctl start kvcached) or point the "
                        "connector at its socket: kv_connector_extra_config {\"socket\": PATH} or $KVCACHED_SOCKET",
                        self.client.target, e)
        except KvcachedError as e:
            level = logging.WARNING if isinstance(e, _TRIPS) else logging.ERROR
            log.log(level, "kvcached connector: the daemon at %s cannot serve this engine's layout (%s: %s); "
                    "the engine runs without the cache until it can", self.client.target, e.code.name, e)
        else:
            log.info("kvcached connector: connected to the daemon at %s (layout %s, %d rank(s), %s loads)",
                     self.client.target, self.layouts[0].model, len(self.layouts),
                     "asynchronous" if self.async_load else "synchronous")

    # -- vLLM hooks ----------------------------------------------------------------------

    def on_new_request(self, request: VllmRequest) -> None:
        """Start the lookup as soon as vLLM has the request: by the time the scheduler asks,
        the answer is usually there."""
        t0 = time.perf_counter()
        st = self._state(request)
        self._start_lookup(st)
        st.sched_s += time.perf_counter() - t0

    def _start_lookup(self, st: _Req) -> bool:
        """Start the request's AcquireReserves if it has none; False if it cannot (BYPASS, daemon down)."""
        if st.phase is not Phase.NEW:
            return st.phase is not Phase.BYPASS  # its lookup is in flight or has landed
        if self._daemon_down():
            return False
        store = st.policy.should_store(st.n_prompt)
        self.stats["lookups"] += 1
        st.lookup_started = self._clock()
        st.lookup = [self._bg.submit(self._acquire_reserve, lay, st.tokens, not st.policy.read, not store,
                                     self.placement(rank)) for rank, lay in enumerate(st.layouts)]
        self._to(st, Phase.LOOKING_UP)
        self._looking.add(st)
        return True

    def _acquire_reserve(self, layout: KVLayout, tokens: Sequence[int], no_cache: bool, no_store: bool,
                         placement: str = "") -> CacheRequest:
        """On a connector thread: one rank's lease and reservation, in the pool slab of that
        rank's device. The scheduler never maps the pool (the workers read and write it through
        tickets)."""
        return self.client.acquire_reserve(layout, tokens, no_cache=no_cache, no_store=no_store,
                                           ttl=self.cfg.lease_ttl_s or None,
                                           reservation_ttl=self.cfg.reservation_ttl_s, map_pool=False,
                                           placement=placement)

    def set_placements(self, placements: dict[int, str]) -> None:
        """Each rank's device, as its worker reported it at start (vLLM's connector handshake,
        after the KV caches are registered and before the first request)."""
        for rank, where in placements.items():
            if 0 <= rank < len(self._placements):
                self._placements[rank] = where
        log.info("kvcached connector: workers' devices for the pool slabs: %s",
                 ", ".join(f"rank {r}: {p or 'unplaced'}" for r, p in enumerate(self._placements)))

    def placement(self, rank: int) -> str:
        return self._placements[rank] if rank < len(self._placements) else ""

    def _landed(self, st: _Req) -> bool:
        """Whether the request's lookup has an outcome now (never waits); takes it if so."""
        futs = st.lookup
        if st.phase is not Phase.LOOKING_UP or futs is None:
            return st.phase in _LANDED
        if not all(f.done() for f in futs):
            if self._clock() - st.lookup_started < self.cfg.lookup_timeout_s:
                return False
            self._failed("lookup", TimeoutError(f"no answer in {self.cfg.lookup_timeout_s} s"))
            for f in futs:  # whatever lands later is given back when it lands
                f.add_done_callback(self._drop_late)
            st.lookup, st.matched = None, 0
            self._to(st, Phase.LOOKUP_FAILED)
            return True
        st.lookup = None
        got: list[CacheRequest] = []
        error: BaseException | None = None
        for f in futs:
            e = f.exception()
            if e is None:
                got.append(f.result())
            else:
                error = error or e
        if error is not None:
            for r in got:
                self._give_back(r)
            self._failed("lookup", error)
            st.matched = 0
            self._to(st, Phase.LOOKUP_FAILED)
            return True
        self.fail.ok("lookup")
        self._take(st, got)
        return True

    def _take(self, st: _Req, reqs: list[CacheRequest]) -> None:
        n = len(reqs)
        ttl = min((r.lease.ttl_seconds for r in reqs if r.lease.lease_id), default=0.0)
        att = _Attempt(next(self._keys), st.req_id, reqs, min(r.matched_tokens for r in reqs) if st.policy.read else 0,
                       ttl, st.lookup_started + ttl if ttl else float("inf"),
                       leases_held=any(r.lease.lease_id for r in reqs),
                       written=[0] * n, committed=[not r.reservation.opened for r in reqs],
                       save_tickets=tuple(r.reservation.ticket() if r.reservation.slots else None for r in reqs),
                       reserved_at=st.lookup_started, loads_out=[0] * n, saves_out=[0] * n)
        self._attempts[att.key] = att
        st.attempt = att
        st.matched = att.matched
        self._to(st, Phase.LEASED)
        if not att.matched:
            self._settle(att)  # nothing to load: the (empty) leases go now

    def get_num_new_matched_tokens(self, request: VllmRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        st = self._state(request)
        try:
            n = self._matched(st, num_computed_tokens)
            return n, bool(n) and self.async_load
        finally:
            st.sched_s += time.perf_counter() - t0

    def _matched(self, st: _Req, num_computed: int) -> int | None:
        st.local_computed = num_computed
        if st.skip or not st.policy.read or st.no_more_loads:
            return 0
        if st.phase not in _LANDED:
            if not self._start_lookup(st):
                return 0
            if not self._landed(st):
                self.stats["lookup_not_yet"] += 1
                return None  # vLLM asks again next step
        att = st.attempt  # None: the lookup failed
        if att is None or att.lease_lost or not att.leases_held or self._clock() >= att.lease_deadline:
            return 0  # nothing leased (any more): promise nothing
        # Whole blocks (chunks are whole blocks), and at least one prompt token left to compute:
        # vLLM needs the last prompt position's logits.
        end = min(st.matched, (st.n_prompt - 1) // self.block_size * self.block_size)
        return max(0, end - num_computed)

    def update_state_after_alloc(self, request: VllmRequest, blocks: VllmBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        t0 = time.perf_counter()
        st = self._state(request)
        att = st.attempt
        assert att is not None, "vLLM allocated for external tokens the connector did not promise"
        start, end = st.local_computed, st.local_computed + num_external_tokens
        first, last = start // self.block_size, end // self.block_size
        block_ids = tuple(tuple(ids[first:last]) for ids in blocks.get_block_ids())
        tickets: list[LeaseTicket | None] = []
        loadable: list[int] = []
        for r in att.cache:
            lease = r.lease
            if not att.leases_held or att.lease_lost or not lease.lease_id:
                tickets.append(None)
                loadable.append(0)
                continue
            tickets.append(lease.ticket())
            loadable.append(max(0, min(lease.matched_tokens, end) // self.block_size - first))
        if min(loadable) < last - first:
            self.stats["short_acquires"] += 1
        margin = min(self.cfg.load_margin_s, att.lease_ttl / 4)
        st.pending = LoadPlan(st.req_id, att.key, first, block_ids, tuple(tickets), tuple(loadable),
                              att.lease_deadline - margin, self.async_load)
        self._pending.append(st)
        st.hit_tokens += num_external_tokens
        self.stats["loads"] += 1
        self.stats["load_tokens"] += num_external_tokens
        st.sched_s += time.perf_counter() - t0

    def build_connector_meta(self, so: VllmSchedulerOutput) -> KvcachedMetadata:
        meta = KvcachedMetadata()
        # Every planned load goes out in the step that planned it, scheduled or not (an
        # asynchronous one is not: its request waits for it), and even if its request has
        # ended since (vLLM holds the blocks until the load is reported). Before the preemptions: vLLM
        # may preempt a request and resume it in one schedule() (a prefix-cache reset), and the
        # load it planned for the resumed request's new blocks must not be dropped with the old.
        for st in self._pending:
            self._hand_out_load(meta, st)
        self._pending.clear()
        if self._finishing:
            self._plan_answers(meta)
        for rid in so.preempted_req_ids or ():
            gone = self._reqs.get(rid)
            if gone is not None:  # its blocks are gone; it starts over (and may load again) when resumed
                self.stats["preemptions"] += 1
                self._retire(gone)
                gone.block_ids, gone.saved_chunks, gone.saved_blocks, gone.matched = [], 0, 0, 0
                if gone.phase is not Phase.BYPASS:
                    self._to(gone, Phase.NEW)
        for nr in so.scheduled_new_reqs:
            new = self._reqs.get(nr.req_id)
            if new is not None:
                t0 = time.perf_counter()
                new.block_ids = [list(ids) for ids in nr.block_ids]
                self._plan_save(meta, new, nr.num_computed_tokens, so.num_scheduled_tokens.get(nr.req_id, 0))
                new.sched_s += time.perf_counter() - t0
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            running = self._reqs.get(rid)
            if running is None or (running.saves_over and rid not in resumed):
                continue  # a decode step of a request with nothing more to store: the common case
            t0 = time.perf_counter()
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                running.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not running.block_ids:
                    running.block_ids = [[] for _ in new_ids]
                for mine, ids in zip(running.block_ids, new_ids):
                    mine.extend(ids)
            self._plan_save(meta, running, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0))
            running.sched_s += time.perf_counter() - t0
        # Take the lookups that have landed for requests vLLM has not asked about yet (they wait
        # in its queue): their leases run from now, and only a taken lease is renewed.
        for st in list(self._looking):
            if st.phase is not Phase.LOOKING_UP or self._landed(st):
                self._looking.discard(st)
        self._renew_leases()
        if not getattr(so, "total_num_scheduled_tokens", 1) and (self._looking or self._finishing):
            self._wait_idle()
        return meta

    def _wait_idle(self) -> None:
        """vLLM scheduled nothing this step and lookups (or a finished request's answer store, whose
        blocks vLLM keeps until it is done) are in flight: the step would be empty, and
        the next one too, for as long as the answers take. An engine that spins empty steps holds
        the GIL in pure Python, so the connector's threads, which need it to send and read each
        call, get it once per switch interval (5 ms) and the answers take far longer (measured: a
        burst of 64 new requests on an idle engine ran 37-49 empty steps before its first
        prefill). So here, and only here, the scheduler thread waits, GIL released, until the
        lookups in flight have landed or ``idle_wait_s`` has passed. Nothing else is waiting for
        it: the step has no work. The time is counted apart (``idle_wait_s``), not as a request's
        time on the scheduler thread."""
        if self.cfg.idle_wait_s <= 0:
            return
        futs: list[concurrent.futures.Future[Any]] = [  # what each lands with does not matter here
            f for st in self._looking if st.lookup is not None for f in st.lookup if not f.done()]
        for fin in self._finishing.values():  # an answer being stored: its Reserves, or the Commits before them
            waiting: Sequence[concurrent.futures.Future[Any]] = fin.reserve or [c for att in fin.held for c in att.commits]
            futs += [f for f in waiting if not f.done()]
        if not futs:
            return
        t0 = time.perf_counter()
        concurrent.futures.wait(futs, timeout=self.cfg.idle_wait_s)
        self.stats["idle_waits"] += 1
        self.idle_wait_seconds += time.perf_counter() - t0

    def _hand_out_load(self, meta: KvcachedMetadata, st: _Req) -> None:
        lp, st.pending = st.pending, None
        if lp is None:
            return
        att = self._attempts.get(lp.key)
        if att is None:  # cannot happen: an attempt with a pending plan is never settled
            return
        meta.loads.append(lp)
        for rank in range(len(att.cache)):
            att.loads_out[rank] += 1
        if st.attempt is att:  # chunks loaded from the daemon are there already: no need to store them
            st.saved_chunks = max(st.saved_chunks, (lp.first_block + min(lp.loadable_blocks)) // self.blocks_per_chunk)
            st.saved_blocks = max(st.saved_blocks, st.saved_chunks * self.blocks_per_chunk)

    def _plan_save(self, meta: KvcachedMetadata, st: _Req, computed: int, scheduled: int) -> None:
        computed_after_step = computed + scheduled
        if st.skip or not st.policy.should_store(st.n_prompt) or not self._landed(st):
            return
        self._take_rereserve(st)
        att = st.store or st.attempt
        if att is None or att.retired:
            return
        k, bs = self.blocks_per_chunk, self.block_size
        ready = min(computed_after_step, st.n_prompt) // self.chunk_tokens
        if self.windowed:
            # Every block computed so far (the last one possibly partial, written again next step):
            # vLLM may free a windowed layer's blocks before their chunk is whole.
            upto = min(computed_after_step, st.n_whole_chunks * self.chunk_tokens)
            reserved = [r.reservation.slots[0].position * k for r in att.cache if r.reservation.slots]
            from_block, to_block = max(st.saved_blocks, min(reserved, default=0)), -(-upto // bs)
            if att.save_tickets and from_block < max(0, computed - self.window + 1) // bs:
                # Blocks computed in an earlier step that was not planned (a store-only request that
                # vLLM ran before its AcquireReserve landed) may be freed by now: those chunks are lost.
                self.stats["saves_lost_window"] += 1
                att.save_tickets = ()
                self._settle(att, close_reservations=True)
                return
        else:
            from_block, to_block = st.saved_chunks * k, ready * k
            if ready > st.saved_chunks and st.store is None and st.rereserve is None:
                self._reserve_again(st, att, ready)
        if to_block <= from_block or not any(att.save_tickets):
            return
        if self._clock() - att.reserved_at > self.cfg.reservation_ttl_s / 2:
            # The room may be gone by the time the worker writes (the daemon frees an expired
            # reservation and may give the room to another writer): store nothing of this request.
            self.stats["saves_too_late"] += 1
            att.save_tickets = ()
            self._settle(att, close_reservations=True)
            return
        if not st.block_ids or len(st.block_ids[0]) < to_block:  # should not happen: computed tokens have blocks
            return
        whole = (upto // self.chunk_tokens) if self.windowed else ready  # chunks complete once it is done
        meta.saves.append(SavePlan(st.req_id, att.key, att.save_tickets, from_block, to_block,
                                   tuple(tuple(ids[from_block:to_block]) for ids in st.block_ids), k, whole))
        for rank, ticket in enumerate(att.save_tickets):
            if ticket is not None:
                att.saves_out[rank] += 1
        st.saved_chunks = whole
        st.saved_blocks = (upto // bs) if self.windowed else to_block
        self.stats["saves"] += 1

    def _reserve_again(self, st: _Req, att: _Attempt, ready: int) -> None:
        """The daemon reserves nothing after a chunk another request is writing (a chunk is only
        stored after its whole prefix), so two requests that share a prefix and arrive together
        used to store the first one's chunks only: the second's own chunks were lost for good
        (this is how a replay lost 256 of 896 tokens it should have hit). Once this request has
        computed chunks its reservation does not cover, and the reservation reported chunks in
        flight, it reserves again (one more round trip, off the scheduler thread, at most 3
        times); by then the other writer has usually committed."""
        if st.rereserves >= 3:
            return
        covers = [r.reservation.slots[-1].position + 1 if r.reservation.slots
                  else r.reservation.cached_tokens // self.chunk_tokens for r in att.cache]
        for r, covered in zip(att.cache, covers):
            if self.replicated:  # the ranks share chunks: another rank's reservation may hold them
                covered = max(covers)
            if r.reservation.in_flight_tokens and covered < ready:
                break
        else:
            return
        st.rereserves += 1
        self.stats["rereserves"] += 1
        st.rereserve = self._reserve(st.layouts, st.tokens)

    def _reserve(self, layouts: tuple[KVLayout, ...], tokens: Sequence[int]) -> "list[concurrent.futures.Future[Reservation]]":
        """A store-only Reserve per rank (in that rank's slab), on the connector's threads."""
        return [self._bg.submit(self.client.reserve, lay, tokens, skip_empty=True, ttl=self.cfg.reservation_ttl_s,
                                map_pool=False, placement=self.placement(rank)) for rank, lay in enumerate(layouts)]

    def _store_attempt(self, req_id: str, got: list[Reservation], *, retired: bool = False) -> _Attempt:
        """A store-only attempt (nothing leased) for the reservations ``got``, one per rank; live
        until what it writes is committed."""
        n = len(got)
        att = _Attempt(next(self._keys), req_id, [CacheRequest(self.client, _NO_LEASE, res) for res in got], 0, 0.0,
                       float("inf"), leases_held=False, written=[0] * n, committed=[not res.opened for res in got],
                       save_tickets=tuple(res.ticket() if res.slots else None for res in got),
                       reserved_at=self._clock(), loads_out=[0] * n, saves_out=[0] * n, load_done=True, retired=retired)
        self._attempts[att.key] = att
        return att

    def _take_rereserve(self, st: _Req) -> None:
        futs = st.rereserve
        if futs is None or not all(f.done() for f in futs):
            return
        st.rereserve = None
        got = [f.result() for f in futs if f.exception() is None]
        error = next((f.exception() for f in futs if f.exception() is not None), None)
        if error is not None:
            for res in got:
                res.abort()
            self._failed("store", error)
            return
        if not any(res.slots for res in got):  # nothing more to write (or still in flight: try again later)
            for res in got:
                res.abort()
            return
        old = st.store or st.attempt
        store = self._store_attempt(st.req_id, got)
        if old is not None and old is not st.attempt:
            old.retired = True
        if old is not None:
            self._settle(old, close_reservations=True)  # commits what it wrote; no more plans use it
        st.store = store
        st.saved_chunks = 0  # the new reservation holds only what nobody has stored: offer it all again

    def update_connector_output(self, output: VllmConnectorOutput) -> None:
        wm = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvcachedWorkerMetadata):
            return
        touched: set[int] = set()
        for (key, rank), n in wm.loaded.items():
            att = self._attempts.get(key)
            if att is not None and rank < len(att.loads_out):
                att.loads_out[rank] -= n
                assert att.loads_out[rank] >= 0, f"rank {rank} reported more loads than it was given"
                touched.add(key)
        for key in wm.load_failed:
            att = self._attempts.get(key)
            st = self._reqs.get(att.req_id) if att is not None else None
            if st is not None and st.attempt is att:
                st.no_more_loads = True  # if vLLM asks again after the failure, promise nothing
        for (key, rank), results in wm.saved.items():
            att = self._attempts.get(key)
            if att is None or rank >= len(att.saves_out):
                continue
            for upto in results:
                att.saves_out[rank] -= 1
                assert att.saves_out[rank] >= 0, f"rank {rank} reported more saves than it was given"
                w = att.written[rank]
                att.written[rank] = -1 if upto < 0 or w < 0 else max(w, upto)
            touched.add(key)
        for key in touched:
            att = self._attempts[key]
            if not any(att.loads_out):
                att.load_done = True
            t0 = time.perf_counter()
            self._settle(att)
            st = self._reqs.get(att.req_id)
            if st is not None:
                st.sched_s += time.perf_counter() - t0

    def request_finished(self, request: VllmRequest, block_ids: "Sequence[Sequence[int]] | None" = None) -> bool:
        """The request is done. True if vLLM must keep its blocks until the workers report it
        (its answer's chunks are being stored: :meth:`_store_answer`)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False
        t0 = time.perf_counter()
        held = [att for att in (st.attempt, st.store) if att is not None]
        self._retire(st)  # may send the prompt's Commits (which the answer's Reserve waits for)
        delay = self._store_answer(st, request, block_ids, held)
        self._to(st, Phase.STORING_ANSWER if delay else Phase.DONE)
        st.sched_s += time.perf_counter() - t0
        self.request_seconds.append(st.sched_s)
        self.unreported_seconds.append(st.sched_s)
        self.stats["requests"] += 1
        self.stats["hit_requests" if st.hit_tokens else "miss_requests"] += 1
        return delay

    def has_pending_push_work(self) -> bool:
        """Reports still owed by the workers, or answers being stored: keep vLLM stepping until they come."""
        return bool(self._finishing) or any(att.in_flight for att in self._attempts.values())

    # -- the answer's chunks --------------------------------------------------------------

    def _store_answer(self, st: _Req, request: VllmRequest, block_ids: "Sequence[Sequence[int]] | None",
                      held: list[_Attempt]) -> bool:
        """Store the whole chunks past the prompt that the request computed (its answer), so the
        next turn of a conversation, whose prompt is this prompt, the answer and a new question,
        hits them too. One Reserve per rank for the sequence, on the connector's thread, after the
        prompt's own commits have landed (else the daemon sees the prompt's chunks in flight and
        reserves nothing after them); then a ``finish`` save plan, and vLLM frees the blocks once
        every rank reported it. Not for sliding-window engines: vLLM has freed most of a windowed
        layer's blocks of the answer by now."""
        if (not self.cfg.store_answers or self.windowed or st.skip or block_ids is None
                or not st.policy.should_store(st.n_prompt + len(getattr(request, "output_token_ids", ()) or ()))
                or self._daemon_down()):
            return False
        computed = int(getattr(request, "num_computed_tokens", 0) or 0)
        n_chunks = computed // self.chunk_tokens
        n_blocks = n_chunks * self.blocks_per_chunk
        if n_chunks <= st.n_prompt // self.chunk_tokens or any(len(ids) < n_blocks for ids in block_ids):
            return False
        tokens = list(request.all_token_ids[: n_chunks * self.chunk_tokens])
        self._finishing[st.req_id] = _Finishing(st, tuple(tuple(ids[:n_blocks]) for ids in block_ids), tokens,
                                                held, self._clock())
        self.stats["answer_stores"] += 1
        return True

    def _plan_answers(self, meta: KvcachedMetadata) -> None:
        """Start the Reserves of finished requests whose prompt Commits have landed (or waited
        ``rpc_timeout_s``), and hand out the save plan of each whose Reserves have landed. Never waits."""
        for rid, fin in list(self._finishing.items()):
            if fin.reserve is None:
                landed = all(all(att.committed) and all(f.done() for f in att.commits) for att in fin.held)
                if not landed and self._clock() - fin.since < self.cfg.rpc_timeout_s:
                    continue
                fin.reserve = self._reserve(fin.st.layouts, fin.tokens)
            if not all(f.done() for f in fin.reserve):
                continue
            del self._finishing[rid]
            self._to(fin.st, Phase.DONE)
            got = [f.result() for f in fin.reserve if f.exception() is None]
            error = next((f.exception() for f in fin.reserve if f.exception() is not None), None)
            n = len(self.layouts)
            k = self.blocks_per_chunk
            to_block = len(fin.block_ids[0])
            # nothing to write: the plan only tells the workers it is done
            tickets: tuple[ReservationTicket | None, ...] = (None,) * n
            key, first = 0, to_block
            if error is not None:
                self._failed("store", error)
                for res in got:
                    res.abort()
            elif not any(res.slots for res in got):
                for res in got:
                    res.abort()
            else:
                att = self._store_attempt(rid, got, retired=True)
                tickets, key = att.save_tickets, att.key
                for rank, ticket in enumerate(tickets):
                    if ticket is not None:
                        att.saves_out[rank] += 1
                first = min(res.slots[0].position for res in got if res.slots) * k
                self.stats["answer_chunks"] += max(len(res.slots) for res in got)
            meta.saves.append(SavePlan(rid, key, tickets, first, to_block,
                                       tuple(ids[first:to_block] for ids in fin.block_ids), k, to_block // k, finish=True))

    # -- the end of an attempt --------------------------------------------------------------

    def _retire(self, st: _Req) -> None:
        """The request is done with its attempt (finished or preempted). What the attempt holds
        goes once the workers have reported every copy they were given (:meth:`_settle`)."""
        if st.lookup is not None:  # still in flight: given back when it lands
            for f in st.lookup:
                f.add_done_callback(self._drop_late)
            st.lookup = None
        self._looking.discard(st)
        if st.pending is not None and not st.pending.async_load:  # nobody needs it any more
            st.pending = None
            self._pending.remove(st)
        if st.rereserve is not None:
            for rf in st.rereserve:
                rf.add_done_callback(_abort_late)
            st.rereserve = None
        for att in (st.attempt, st.store):  # an asynchronous load planned still goes out: see _settle
            if att is not None:
                att.retired = True
                self._settle(att)
        st.attempt = st.store = None

    def _settle(self, att: _Attempt, *, close_reservations: bool = False) -> None:
        """Release, commit or give back what the attempt no longer needs, never what a worker may
        still be copying. Never waits for the daemon."""
        if att.leases_held and not any(att.loads_out) and (att.retired or att.load_done or not att.matched):
            if not any(st.pending is not None and st.pending.key == att.key for st in self._pending):
                att.leases_held = False
                for r in att.cache:
                    r.lease.release()
        for rank, r in enumerate(att.cache):
            if att.committed[rank] or att.saves_out[rank]:
                continue
            res = r.reservation
            w = att.written[rank]
            if att.retired or close_reservations or w < 0 or (res.slots and w > res.slots[-1].position):
                self._close_reservation(att, rank)
        if att.retired and not att.leases_held and all(att.committed) and not att.in_flight:
            self._attempts.pop(att.key, None)

    @staticmethod
    def _give_back(r: CacheRequest) -> None:
        try:
            r.finish(commit=False)
        except Exception as e:  # noqa: BLE001 - the session's end frees it anyway
            log.debug("kvcached connector: giving back a late lease failed: %s", e)

    @classmethod
    def _drop_late(cls, fut: "concurrent.futures.Future[CacheRequest]") -> None:
        """A request that ended before its AcquireReserve answered: give back what it got."""
        if not fut.cancelled() and fut.exception() is None:
            cls._give_back(fut.result())

    def _close_reservation(self, att: _Attempt, rank: int) -> None:
        """Commit rank ``rank``'s written chunks (the rest are given back), on the connector's
        thread: the request's second round trip. Nothing written: an abort on the stream."""
        if att.committed[rank]:
            return
        att.committed[rank] = True
        res = att.cache[rank].reservation
        n = sum(1 for slot in res.slots if slot.position < att.written[rank])
        if n <= 0:
            res.abort()
            return
        att.commits.append(self._bg.submit(self._commit_now, res, n))

    def _commit_now(self, res: Reservation, n: int) -> None:
        try:
            receipt = res.commit(chunks=n)
        except Exception as e:  # noqa: BLE001 - fail open: the request was served, just not stored
            self._failed("store", e)
            return
        self.fail.ok("store")
        self.stats["stored_chunks"] += receipt.stored_chunks

    # -- lease renewal ----------------------------------------------------------------------

    def _renew_leases(self) -> None:
        """Renew the leases still needed once a third of their TTL has passed (one KeepAlive per
        attempt, on a connector thread); take the answers of earlier renewals."""
        now = self._clock()
        for att in self._attempts.values():
            if att.renewal is not None:
                if not att.renewal.done():
                    continue
                try:
                    ttl = att.renewal.result()
                    att.lease_deadline = att.renewal_sent + ttl
                    self.stats["lease_renewals"] += 1
                except Exception as e:  # noqa: BLE001 - the leases are gone: load nothing through them
                    att.lease_lost = True
                    self._failed("renew", e)
                att.renewal = None
            if (not att.leases_held or att.lease_lost or not att.lease_ttl
                    or now < att.lease_deadline - att.lease_ttl * 2 / 3):
                continue
            ids = [r.lease.lease_id for r in att.cache if r.lease.lease_id]
            att.renewal_sent = now
            att.renewal = self._bg.submit(self.client.keep_alive, ids, self.cfg.lease_ttl_s or None,
                                          session_id=att.cache[0].lease.session_id)

    def close(self) -> None:
        for st in list(self._reqs.values()):
            self._retire(st)
            self._to(st, Phase.DONE)
        for att in list(self._attempts.values()):  # the engine is going: nothing more will be copied
            att.loads_out = [0] * len(att.loads_out)
            att.saves_out = [0] * len(att.saves_out)
            att.retired = True
            self._settle(att)
        self._reqs.clear()
        self._pending.clear()
        self._bg.shutdown(wait=True)
        for fin in self._finishing.values():  # nothing will copy them now: give the room back
            self._to(fin.st, Phase.DONE)
            for f in fin.reserve or ():
                if f.exception() is None:
                    f.result().abort()
        self._finishing.clear()
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def tracked_requests(self) -> int:
        return len(self._reqs)

    @property
    def live_attempts(self) -> int:
        return len(self._attempts)
