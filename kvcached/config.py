"""Engine configuration. Daemon-level settings (socket, metrics...) come later
and wrap this; defaults follow DESIGN.md section 8."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvcached.contract.pool import BLOCK_ALIGN  # every chunk's offset is a multiple of it (why 64: there)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: The eviction orders (kvcached.index.eviction) and admission rules; one list each, used by the
#: engine, the settings file's checks and the messages that name the choices.
EvictionPolicyName = Literal["adaptive", "frequency", "lru"]
AdmissionName = Literal["always", "frequency"]
#: How committed chunks reach the remote tier (kvcached.publish).
RemoteWriteMode = Literal["async", "on_evict", "off"]
EVICTION_POLICIES: tuple[EvictionPolicyName, ...] = get_args(EvictionPolicyName)
ADMISSIONS: tuple[AdmissionName, ...] = get_args(AdmissionName)
REMOTE_WRITE_MODES: tuple[RemoteWriteMode, ...] = get_args(RemoteWriteMode)


def one_of(names: tuple[str, ...]) -> str:
    """``a, b or c``: the choices, as the error messages name them."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


@dataclass(frozen=True)
class FileAccess:
    """Who, besides the daemon's own user, may use a domain's tier files.

    A client that may connect to a domain's socket must also be able to map its
    pool (read-write: it writes reserved blocks) and read its NVMe tier directly
    (the LMDB data file read-only, its lock file read-write for the reader
    table). So the tier files grant exactly the classes the socket grants:
    ``group`` and/or ``other`` when the socket mode lets them connect, and the
    socket's group owns them. Nobody else gets anything: the filesystem, not
    the daemon, keeps other users and other domains out.

    Modes are set with chmod after creation, so a service ``UMask=`` cannot
    narrow them silently.
    """

    group: bool = False
    other: bool = False
    gid: int = -1  # -1: leave the group as created (the daemon's)

    @classmethod
    def for_socket(cls, socket_mode: int, gid: int = -1) -> "FileAccess":
        return cls(group=bool(socket_mode & 0o020), other=bool(socket_mode & 0o002), gid=gid)

    def _bits(self, owner: int, bits: int) -> int:
        return owner | (bits << 3 if self.group else 0) | (bits if self.other else 0)

    @property
    def shared_mode(self) -> int:
        """Read-write for whoever may connect: the pool segment, the LMDB lock file."""
        return self._bits(0o600, 0o6)

    @property
    def read_mode(self) -> int:
        return self._bits(0o600, 0o4)

    @property
    def dir_mode(self) -> int:
        return self._bits(0o700, 0o5)

    def open_parent(self, path: str) -> None:
        """When anything is shared, let anyone enter (not list) a directory on the way to a
        shared one (the state dir, ``nvme/``). Only the shared directory itself is gated by
        group: domains with different groups share these parents."""
        if self.group or self.other:
            os.chmod(path, os.stat(path).st_mode & 0o7777 | 0o111)

    def apply(self, path_or_fd: str | int, mode: int) -> None:
        if isinstance(path_or_fd, int):
            os.fchmod(path_or_fd, mode)
            if self.gid >= 0:
                os.fchown(path_or_fd, -1, self.gid)
        else:
            os.chmod(path_or_fd, mode)
            if self.gid >= 0:
                os.chown(path_or_fd, -1, self.gid)


#: The StoreConfig fields a running store changes on a reload (SIGHUP: ``Store.reconfigure``),
#: and reports in its stats as one snapshot.
RELOADABLE_FIELDS = ("cache_ttl", "lease_ttl", "reservation_ttl", "max_leases_per_session",
                     "max_reservations_per_session", "eviction_weight")


