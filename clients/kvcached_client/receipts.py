"""What a put tells its caller: how much was stored, and how much of it would survive a restart."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvcached.v1 import kvcached_pb2 as pb

log = logging.getLogger("kvcached_client")


@dataclass(frozen=True)
class PutReceipt:
    """The daemon's answer to a put.

    ``cached_tokens`` is the prompt's cached prefix after the put (stored now, or already
    cached); ``durable_tokens`` the part of it, from the first token, that has an NVMe copy,
    so a restart of the daemon keeps it. A write-through domain writes NVMe before the put
    returns, so there ``durable`` should be True; when the disk or the LMDB map is full it is
    False, the chunks past ``durable_tokens`` are cached in the pool only, and the client logs
    a warning. The put itself still succeeded: a cache that cannot reach its disk serves on.
    A write-back domain writes NVMe later (pool eviction, ``flush``), so new chunks are not
    durable yet when the put returns.
    """

    stored_chunks: int  # chunks this put wrote (skipped: already cached, or another writer's)
    cached_tokens: int
    durable_tokens: int
    in_flight_tokens: int = 0  # after cached_tokens: being written by another writer right now
    write_through: bool = False
    #: Full chunks (in tokens) the put could not store because the pool had no room (it is full of
    #: leased or reserved chunks), and the daemon's reason. A full cache is not an error.
    not_stored_tokens: int = 0
    not_stored_reason: str = ""

    @property
    def durable(self) -> bool:
        """Everything cached of the prompt has an NVMe copy."""
        return self.durable_tokens >= self.cached_tokens


class _ShortfallLog:
    """Logs when write-through puts start and stop falling short: once per change, not once per put
    (with a full disk every put would warn)."""

    def __init__(self) -> None:
        self.short = False

    def note(self, r: PutReceipt) -> None:
        if not r.write_through or self.short == (not r.durable):  # write-back puts, or no change
            return
        self.short = not r.durable
        if self.short:
            log.warning("write-through put is durable for %d of its %d cached tokens: the daemon's NVMe tier is "
                        "full or failing, the rest is cached in the pool only (logged once until puts are "
                        "durable again; check PutReceipt.durable)", r.durable_tokens, r.cached_tokens)
        else:
            log.info("write-through puts are durable again")


_shortfall = _ShortfallLog()


def put_receipt(commit: pb.CommitResponse, in_flight_tokens: int = 0) -> PutReceipt:
    """A :class:`PutReceipt` from the Commit (or PutBytes) reply; logs when write-through falls short."""
    r = PutReceipt(commit.committed_chunks, commit.cached_tokens, commit.durable_tokens, in_flight_tokens,
                   commit.write_through)
    _shortfall.note(r)
    return r


__all__ = ["PutReceipt", "put_receipt"]
