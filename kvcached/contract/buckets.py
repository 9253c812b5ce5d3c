"""Histogram buckets that the daemon's metrics and kvcached-router's share, so a dashboard reads
one histogram whichever process filled it."""

#: Top-1 similarity of semantic-cache lookups: fine steps where serve/refuse thresholds sit.
SIMILARITY_BUCKETS = tuple(round(0.80 + 0.01 * i, 2) for i in range(21))
