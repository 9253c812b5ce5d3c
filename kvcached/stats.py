"""Counters the engine keeps and the snapshot it reports.

The engine only counts; exporting (Prometheus, kvcachectl) reads
:class:`StoreStats` snapshots, so no metrics library is imported here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvcached.promptshape import LayoutShapeStats


@dataclass
class Counters:
    """Monotonic event counts. Mutated under the store lock only."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    acquires: int = 0
    acquired_tokens: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_session_released: int = 0
    reservations: int = 0
    commits: int = 0
    committed_chunks: int = 0
    aborts: int = 0
    reservations_expired: int = 0
    in_flight_conflicts: int = 0
    pool_evictions: int = 0
    nvme_evictions: int = 0
    ttl_expirations: int = 0
    promotions: int = 0
    prefetched: int = 0  # promotions ahead of need (counted in promotions too)
    demotions: int = 0
    write_through_writes: int = 0
    write_through_failures: int = 0
    corrupt_dropped: int = 0
    dropped_no_room: int = 0
    pool_window_evictions: int = 0  # room made by evicting a contiguous window (fragmented pool)
    sync_demotions: int = 0  # demotions on a request's path (the background writer fell behind)
    writeback_batches: int = 0  # background write-back: LMDB transactions (one sync each)
    writeback_chunks: int = 0  # chunks written by them
    writeback_bytes: int = 0
    writeback_waits: int = 0  # reservations that waited for the writer to make room
    writeback_wait_seconds: float = 0.0
    writeback_wait_timeouts: int = 0  # ...and gave up waiting (then demoted themselves)
    legacy_rewritten: int = 0  # format-1 NVMe records rewritten in the current format
    not_reserved_chunks: int = 0  # chunks a reservation could not get room for (reported, not an error)
    admitted_chunks: int = 0  # chunks a reservation got pool room for (the admission decision: yes)
    refused_value_chunks: int = 0  # ...refused by the admission policy: worth less than their victims
    remote_filled_chunks: int = 0  # chunks fetched from the remote tier (verified) and stored here


@dataclass(frozen=True)
class TierStats:
    capacity_bytes: int
    used_bytes: int
    chunks: int


@dataclass(frozen=True)
class SlabStats:
    """One slab of the pool (one per GPU): its device, size and what is taken."""

    placement: str
    capacity_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class PoolStats(TierStats):
    """The packed pool. ``used_bytes`` counts committed and reserved runs (rounded up to the
    alignment); ``payload_bytes`` only the committed chunks' bytes, what holds KV."""

    payload_bytes: int
    free_bytes: int
    largest_free_bytes: int  # the longest free run: the biggest chunk that fits without evicting
    free_runs: int
    reserved_bytes: int
    reserved_chunks: int
    cached_chunks: int  # committed, not pinned by any lease
    leased_chunks: int  # committed and pinned by at least one lease
    leased_bytes: int
    generation: str
    slabs: tuple[SlabStats, ...] = ()


@dataclass(frozen=True)
class NvmeStats(TierStats):
    file_bytes: int
    map_bytes: int
    readers: int
    admitting: bool
    map_grows: int = 0  # times a full LMDB map was grown (kvcached.tiers.nvme)


@dataclass(frozen=True)
class HashMemoStats:
    """The chunk-hash memo (kvcached.hashmemo): what it holds and how much hashing it saved."""

    runs: int
    bytes: int
    max_bytes: int
    memo_chunks: int  # chunk hashes answered from the memo
    hashed_chunks: int  # chunk hashes computed with SHA-256


@dataclass(frozen=True)
class EvictionStats:
    """The eviction policy (kvcached.index.eviction) and what it measured."""

    policy: str
    admission: str
    weight: float = 0.0
    turnover_seconds: float = 0.0  # time the workload takes to use a pool's worth of chunks
    memory_chunks: int = 0  # the sketch's width: evicted chunks whose counts it remembers
    weight_switches: int = 0  # adaptive: times its simulations moved the weight


@dataclass(frozen=True)
class RemoteTierStats:
    """The remote tier (kvcached.tiers.remote_redis) and its publisher (kvcached.publish)."""

    hits: int
    misses: int
    bytes_fetched: int
    bytes_published: int
    published: int
    errors: int
    skipped_open: int
    breaker_state: str  # closed / open / half_open
    breaker_opened: int
    refused: dict = field(default_factory=dict)  # reason -> values not served
    queue_depth: int = 0  # chunks waiting to be published or demoted
    queue_dropped: int = 0
    demoted: int = 0  # chunks sent there as they left this host's last local tier
    refreshed: int = 0  # chunks leaving it that the remote already held (TTL renewed only)
    queue_bytes: int = 0  # payload bytes copied for demotion, waiting to be sent
    deadline_missed: int = 0  # calls abandoned at their deadline (a frozen or very slow Redis)
    skipped_busy: int = 0  # calls not made: every remote I/O thread was still in an abandoned call


@dataclass(frozen=True)
class StoreStats:
    domain: str
    layouts: int
    indexed_chunks: int
    leases_active: int
    reservations_active: int
    sessions: int
    pool: PoolStats
    nvme: NvmeStats | None
    counters: Counters = field(default_factory=Counters)
    hash_memo: HashMemoStats | None = None
    eviction: EvictionStats | None = None
    remote: RemoteTierStats | None = None
    #: Layout id -> where its lookups stop matching (kvcached.promptshape).
    prompt_shape: dict[str, LayoutShapeStats] = field(default_factory=dict)
    #: The reloadable settings in effect, read in one piece (after a SIGHUP: did it apply?).
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        c = self.counters
        return c.hit_tokens / c.lookup_tokens if c.lookup_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


class HitRateHistory:
    """Token hit rate over recent windows, from periodic samples of the cumulative counters."""

    def __init__(self, every: float = 10.0, keep: float = 3700.0) -> None:
        self.every = every
        self.keep = keep
        self._samples: list[tuple[float, int, int]] = []

    def sample(self, now: float, lookup_tokens: int, hit_tokens: int) -> None:
        if self._samples and now - self._samples[-1][0] < self.every:
            return
        self._samples.append((now, lookup_tokens, hit_tokens))
        while self._samples and now - self._samples[0][0] > self.keep:
            self._samples.pop(0)

    def window(self, now: float, seconds: float, lookup_tokens: int, hit_tokens: int) -> tuple[float | None, int]:
        """(hit rate, tokens looked up) over the last ``seconds``; rate None without traffic."""
        base = next((s for s in self._samples if now - s[0] <= seconds), None)
        if base is None:
            return None, 0
        looked = lookup_tokens - base[1]
        return ((hit_tokens - base[2]) / looked if looked else None), looked
