"""Daemon settings: embedded defaults < TOML config file < command-line flags.

``kvcached serve`` with no arguments and no config file works: every setting
has a default that needs nothing installed (DESIGN.md section 6). The config
file is ``/etc/kvcached/kvcached.toml`` when it exists, or ``--config FILE``.

Sizes may be integers (bytes) or strings such as ``"512M"`` / ``"2GiB"``.
"""

from __future__ import annotations

import dataclasses
import grp
import ipaddress
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kvcached.contract.socket_path import default_socket
from kvcached.config import (ADMISSIONS, BLOCK_ALIGN, EVICTION_POLICIES, RELOADABLE_FIELDS, REMOTE_WRITE_MODES,
                             AdmissionName, EvictionPolicyName, FileAccess, GiB, MiB, RemoteWriteMode, StoreConfig,
                             one_of)

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged (a dependency there; see pyproject.toml)
    import tomli as tomllib

DEFAULT_CONFIG_FILE = "/etc/kvcached/kvcached.toml"

#: Settings SIGHUP may change on a running daemon; everything else needs a restart.
RELOADABLE = frozenset({"cache_ttl", "lease_ttl", "reservation_ttl", "call_timeout", "log_level",
                        "bypass_generation_tokens", "max_sessions", "max_leases_per_session",
                        "max_reservations_per_session", "eviction_weight",
                        # read from the file by `kvcachectl report`, never by the daemon:
                        "report_gpu_hour_price", "report_prefill_tokens_per_s"})
#: The reloadable settings the store itself applies (Store.reconfigure).
STORE_RELOADABLE = RELOADABLE_FIELDS  # what Store.reconfigure applies

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)


class SettingsError(ValueError):
    """A config file or flag value is wrong; the message names it."""