@dataclass(frozen=True)
class StoreConfig:
    """Everything the engine of one trust domain needs.

    ``pool_bytes`` is rounded down to a multiple of :data:`BLOCK_ALIGN`; chunks of
    every layout share it (a packed pool), so a layout can be registered as long
    as one chunk fits in the pool.

    Write-back (with an NVMe tier): a background writer keeps the pool's free
    space at or above ``writeback_low`` (a fraction of the pool) by demoting
    least-recently-used chunks to NVMe in batches of up to
    ``writeback_batch_bytes`` until ``writeback_high`` is free; a reservation
    that finds no room waits up to ``writeback_wait`` seconds for it before
    demoting synchronously itself.
    """

    state_dir: str
    domain: str = "default"
    #: The domain's hash key: a file shared by every host of the domain (kvcached.contract.keys.load_shared_key),
    #: or None for this daemon's own ``<state_dir>/hash.key``, created on first start.
    hash_key_file: str | None = None
    device: str = "cpu"  # "cpu" (host shared memory), "cuda" (a slab on every GPU), "cuda:N" or "cuda:N,M"
    pool_bytes: int = 1 * GiB  # each slab's
    pool_slabs: int = 1  # host pool only: slabs host:0 .. (kvcached.tiers.packed)
    pool_prefault: bool = True
    nvme_bytes: int = 64 * GiB  # 0 disables the NVMe tier
    nvme_map_bytes: int | None = None  # LMDB map size; default 2 x nvme_bytes (sparse)
    cache_ttl: float = 3600.0
    lease_ttl: float = 30.0
    reservation_ttl: float = 30.0
    write_through: bool = False
    prefetch_distance: int = 8
    max_prompt_tokens: int = 1 << 20
    #: Accept layouts whose clients send their own keys in place of token ids (``KVLayout.client_keys``,
    #: SGLang's HiCache backend). Off: such a layout is refused with FAILED_PRECONDITION.
    trust_client_keys: bool = False
    #: Memory for remembered chunk-hash runs (kvcached.hashmemo); 0 hashes every request afresh.
    hash_memo_bytes: int = 32 * MiB
    #: Caps per session, so one client (buggy or hostile) cannot pin the whole pool or grow
    #: the tables without bound; reaching one is RESOURCE_EXHAUSTED naming the setting.
    max_leases_per_session: int = 16384
    max_reservations_per_session: int = 1024
    writeback: bool = True
    writeback_low: float = 0.08
    writeback_high: float = 0.10
    writeback_batch_bytes: int = 64 * MiB
    writeback_wait: float = 2.0
    #: Eviction order of the pool and NVMe tiers (kvcached.index.eviction): "adaptive" (the
    #: default: recency boosted by hits, the boost's weight chosen online), "frequency" (the
    #: same with a fixed weight) or "lru". ``eviction_weight``: pool turnovers one more hit is
    #: worth (frequency only); ``eviction_memory_chunks``: evicted chunks whose use
    #: counts the policy's sketch remembers (a power of two; 2 bytes each).
    eviction_policy: EvictionPolicyName = "adaptive"
    eviction_weight: float = 1.0
    eviction_memory_chunks: int = 1 << 22
    #: "always" (the default) or "frequency": refuse a new chunk that would rank below the
    #: chunk it evicts (a doorkeeper; measured to cost hit rate on document workloads).
    eviction_admission: AdmissionName = "always"
    #: The remote tier (kvcached.tiers.remote_redis.RemoteConfig; its domain is this one's), or
    #: None. ``remote_write``: "async" publishes committed chunks in the background (and demotes
    #: chunks there when they leave the last local tier), "on_evict" only demotes, "off" only
    #: reads; ``remote_queue_chunks`` bounds what waits to be published.
    remote: Any = None
    remote_write: RemoteWriteMode = "async"
    remote_queue_chunks: int = 4096
    remote_queue_bytes: int = 256 * MiB  # copies of chunks waiting to be demoted there
    #: Feed a KV event stream (kvcached.events) from the index; ``kv_events_pending`` bounds the
    #: events waiting for the publisher (beyond it: a resync).
    kv_events: bool = False
    kv_events_pending: int = 100_000
    #: Tier file permissions; the daemon derives them from the domain's socket.
    file_access: FileAccess = field(default_factory=FileAccess)

    def __post_init__(self) -> None:
        if self.pool_bytes < BLOCK_ALIGN:
            raise ValueError(f"pool_bytes must be at least {BLOCK_ALIGN}")
        if not 1 <= self.pool_slabs <= 64 or (self.pool_slabs > 1 and self.device != "cpu"):
            raise ValueError("pool_slabs: 1..64, and only for the host pool (a CUDA pool has one slab per GPU)")
        if not 0 <= self.writeback_low <= self.writeback_high < 1:
            raise ValueError("writeback_low and writeback_high are fractions of the pool: 0 <= low <= high < 1")
        if self.writeback_batch_bytes < 1 or self.writeback_wait < 0:
            raise ValueError("writeback_batch_bytes must be positive and writeback_wait >= 0")
        if self.nvme_bytes < 0:
            raise ValueError("nvme_bytes must be >= 0")
        for name in ("cache_ttl", "lease_ttl", "reservation_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_leases_per_session < 1 or self.max_reservations_per_session < 1:
            raise ValueError("max_leases_per_session and max_reservations_per_session must be >= 1")
        if self.hash_memo_bytes < 0:
            raise ValueError("hash_memo_bytes must be >= 0")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be {one_of(EVICTION_POLICIES)}, not {self.eviction_policy!r}")
        if self.remote_write not in REMOTE_WRITE_MODES:
            raise ValueError(f"remote_write must be {one_of(REMOTE_WRITE_MODES)}, not {self.remote_write!r}")
        if self.remote_queue_chunks < 1 or self.remote_queue_bytes < 1:
            raise ValueError("remote_queue_chunks and remote_queue_bytes must be >= 1")
        if self.eviction_admission not in ADMISSIONS:
            raise ValueError(f"eviction_admission must be {one_of(ADMISSIONS)}, not {self.eviction_admission!r}")
        if self.eviction_admission != "always" and self.eviction_policy == "lru":
            raise ValueError("eviction_admission = frequency needs eviction_policy = adaptive or frequency")
        if not 0 <= self.eviction_weight <= 1000:
            raise ValueError("eviction_weight must be in 0..1000")
        m = self.eviction_memory_chunks
        if m < 1024 or m > 1 << 28 or m & (m - 1):
            raise ValueError("eviction_memory_chunks must be a power of two in 1024..2**28")
        if not 0 <= self.prefetch_distance <= 1024:
            raise ValueError("prefetch_distance must be in 0..1024")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu or cuda[:N], not {self.device!r}")
        if not self.domain or "/" in self.domain or len(self.domain) > 64:
            raise ValueError("domain must be a short name without '/'")
