"""The connector's worker side: copies between leased chunks and vLLM's paged blocks.

Per step, in vLLM's order:

1. ``begin_step`` (bind_connector_metadata, before the forward): reserves, for each
   :class:`SavePlan`, the chunks the daemon does not have yet (one Reserve per request).
2. ``start_load`` (before the forward when the step has loads): opens each
   :class:`LoadPlan`'s lease through its ticket and copies the chunks into the request's
   blocks. On a CUDA engine the copies run on a side stream, layer by layer, and
   ``wait_for_layer_load`` makes the forward wait for its layer only; on the CPU they are
   done at once (the copies and the model compete for the same cores anyway).
3. ``save_layer`` (after each attention layer): copies the layer's new blocks into the
   reserved pool blocks.
4. ``finish_step`` (wait_for_save, after the forward): copies any layer that did not pass
   through ``save_layer``, commits the reservations, and reports the loads done (the
   scheduler then releases their leases).

Fail open: a lease that cannot be read (daemon restarted, pool not mappable, an NVMe read
error) turns its blocks into load errors, which vLLM recomputes
(``get_block_ids_with_load_errors``); a store that fails is aborted and skipped. Neither
fails the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvcached_client.client import Client, Reservation
from kvcached_client.errors import KvcachedError
from kvcached_client.failopen import FailOpen
from kvcached_client.vllm.paged import PagedLayout
from kvcached_client.vllm.plan import KvcachedMetadata, KvcachedWorkerMetadata, LoadPlan, SavePlan

log = logging.getLogger("kvcached_client.vllm")


@dataclass
class _Save:
    plan: SavePlan
    res: Reservation
    layers_done: set[int] = field(default_factory=set)


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
        self._saves: list[_Save] = []
        self._loaded: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._stream: "torch.cuda.Stream | None" = None
        self._layer_events: dict[int, "torch.cuda.Event"] = {}
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

    # -- loads ---------------------------------------------------------------------------

    def start_load(self, meta: KvcachedMetadata) -> None:
        if not meta.loads:
            return
        if self._stream is None:
            for lp in meta.loads:
                self._load(lp)
            return
        self._layer_events.clear()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            for lp in meta.loads:
                self._load(lp)
            for layer in range(len(self.caches)):
                ev = torch.cuda.Event()
                ev.record(self._stream)
                self._layer_events[layer] = ev

    def wait_for_layer(self, layer_name: str) -> None:
        ev = self._layer_events.get(self.layer_index.get(layer_name, -1))
        if ev is not None:
            torch.cuda.current_stream(ev.device if hasattr(ev, "device") else None).wait_event(ev)

    def _load(self, lp: LoadPlan) -> None:
        """Copy what the lease covers into the request's blocks; the rest are load errors."""
        ticket = lp.tickets[self.rank] if self.rank < len(lp.tickets) else None
        ok = lp.loadable_blocks[self.rank] if ticket is not None else 0
        try:
            if ok:
                self._copy_in(lp, ticket, ok)
        except (KvcachedError, OSError, RuntimeError, ValueError) as e:
            self.fail.failed("load", e)
            ok = 0
        else:
            if ok:
                self.fail.ok("load")
        failed = lp.block_ids[ok:]
        self._failed_blocks.update(failed)
        self.stats["loaded_blocks"] += ok
        self.stats["failed_blocks"] += len(failed)
        self._loaded.add(lp.req_id)

    def _copy_in(self, lp: LoadPlan, ticket, n_blocks: int) -> None:
        view = self.client.open_lease(ticket)
        first_pos = view.locations[0].position if len(view) else 0
        device = self.caches[0].device
        k, n = self.blocks_per_chunk, self.block_size
        j = 0
        try:
            while j < n_blocks:
                b = lp.first_block + j
                chunk_i, sub = divmod(b, k)
                take = min(k - sub, n_blocks - j)
                chunk = view.chunk(chunk_i - first_pos)
                if chunk.device != device:
                    chunk = chunk.to(device, non_blocking=True)
                ids = torch.tensor(lp.block_ids[j : j + take], dtype=torch.long, device=device)
                for layer, cache in enumerate(self.caches):
                    self.converter.scatter(cache, ids, chunk[:, layer, :, sub * n : (sub + take) * n])
                j += take
        finally:
            view.release()

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves ---------------------------------------------------------------------------

    def begin_step(self, meta: KvcachedMetadata) -> None:
        self._saves = []
        for sp in meta.saves:
            try:
                res = self.client.reserve(sp.layouts[self.rank], sp.tokens)
            except KvcachedError as e:
                self.fail.failed("store", e)
                self.stats["store_failures"] += 1
                continue
            if res.slots:
                self._saves.append(_Save(sp, res))
            else:
                self._commit(res)  # nothing to write: the daemon had all of it (or others are writing it)

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None or not self._saves:
            return
        for s in self._saves:
            self._copy_out(s, layer, kv_layer)

    def _copy_out(self, s: _Save, layer: int, cache: torch.Tensor) -> None:
        k = self.blocks_per_chunk
        for slot in s.res.slots:
            ids = torch.tensor(s.plan.block_ids[slot.position * k : (slot.position + 1) * k],
                               dtype=torch.long, device=cache.device)
            dst = s.res.view(slot)[:, layer]
            if dst.device == cache.device:
                self.converter.gather(cache, ids, dst)
            else:  # a host pool for a GPU engine: gather on the GPU, then one copy
                tmp = torch.empty(dst.shape, dtype=dst.dtype, device=cache.device)
                self.converter.gather(cache, ids, tmp)
                dst.copy_(tmp)
        s.layers_done.add(layer)

    def finish_step(self) -> KvcachedWorkerMetadata | None:
        saves, self._saves = self._saves, []
        for s in saves:
            try:
                for layer, cache in enumerate(self.caches):
                    if layer not in s.layers_done:
                        self._copy_out(s, layer, cache)
            except (KvcachedError, RuntimeError, ValueError) as e:
                self.fail.failed("store", e)
                self.stats["store_failures"] += 1
                s.res.abort()
                continue
            self._commit(s.res)
        if self._stream is not None and self._layer_events:
            self._stream.synchronize()  # the leases may be released once we report the loads done
            self._layer_events.clear()
        loaded, self._loaded = self._loaded, set()
        return KvcachedWorkerMetadata(loaded) if loaded else None

    def _commit(self, res: Reservation) -> None:
        try:
            receipt = res.commit()
        except KvcachedError as e:
            self.fail.failed("store", e)
            self.stats["store_failures"] += 1
            res.abort()
            return
        self.fail.ok("store")
        self.stats["stored_chunks"] += receipt.stored_chunks

    def close(self) -> None:
        for s in self._saves:
            s.res.abort()
        self._saves = []
        if self._client is not None:
            self._client.close()
            self._client = None
