"""Tiers hold chunk bytes under their hash. They know nothing of the index, leases or RPC."""

from kvcached.tiers.base import ChunkMeta, Slot, Tier

__all__ = ["ChunkMeta", "Slot", "Tier"]
