"""Client exceptions, one per gRPC status the daemon uses. All derive from KvcachedError."""

from __future__ import annotations

import grpc


class KvcachedError(Exception):
    """Base class. ``code`` is the gRPC status code, ``details`` the daemon's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgumentError(KvcachedError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KvcachedError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(KvcachedError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(KvcachedError):
    """The pool is full of leased/reserved chunks, or a message was too large."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(KvcachedError):
    """The daemon is not running, restarting, or draining."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(KvcachedError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PoolMappingError(KvcachedError):
    """The pool could not be mapped (another host, another container, a GPU pool without CUDA)."""


_BY_CODE = {
    c.code: c
    for c in (InvalidArgumentError, NotFoundError, FailedPreconditionError, ResourceExhaustedError,
              UnavailableError, DeadlineExceededError)
}


def from_rpc_error(e: grpc.RpcError) -> KvcachedError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    return from_status(code, details)


def from_status(code: grpc.StatusCode, details: str) -> KvcachedError:
    """The exception for a call that ended with ``code`` (a unary call's status, or a call's
    error on the session stream)."""
    cls = _BY_CODE.get(code, KvcachedError)
    return cls(details, code)
