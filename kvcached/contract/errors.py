"""Domain errors of kvcached.

Every error a caller can provoke is a subclass of :class:`KvcacheError` and
carries a :class:`ErrorKind`. The kind is the *only* thing the gRPC layer
looks at to choose a status code (one table, in the servicer); the engine
never imports grpc. Messages are written for the person reading them: they
say what was wrong and what to do about it.

:class:`InternalInvariantError` is different: it means kvcached itself has a
bug (for example a reference count that would go negative). It is raised,
never clamped or logged-and-ignored, and maps to INTERNAL.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What kind of failure, independent of any transport."""

    INVALID_ARGUMENT = "invalid_argument"  # the request itself is malformed
    NOT_FOUND = "not_found"  # it names a lease/layout/reservation that does not exist
    FAILED_PRECONDITION = "failed_precondition"  # valid, but not in this state
    RESOURCE_EXHAUSTED = "resource_exhausted"  # no room, even after eviction
    UNAVAILABLE = "unavailable"  # the store is closed or draining
    INTERNAL = "internal"  # a kvcached bug


class KvcacheError(Exception):
    """Base of every domain error."""

    kind: ErrorKind = ErrorKind.INTERNAL


# -- invalid argument ---------------------------------------------------------


class InvalidArgument(KvcacheError):
    kind = ErrorKind.INVALID_ARGUMENT


class InvalidLayout(InvalidArgument):
    """A layout field is out of range or unsupported."""


class InvalidTokens(InvalidArgument):
    """Token ids are not integers in range, or the array is malformed."""


class InvalidKV(InvalidArgument):
    """KV data has the wrong shape, dtype or byte size for its layout."""


class InvalidPoolHandle(InvalidArgument):
    """A pool handle (GetPoolHandle's answer) that no client could map: an unknown kind, no
    blocks, a segment name that is not a plain /dev/shm name, a CUDA IPC handle of the wrong size."""


# -- not found -----------------------------------------------------------------


class NotFound(KvcacheError):
    kind = ErrorKind.NOT_FOUND


class UnknownLayout(NotFound):
    pass


class UnknownLease(NotFound):
    pass


class UnknownReservation(NotFound):
    pass


class ChunkNotCached(NotFound):
    pass


# -- failed precondition -------------------------------------------------------


class FailedPrecondition(KvcacheError):
    kind = ErrorKind.FAILED_PRECONDITION


class ReservationClosed(FailedPrecondition):
    """Commit or abort of a reservation that was already committed, aborted or expired."""


class LeaseExpired(FailedPrecondition):
    """Keep-alive of a lease whose TTL already ran out (its pins are gone)."""


class ClientKeysNotTrusted(FailedPrecondition):
    """A layout whose "token ids" are keys the client computed (``KVLayout.client_keys``), on a
    domain that does not trust its clients' keys (``trust_client_keys``)."""


class SessionNotOpen(FailedPrecondition):
    """A call names a session that ended (or one of a daemon that has since restarted)."""


# -- resource exhausted ----------------------------------------------------------


class ResourceExhausted(KvcacheError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class TierFull(ResourceExhausted):
    """A tier cannot admit more data, even after evicting what it may evict."""


class LimitReached(ResourceExhausted):
    """A configured cap (max_sessions, max_leases_per_session, max_reservations_per_session)."""


# -- unavailable -----------------------------------------------------------------


class Unavailable(KvcacheError):
    kind = ErrorKind.UNAVAILABLE


class StoreClosed(Unavailable):
    pass


class StoreDraining(Unavailable):
    """The daemon is shutting down or was drained by an operator."""


class StoreLocked(Unavailable):
    """Another process already serves this state directory and domain."""


# -- bugs --------------------------------------------------------------------------


class InternalInvariantError(KvcacheError):
    """kvcached broke one of its own invariants. Never caught to carry on."""

    kind = ErrorKind.INTERNAL


class RefcountUnderflow(InternalInvariantError):
    pass


class CorruptChunk(KvcacheError):
    """Stored bytes failed their checksum or header check. The tier drops the
    chunk; the store treats it as a miss and never serves it."""

    kind = ErrorKind.NOT_FOUND


def shown(value: object, limit: int = 64) -> str:
    """A caller-supplied value as it may appear in an error message: quoted, and cut to
    ``limit`` characters. Echoing a 20,000-character id would make the message useless and
    overflow gRPC's metadata limit, which turns the intended status into a transport error."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(str(value))} characters)"


class WouldBlock(Exception):
    """Not a domain error: raised by :meth:`Store.run_inline` *before any state changes*
    when a call would wait for the store lock or for disk I/O. The caller then runs the
    call on a worker thread instead. Never reaches a client."""
