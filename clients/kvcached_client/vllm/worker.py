"""The connector's worker side: copies between leased chunks and vLLM's paged blocks.

Per step, in vLLM's order:

1. ``begin_step`` (bind_connector_metadata): takes the step's plans.
2. ``start_load`` (before the forward when the step has synchronous loads, after it is launched
   otherwise): opens each :class:`LoadPlan`'s lease through its ticket and copies the chunks
   into the request's blocks. On a CUDA engine the copies run on a side stream (synchronous
   loads layer by layer, so ``wait_for_layer_load`` makes the forward wait for its own layer
   only); on the CPU they are done at once (the copies and the model share the same cores).
3. ``finish_step`` (wait_for_save, after the forward): for each :class:`SavePlan`, copies the
   reserved chunks that are whole now out of the paged cache into their pool room (on CUDA on a
   second side stream that waits for the forward; the compute stream then waits for the copy,
   so no later step overwrites a block before it is read).
4. ``get_finished`` / ``take_report``: every plan is reported once its copies have *completed*
   (a CUDA event on the stream that did them has fired; on the CPU at once): asynchronous loads
   in ``get_finished``'s "finished receiving" set, and every load and save in the step's worker
   metadata, from which the scheduler side releases leases and commits.

No device-wide synchronisation anywhere on the step's path: completion is an event per batch of
copies, polled without blocking, and the tensors a side stream uses (block-id indexes, staged
chunks) are made on that stream and kept alive until its event fires. The lease views are
closed then too, without their own device synchronisation.

A plan whose lease has, or would have by the copy, run out (its ``lease_deadline`` minus a
margin) is refused: its blocks are reported as failed loads and vLLM recomputes them, instead
of reading pool blocks the daemon may have handed to other chunks.

Fail open: a lease that cannot be read (daemon restarted, pool not mappable, an NVMe read
error) turns its blocks into load errors, which vLLM recomputes
(``get_block_ids_with_load_errors``); a store that fails is reported -1 and not committed.
Neither fails the request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvcached_client._core import Location
from kvcached_client.client import Client, LeaseView, ReservationView
from kvcached_client.errors import KvcachedError
from kvcached_client.failopen import FailOpen
from kvcached_client.vllm.paged import PagedLayout
from kvcached_client.vllm.plan import NULL_BLOCK, KvcachedMetadata, KvcachedWorkerMetadata, LoadPlan, SavePlan

log = logging.getLogger("vllm.kvcached")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL

#: At most this many bytes of a step's chunks are staged at once on the cache's device (a run of
#: layers; at least one layer whatever its size), for the converters that batch.
STAGING_BYTES = 64 << 20


@dataclass
class _Copy:
    """Blocks of one chunk to load into one KV-cache group's blocks: ``take`` blocks from block
    ``sub`` of ``chunk``."""

    chunk: torch.Tensor  # [2, layers, kv_heads, chunk_tokens, head_dim]
    sub: int
    take: int
    lo: int  # the block ids are index[lo : lo + take] of the step's index tensor
    plan: int  # which of the step's plans
    group: int = 0


def _ranges(index: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``index``'s entries ``[lo, lo + n)`` for each ``(lo, n)`` of ``spans``, in order: a slice
    when the spans follow each other (one KV-cache group: always), else one concatenation."""
    if all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
        return index[spans[0][0] : spans[-1][0] + spans[-1][1]]
    return torch.cat([index[lo : lo + n] for lo, n in spans])


def real_runs(ids: "list[int] | tuple[int, ...]") -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of real (non-null) block ids: a sliding-window group's
    blocks before its window are vLLM's null block, and are neither loaded nor stored."""
    runs: list[tuple[int, int]] = []
    start = None
    for j, b in enumerate(ids):
        if b != NULL_BLOCK and start is None:
            start = j
        elif b == NULL_BLOCK and start is not None:
            runs.append((start, j - start))
            start = None
    if start is not None:
        runs.append((start, len(ids) - start))
    return runs


#: One chunk's blocks of one KV-cache group to store: (reservation, its slot, the first block
#: within the slot, how many blocks, the group, where their ids start in the step's index).
_Write = tuple[ReservationView, Location, int, int, int, int]


@dataclass
class _InFlight:
    """Copies queued on a stream, what they use, and what to report once they are done."""

    event: "torch.cuda.Event | None"  # None: already done (CPU)
    keep: list[torch.Tensor] = field(default_factory=list)  # tensors the stream still reads or writes
    views: list[LeaseView] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[tuple[SavePlan, int]] = field(default_factory=list)  # (plan, written up to or -1)
    finishes: list[str] = field(default_factory=list)  # finished requests whose blocks vLLM keeps until done

    def done(self) -> bool:
        return self.event is None or self.event.query()


