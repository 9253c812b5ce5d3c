"""The remote tier's contract: what the fill and the publisher may ask of it.

A remote tier holds chunks shared by every host of a trust domain (Redis or Redis Cluster in
:mod:`kvcached.tiers.remote_redis`). It is not a :class:`kvcached.tiers.base.Tier`: the local
tiers are called under the store lock, one thread at a time, and never wait on the network;
a remote tier is the opposite.

Rules
-----
* **Called without the store lock**, from any thread, several at once (the fill on request
  threads, the publisher on its own): it synchronises its own state (counters, breaker,
  connections) with a lock of its own, never the store's.
* **Bounded.** Every call returns within its deadline (``remote_timeout`` per round trip it
  needs), whatever the network does; time the caller spends in its own ``dest`` callback is
  not the remote's.
* **Fail-open.** Nothing raises a remote error to the caller: an unreachable, slow or refusing
  remote is a miss (``fetch`` nothing, ``fetch_into`` 0) or a failed send (False), counted in
  its stats and logged. A value is served only once verified (MAC, header, checksum).
* **Ownership of destinations** (``fetch_into``): ``dest(i)`` is called at most once per chunk,
  one call at a time, and what it returns is written only until ``fetch_into`` returns; after
  that (also after a deadline) the caller may free it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.record import ChunkMeta


class RemoteTier(Protocol):
    #: Whether ``fetch_into`` writes values straight into its destinations (else it copies).
    direct: bool

    def available(self) -> bool:
        """False while calls would be skipped (the breaker is open)."""
        ...

    def fetch(self, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int) -> list[memoryview]:
        """The verified payloads of the leading chunks of ``hashes`` the remote holds, in order."""
        ...

    def fetch_into(self, layout_id: LayoutId, hashes: Sequence[ChunkHash], chunk_bytes: int,
                   dest: Callable[[int], memoryview | None]) -> int:
        """Chunk ``i``'s verified payload written into ``dest(i)``; how many leading chunks arrived."""
        ...

    def publish(self, chunks: Sequence[tuple[ChunkMeta, bytes | memoryview]]) -> bool:
        """Store ``chunks`` (with the remote's TTL); False if it could not be reached."""
        ...

    def demote(self, chunks: Sequence[tuple[ChunkMeta, bytes | memoryview]]) -> bool:
        """Make sure the remote holds ``chunks``, which leave this host's last local tier."""
        ...
