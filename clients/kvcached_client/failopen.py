"""Fail open: when kvcached cannot help, the request is served by the model alone.

A cache must never be the reason a request fails. The engine integrations (``hf``, ``vllm``)
catch the daemon's errors (absent, restarting, refusing, a pool that cannot be mapped) at
each cache operation, count them, log them and carry on as if nothing were cached.

* counter: ``kvcached_client_fail_open_total{integration, op, reason}`` in the process's
  default Prometheus registry (``reason`` is the gRPC status name, or the exception's class);
* log: one warning when an operation starts failing (or fails for a new reason), one info
  line when it works again; not one line per request, which on a dead daemon would be a
  flood.

:class:`FailOpen` is thread-safe: the vLLM scheduler and worker sides call it from their
own threads.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import Counter

from kvcached_client.errors import KvcachedError

log = logging.getLogger("kvcached_client")

FAIL_OPEN_TOTAL = Counter(
    "kvcached_client_fail_open",
    "Cache operations that failed and were skipped: the request was served without the cache",
    ["integration", "op", "reason"],
)


def reason_of(error: BaseException) -> str:
    """A short, bounded label for an error: the gRPC status name for daemon errors."""
    if isinstance(error, KvcachedError) and error.code.name != "UNKNOWN":
        return error.code.name
    return type(error).__name__  # e.g. PoolMappingError


class FailOpen:
    """Counts and logs cache failures of one integration; see the module docstring."""

    def __init__(self, integration: str) -> None:
        self.integration = integration
        self._lock = threading.Lock()
        self._failing: dict[str, str] = {}  # op -> reason it is failing with
        self.counts: dict[tuple[str, str], int] = {}  # (op, reason) -> failures, for callers and tests

    def failed(self, op: str, error: BaseException) -> str:
        """Record that ``op`` failed with ``error``; returns the reason label."""
        reason = reason_of(error)
        FAIL_OPEN_TOTAL.labels(self.integration, op, reason).inc()
        with self._lock:
            self.counts[(op, reason)] = self.counts.get((op, reason), 0) + 1
            changed = self._failing.get(op) != reason
            self._failing[op] = reason
        if changed:
            log.warning("kvcached %s: %s failed (%s: %s); serving without the cache (logged once until it "
                        "works again; counted in kvcached_client_fail_open_total)",
                        self.integration, op, reason, error)
        return reason

    def ok(self, op: str) -> None:
        """Record that ``op`` worked; logs once if it had been failing."""
        if op not in self._failing:  # unlocked fast path: the common case costs a dict lookup
            return
        with self._lock:
            was = self._failing.pop(op, None)
        if was is not None:
            log.info("kvcached %s: %s works again", self.integration, op)

    def total(self, op: str | None = None) -> int:
        with self._lock:
            return sum(n for (o, _), n in self.counts.items() if op is None or o == op)


__all__ = ["FAIL_OPEN_TOTAL", "FailOpen", "reason_of"]
