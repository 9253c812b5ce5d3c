"""Engine configuration. Daemon-level settings (socket, metrics...) come later
and wrap this; defaults follow DESIGN.md section 8."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
#: Every pool block size, and so every block's offset in the slab, is a multiple of this. A block
#: is viewed as a tensor of the layout's dtype in place, and a CUDA view at an offset that its
#: element size does not divide fails ("storage offset must be divisible by the element size");
#: 64 is a multiple of every element size a layout can name (kvcached.keys.DTYPE_SIZES), a CPU
#: cache line (two blocks never share one, so writers of neighbouring blocks do not contend) and
#: keeps the 16-byte vector loads of GPU copy kernels aligned. Chunks of every realistic layout
#: (and of every test layout) are multiples of it, so it costs no padding there.
BLOCK_ALIGN = 64


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


def check_block_bytes(block_bytes: int) -> None:
    """Refuse a pool block size that is not a positive multiple of :data:`BLOCK_ALIGN`."""
    if block_bytes <= 0 or block_bytes % BLOCK_ALIGN:
        up = max(BLOCK_ALIGN, -(-block_bytes // BLOCK_ALIGN) * BLOCK_ALIGN)
        raise ValueError(f"pool_block_bytes must be a positive multiple of {BLOCK_ALIGN} bytes (so every block "
                         f"offset is aligned for any dtype), got {block_bytes}; use {up}")


@dataclass(frozen=True)
class StoreConfig:
    """Everything the engine of one trust domain needs.

    ``pool_bytes`` is rounded down to whole ``pool_block_bytes`` blocks. A
    layout whose chunk is larger than one block cannot be registered.
    ``pool_block_bytes`` must be a multiple of :data:`BLOCK_ALIGN`, so that every
    block starts aligned for any dtype.
    """

    state_dir: str
    domain: str = "default"
    device: str = "cpu"  # "cpu" (host shared memory) or "cuda[:N]"
    pool_bytes: int = 1 * GiB
    pool_block_bytes: int = 16 * MiB  # one Llama-3-8B bf16 chunk of 128 tokens
    pool_prefault: bool = True
    nvme_bytes: int = 64 * GiB  # 0 disables the NVMe tier
    nvme_map_bytes: int | None = None  # LMDB map size; default 2 x nvme_bytes (sparse)
    cache_ttl: float = 3600.0
    lease_ttl: float = 30.0
    reservation_ttl: float = 30.0
    write_through: bool = False
    prefetch_distance: int = 8
    max_prompt_tokens: int = 1 << 20
    #: Memory for remembered chunk-hash runs (kvcached.hashmemo); 0 hashes every request afresh.
    hash_memo_bytes: int = 32 * MiB
    #: Caps per session, so one client (buggy or hostile) cannot pin the whole pool or grow
    #: the tables without bound; reaching one is RESOURCE_EXHAUSTED naming the setting.
    max_leases_per_session: int = 16384
    max_reservations_per_session: int = 1024
    #: Tier file permissions; the daemon derives them from the domain's socket.
    file_access: FileAccess = field(default_factory=FileAccess)

    def __post_init__(self) -> None:
        check_block_bytes(self.pool_block_bytes)
        if self.pool_bytes < self.pool_block_bytes:
            raise ValueError("pool_bytes must hold at least one pool_block_bytes block")
        if self.nvme_bytes < 0:
            raise ValueError("nvme_bytes must be >= 0")
        for name in ("cache_ttl", "lease_ttl", "reservation_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_leases_per_session < 1 or self.max_reservations_per_session < 1:
            raise ValueError("max_leases_per_session and max_reservations_per_session must be >= 1")
        if self.hash_memo_bytes < 0:
            raise ValueError("hash_memo_bytes must be >= 0")
        if not 0 <= self.prefetch_distance <= 1024:
            raise ValueError("prefetch_distance must be in 0..1024")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu or cuda[:N], not {self.device!r}")
        if not self.domain or "/" in self.domain or len(self.domain) > 64:
            raise ValueError("domain must be a short name without '/'")

    @property
    def pool_blocks(self) -> int:
        return self.pool_bytes // self.pool_block_bytes
