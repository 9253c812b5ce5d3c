"""Prefix index and eviction queues. Knows chunk hashes and tier ids, nothing of bytes or RPC."""

from kvcached.index.eviction import POLICIES, FrequencyPolicy, LruPolicy, make_policy
from kvcached.index.trie import Node, PrefixIndex

__all__ = ["POLICIES", "FrequencyPolicy", "LruPolicy", "Node", "PrefixIndex", "make_policy"]
