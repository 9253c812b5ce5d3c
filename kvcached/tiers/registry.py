"""Device pool backends by name: a table, not an if-chain.

``make_pool(config)`` builds the pool a store's config asks for. A backend
is a function from the config to a :class:`PackedPool`; adding one is one line
in :data:`POOLS`.
"""

from __future__ import annotations

from typing import Callable

from kvcached.config import StoreConfig
from kvcached.tiers.packed import PackedPool


def _host(config: StoreConfig) -> PackedPool:
    from kvcached.tiers.pool_shm import HostPool, remove_stale_segments

    prefix = f"kvcached.{config.domain}"
    remove_stale_segments(prefix)
    return HostPool(prefix, config.pool_bytes, slabs=config.pool_slabs, prefault=config.pool_prefault,
                    access=config.file_access)


def _cuda(config: StoreConfig) -> PackedPool:
    from kvcached.tiers.pool_cuda import CudaPool

    return CudaPool(config.device, config.pool_bytes)


POOLS: dict[str, Callable[[StoreConfig], PackedPool]] = {"cpu": _host, "cuda": _cuda}


def make_pool(config: StoreConfig) -> PackedPool:
    kind = config.device.split(":", 1)[0]
    try:
        factory = POOLS[kind]
    except KeyError:
        raise ValueError(f"no pool backend for device {config.device!r}; known: {', '.join(POOLS)}") from None
    return factory(config)
