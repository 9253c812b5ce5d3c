"""The connector's scheduler side: how much of each prompt kvcached has, leases, the plan.

Runs on vLLM's scheduler thread, so every hook is short and nothing here waits long for
the daemon:

Two round trips per request, both on the connector's own thread:

* ``on_new_request`` / ``get_num_new_matched_tokens``: one **AcquireReserve** starts as soon as
  vLLM has the request: it pins the cached prefix (a lease: the daemon will not evict or
  overwrite those chunks) and reserves pool room for the prompt's uncached full chunks. The
  scheduler waits at most ``lookup_wait_ms`` for it, and an answer that is not there yet is
  "not yet" (``None``): vLLM asks again on its next step. The hit is whole chunks, cut to whole
  vLLM blocks and to at least one prompt token left to compute.
* ``update_state_after_alloc``: once vLLM has allocated the blocks, plans the load of the
  leased chunks into them (no call to the daemon).
* ``build_connector_meta``: hands the worker a :class:`LoadPlan` (lease tickets, target
  blocks) and a :class:`SavePlan` (reservation tickets) for the reserved chunks that are whole
  by the end of the step; the worker writes them into the pool.
* ``update_connector_output``: the worker says which loads are done (their leases are
  released on the session stream: no round trip) and up to which chunk it wrote; once every
  reserved chunk is written, one **Commit** publishes them. Leases are also released, and
  what was written committed (the rest given back), on preemption and when the request
  finishes, whatever happened, so a finished, aborted or preempted request pins nothing.

Fail open: a daemon that is absent, restarting or refusing makes the request run without
the cache (0 external tokens), logs once, counts ``kvcached_client_fail_open_total`` and
makes the next requests skip the daemon for ``retry_s`` (so a dead daemon costs nothing per
request). A lease that covers less than was promised to vLLM (the chunks went between the
lookup and the acquire, or the daemon did) becomes failed blocks in the plan; the worker
reports them to vLLM, which recomputes them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvcached.keys import KVLayout
from kvcached_client import _core
from kvcached_client.client import CacheRequest, Client
from kvcached_client.errors import DeadlineExceededError, KvcachedError, UnavailableError
from kvcached_client.failopen import FailOpen
from kvcached_client.policy import CachePolicy
from kvcached_client.vllm.config import ConnectorConfig
from kvcached_client.vllm.plan import KvcachedMetadata, KvcachedWorkerMetadata, LoadPlan, SavePlan
from kvcached_client.vllm.spec import request_cacheable, with_lora

log = logging.getLogger("kvcached_client.vllm")

#: daemon trouble: skip the daemon for a while. Other errors only fail the one request.
_TRIPS = (UnavailableError, DeadlineExceededError, TimeoutError)


def policy_of(request: Any) -> CachePolicy:
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
class _Req:
    req_id: str
    tokens: bytes  # the prompt, packed
    n_prompt: int
    policy: CachePolicy
    layouts: tuple[KVLayout, ...]  # per tensor-parallel rank, with the request's LoRA
    skip: str | None = None  # why this request does not use the cache at all
    lookup: "concurrent.futures.Future[list[CacheRequest]] | None" = None
    lookup_started: float = 0.0
    matched: int | None = None  # tokens cached in the daemon (all ranks), once known
    local_computed: int = 0  # vLLM's own (block-aligned) prefix-cache hit at the last ask
    pending: LoadPlan | None = None  # planned, not yet handed to the worker
    cache: list[CacheRequest] | None = None  # per rank: its lease and reservation (AcquireReserve)
    leases_held: bool = False  # the leases are not released yet
    written: list[int] = field(default_factory=list)  # per rank: reserved chunks written up to here (-1: failed)
    committed: list[bool] = field(default_factory=list)  # per rank: its reservation is closed
    save_tickets: tuple | None = None
    reserved_at: float = 0.0  # when the reservations were granted (their TTL runs from there)
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks already handed to the worker to write
    sched_s: float = 0.0  # time spent for it on the scheduler thread


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, layouts: tuple[KVLayout, ...], block_size: int,
                 client_factory: Callable[[], Client], clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.layouts = layouts
        self.block_size = block_size
        self.chunk_tokens = layouts[0].chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // block_size
        self._client_factory = client_factory
        self._client: Client | None = None
        self._clock = clock
        self._reqs: dict[str, _Req] = {}
        self._retry_at = 0.0
        self.fail = FailOpen("vllm")
        #: connector time on the scheduler thread per finished request (seconds), newest last
        self.request_seconds: collections.deque[float] = collections.deque(maxlen=100_000)
        self.stats = collections.Counter()
        # Lookups and releases run here, off the scheduler thread: a blocking gRPC call releases
        # the GIL while it waits (grpc's own futures cost more to issue, ~1 ms, than a whole call).
        self._bg = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcached-scheduler")

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

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            skip = request_cacheable(request)
            tokens = b"" if skip else _core.pack_tokens(request.prompt_token_ids)
            lora = getattr(request, "lora_request", None)
            st = _Req(request.request_id, tokens, len(tokens) // 4, policy_of(request),
                      tuple(with_lora(lay, lora) for lay in self.layouts), skip)
            self._reqs[request.request_id] = st
        return st

    def check_daemon(self) -> None:
        """At engine start: register the layouts, so a daemon that refuses them (a chunk larger
        than its pool blocks, ...) is reported once, loudly, instead of per request. A daemon
        that is not running is only a warning: the engine serves without it until it comes."""
        try:
            for lay in self.layouts:
                self.client.register(lay)
            self.client.session_id()  # leases are bound to it: open it now, not on the first hit
        except KvcachedError as e:
            level = logging.WARNING if isinstance(e, _TRIPS) else logging.ERROR
            log.log(level, "kvcached connector: the daemon cannot serve this engine's layout (%s: %s); "
                    "the engine runs without the cache until it can", e.code.name, e)
        else:
            log.info("kvcached connector: daemon at %s serves layout %s", self.client.target, self.layouts[0].model)

    # -- vLLM hooks ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Start the lookup as soon as vLLM has the request: by the time the scheduler asks,
        the answer is usually there."""
        t0 = time.perf_counter()
        st = self._state(request)
        self._start_lookup(st)
        st.sched_s += time.perf_counter() - t0

    def _start_lookup(self, st: _Req) -> bool:
        """Start the request's AcquireReserve if it has none; False if it cannot (daemon down, ...)."""
        if st.lookup is not None or st.matched is not None:
            return True
        store = st.policy.should_store(st.n_prompt)
        if st.skip or not (st.policy.read or store) or self._daemon_down():
            return False
        self.stats["lookups"] += 1
        st.lookup = self._bg.submit(self._lookup, st.layouts, st.tokens, not st.policy.read, not store)
        st.lookup_started = self._clock()
        return True

    def _lookup(self, layouts: tuple[KVLayout, ...], tokens: bytes, no_cache: bool, no_store: bool) -> list[CacheRequest]:
        """On the connector's thread: each tensor-parallel rank's lease and reservation."""
        reqs: list[CacheRequest] = []
        try:
            for lay in layouts:
                reqs.append(self.client.acquire_reserve(lay, tokens, no_cache=no_cache, no_store=no_store,
                                                        reservation_ttl=self.cfg.reservation_ttl_s))
        except BaseException:
            for r in reqs:
                r.finish(commit=False)
            raise
        return reqs

    def _take(self, st: _Req, reqs: list[CacheRequest]) -> None:
        st.cache = reqs
        st.leases_held = True
        st.written = [0] * len(reqs)
        st.committed = [not r.reservation.opened for r in reqs]
        st.save_tickets = tuple(r.reservation.ticket() if r.reservation.slots else None for r in reqs)
        st.reserved_at = self._clock()
        st.matched = min(r.matched_tokens for r in reqs) if st.policy.read else 0

    def _cache_now(self, st: _Req) -> list[CacheRequest] | None:
        """The request's AcquireReserve answer if it has come (never waits)."""
        if st.cache is None and st.lookup is not None and st.lookup.done():
            try:
                self._take(st, st.lookup.result())
            except Exception as e:  # noqa: BLE001 - fail open
                self._failed("lookup", e)
                st.lookup = None
                st.matched = 0 if st.matched is None else st.matched
        return st.cache

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        st = self._state(request)
        try:
            return self._matched(st, num_computed_tokens), False
        finally:
            st.sched_s += time.perf_counter() - t0

    def _matched(self, st: _Req, num_computed: int) -> int | None:
        st.local_computed = num_computed
        if st.skip or not st.policy.read:
            return 0
        if st.matched is None:
            if not self._start_lookup(st) or st.lookup is None:
                return 0
            try:
                self._take(st, st.lookup.result(timeout=self.cfg.lookup_wait_ms / 1000))
                self.fail.ok("lookup")
            except concurrent.futures.TimeoutError:
                if self._clock() - st.lookup_started < self.cfg.lookup_timeout_s:
                    self.stats["lookup_not_yet"] += 1
                    # Let the connector's thread run: an idle engine asks again at once, in a loop
                    # that would hold the GIL and starve the lookup it waits for (5 ms switches).
                    time.sleep(0)
                    return None  # vLLM asks again next step
                self._failed("lookup", TimeoutError(f"no answer in {self.cfg.lookup_timeout_s} s"))
                st.matched = 0
            except Exception as e:  # noqa: BLE001 - fail open: whatever went wrong, compute instead
                self._failed("lookup", e)
                st.matched = 0
            assert st.matched is not None
        # Whole blocks (chunks are whole blocks), and at least one prompt token left to compute:
        # vLLM needs the last prompt position's logits.
        end = min(st.matched, (st.n_prompt - 1) // self.block_size * self.block_size)
        return max(0, end - num_computed)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        t0 = time.perf_counter()
        st = self._state(request)
        start, end = st.local_computed, st.local_computed + num_external_tokens
        first, last = start // self.block_size, end // self.block_size
        block_ids = tuple(blocks.get_block_ids()[0][first:last])
        tickets: list[Any] = []
        loadable: list[int] = []
        for r in st.cache or [None] * len(st.layouts):
            lease = r.lease if r is not None and st.leases_held else None
            if lease is None or not lease.lease_id:
                tickets.append(None)
                loadable.append(0)
                continue
            tickets.append(lease.ticket())
            loadable.append(max(0, min(lease.matched_tokens, end) // self.block_size - first))
        if min(loadable) < len(block_ids):
            self.stats["short_acquires"] += 1
        st.pending = LoadPlan(st.req_id, first, block_ids, tuple(tickets), tuple(loadable))
        self.stats["loads"] += 1
        self.stats["load_tokens"] += num_external_tokens
        st.sched_s += time.perf_counter() - t0

    def build_connector_meta(self, so: Any) -> KvcachedMetadata:
        meta = KvcachedMetadata()
        for rid in so.preempted_req_ids or ():
            st = self._reqs.get(rid)
            if st is not None:  # its blocks are gone; it starts over (and may load again) when resumed
                self._end(st)
                st.block_ids, st.saved_chunks, st.pending, st.matched, st.lookup = [], 0, None, None, None
                st.cache, st.save_tickets = None, None
        for nr in so.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is not None:
                t0 = time.perf_counter()
                st.block_ids = list(nr.block_ids[0])
                self._plan(meta, st, nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0))
                st.sched_s += time.perf_counter() - t0
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            t0 = time.perf_counter()
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(meta, st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
            st.sched_s += time.perf_counter() - t0
        return meta

    def _plan(self, meta: KvcachedMetadata, st: _Req, computed_after_step: int) -> None:
        if st.pending is not None:
            meta.loads.append(st.pending)
            if st.matched:  # chunks loaded from the daemon are there already: no need to store them
                st.saved_chunks = max(st.saved_chunks, (st.pending.first_block + min(st.pending.loadable_blocks))
                                      // self.blocks_per_chunk)
            st.pending = None
        if st.skip or not st.policy.should_store(st.n_prompt) or self._cache_now(st) is None:
            return
        ready = min(computed_after_step, st.n_prompt) // self.chunk_tokens
        if ready <= st.saved_chunks or st.save_tickets is None or not any(st.save_tickets):
            return
        if self._clock() - st.reserved_at > self.cfg.reservation_ttl_s / 2:
            # The room may be gone by the time the worker writes (the daemon frees an expired
            # reservation and may give the room to another writer): store nothing of this request.
            self.stats["saves_too_late"] += 1
            st.save_tickets = None
            for rank in range(len(st.cache or ())):
                self._close_reservation(st, rank)
            return
        n_blocks = ready * self.blocks_per_chunk
        if len(st.block_ids) < n_blocks:  # should not happen: computed tokens have blocks
            return
        meta.saves.append(SavePlan(st.req_id, st.save_tickets, st.saved_chunks, ready, tuple(st.block_ids[:n_blocks])))
        st.saved_chunks = ready
        self.stats["saves"] += 1

    def update_connector_output(self, output: Any) -> None:
        wm = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(wm, KvcachedWorkerMetadata):
            for rid in wm.loaded:
                st = self._reqs.get(rid)
                if st is not None:
                    t0 = time.perf_counter()
                    self._release(st)
                    st.sched_s += time.perf_counter() - t0
            for (rid, rank), upto in wm.saved.items():
                st = self._reqs.get(rid)
                if st is None or st.cache is None or rank >= len(st.cache) or st.committed[rank]:
                    continue
                t0 = time.perf_counter()
                st.written[rank] = upto if upto < 0 or st.written[rank] < 0 else max(st.written[rank], upto)
                res = st.cache[rank].reservation
                if st.written[rank] < 0 or st.written[rank] > res.slots[-1].position:  # all written, or failed
                    self._close_reservation(st, rank)
                st.sched_s += time.perf_counter() - t0

    def request_finished(self, request: Any) -> None:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return
        t0 = time.perf_counter()
        self._end(st)
        st.sched_s += time.perf_counter() - t0
        self.request_seconds.append(st.sched_s)

    def _end(self, st: _Req) -> None:
        """The request is done with the cache (finished or preempted): release its leases,
        commit what was written, give back the rest. Never waits for the daemon. A lookup still
        in flight is cleaned up when it lands."""
        if st.cache is None and st.lookup is not None and not st.lookup.done():
            st.lookup.add_done_callback(self._drop_late)  # runs on the connector's thread, when it lands
        self._cache_now(st)
        self._release(st)
        for rank in range(len(st.cache or ())):
            self._close_reservation(st, rank)

    @staticmethod
    def _drop_late(fut: "concurrent.futures.Future[list[CacheRequest]]") -> None:
        """A request that ended before its AcquireReserve answered: give back what it got."""
        if fut.cancelled() or fut.exception() is not None:
            return
        for r in fut.result():
            try:
                r.finish(commit=False)
            except Exception as e:  # noqa: BLE001 - the session's end frees it anyway
                log.debug("kvcached connector: giving back a late lease failed: %s", e)

    def _release(self, st: _Req) -> None:
        """Release the request's leases: on the session stream, so no round trip at all."""
        if st.cache is not None and st.leases_held:
            st.leases_held = False
            for r in st.cache:
                r.lease.release()

    def _close_reservation(self, st: _Req, rank: int) -> None:
        """Commit rank ``rank``'s written chunks (the rest are given back), on the connector's
        thread: the request's second round trip. Nothing written: an abort on the stream."""
        if st.cache is None or st.committed[rank]:
            return
        st.committed[rank] = True
        res = st.cache[rank].reservation
        n = sum(1 for slot in res.slots if slot.position < st.written[rank])
        if n <= 0:
            res.abort()
            return
        self._bg.submit(self._commit_now, res, n)

    def _commit_now(self, res: Any, n: int) -> None:
        try:
            receipt = res.commit(chunks=n)
        except Exception as e:  # noqa: BLE001 - fail open: the request was served, just not stored
            self._failed("store", e)
            return
        self.fail.ok("store")
        self.stats["stored_chunks"] += receipt.stored_chunks

    def close(self) -> None:
        for st in self._reqs.values():
            self._end(st)
        self._reqs.clear()
        self._bg.shutdown(wait=True)
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def tracked_requests(self) -> int:
        return len(self._reqs)
