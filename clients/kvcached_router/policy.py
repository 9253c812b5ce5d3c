"""Where a request goes: the routing policies, side by side.

Every policy sees the same :class:`HostState` list (healthy hosts only) and a request's chunk
hashes, and returns a :class:`Decision`. Load is the router's own count of each host's
in-flight requests and of the prefill tokens it has sent there that have not started
answering yet (``queued_tokens``).

* ``round_robin``: the next host in turn.
* ``least_loaded``: fewest in-flight requests, then fewest queued prefill tokens.
* ``prefix_hash``: consistent hashing (a ring of virtual nodes) on the prompt's first
  ``prefix_hash_chunks`` chunk hashes, as SGLang's and production-stack's prefix routers do:
  the same system prompt always lands on the same host, whatever its load.
* ``longest_prefix``: the host holding the longest cached prefix, ignoring load (the bound
  the cache-aware policy is measured against).
* ``kvcached`` (the default): the longest cached prefix among the hosts that are not over the
  load bound, ties to the host whose queue would start this prefill soonest. The bound is
  that of consistent hashing with bounded loads (Mirrokni et al.): a host may take a request
  while its in-flight count is below ``load_factor`` x the mean after adding this one (and
  always up to ``load_slack`` above the mean: measured, without it a host serving a single
  request lost a 46-chunk prefix to one holding 2), so no host carries much more than its
  share however popular its prefixes are, and within that bound the cache decides. A route counts as ``cache``
  when the chosen host holds a prefix, ``load`` when a host with a longer prefix was over the
  bound, ``balance`` when nobody holds any.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from collections.abc import Sequence

from kvcached_router.index import HostIndex

#: Media whose chunks must be read from storage before they serve, weighed by ``storage_weight``:
#: a daemon's NVMe tier ("STORAGE", vLLM's name; "DISK" from daemons before it, and SGLang's
#: L3), and SGLang's L4 "EXTERNAL" (a shared or remote pool). "GPU", "CPU" and SGLang's
#: "CPU_PINNED" (its L2 host memory) count in full.
STORAGE_MEDIA = ("STORAGE", "DISK", "EXTERNAL")
POLICIES = ("kvcached", "round_robin", "least_loaded", "prefix_hash", "longest_prefix")


@dataclass
class HostState:
    name: str
    index: HostIndex = field(default_factory=HostIndex)
    in_flight: int = 0
    queued_tokens: int = 0  # prefill tokens sent here whose responses have not started
    healthy: bool = True
    routed: int = 0  # requests routed here so far (the last tie-break: spreads new prefixes evenly)


@dataclass(frozen=True)
class Decision:
    host: HostState
    policy: str
    reason: str  # cache / load / balance / turn / least_loaded / hash
    cached_chunks: int  # what the router's index says the chosen host holds
    best_chunks: int  # the longest prefix any healthy host holds (per the index)
    bound: int = 0  # the load bound at the decision (kvcached policy): in-flight requests a host may carry
    loads: dict[str, int] = field(default_factory=dict)  # each healthy host's in-flight requests then


class Router:
    """Chooses a host for each request by the configured policy (see the module docstring)."""

    def __init__(self, hosts: Sequence[HostState], policy: str = "kvcached", *, load_factor: float = 1.25,
                 load_slack: int = 2, prefix_hash_chunks: int = 2, vnodes: int = 64,
                 storage_weight: float = 1.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self.hosts = list(hosts)
        self.policy = policy
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.prefix_hash_chunks = prefix_hash_chunks
        # What a cached chunk is worth by where it lives: one only on the daemon's NVMe must be
        # read before it serves (the pool's are mapped by the engine as they are).
        self.weights = {medium: storage_weight for medium in STORAGE_MEDIA}
        self._turn = itertools.count()
        self._ring = sorted((_h64(f"{h.name}#{v}".encode()), h.name) for h in self.hosts for v in range(vnodes))
        self._ring_keys = [k for k, _ in self._ring]

    def choose(self, hashes: Sequence[bytes], exclude: frozenset[str] = frozenset()) -> Decision | None:
        """The host for a request whose full chunks hash to ``hashes``; None if no host is healthy."""
        live = [h for h in self.hosts if h.healthy and h.name not in exclude]
        if not live:
            return None
        walked = {h.name: h.index.prefix_value(hashes, self.weights) for h in live}
        prefixes = {name: n for name, (n, _) in walked.items()}
        values = {name: v for name, (_, v) in walked.items()}
        best = max(prefixes.values())
        if self.policy == "round_robin":
            host, reason = live[next(self._turn) % len(live)], "turn"
        elif self.policy == "least_loaded":
            host, reason = min(live, key=_load), "least_loaded"
        elif self.policy == "prefix_hash":
            host, reason = self._by_hash(hashes, live), "hash"
        elif self.policy == "longest_prefix":
            host = max(live, key=lambda h: (values[h.name], -h.in_flight, -h.queued_tokens))
            reason = "cache" if prefixes[host.name] else "balance"
        else:
            host, reason = self._bounded(live, prefixes, values, best, hashes)
        decision = Decision(host, self.policy, reason, prefixes[host.name], best, self.load_bound(live),
                            {h.name: h.in_flight for h in live})
        host.routed += 1
        return decision

    def load_bound(self, live: Sequence[HostState]) -> int:
        """The most in-flight requests a host may already carry to take one more: ``load_factor``
        times the mean after this request, and never fewer than ``load_slack`` above the mean.
        The slack matters at low load, where the factor alone would send a request away from a
        host with a long cached prefix because it is serving one other request."""
        mean_after = (sum(h.in_flight for h in live) + 1) / len(live)
        return max(math.ceil(self.load_factor * mean_after), math.floor(mean_after) + self.load_slack) - 1

    def _bounded(self, live: list[HostState], prefixes: dict[str, int], values: dict[str, float], best: int,
                 hashes: Sequence[bytes]) -> tuple[HostState, str]:
        bound = self.load_bound(live)
        eligible = [h for h in live if h.in_flight <= bound] or live
        top_value = max(values[h.name] for h in eligible)
        # Among the longest prefixes within the bound: one its daemon has confirmed (not only
        # "about to store", which a request still in flight may not deliver), then the queue that
        # would start it soonest.
        tied = [h for h in eligible if values[h.name] == top_value]
        if len(tied) > 1:
            confirmed = {h.name: h.index.confirmed_prefix(hashes) for h in tied}
            most = max(confirmed.values())
            tied = [h for h in tied if confirmed[h.name] == most]
        host = min(tied, key=_load_tokens)
        if prefixes[host.name] == 0:
            return host, "load" if best > 0 else "balance"
        # "load" only when the load bound kept the request from a host whose cache was worth more
        return host, "load" if top_value < max(values.values()) else "cache"

    def _by_hash(self, hashes: Sequence[bytes], live: list[HostState]) -> HostState:
        names = {h.name: h for h in live}
        key = _h64(b"".join(hashes[: self.prefix_hash_chunks]) or b"empty")
        i = bisect.bisect(self._ring_keys, key)
        for j in range(len(self._ring)):
            name = self._ring[(i + j) % len(self._ring)][1]
            if name in names:
                return names[name]
        return live[0]  # pragma: no cover - live is never empty here


def _load(h: HostState) -> tuple[int, int, int]:
    return h.in_flight, h.queued_tokens, h.routed


def _load_tokens(h: HostState) -> tuple[int, int, int]:
    # At low load every queue is empty: without the count, the first host in the list would win
    # every tie (measured: the busiest host took 2.6x the least busy's requests).
    return h.queued_tokens, h.in_flight, h.routed


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
