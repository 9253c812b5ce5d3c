"""The connector's settings, from ``kv_connector_extra_config``.

::

    --kv-transfer-config '{"kv_connector": "KvcachedConnector",
                           "kv_connector_module_path": "kvcached_client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvcached/kvcached.sock"}}'

Every key is optional; unknown keys are refused at start (a typo would otherwise be ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvcached_client._core import NVME_READ_DEFAULT, NVME_READ_MODES


LOAD_MODES = ("auto", "async", "sync")


@dataclass(frozen=True)
class ConnectorConfig:
    #: the daemon's socket; default $KVCACHED_SOCKET or the daemon's default socket
    socket: str | None = None
    #: tokens per kvcached chunk; a multiple of vLLM's block size (default 128 rounded up to blocks)
    chunk_tokens: int | None = None
    #: the weights' identity in cache keys; default "model@revision" from vLLM's model config
    model_id: str | None = None
    #: a lookup still unanswered after this long counts as a failure (the request runs without the cache);
    #: until then the scheduler answers "not yet" and vLLM asks again on its next step (it never waits)
    lookup_timeout_s: float = 1.0
    #: a step vLLM scheduled nothing for, while lookups are in flight: wait (without the GIL) up to this
    #: long for them to land, instead of letting the engine spin empty steps that starve the connector's
    #: threads of the GIL (README "Use with vLLM"); 0 turns it off
    idle_wait_s: float = 0.02
    #: after the daemon fails (absent, restarting), requests skip the cache for this long before trying again
    retry_s: float = 1.0
    #: deadline of each call to the daemon
    rpc_timeout_s: float = 5.0
    #: how long the daemon holds pool room for a request's uncached chunks: from its arrival (the
    #: AcquireReserve) until its prefill has written them (the Commit); a queued request plus a
    #: long CPU prefill can take minutes
    reservation_ttl_s: float = 600.0
    #: the leases' TTL (0: the daemon's lease_ttl); the scheduler renews a lease still needed once a
    #: third of it has passed, and a worker refuses to load through one within ``load_margin_s`` of its end
    lease_ttl_s: float = 0.0
    #: a worker loads through a lease only if it has at least this long to live (capped at a quarter of its TTL)
    load_margin_s: float = 2.0
    #: "async": loads run between scheduler steps (vLLM's WAITING_FOR_REMOTE_KVS; the copy on a side
    #: stream after the forward is launched); "sync": in the step that computes the rest of the prompt;
    #: "auto": async on CUDA engines, sync on CPU engines (measured faster there, README "Use with vLLM")
    load_mode: str = "auto"
    #: how NVMe-only chunks reach the worker: "direct" (read the LMDB file) or "promote" (the daemon copies)
    nvme_read: str = NVME_READ_DEFAULT
    #: vLLM's load-failure policy must be "recompute" for fail-open loads; the connector sets it unless False
    set_recompute_policy: bool = True
    #: each worker's device, which picks its slab of the daemon's pool (one slab per GPU): default the
    #: UUID of the GPU its KV cache is on (a CPU engine: none, the daemon picks); "{rank}" becomes the
    #: worker's TP rank, e.g. "host:{rank}" for a host pool with pool_slabs
    placement: str | None = None
    #: store a finished request's answer too (its generated tokens' whole chunks), so the next turn of a
    #: conversation hits it; vLLM keeps the request's blocks until they are copied (one round trip).
    #: Per request ``no_store`` and the long-generation bypass apply as to prompts
    store_answers: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvcached connector: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: {sorted(known)})")
        try:
            cfg = cls(**extra)
        except TypeError as e:
            raise ValueError(f"kvcached connector: kv_connector_extra_config: {e}") from None
        if cfg.nvme_read not in NVME_READ_MODES:
            raise ValueError(f"kvcached connector: nvme_read must be one of {NVME_READ_MODES}")
        if cfg.load_mode not in LOAD_MODES:
            raise ValueError(f"kvcached connector: load_mode must be one of {LOAD_MODES}, not {cfg.load_mode!r}")
        if (cfg.lookup_timeout_s <= 0 or cfg.retry_s < 0 or cfg.rpc_timeout_s <= 0 or cfg.lease_ttl_s < 0
                or cfg.load_margin_s < 0 or cfg.reservation_ttl_s <= 0 or cfg.idle_wait_s < 0):
            raise ValueError("kvcached connector: retry_s, lease_ttl_s, load_margin_s and idle_wait_s must be >= 0, "
                             "lookup_timeout_s, rpc_timeout_s and reservation_ttl_s > 0")
        return cfg


def async_loads(cfg: ConnectorConfig, vllm_config: Any) -> bool:
    """Whether loads run asynchronously (``load_mode``; "auto": on CUDA engines only)."""
    if cfg.load_mode != "auto":
        return cfg.load_mode == "async"
    return getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") == "cuda"
