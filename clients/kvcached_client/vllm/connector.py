"""``KvcachedConnector``: vLLM's KV-connector API (v1) in front of a kvcached daemon.

::

    LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="KvcachedConnector", kv_connector_module_path="kvcached_client.vllm",
        kv_role="kv_both", kv_connector_extra_config={"socket": "/run/kvcached/kvcached.sock"}))

vLLM makes one instance per role: a SCHEDULER one in the engine core and a WORKER one per
GPU worker; this class only routes each hook to :mod:`~kvcached_client.vllm.scheduler` or
:mod:`~kvcached_client.vllm.worker`. At construction it checks the model and settings
(:mod:`~kvcached_client.vllm.spec`) and refuses what it cannot serve exactly, so a wrong
set-up stops the engine at start with a clear message, never a request later.

vLLM's ``kv_load_failure_policy`` defaults to "fail" (a failed load fails the request). A
cache must fail open, so unless ``set_recompute_policy`` is false in the extra config, the
connector switches it to "recompute" (logged): a chunk that cannot be loaded is recomputed.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcached_client.client import Client
from kvcached_client.vllm.config import ConnectorConfig, async_loads
from kvcached_client.vllm.paged import converter_for, verify_cpu_layout
from kvcached_client.vllm.plan import KvcachedHandshake, KvcachedMetadata, KvcachedWorkerMetadata
from kvcached_client.vllm.scheduler import SchedulerSide
from kvcached_client.vllm.spec import (
    UnsupportedEngineError,
    check,
    chunk_tokens_for,
    engine_layouts,
    model_id,
    require_kv_cache_config,
)
from kvcached_client.vllm import stats
from kvcached_client.vllm.stats import SCHEDULER_KEYS, KvcachedConnectorStats, KvcachedPromMetrics, StatsDelta
from kvcached_client.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvcached")  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL


class KvcachedConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        kv_cache_config = require_kv_cache_config(kv_cache_config)  # vLLM 0.32 always passes it
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self.shape = shape = check(vllm_config, kv_cache_config)
        block_size = shape.groups[0].block_size
        chunk = chunk_tokens_for(block_size, cfg.chunk_tokens)
        self.layer_names = list(shape.layer_names)
        group_of = {name: g for g, group in enumerate(shape.groups) for name in group.layer_names}
        self.layer_groups = [group_of[name] for name in self.layer_names]
        self.layouts = engine_layouts(vllm_config, shape, chunk, model=model_id(vllm_config, cfg.model_id))
        if cfg.set_recompute_policy and ktc.kv_load_failure_policy != "recompute":
            log.info("kvcached connector: setting kv_load_failure_policy='recompute' (was %r): a chunk that "
                     "cannot be loaded is recomputed instead of failing the request", ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = "recompute"
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        name = f"vllm {role.name.lower()} pid {os.getpid()}"
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(cfg, self.layouts, block_size, lambda: self._client(name),
                                           async_load=async_loads(cfg, vllm_config), window=shape.window)
            self.scheduler.check_daemon()
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            backend = self._backend_name(vllm_config)
            self.worker = WorkerSide(self.layer_names, block_size, chunk, rank, converter_for(backend),
                                     lambda where: self._client(f"{name} rank {rank}", where),
                                     placement=cfg.placement, layer_groups=self.layer_groups)
            self._backend = backend
        self._delta = self._stats_delta()
        log.info("kvcached connector (%s): layout %s, %d layers (%s), %d KV heads, head dim %d, %s, chunk %d tokens "
                 "(%d vLLM blocks), socket %s", role.name.lower(), self.layouts[0].model, self.layouts[0].num_layers,
                 ", ".join(f"{g.kind}{g.window or ''} x{len(g.layer_names)}" for g in shape.groups),
                 self.layouts[0].num_kv_heads, self.layouts[0].head_dim, self.layouts[0].dtype, chunk,
                 chunk // block_size, cfg.socket or "default")

    def _stats_delta(self) -> StatsDelta:
        """The counters this side adds to vLLM's connector stats (they reach ``vllm serve``'s
        /metrics as ``kvcached_vllm_*``, :mod:`~kvcached_client.vllm.stats`)."""
        if self.scheduler is not None:
            sch = self.scheduler
            seconds = sch.unreported_seconds
            return StatsDelta(lambda: {**{k: sch.stats.get(k, 0) for k in SCHEDULER_KEYS},
                                       "fail_open_events": sch.fail.total()},
                              lambda: [seconds.popleft() for _ in range(len(seconds))])
        w = self.worker
        assert w is not None
        return StatsDelta(lambda: {"loaded_blocks": w.stats["loaded_blocks"], "failed_blocks": w.stats["failed_blocks"],
                                   "expired_leases": w.stats["expired_leases"],
                                   "store_failures_worker": w.stats["store_failures"], "fail_open_events": w.fail.total()})

    def get_kv_connector_stats(self) -> KvcachedConnectorStats | None:
        return self._delta.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcachedConnectorStats:
        return stats.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvcachedPromMetrics:
        return stats.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _client(self, name: str, placement: str = "") -> Client:
        # Unary calls: the scheduler side calls from its background threads beside vLLM's busy
        # scheduler thread, where a call on the session stream waits for the GIL on more threads
        # (bench/hf_path.py, "beside a busy thread").
        return Client(self.config.socket, timeout=self.config.rpc_timeout_s, client_name=name,
                      nvme_read=self.config.nvme_read, placement=placement, stream_calls=False)

    def _backend_name(self, vllm_config: "VllmConfig") -> str:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        # The abstract base, as vLLM's own callers pass it (the lookup filters with isinstance); mypy
        # takes no abstract class for a type[T] parameter.
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, self.layer_names)  # type: ignore[type-abstract]
        names = {layer.get_attn_backend().get_name() for layer in layers.values()}
        if len(names) != 1:
            raise UnsupportedEngineError(f"kvcached connector: the layers use several attention backends {names}")
        return names.pop()

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)
        cache = self.worker.caches[0]
        lay = self.layouts[0]
        if self.shape.mla:
            ok, want, block_dim = (cache.ndim in (3, 4) and cache.shape[-1] == 2 * lay.head_dim
                                   and (cache.ndim == 3 or cache.shape[1] == 1),
                                   "[blocks, (1,) block_size, kv_lora_rank + rope_dim]", cache.ndim - 2)
        else:
            ok, want, block_dim = (cache.ndim == 4 and cache.shape[1] == lay.num_kv_heads
                                   and cache.shape[3] == 2 * lay.head_dim, "[blocks, kv_heads, block_size, 2 * head_dim]", 2)
        if not ok:
            raise UnsupportedEngineError(
                f"kvcached connector: the {self._backend} KV cache has shape {tuple(cache.shape)}, not the "
                f"{want} view of vLLM 0.32")
        if cache.shape[block_dim] != self.worker.block_size:
            raise UnsupportedEngineError(
                f"kvcached connector: the attention kernel's block size {cache.shape[2]} differs from the "
                f"scheduler's {self.worker.block_size}; set --block-size to a size the kernel supports")
        if self._backend == "CPU_ATTN":
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

            # (type-abstract: the abstract base, as in _backend_name)
            layer = next(iter(get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase,  # type: ignore[type-abstract]
                                                          self.layer_names[:1]).values()))
            isa = getattr(layer, "isa", "vec")
            # An fp8 cache is uint8; the K and V its kernel quantises are in the model's dtype.
            act = self._vllm_config.model_config.dtype if cache.dtype == torch.uint8 else cache.dtype
            assert isinstance(act, torch.dtype), "ModelConfig resolves its dtype to a torch.dtype at start"
            why = verify_cpu_layout(act, cache.shape[1], cache.shape[2], self.layouts[0].head_dim, isa,
                                    kv_cache_dtype=self.shape.kv_cache_dtype)
            if why:
                raise UnsupportedEngineError(f"kvcached connector: {why}; not supported yet")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KvcachedMetadata):
            self.worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert self.worker is not None and isinstance(meta, KvcachedMetadata)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing per layer: stores are reserved, copied and committed after the forward
        (``wait_for_save``), see :mod:`~kvcached_client.vllm.worker`."""

    def wait_for_save(self) -> None:
        if self.worker is not None and self.has_connector_metadata():
            self.worker.finish_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose answer's copies completed on this rank (vLLM frees their blocks
        once every rank said so), and asynchronous loads whose copies completed (vLLM schedules the
        request once every rank said so)."""
        if self.worker is None:
            return None, None
        sent, received = self.worker.get_finished()
        return sent or None, received or None

    def get_handshake_metadata(self) -> KvcachedHandshake | None:
        """What this worker tells the scheduler side once, at start (vLLM's connector handshake,
        collected from every rank after the KV caches are registered): its device, so that the
        scheduler reserves and promotes this rank's chunks in that GPU's pool slab."""
        return KvcachedHandshake(self.worker.placement) if self.worker is not None else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self.scheduler is not None:
            self.scheduler.set_placements({rank: m.placement for rank, m in metadata.items()
                                           if isinstance(m, KvcachedHandshake)})

    def build_connector_worker_meta(self) -> KvcachedWorkerMetadata | None:
        return self.worker.take_report() if self.worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvcachedMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM may free the blocks at once, unless the request's answer is being stored (True: it
        keeps them until every worker reports the request in ``get_finished``). A prompt store's
        copies are ordered before any later step's writes to its blocks (on CUDA the compute
        stream waits for the store's event), and an asynchronous load's blocks are held by vLLM
        itself until the load is reported."""
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request, block_ids), None

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()
