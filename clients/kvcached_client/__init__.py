"""Client library for kvcached (DESIGN.md section 7).

::

    from kvcached_client import Client, KVLayout
    layout = KVLayout(model="org/name@rev", num_layers=32, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16", chunk_tokens=128)
    with Client() as c:
        n = c.lookup(layout, token_ids)
        with c.acquire(layout, token_ids) as lease:
            lease.chunk(0)
        receipt = c.put(layout, token_ids, kv)   # receipt.stored_chunks, .cached_tokens, .durable
"""

from kvcached.contract.keys import KVLayout
from kvcached_client.aio import AsyncClient, AsyncLease
from kvcached_client.client import Client, Lease
from kvcached_client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvcachedError,
    NotFoundError,
    PoolMappingError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvcached_client.receipts import PutReceipt

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "KVLayout",
    "KvcachedError",
    "Lease",
    "NotFoundError",
    "PoolMappingError",
    "PutReceipt",
    "ResourceExhaustedError",
    "UnavailableError",
]
