"""KV event messages: the types, encoder and decoder of the stream the daemon publishes.

They mirror ``vllm/distributed/kv_events.py`` field for field (msgspec structs, same class names
as tags, same options), so vLLM's own decoder reads what this one encodes and consumers written
for vLLM's stream (llm-d's indexer, Dynamo's router, kvcached-router) read this one. What the
fields mean and when each event is sent: :mod:`kvcached.events`, which makes them from the
daemon's index.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
#: The daemon's NVMe tier: vLLM's name for an offloading tier on storage (``MEDIUM_STORAGE``).
#: Daemons before this release said "DISK"; the router reads both.
MEDIUM_STORAGE = "STORAGE"
#: Every chunk a daemon reports is on its own host (vLLM's ``Locality.LOCAL``): chunks only in
#: the shared remote tier are not reported, since every host of the domain reaches them alike.
LOCAL = "LOCAL"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """One message: ``[ts, [events...], data_parallel_rank]`` in msgpack."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """An event is a msgpack map tagged ``"type": <class name>``, defaults left out."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    locality: str | None = None  # LOCAL or REMOTE relative to the publisher (vLLM 0.32's field)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KvEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=KvEventBatch)
