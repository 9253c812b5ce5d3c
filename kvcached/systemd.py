"""sd_notify without libsystemd: the daemon's side of ``Type=notify``.

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace); each
notification is one datagram of ``KEY=VALUE`` lines. Without ``NOTIFY_SOCKET`` (not run by
systemd) every call is a no-op, so the daemon never needs to know how it was started.

What kvcached sends, and when (see :mod:`kvcached.daemon`):

* ``EXTEND_TIMEOUT_USEC`` while the pool is allocated and the index rebuilt from NVMe;
* ``READY=1`` and ``STATUS=...`` only after the socket is bound and the index rebuilt;
* ``WATCHDOG=1`` from the event loop at half of ``WATCHDOG_USEC``: a stuck loop stops the
  pings and systemd restarts the service;
* ``RELOADING=1`` + ``MONOTONIC_USEC`` on SIGHUP, then ``READY=1`` again;
* ``STOPPING=1`` on SIGTERM.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        self._addr = addr or None
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval: float | None = int(usec) / 1e6 / 2 if usec.isdigit() and int(usec) > 0 and mine else None

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines (keys upper-cased); False when not under systemd."""
        if self._addr is None:
            return False
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.sendto(msg, self._addr)
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def reloading(self) -> bool:
        return self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self) -> bool:
        return self.send(STOPPING=1, STATUS="stopping: draining in-flight calls, flushing to NVMe")

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
