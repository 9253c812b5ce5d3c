"""Device pool backends by name: a table, not an if-chain.

``make_pool(config)`` builds the pool a store's config asks for. A backend
is a function from the config to a :class:`BlockPool`; adding one is one line
in :data:`POOLS`.
"""

from __future__ import annotations

from typing import Callable

from kvcached.config import StoreConfig
from kvcached.tiers.blocks import BlockPool


def _host(config: StoreConfig) -> BlockPool:
    from kvcached.tiers.pool_shm import HostPool, remove_stale_segments

    prefix = f"kvcached.{config.domain}"
    remove_stale_segments(prefix)
    return HostPool(prefix, config.pool_block_bytes, config.pool_blocks, prefault=config.pool_prefault,
                    access=config.file_access)


def _cuda(config: StoreConfig) -> BlockPool:
    from kvcached.tiers.pool_cuda import CudaPool

    return CudaPool(config.device, config.pool_block_bytes, config.pool_blocks)


POOLS: dict[str, Callable[[StoreConfig], BlockPool]] = {"cpu": _host, "cuda": _cuda}


def make_pool(config: StoreConfig) -> BlockPool:
    kind = config.device.split(":", 1)[0]
    try:
        factory = POOLS[kind]
    except KeyError:
        raise ValueError(f"no pool backend for device {config.device!r}; known: {', '.join(POOLS)}") from None
    return factory(config)
