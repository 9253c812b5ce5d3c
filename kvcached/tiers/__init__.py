"""Tiers hold chunk bytes under their hash. They know nothing of the index, leases or RPC."""

from kvcached.contract.record import ChunkMeta
from kvcached.tiers.base import Slot, Tier

__all__ = ["ChunkMeta", "Slot", "Tier"]