def parse_size(text: str | int) -> int:
    """``"512M"``, ``"2GiB"``, ``1048576`` -> bytes (binary multiples)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise SettingsError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise SettingsError(f"not a size: {text!r} (use e.g. 512M, 2G, 1073741824)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def default_state_dir() -> str:
    """``$STATE_DIRECTORY`` (set by systemd's StateDirectory=) or ``~/.local/state/kvcached``."""
    sd = os.environ.get("STATE_DIRECTORY")
    if sd:
        return sd.split(":")[0]
    return os.path.join(os.path.expanduser("~"), ".local", "state", "kvcached")


def free_shm_bytes() -> int:
    """What /dev/shm has free."""
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:  # pragma: no cover
        return 4 * GiB


def default_pool_bytes(domains: int = 1) -> int:
    """Host pool: a quarter of what /dev/shm has free, at most 1 GiB, split evenly among
    ``domains`` pools; each gets at least 64 MiB."""
    return max(64 * MiB, min(1 * GiB, free_shm_bytes() // 4) // domains)


def default_pool_for(device: str, domains: int = 1) -> int:
    """The default pool size on ``device`` (cpu or cuda[:N]), for each of ``domains`` pools."""
    if device == "cpu":
        return default_pool_bytes(domains)
    from kvcached.tiers.pool_cuda import default_pool_bytes as cuda_default

    return cuda_default(device, domains)


@dataclass(frozen=True)
class DaemonSettings:
    socket: str
    state_dir: str
    socket_mode: int = 0o660
    socket_owner: str = ""
    socket_group: str = ""
    device: str = "auto"
    domain: str = "default"
    #: The domain's hash key shared by its hosts (same file on each; `kvcachectl keygen`); "" keeps
    #: the daemon's own <state_dir>/hash.key. Restart to change; a new key orphans the NVMe chunks.
    hash_key_file: str = ""
    pool_bytes: int = 0  # 0: the device's default (default_pool_for), shared by the domains that take it
    #: Host pool only: slabs (separate shared-memory segments, ``host:0`` ...), as a multi-GPU
    #: host has one per GPU; chunks go to the slab a client names. ``pool_bytes`` is each slab's.
    pool_slabs: int = 1
    #: No longer used: the pool is packed (chunks of any size share it). Still accepted so that
    #: existing config files load; the daemon logs that it is ignored.
    pool_block_bytes: int = 0
    nvme_bytes: int = 64 * GiB
    nvme_map_bytes: int = 0  # 0: 2 x nvme_bytes
    write_through: bool = False
    cache_ttl: float = 3600.0
    lease_ttl: float = 30.0
    reservation_ttl: float = 30.0
    prefetch_distance: int = 8
    max_prompt_tokens: int = 1 << 20
    #: Accept layouts keyed by keys the clients computed (SGLang's HiCache backend sends SGLang's
    #: page keys, never token ids); off, they are refused. See docs/sglang.md.
    trust_client_keys: bool = False
    hash_memo_bytes: int = 32 * MiB  # remembered chunk-hash runs; 0 disables
    bypass_generation_tokens: int = 8192  # requests expecting more output tokens are not stored
    max_sessions: int = 1024  # open Session streams per domain
    max_leases_per_session: int = 16384
    max_reservations_per_session: int = 1024
    writeback: bool = True  # background demotion to NVMe (kvcached.writeback)
    writeback_low: float = 0.08  # when less of the pool is free, the writer starts...
    writeback_high: float = 0.10  # ...by demoting batches until this much is free
    writeback_batch_bytes: int = 64 * MiB
    writeback_wait: float = 2.0  # how long a reservation waits for room before demoting itself
    eviction_policy: EvictionPolicyName = "adaptive"  # or "frequency", "lru" (kvcached.index.eviction); restart to change
    eviction_weight: float = 1.0  # pool turnovers one more hit is worth (reloadable)
    eviction_memory_chunks: int = 1 << 22  # evicted chunks whose use counts are remembered (2 B each)
    eviction_admission: AdmissionName = "always"  # or "frequency": a doorkeeper (costs hit rate on documents)
    # The remote tier (Redis / Redis Cluster, kvcached.tiers.remote_redis); off while remote_nodes is "".
    remote_nodes: str = ""  # "host:port,host:port" (any nodes of a cluster)
    remote_cluster: bool = False
    remote_username: str = ""  # the domain's Redis ACL user (~kvc:<domain>:*)
    remote_password_file: str = ""  # readable by the daemon only (mode 0600/0400)
    remote_ttl: float = 0.0  # 0: cache_ttl
    remote_timeout: float = 0.5
    remote_write: RemoteWriteMode = "async"  # or "on_evict", "off"
    # KV events in vLLM's wire format (kvcached.events, kvcached.service.kv_events); off while "".
    # They carry prompt token ids: ipc:// or loopback TCP unless kv_events_allow_remote.
    kv_events_endpoint: str = ""  # ZMQ PUB, e.g. "ipc:///run/kvcached/kv-events" or "tcp://127.0.0.1:5557"
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER that resends from a sequence number
    kv_events_topic: str = ""
    kv_events_buffer_batches: int = 10_000  # batches kept for replay
    kv_events_allow_remote: bool = False
    remote_queue_chunks: int = 4096  # chunks waiting to be published (oldest dropped beyond)
    remote_queue_bytes: int = 256 * MiB  # chunk copies waiting to be demoted to the remote tier
    remote_tls: bool = False
    remote_tls_ca: str = ""
    metrics_addr: str = "127.0.0.1:9464"
    tcp_listen: str = ""  # e.g. "127.0.0.1:50551"; empty: Unix socket only
    tls_cert: str = ""
    tls_key: str = ""
    allow_insecure_tcp: bool = False
    max_message_bytes: int = 64 * MiB
    call_timeout: float = 30.0
    expire_interval: float = 1.0
    worker_threads: int = 4
    log_level: str = "info"
    # What `kvcachectl report` prices the saved prefill at (its flags win); 0: not stated.
    report_gpu_hour_price: float = 0.0  # $ per GPU-hour
    report_prefill_tokens_per_s: float = 0.0  # prefill throughput of one GPU
    #: Further trust domains, each with its own socket, pool and NVMe environment ([domains.NAME]).
    extra_domains: tuple["DaemonSettings", ...] = ()

    def __post_init__(self) -> None:
        # The per-key rules (_RULES) are the one statement of what each setting allows; load_settings
        # applies them as it reads each value (to say where it came from), this to any construction.
        for name, (ok, allowed) in _RULES.items():
            value = getattr(self, name)
            if not ok(value):
                raise SettingsError(f"{name} = {value!r} is not allowed: {allowed}")
        if self.writeback_low > self.writeback_high:
            raise SettingsError(f"writeback_low = {self.writeback_low!r} is above writeback_high = "
                                f"{self.writeback_high!r}: 0 <= writeback_low <= writeback_high < 1")
        if self.eviction_admission == "frequency" and self.eviction_policy not in ("frequency", "adaptive"):
            raise SettingsError(f"eviction_admission = 'frequency' needs eviction_policy = 'frequency' or 'adaptive', "
                                f"not {self.eviction_policy!r}")
        if self.tcp_listen:
            self.check_tcp()

    def validate(self) -> None:
        """Everything the daemon would refuse when it opens this domain, refused now: building
        its StoreConfig runs the store's own checks (for the CPU, so no GPU is touched), the
        remote tier's, the KV events', the socket group's and the shared key file's."""
        self.store_config(self.pool_bytes or 1 << 30, device="cpu")

    def check_tcp(self) -> None:
        """TLS is required on TCP unless the address is loopback or insecure TCP is allowed."""
        host = self.tcp_listen.rsplit(":", 1)[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not (self.tls_cert and self.tls_key) and not loopback and not self.allow_insecure_tcp:
            raise SettingsError(
                f"tcp_listen = {self.tcp_listen!r}: refusing plain TCP: set tls_cert and tls_key, listen on loopback, "
                "or set allow_insecure_tcp = true if the network is trusted"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("tls_cert and tls_key go together")

    def resolved_device(self) -> str:
        """``auto`` becomes ``cuda`` when torch sees a GPU, else ``cpu``."""
        if self.device != "auto":
            return self.device
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # pragma: no cover - torch is a dependency
            return "cpu"

    def store_configs(self) -> list[StoreConfig]:
        """The StoreConfig of every trust domain, this one first (what the daemon opens).

        The domains that set no ``pool_bytes`` share one default (:func:`default_pool_for`),
        computed once from the memory free before any pool exists and split evenly among them,
        so together they take what one default pool would. Computed per domain as each pool is
        created, each would get its fraction of what the ones before it left (on a GPU: half of
        the free memory, then a quarter, then an eighth).
        """
        domains = [self, *self.extra_domains]
        sharing = sum(1 for d in domains if not d.pool_bytes)
        share = default_pool_for(self.resolved_device(), sharing) if sharing else None
        return [d.store_config(share) for d in domains]

    def store_config(self, default_pool: int | None = None, *, device: str | None = None) -> StoreConfig:
        """This domain's StoreConfig; ``default_pool`` is its pool size when ``pool_bytes`` is
        not set (None: this domain's default, as if it were the only one); ``device`` overrides
        the resolved device (validation uses the CPU)."""
        device = device or self.resolved_device()
        pool = self.pool_bytes or (default_pool if default_pool is not None else default_pool_for(device))
        if self.hash_key_file:  # refused at load time, with the reason, rather than at the store's start
            from kvcached.contract.keys import load_shared_key

            try:
                load_shared_key(self.hash_key_file)
            except ValueError as e:
                raise SettingsError(f"hash_key_file = {self.hash_key_file!r}: {e}") from None
        return StoreConfig(
            state_dir=self.state_dir,
            domain=self.domain,
            hash_key_file=self.hash_key_file or None,
            device=device,
            pool_bytes=pool,
            pool_slabs=self.pool_slabs,
            nvme_bytes=self.nvme_bytes,
            nvme_map_bytes=self.nvme_map_bytes or None,
            cache_ttl=self.cache_ttl,
            lease_ttl=self.lease_ttl,
            reservation_ttl=self.reservation_ttl,
            write_through=self.write_through,
            prefetch_distance=self.prefetch_distance,
            max_prompt_tokens=self.max_prompt_tokens,
            trust_client_keys=self.trust_client_keys,
            hash_memo_bytes=self.hash_memo_bytes,
            max_leases_per_session=self.max_leases_per_session,
            max_reservations_per_session=self.max_reservations_per_session,
            writeback=self.writeback,
            writeback_low=self.writeback_low,
            writeback_high=self.writeback_high,
            writeback_batch_bytes=self.writeback_batch_bytes,
            writeback_wait=self.writeback_wait,
            eviction_policy=self.eviction_policy,
            eviction_weight=self.eviction_weight,
            eviction_memory_chunks=self.eviction_memory_chunks,
            eviction_admission=self.eviction_admission,
            remote=self.remote_config(),
            remote_write=self.remote_write,
            remote_queue_chunks=self.remote_queue_chunks,
            kv_events=bool(self.kv_events_config()),
            remote_queue_bytes=self.remote_queue_bytes,
            file_access=FileAccess.for_socket(self.socket_mode, self.socket_gid()),
        )

    def kv_events_config(self) -> Any:
        """This domain's KvEventsConfig, or None without ``kv_events_endpoint``."""
        if not self.kv_events_endpoint:
            if self.kv_events_replay_endpoint:
                raise SettingsError("kv_events_replay_endpoint needs kv_events_endpoint")
            return None
        from kvcached.service.kv_events import KvEventsConfig

        try:
            return KvEventsConfig(self.kv_events_endpoint, self.kv_events_replay_endpoint, self.kv_events_topic,
                                  self.kv_events_buffer_batches, allow_remote=self.kv_events_allow_remote)
        except ValueError as e:
            raise SettingsError(f"kv_events_endpoint = {self.kv_events_endpoint!r}: {e}") from None

    def remote_config(self) -> Any:
        """This domain's RemoteConfig, or None without ``remote_nodes``. The password file must be
        readable by its owner only: a credential others can read is refused, not used."""
        if not self.remote_nodes.strip():
            return None
        from kvcached.tiers.remote_redis import RemoteConfig

        password = None
        if self.remote_password_file:
            try:
                st = os.stat(self.remote_password_file)
                if st.st_mode & 0o077:
                    raise SettingsError(f"remote_password_file {self.remote_password_file} is readable by others "
                                        f"(mode {oct(st.st_mode & 0o777)}); chmod 600 it")
                with open(self.remote_password_file) as f:
                    password = f.read().strip()
            except OSError as e:
                raise SettingsError(f"remote_password_file: {e}") from None
        try:
            return RemoteConfig(
                nodes=tuple(n.strip() for n in self.remote_nodes.split(",") if n.strip()), domain=self.domain,
                cluster=self.remote_cluster, username=self.remote_username or None, password=password,
                ttl=self.remote_ttl or self.cache_ttl, timeout=self.remote_timeout, ssl=self.remote_tls,
                ssl_ca_certs=self.remote_tls_ca or None)
        except ValueError as e:
            raise SettingsError(f"remote_nodes = {self.remote_nodes!r}: {e}") from None

    def socket_gid(self) -> int:
        """The socket group's gid (-1: not set); it also owns the domain's tier files. Refused when
        this process could not give files to it (see :func:`id_mapped`)."""
        if not self.socket_group:
            return -1
        try:
            gid = grp.getgrnam(self.socket_group).gr_gid
        except KeyError:
            raise SettingsError(f"socket_group {self.socket_group!r} does not exist on this host") from None
        if gid != os.getegid() and not id_mapped("gid", gid):
            raise SettingsError(
                f"socket_group = {self.socket_group!r}: this process cannot give files to group "
                f"{self.socket_group} (gid {gid}): its user namespace does not map that group (systemd's "
                "PrivateUsers=yes maps only the service's own user and group). Add the clients' users to the "
                "service's group instead, or set PrivateUsers=no in a drop-in (systemd/README.md)")
        return gid


def id_mapped(kind: str, ident: int) -> bool:
    """Whether ``ident`` (a uid or gid) exists in this process's user namespace. In the initial
    namespace every id does; in one such as systemd's ``PrivateUsers=yes`` makes, an id outside
    ``/proc/self/{uid,gid}_map`` cannot own a file (chown fails with EINVAL)."""
    try:
        with open(f"/proc/self/{kind}_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except (OSError, ValueError):
        return True  # no /proc: nothing to say
    return any(inside <= ident < inside + count for inside, _outside, count in ranges)


def _is_pow2(v: int) -> bool:
    return 1024 <= v <= 1 << 28 and not v & (v - 1)


#: What each setting allows beyond its type, in the words an error shows. Checked per key, where
#: the key and the value are known (load_settings); the store's own checks run after as a net.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "device": (lambda v: v in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+(,\d+)*)?", v) is not None,
               "auto, cpu, cuda (every GPU, a pool slab each), cuda:N or cuda:N,M,..."),
    "pool_slabs": (lambda v: 1 <= v <= 64, "1..64 (host pool only)"),
    "socket": (lambda v: bool(v.strip()), "a path"),
    "state_dir": (lambda v: bool(v.strip()), "a directory"),
    "domain": (lambda v: 0 < len(v) <= 64 and "/" not in v, "a name of 1-64 characters without '/'"),
    "socket_mode": (lambda v: 0 <= v <= 0o777, "an octal permission such as \"0660\""),
    "pool_bytes": (lambda v: v == 0 or v >= BLOCK_ALIGN, f"0 (the device's default) or a size of at least {BLOCK_ALIGN} bytes"),
    "cache_ttl": (lambda v: v > 0, "seconds > 0"),
    "lease_ttl": (lambda v: v > 0, "seconds > 0"),
    "reservation_ttl": (lambda v: v > 0, "seconds > 0"),
    "prefetch_distance": (lambda v: 0 <= v <= 1024, "0..1024 chunks"),
    "max_prompt_tokens": (lambda v: v >= 1, "a number of tokens >= 1"),
    "bypass_generation_tokens": (lambda v: v >= 0, "a number of tokens >= 0"),
    "max_sessions": (lambda v: v >= 1, "an integer >= 1"),
    "max_leases_per_session": (lambda v: v >= 1, "an integer >= 1"),
    "max_reservations_per_session": (lambda v: v >= 1, "an integer >= 1"),
    "writeback_low": (lambda v: 0 <= v < 1, "a fraction of the pool, 0 <= writeback_low <= writeback_high < 1"),
    "writeback_high": (lambda v: 0 <= v < 1, "a fraction of the pool, 0 <= writeback_low <= writeback_high < 1"),
    "writeback_batch_bytes": (lambda v: v >= 1, "a size > 0"),
    "writeback_wait": (lambda v: v >= 0, "seconds >= 0"),
    "eviction_policy": (lambda v: v in EVICTION_POLICIES, one_of(EVICTION_POLICIES)),
    "eviction_weight": (lambda v: 0 <= v <= 1000, "0..1000"),
    "eviction_memory_chunks": (_is_pow2, "a power of two in 1024..268435456"),
    "eviction_admission": (lambda v: v in ADMISSIONS, one_of(ADMISSIONS)),
    "remote_ttl": (lambda v: v >= 0, "seconds >= 0 (0: cache_ttl)"),
    "remote_timeout": (lambda v: v > 0, "seconds > 0"),
    "remote_write": (lambda v: v in REMOTE_WRITE_MODES, one_of(REMOTE_WRITE_MODES)),
    "remote_queue_chunks": (lambda v: v >= 1, "an integer >= 1"),
    "remote_queue_bytes": (lambda v: v >= 1, "a size > 0"),
    "kv_events_buffer_batches": (lambda v: v >= 1, "an integer >= 1"),
    "max_message_bytes": (lambda v: v >= 64 * 1024, "a size of at least 64K"),
    "call_timeout": (lambda v: v > 0, "seconds > 0"),
    "expire_interval": (lambda v: v > 0, "seconds > 0"),
    "worker_threads": (lambda v: v >= 1, "an integer >= 1"),
    "log_level": (lambda v: v.lower() in ("debug", "info", "warning", "error"), "debug, info, warning or error"),
    "report_gpu_hour_price": (lambda v: v >= 0, "a price >= 0 (0: not stated)"),
    "report_prefill_tokens_per_s": (lambda v: v >= 0, "tokens per second >= 0 (0: not stated)"),
}


#: The settings' annotations (strings: ``from __future__ import annotations``) as the TOML types
#: they take; a ``Literal`` of names is a string, its names checked by ``_RULES``.
_TYPES = {"int": int, "float": float, "str": str, "bool": bool,
          "EvictionPolicyName": str, "AdmissionName": str, "RemoteWriteMode": str}
_SIZES = {"pool_bytes", "pool_block_bytes", "nvme_bytes", "nvme_map_bytes", "max_message_bytes",
          "hash_memo_bytes", "writeback_batch_bytes", "remote_queue_bytes"}


def _coerce(name: str, value: Any, field: dataclasses.Field) -> Any:
    """``value`` as the setting's type, refused (naming the key and the value) if it is not one
    or is out of what the setting allows."""
    coerced = _coerce_type(name, value, field)
    rule = _RULES.get(name)
    if rule is not None and not rule[0](coerced):
        raise SettingsError(f"{name} = {value!r} is not allowed: {rule[1]}")
    return coerced


def _coerce_type(name: str, value: Any, field: dataclasses.Field) -> Any:
    if name in _SIZES:
        try:
            return parse_size(value)
        except SettingsError:
            raise SettingsError(f"{name} = {value!r} is not allowed: a size >= 0 such as 512M, 2G or 1073741824") from None
    if name == "socket_mode":
        if isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise SettingsError(f"socket_mode = {value!r} is not allowed: an octal permission such as \"0660\"") from None
        if not isinstance(value, int) or isinstance(value, bool):
            raise SettingsError(f"socket_mode = {value!r} is not allowed: an octal permission such as \"0660\"")
        return value
    typ = _TYPES[str(field.type)]
    if typ is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{name} = {value!r} is not allowed: true or false")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        what = {int: "an integer", float: "a number", str: "a string"}[typ]
        raise SettingsError(f"{name} = {value!r} is not allowed: {what}")
    return value


def load_settings(config_file: str | None = None, overrides: Mapping[str, Any] | None = None) -> DaemonSettings:
    """Defaults, then the config file (if any), then ``overrides`` (flags; None values ignored).

    Every error is a :class:`SettingsError` of one line that names where the value came from (the
    file, or the command line), the key, the value and what is allowed; everything the daemon
    would refuse at start is refused here, so a reload with a bad value keeps the running settings.
    """
    values: dict[str, Any] = {}
    path = config_file if config_file is not None else (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    if path is not None:
        try:
            with open(path, "rb") as f:
                values.update(tomllib.load(f))
        except FileNotFoundError:
            raise SettingsError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"config file {path} cannot be read: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"{path}: not valid TOML: {e}") from None
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}

    def source(key: str) -> str:
        return "command line" if key in flags or path is None else path

    values.update(flags)
    domain_tables = values.pop("domains", {})
    if not isinstance(domain_tables, dict):
        raise SettingsError(f"{path}: domains must be a table of [domains.NAME] tables")
    fields = {f.name: f for f in dataclasses.fields(DaemonSettings) if f.name != "extra_domains"}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise SettingsError(f"{source(unknown[0])}: unknown setting(s) {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for k, v in values.items():
        try:
            kwargs[k] = _coerce(k, v, fields[k])
        except SettingsError as e:
            raise SettingsError(f"{source(k)}: {e}") from None
    kwargs.setdefault("socket", default_socket())
    kwargs.setdefault("state_dir", default_state_dir())
    where = path or "command line"
    try:
        main = DaemonSettings(**kwargs)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{where}: {e}") from None
    extra = []
    for name, table in domain_tables.items():
        try:
            extra.append(_domain_settings(main, name, table, fields))
        except (TypeError, ValueError) as e:
            raise SettingsError(f"{where}: [domains.{name}] {e}") from None
    names = [main.domain, *(d.domain for d in extra)]
    sockets = [main.socket, *(d.socket for d in extra)]
    if len(set(names)) != len(names) or len(set(sockets)) != len(sockets):
        raise SettingsError(f"{where}: every trust domain needs its own name and its own socket")
    settings = dataclasses.replace(main, extra_domains=tuple(extra))
    for d in (settings, *settings.extra_domains):
        try:
            d.validate()
        except (TypeError, ValueError) as e:
            label = "" if d is settings else f"[domains.{d.domain}] "
            raise SettingsError(f"{where}: {label}{e}") from None
    return settings


#: What a [domains.NAME] table may set; the rest is the daemon's.
DOMAIN_KEYS = frozenset({
    "socket", "socket_mode", "socket_owner", "socket_group", "pool_bytes", "pool_slabs", "pool_block_bytes", "nvme_bytes",
    "nvme_map_bytes", "cache_ttl", "lease_ttl", "reservation_ttl", "write_through", "prefetch_distance",
    "max_prompt_tokens", "trust_client_keys", "hash_memo_bytes", "bypass_generation_tokens", "max_sessions",
    "max_leases_per_session", "max_reservations_per_session", "writeback", "writeback_low", "writeback_high",
    "writeback_batch_bytes",
    "writeback_wait", "eviction_policy", "eviction_weight", "eviction_memory_chunks", "eviction_admission",
    "remote_nodes", "remote_cluster", "remote_username", "remote_password_file", "remote_ttl", "remote_timeout",
    "remote_write", "remote_tls", "remote_tls_ca", "remote_queue_chunks", "remote_queue_bytes",
    "hash_key_file", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic", "kv_events_buffer_batches",
    "kv_events_allow_remote",
})


def _domain_settings(main: DaemonSettings, name: str, table: Any, fields: dict) -> DaemonSettings:
    """A trust domain: the daemon's settings overlaid with its own table; it must name its socket."""
    if not isinstance(table, dict):
        raise SettingsError(f"[domains.{name}] must be a table")
    bad = sorted(set(table) - DOMAIN_KEYS)
    if bad:
        raise SettingsError(f"[domains.{name}] cannot set {', '.join(bad)} (allowed: {', '.join(sorted(DOMAIN_KEYS))})")
    if "socket" not in table:
        raise SettingsError(f"[domains.{name}] needs its own socket")
    own = {k: _coerce(k, v, fields[k]) for k, v in table.items()}
    return dataclasses.replace(main, domain=name, tcp_listen="", metrics_addr="off", **own)
