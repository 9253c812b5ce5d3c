"""The connector's worker side: copies between leased chunks and vLLM's paged blocks.

Per step, in vLLM's order:

1. ``begin_step`` (bind_connector_metadata): takes the step's plans.
2. ``start_load`` (before the forward when the step has loads): opens each
   :class:`LoadPlan`'s lease through its ticket and copies the chunks into the request's
   blocks. On a CUDA engine the copies run on a side stream, layer by layer, and
   ``wait_for_layer_load`` makes the forward wait for its layer only; on the CPU they are
   done at once (the copies and the model compete for the same cores anyway).
3. ``finish_step`` (wait_for_save, after the forward): for each :class:`SavePlan`, copies
   the reserved chunks that are whole now out of the paged cache into their pool room (the
   scheduler side reserved them with the request's AcquireReserve; no call to the daemon
   here), then reports the loads done and the chunks written; the scheduler side releases the
   leases and commits.

Fail open: a lease that cannot be read (daemon restarted, pool not mappable, an NVMe read
error) turns its blocks into load errors, which vLLM recomputes
(``get_block_ids_with_load_errors``); a store that fails is aborted and skipped. Neither
fails the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from kvcached_client.client import Client, LeaseView, ReservationView
from kvcached_client.errors import KvcachedError
from kvcached_client.failopen import FailOpen
from kvcached_client.vllm.paged import PagedLayout
from kvcached_client.vllm.plan import KvcachedMetadata, KvcachedWorkerMetadata, LoadPlan, SavePlan

log = logging.getLogger("kvcached_client.vllm")


@dataclass
class _Copy:
    """Blocks of one chunk to load: ``take`` blocks from block ``sub`` of ``chunk``."""

    chunk: torch.Tensor  # [2, layers, kv_heads, chunk_tokens, head_dim]
    sub: int
    take: int
    block_ids: torch.Tensor


class WorkerSide:
    def __init__(self, layer_names: list[str], block_size: int, chunk_tokens: int, tp_rank: int,
                 converter: PagedLayout, client_factory: Callable[[], Client]) -> None:
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.rank = tp_rank
        self.converter = converter
        self._client_factory = client_factory
        self._client: Client | None = None
        self.caches: list[torch.Tensor] = []
        self.fail = FailOpen("vllm")
        self._save_plans: list[SavePlan] = []
        self._loaded: set[str] = set()
        self._saved: dict[tuple[str, int], int] = {}
        self._failed_blocks: set[int] = set()
        self._stream: "torch.cuda.Stream | None" = None
        self._layer_events: dict[int, "torch.cuda.Event"] = {}
        self._views: list[LeaseView] = []  # this step's lease views, closed in finish_step
        self.stats: dict[str, int] = {"loaded_blocks": 0, "failed_blocks": 0, "stored_chunks": 0, "store_failures": 0}

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_index if n not in kv_caches]
        if missing:
            raise ValueError(f"kvcached connector: vLLM registered no KV cache for layers {missing[:3]}")
        self.caches = [kv_caches[n] for n in self.layer_index]
        if self.caches and self.caches[0].is_cuda:
            self._stream = torch.cuda.Stream(device=self.caches[0].device)
        try:  # session and pool mapping now, not on the first request (a daemon that is down: later)
            self.client.warm_up()
        except KvcachedError as e:
            log.info("kvcached connector: worker could not reach the daemon yet (%s); it will on first use", e)

    # -- loads ---------------------------------------------------------------------------

    def start_load(self, meta: KvcachedMetadata) -> None:
        """Copy each plan's leased chunks into its blocks, layer by layer (see the module docstring)."""
        if not meta.loads:
            return
        views: list[LeaseView] = []
        items: list[_Copy] = []
        for lp in meta.loads:
            items += self._prepare(lp, views)
        try:
            if self._stream is None:
                for layer in range(len(self.caches)):
                    self._copy_layer(items, layer)
            else:
                self._layer_events.clear()
                self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
                with torch.cuda.stream(self._stream):
                    for layer in range(len(self.caches)):
                        self._copy_layer(items, layer)
                        ev = torch.cuda.Event()
                        ev.record(self._stream)
                        self._layer_events[layer] = ev
        except RuntimeError as e:  # a copy that failed midway: none of this step's loads can be trusted
            self.fail.failed("load", e)
            for it in items:
                self._failed_blocks.update(it.block_ids.tolist())
                self.stats["loaded_blocks"] -= it.block_ids.numel()
                self.stats["failed_blocks"] += it.block_ids.numel()
        finally:
            # Closed in finish_step, after the copies are done (closing a CUDA view synchronises the
            # device, which here would end the layer-by-layer overlap). The leases themselves stay
            # held by the scheduler side until it hears the loads are done.
            self._views += views

    def wait_for_layer(self, layer_name: str) -> None:
        ev = self._layer_events.get(self.layer_index.get(layer_name, -1))
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def _copy_layer(self, items: list["_Copy"], layer: int) -> None:
        cache, n = self.caches[layer], self.block_size
        for it in items:
            self.converter.scatter(cache, it.block_ids, it.chunk[:, layer, :, it.sub * n : (it.sub + it.take) * n])

    def _prepare(self, lp: LoadPlan, views: list[LeaseView]) -> list["_Copy"]:
        """Open the plan's lease and read its chunks (a pool view, or an NVMe read); the blocks
        past what could be read are load errors, and so reported to vLLM."""
        ticket = lp.tickets[self.rank] if self.rank < len(lp.tickets) else None
        want = lp.loadable_blocks[self.rank] if ticket is not None else 0
        items: list[_Copy] = []
        done = 0
        if want:
            try:
                view = self.client.open_lease(ticket)
                views.append(view)
                first_pos = view.locations[0].position if len(view) else 0
                device = self.caches[0].device
                k = self.blocks_per_chunk
                while done < want:
                    chunk_i, sub = divmod(lp.first_block + done, k)
                    take = min(k - sub, want - done)
                    chunk = view.chunk(chunk_i - first_pos)
                    if chunk.device != device:
                        chunk = chunk.to(device, non_blocking=True)
                    ids = torch.tensor(lp.block_ids[done : done + take], dtype=torch.long, device=device)
                    items.append(_Copy(chunk, sub, take, ids))
                    done += take
                self.fail.ok("load")
            except (KvcachedError, OSError, RuntimeError, ValueError) as e:
                self.fail.failed("load", e)
        failed = lp.block_ids[done:]
        self._failed_blocks.update(failed)
        self.stats["loaded_blocks"] += done
        self.stats["failed_blocks"] += len(failed)
        self._loaded.add(lp.req_id)
        return items

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves ---------------------------------------------------------------------------

    def begin_step(self, meta: KvcachedMetadata) -> None:
        self._save_plans = list(meta.saves)

    def _store(self, sp: SavePlan) -> None:
        """Copy this rank's reserved chunks ``from_chunk .. to_chunk - 1`` into their pool room
        and report how far they are written (-1 on failure: the scheduler commits what was
        written before and gives the rest back)."""
        ticket = sp.tickets[self.rank] if self.rank < len(sp.tickets) else None
        if ticket is None:
            return
        try:
            res = self.client.open_reservation(ticket)
            slots = [slot for slot in res.slots if sp.from_chunk <= slot.position < sp.to_chunk]
            for layer, cache in enumerate(self.caches):
                self._copy_out(sp, res, slots, layer, cache)
            if slots and self.caches and self.caches[0].is_cuda:
                torch.cuda.synchronize(self.caches[0].device)  # the commit must not overtake the copies
        except (KvcachedError, RuntimeError, ValueError) as e:
            self.fail.failed("store", e)
            self.stats["store_failures"] += 1
            self._saved[(sp.req_id, self.rank)] = -1
            return
        self.fail.ok("store")
        self.stats["stored_chunks"] += len(slots)
        self._saved[(sp.req_id, self.rank)] = sp.to_chunk

    def _copy_out(self, sp: SavePlan, res: ReservationView, slots: list, layer: int, cache: torch.Tensor) -> None:
        k = self.blocks_per_chunk
        for slot in slots:
            ids = torch.tensor(sp.block_ids[slot.position * k : (slot.position + 1) * k],
                               dtype=torch.long, device=cache.device)
            dst = res.view(slot)[:, layer]
            if dst.device == cache.device:
                self.converter.gather(cache, ids, dst)
            else:  # a host pool for a GPU engine: gather on the GPU, then one copy
                tmp = torch.empty(dst.shape, dtype=dst.dtype, device=cache.device)
                self.converter.gather(cache, ids, tmp)
                dst.copy_(tmp)

    def finish_step(self) -> KvcachedWorkerMetadata | None:
        plans, self._save_plans = self._save_plans, []
        for sp in plans:
            self._store(sp)
        if self._stream is not None and self._layer_events:
            self._stream.synchronize()  # the leases may be released once we report the loads done
            self._layer_events.clear()
        views, self._views = self._views, []
        for v in views:
            v.release()
        loaded, self._loaded = self._loaded, set()
        saved, self._saved = self._saved, {}
        return KvcachedWorkerMetadata(loaded, saved) if loaded or saved else None

    def close(self) -> None:
        self._save_plans = []
        if self._client is not None:
            self._client.close()
            self._client = None
