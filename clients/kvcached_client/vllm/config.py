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


@dataclass(frozen=True)
class ConnectorConfig:
    #: the daemon's socket; default $KVCACHED_SOCKET or the daemon's default socket
    socket: str | None = None
    #: tokens per kvcached chunk; a multiple of vLLM's block size (default 128 rounded up to blocks)
    chunk_tokens: int | None = None
    #: the weights' identity in cache keys; default "model@revision" from vLLM's model config
    model_id: str | None = None
    #: how long the scheduler waits for a lookup before answering "not yet" (vLLM asks again next step)
    lookup_wait_ms: float = 2.0
    #: a lookup still unanswered after this long counts as a failure (the request runs without the cache)
    lookup_timeout_s: float = 1.0
    #: after the daemon fails (absent, restarting), requests skip the cache for this long before trying again
    retry_s: float = 1.0
    #: deadline of each call to the daemon
    rpc_timeout_s: float = 5.0
    #: how long the daemon holds pool room for a request's uncached chunks: from its arrival (the
    #: AcquireReserve) until its prefill has written them (the Commit); a queued request plus a
    #: long CPU prefill can take minutes
    reservation_ttl_s: float = 600.0
    #: how NVMe-only chunks reach the worker: "direct" (read the LMDB file) or "promote" (the daemon copies)
    nvme_read: str = NVME_READ_DEFAULT
    #: vLLM's load-failure policy must be "recompute" for fail-open loads; the connector sets it unless False
    set_recompute_policy: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvcached connector: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: {sorted(known)})")
        cfg = cls(**extra)
        if cfg.nvme_read not in NVME_READ_MODES:
            raise ValueError(f"kvcached connector: nvme_read must be one of {NVME_READ_MODES}")
        if cfg.lookup_wait_ms < 0 or cfg.lookup_timeout_s <= 0 or cfg.retry_s < 0 or cfg.rpc_timeout_s <= 0:
            raise ValueError("kvcached connector: lookup_wait_ms, retry_s must be >= 0, timeouts > 0")
        return cfg
