"""Logging to journald through its native protocol, without libsystemd.

When systemd connects the daemon's stderr to the journal it sets ``JOURNAL_STREAM`` to the
``device:inode`` of that stream. Then kvcached sends each record as one datagram to
``/run/systemd/journal/socket`` with structured fields operators can filter on
(``journalctl -u kvcached EVENT=session_lost``); otherwise it logs plain lines to stderr.

Fields: ``MESSAGE``, ``PRIORITY`` (from the level), ``SYSLOG_IDENTIFIER``, ``CODE_FILE`` /
``CODE_LINE`` / ``CODE_FUNC``, ``LOGGER``, and, when a log call passes them in ``extra``,
``EVENT``, ``MODEL``, ``LAYOUT_ID``, ``TIER``, ``LEASE_ID``, ``SESSION_ID``, ``ERROR_KIND``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

JOURNAL_SOCKET = "/run/systemd/journal/socket"
STRUCTURED = ("event", "model", "layout_id", "tier", "lease_id", "session_id", "error_kind")

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def stderr_is_journal(env: dict[str, str] | None = None) -> bool:
    """True when stderr is the journal stream systemd set up (``JOURNAL_STREAM``)."""
    return stream_is_journal(2, env)


def stream_is_journal(fd: int, env: dict[str, str] | None = None) -> bool:
    """True when file descriptor ``fd`` is the journal stream systemd set up (``JOURNAL_STREAM``)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(fd)
    except (ValueError, OSError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def priority(levelno: int) -> int:
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


def encode(fields: dict[str, str]) -> bytes:
    """The journal's datagram format: ``KEY=value\\n``, or ``KEY\\n<len64le><value>\\n`` for values with newlines."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalHandler(logging.Handler):
    def __init__(self, identifier: str = "kvcached", path: str | None = None) -> None:
        super().__init__()
        self.identifier = identifier
        # KVCACHED_JOURNAL_SOCKET: for tests, which listen on their own datagram socket.
        self.path = path or os.environ.get("KVCACHED_JOURNAL_SOCKET") or JOURNAL_SOCKET
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            fields = {
                "MESSAGE": message,
                "PRIORITY": str(priority(record.levelno)),
                "SYSLOG_IDENTIFIER": self.identifier,
                "LOGGER": record.name,
                "CODE_FILE": record.pathname,
                "CODE_LINE": str(record.lineno),
                "CODE_FUNC": record.funcName,
            }
            for name in STRUCTURED:
                value = getattr(record, name, None)
                if value is not None:
                    fields[name.upper()] = str(value)
            self._sock.sendto(encode(fields), self.path)
        except Exception:  # a logging failure must never take the daemon down
            self.handleError(record)

    def close(self) -> None:
        self._sock.close()
        super().close()
