"""Prefix index and eviction queues. Knows chunk hashes and tier ids, nothing of bytes or RPC."""

from kvcached.index.trie import Node, PrefixIndex

__all__ = ["Node", "PrefixIndex"]