class WorkerSide:
    def __init__(self, layer_names: list[str], block_size: int, chunk_tokens: int, tp_rank: int,
                 converter: PagedLayout, client_factory: Callable[[str], Client], *,
                 clock: Callable[[], float] = time.monotonic, placement: str | None = None,
                 layer_groups: "list[int] | None" = None) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        #: the KV-cache group of each layer (chunk order); plans carry block ids per group
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * len(layer_names)
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.rank = tp_rank
        self.converter = converter
        self._clock = clock
        self._client_factory = client_factory
        self._placement_setting = placement
        #: this rank's device for the daemon's pool slab (set by register; see ConnectorConfig.placement)
        self.placement = ""
        self._client: Client | None = None
        self.caches: list[torch.Tensor] = []
        self.fail = FailOpen("vllm")
        self._save_plans: list[SavePlan] = []
        self._failed_blocks: set[int] = set()
        self._load_stream: "torch.cuda.Stream | None" = None
        self._save_stream: "torch.cuda.Stream | None" = None
        self._layer_events: dict[int, "torch.cuda.Event"] = {}
        self._in_flight: list[_InFlight] = []
        self._recving: set[str] = set()  # asynchronous loads done, for get_finished
        self._sent: set[str] = set()  # finished requests whose answer's copies are done, for get_finished
        self._report = KvcachedWorkerMetadata()
        self.stats: dict[str, int] = {"loaded_blocks": 0, "failed_blocks": 0, "stored_chunks": 0, "store_failures": 0,
                                      "expired_leases": 0}

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = self._client_factory(self.placement)
        return self._client

    @property
    def _cuda(self) -> bool:
        return self._load_stream is not None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_index if n not in kv_caches]
        if missing:
            raise ValueError(f"kvcached connector: vLLM registered no KV cache for layers {missing[:3]}")
        self.caches = [kv_caches[n] for n in self.layer_index]
        if self.caches and self.caches[0].is_cuda:
            device = self.caches[0].device
            self._load_stream = torch.cuda.Stream(device=device)
            self._save_stream = torch.cuda.Stream(device=device)
        if self._placement_setting is not None:
            self.placement = self._placement_setting.replace("{rank}", str(self.rank))
        elif self.caches and self.caches[0].is_cuda:
            from kvcached_client._core import placement_of

            self.placement = placement_of(self.caches[0].device)  # the GPU's UUID: its slab of the pool
        try:  # session and pool mapping now, not on the first request (a daemon that is down: later)
            self.client.warm_up()
            pool = self.client._pool
            log.info("kvcached connector (worker rank %d): pool mapped at %s, slab %s of %d (%s)", self.rank,
                     self.client.target, pool.mapped_slabs, pool.slabs, self.placement or "unplaced")
        except KvcachedError as e:
            log.info("kvcached connector: worker could not reach the daemon yet (%s); it will on first use", e)

    def _index(self, ids: list[int], stream: "torch.cuda.Stream | None") -> torch.Tensor:
        """The step's block ids as one int64 tensor on the cache's device: one small host-to-device
        copy per step (from pinned memory, on ``stream``), not one tensor per chunk and layer."""
        host = torch.tensor(ids, dtype=torch.long)
        if stream is None:
            return host
        return host.pin_memory().to(self.caches[0].device, non_blocking=True)

    # -- loads ---------------------------------------------------------------------------

    def start_load(self, meta: KvcachedMetadata) -> None:
        """Copy each plan's leased chunks into its blocks (see the module docstring)."""
        self._layer_events.clear()
        if not meta.loads:
            return
        batch = _InFlight(None, loads=list(meta.loads))
        items: list[_Copy] = []
        ids: list[int] = []
        for j, lp in enumerate(meta.loads):
            items += self._prepare(j, lp, batch.views, ids)
        try:
            if not items:
                pass
            elif self._load_stream is None:
                self._copy_layers(items, self._index(ids, None))
            else:
                stream = self._load_stream
                # After whatever the compute stream did to these blocks (vLLM zeroes new blocks there).
                stream.wait_stream(torch.cuda.current_stream(stream.device))
                with torch.cuda.stream(stream):
                    index = self._index(ids, stream)
                    batch.keep += [index] + [it.chunk for it in items]
                    sync = [it for it in items if not meta.loads[it.plan].async_load]
                    later = [it for it in items if meta.loads[it.plan].async_load]
                    def layer_done(layer: int) -> None:  # the forward's wait_for_layer waits for this
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        self._layer_events[layer] = ev

                    if sync:
                        self._copy_layers(sync, index, layer_done)
                    self._copy_layers(later, index)
                    batch.event = torch.cuda.Event()
                    batch.event.record(stream)
        except RuntimeError as e:  # a copy that failed midway: none of this step's loads can be trusted
            self.fail.failed("load", e)
            for it in items:
                block_ids = ids[it.lo : it.lo + it.take]
                self._failed_blocks.update(block_ids)
                self.stats["loaded_blocks"] -= len(block_ids)
                self.stats["failed_blocks"] += len(block_ids)
                self._report.load_failed.add(meta.loads[it.plan].key)
            if self._load_stream is not None and batch.event is None:
                batch.event = torch.cuda.Event()
                batch.event.record(self._load_stream)
        self._in_flight.append(batch)
        self._poll()

    def wait_for_layer(self, layer_name: str) -> None:
        ev = self._layer_events.get(self.layer_index.get(layer_name, -1))
        if ev is not None:
            torch.cuda.current_stream(self.caches[0].device).wait_event(ev)  # the GPU waits; the host does not

    def _layer_run(self, layer: int, tokens: int, like: torch.Tensor) -> int:
        """The end of the run of layers from ``layer`` that are staged together: consecutive layers
        of ``layer``'s KV-cache group (their blocks are the same), at most STAGING_BYTES of
        ``tokens`` tokens of chunks like ``like`` ([2, layers, kv_heads, chunk_tokens, head_dim])."""
        per_layer = tokens * 2 * like.shape[2] * like.shape[4] * like.element_size()
        cap = max(1, STAGING_BYTES // max(1, per_layer))
        end = layer + 1
        while end < len(self.caches) and end - layer < cap and self.layer_groups[end] == self.layer_groups[layer]:
            end += 1
        return end

    def _copy_layers(self, items: list[_Copy], index: torch.Tensor,
                     layer_done: "Callable[[int], None] | None" = None) -> None:
        """Scatter ``items`` into every layer's blocks, layer by layer (``layer_done`` after each).

        With a converter that batches (the GPU backends'), the chunks' token ranges of a run of
        layers are first concatenated into one staging tensor (one kernel), and each layer is then
        one converter call for all the step's chunks: on an H200 a 128 MiB load into a 32-layer
        cache took 9.9 ms with one call per chunk and layer, 2.1 ms staged (host-bound both: these
        calls run on the engine's thread). Otherwise one call per chunk and layer."""
        n = self.block_size
        groups: dict[int, list[_Copy]] = {}
        for it in items:
            groups.setdefault(it.group, []).append(it)
        batched = {g: _ranges(index, [(it.lo, it.take) for it in its])
                   for g, its in groups.items() if self.converter.batches and len(its) > 1}
        staged: torch.Tensor | None = None
        first = end = 0
        for layer, cache in enumerate(self.caches):
            g = self.layer_groups[layer]
            mine = groups.get(g, [])
            if g in batched:
                if layer >= end:  # a run never spans two groups: a new group starts a new run
                    first, end = layer, self._layer_run(layer, sum(it.take for it in mine) * n, mine[0].chunk)
                    staged = torch.cat([it.chunk[:, first:end, :, it.sub * n : (it.sub + it.take) * n]
                                        for it in mine], dim=3)  # [2, layers, kv_heads, tokens, head_dim]
                assert staged is not None  # made at the run's first layer
                self.converter.scatter(cache, batched[g], staged[:, layer - first])
            else:
                for it in mine:
                    self.converter.scatter(cache, index[it.lo : it.lo + it.take],
                                           it.chunk[:, layer, :, it.sub * n : (it.sub + it.take) * n])
            if layer_done is not None:
                layer_done(layer)

    def _prepare(self, j: int, lp: LoadPlan, views: list[LeaseView], ids: list[int]) -> list[_Copy]:
        """Open plan ``j``'s lease and find its chunks (a pool view, or an NVMe read); the blocks
        past what can be read, and every block of a lease that is running out, are load errors,
        and so reported to vLLM."""
        ticket = lp.tickets[self.rank] if self.rank < len(lp.tickets) else None
        want = lp.loadable_blocks[self.rank] if ticket is not None else 0
        items: list[_Copy] = []
        done = 0
        if want and self._clock() >= lp.load_before:
            want = 0
            self.stats["expired_leases"] += 1
            self.fail.failed("load", TimeoutError("the lease ran out before the load; recomputing"))
        if want and ticket is not None:  # (want is 0 without a ticket)
            try:
                view = self.client.open_lease(ticket)
                views.append(view)
                first_pos = view.locations[0].position if len(view) else 0
                device = self.caches[0].device
                k = self.blocks_per_chunk
                lo = lp.first_block // k - first_pos  # the chunks this load reads, cut from run views
                chunks = view.chunk_views(lo, (lp.first_block + want - 1) // k - first_pos - lo + 1)
                while done < want:
                    chunk_i, sub = divmod(lp.first_block + done, k)
                    take = min(k - sub, want - done)
                    chunk = chunks[chunk_i - first_pos - lo]
                    if chunk.device != device:
                        chunk = chunk.to(device, non_blocking=True)
                    for g, group_ids in enumerate(lp.block_ids):
                        for off, n in real_runs(group_ids[done : done + take]):
                            items.append(_Copy(chunk, sub + off, n, len(ids), j, g))
                            ids += group_ids[done + off : done + off + n]
                    done += take
                self.fail.ok("load")
            except (KvcachedError, OSError, RuntimeError, ValueError) as e:
                self.fail.failed("load", e)
                del ids[len(ids) - sum(it.take for it in items):]
                items, done = [], 0
        failed = lp.failed_block_ids(done)
        if done < lp.num_blocks:
            self._failed_blocks.update(failed)
            self._report.load_failed.add(lp.key)
        self.stats["loaded_blocks"] += sum(it.take for it in items)
        self.stats["failed_blocks"] += len(failed)
        return items

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Finished requests whose answer's copies completed ("finished sending": vLLM frees their
        blocks once every rank said so) and asynchronous loads whose copies completed ("finished
        receiving"; vLLM schedules the request once every rank said so), since the last call."""
        self._poll()
        sent, self._sent = self._sent, set()
        done, self._recving = self._recving, set()
        return sent, done

    # -- saves ---------------------------------------------------------------------------

    def begin_step(self, meta: KvcachedMetadata) -> None:
        self._save_plans = list(meta.saves)

    def finish_step(self) -> None:
        """Queue this step's stores (after the forward), then take what has completed."""
        plans, self._save_plans = self._save_plans, []
        if plans:
            self._store(plans)
        self._poll()

    def _store(self, plans: list[SavePlan]) -> None:
        """Copy each plan's blocks ``from_block .. to_block - 1`` that belong to this rank's
        reserved chunks into their pool room; each plan is reported, once the copies are done,
        as written up to ``to_chunk`` (-1 on failure: the scheduler commits what was written
        before and gives the rest back)."""
        batch = _InFlight(None)
        work: list[_Write] = []
        ids: list[int] = []
        k = self.blocks_per_chunk
        ok: list[tuple[SavePlan, bool, int]] = []  # (plan, opened, chunks it completes)
        for sp in plans:
            ticket = sp.tickets[self.rank] if self.rank < len(sp.tickets) else None
            if sp.finish:  # vLLM frees its blocks once every rank reported it (after this batch's copies)
                batch.finishes.append(sp.req_id)
            if ticket is None:
                continue
            try:
                res = self.client.open_reservation(ticket)
                whole = 0
                for slot in res.slots:
                    lo = max(sp.from_block, slot.position * k)
                    hi = min(sp.to_block, (slot.position + 1) * k)
                    if lo >= hi:
                        continue
                    whole += slot.position < sp.to_chunk and hi == (slot.position + 1) * k
                    for g, group_ids in enumerate(sp.block_ids):
                        part = group_ids[lo - sp.from_block : hi - sp.from_block]
                        if NULL_BLOCK in part:  # a block vLLM no longer holds: this chunk cannot be whole
                            raise ValueError(f"block {lo + part.index(NULL_BLOCK)} of group {g} is not held any more")
                        work.append((res, slot, lo - slot.position * k, hi - lo, g, len(ids)))
                        ids += part
                ok.append((sp, True, whole))
            except (KvcachedError, RuntimeError, ValueError) as e:
                self.fail.failed("store", e)
                ok.append((sp, False, 0))
        stream = self._save_stream
        try:
            if not work:
                pass
            elif stream is None:
                self._copy_out(work, self._index(ids, None), batch)
            else:
                compute = torch.cuda.current_stream(stream.device)
                stream.wait_stream(compute)  # after the forward wrote the blocks
                with torch.cuda.stream(stream):
                    index = self._index(ids, stream)
                    batch.keep.append(index)
                    self._copy_out(work, index, batch)
                    batch.event = torch.cuda.Event()
                    batch.event.record(stream)
                compute.wait_event(batch.event)  # no later step overwrites a block before it is read
        except RuntimeError as e:
            self.fail.failed("store", e)
            ok = [(sp, False, 0) for sp, _, _ in ok]
            if self._save_stream is not None and batch.event is None:
                batch.event = torch.cuda.Event()
                batch.event.record(self._save_stream)
        for sp, good, n in ok:
            if good:
                self.fail.ok("store")
                self.stats["stored_chunks"] += n
            else:
                self.stats["store_failures"] += 1
            batch.saves.append((sp, sp.to_chunk if good else -1))
        self._in_flight.append(batch)

    def _copy_out(self, work: list[_Write], index: torch.Tensor, batch: _InFlight) -> None:
        """Gather every layer's blocks of ``work`` into the reserved chunks. With a converter that
        batches, a run of layers is gathered for all the step's chunks into one staging tensor (one
        converter call per layer), then copied into each chunk with one copy for the whole run;
        otherwise one gather per chunk and layer (as :meth:`_copy_layers`)."""
        n = self.block_size
        views = [res.view(slot) for res, slot, *_ in work]  # [2, layers, kv_heads, chunk_tokens, head_dim] each
        groups: dict[int, list[int]] = {}
        for i, w in enumerate(work):
            groups.setdefault(w[4], []).append(i)
        layer = 0
        while layer < len(self.caches):
            g = self.layer_groups[layer]
            mine = groups.get(g, [])
            if not (self.converter.batches and len(mine) > 1):
                for i in mine:
                    _res, _slot, first, count, _g, lo = work[i]
                    self._gather_into(self.caches[layer], index[lo : lo + count],
                                      views[i][:, layer, :, first * n : (first + count) * n], batch)
                layer += 1
                continue
            like = views[mine[0]]
            tokens = sum(work[i][3] for i in mine) * n
            end = self._layer_run(layer, tokens, like)
            staged = torch.empty((2, end - layer, like.shape[2], tokens, like.shape[4]), dtype=like.dtype,
                                 device=self.caches[layer].device)
            ids = _ranges(index, [(work[i][5], work[i][3]) for i in mine])
            for j in range(end - layer):
                self.converter.gather(self.caches[layer + j], ids, staged[:, j])
            at = 0
            for i in mine:
                first, count = work[i][2], work[i][3]
                views[i][:, layer:end, :, first * n : (first + count) * n].copy_(staged[:, :, :, at : at + count * n])
                at += count * n
            batch.keep.append(staged)  # a host pool's copy may still read it when this returns
            layer = end

    def _gather_into(self, cache: torch.Tensor, block_ids: torch.Tensor, dst: torch.Tensor, batch: _InFlight) -> None:
        if dst.device == cache.device:
            self.converter.gather(cache, block_ids, dst)
        else:  # a host pool for a GPU engine: gather on the GPU, then one copy
            tmp = torch.empty(dst.shape, dtype=dst.dtype, device=cache.device)
            self.converter.gather(cache, block_ids, tmp)
            dst.copy_(tmp)
            batch.keep.append(tmp)

    # -- reports ---------------------------------------------------------------------------

    def _poll(self) -> None:
        """Move every batch whose copies completed into the report (never waits)."""
        still: list[_InFlight] = []
        for batch in self._in_flight:
            if not batch.done():
                still.append(batch)
                continue
            for v in batch.views:
                v.release(synced=True)  # its copies are done: no device synchronisation
            r = self._report
            for lp in batch.loads:
                r.loaded[(lp.key, self.rank)] = r.loaded.get((lp.key, self.rank), 0) + 1
                if lp.async_load:
                    self._recving.add(lp.req_id)
            for sp, upto in batch.saves:
                r.saved.setdefault((sp.key, self.rank), []).append(upto)
            self._sent.update(batch.finishes)
        self._in_flight = still

    def take_report(self) -> KvcachedWorkerMetadata | None:
        """What completed since the last report (the step's ``kv_connector_worker_meta``)."""
        self._poll()
        report, self._report = self._report, KvcachedWorkerMetadata()
        return report if report else None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def close(self) -> None:
        self._save_plans = []
        if self._in_flight and self._load_stream is not None:
            for batch in self._in_flight:  # shutting down: the pool must not be unmapped under a copy
                if batch.event is not None:
                    batch.event.synchronize()
        self._in_flight = []
        if self._client is not None:
            self._client.close()
            self._client = None

