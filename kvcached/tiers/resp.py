"""Pipelined Redis GETs whose values land in buffers the caller supplies (the remote tier's reader).

redis-py (with hiredis) turns each bulk reply into a new ``bytes`` object: the value is copied
from the socket into hiredis's buffer, then into the object, with the GIL held, and the remote
tier copied it a third time into a pool slot. That bound a cross-host fill to one core (0.59
GB/s end to end on the benchmark box). This reader speaks just enough RESP2 for the tier's
fetch (``AUTH``, pipelined ``GET``) and reads each value with ``socket.recv_into`` straight
into the memory the caller names, in as many pieces as the caller wants (the tier: record
header, payload into the pool slot, MAC): the kernel's copy is the only one, and it runs with
the GIL released.

It is not a general client. Anything but a bulk string or a nil in answer to a GET (``-MOVED``,
``-ASK``, an ACL refusal, ...) is handed to the caller as that key's :class:`ErrorReply`; the
caller decides (the tier asks redis-py, which knows the cluster's redirections, for the rest).
A broken connection or a reply that is not RESP raises :class:`RespProtocolError` or an
``OSError``; the connection is then unusable and must be closed.

Thread-safety: a :class:`RespConnection` is used by one thread at a time (the tier keeps idle
connections in a pool and hands each call its own). :meth:`RespConnection.shutdown` may be
called from another thread: it makes a blocked read return at once (how a call abandoned at its
deadline is stopped before its buffers are given back).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Bytes read at a time while looking for a reply's first line (a value's bytes go elsewhere).
_LINE_READ = 64 << 10


class RespProtocolError(Exception):
    """The server's bytes are not the RESP this reader expects (or the connection closed)."""


@dataclass(frozen=True)
class ErrorReply:
    """A ``-ERR ...`` reply to one command (``-MOVED 3999 10.0.0.2:6381`` is one)."""

    message: str

    @property
    def redirect(self) -> bool:
        """A cluster redirection or a slot in migration: asking again elsewhere may succeed."""
        return self.message.split(" ", 1)[0] in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


#: What the caller does with a value of ``length`` bytes for key ``index``: read exactly
#: ``length`` bytes from the connection (:meth:`RespConnection.read_into` / :meth:`skip`).
Sink = Callable[[int, int, "RespConnection"], None]


class RespConnection:
    """One TCP connection to one Redis node."""

    def __init__(self, host: str, port: int, *, timeout: float, username: str | None = None,
                 password: str | None = None) -> None:
        self.address = f"{host}:{port}"
        self._sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._buf = bytearray(_LINE_READ)
            self._view = memoryview(self._buf)
            self._start = self._end = 0  # unread bytes are _buf[_start:_end]
            if password is not None:
                args = ("AUTH", username, password) if username else ("AUTH", password)
                self._sock.sendall(command(*args))
                line = self._line()
                if not line.startswith(b"+"):
                    raise RespProtocolError(f"AUTH refused by {self.address}: {line.decode(errors='replace')}")
        except BaseException:
            self._sock.close()
            raise

    # -- the one operation -----------------------------------------------------------------------

    def send_many(self, keys: Sequence[bytes]) -> None:
        """Send a pipelined ``GET`` of each of ``keys`` (read the replies with :meth:`read_many`)."""
        self._sock.sendall(b"".join(command(b"GET", k) for k in keys))

    def read_many(self, count: int, sink: Sink) -> list[int | ErrorReply | None]:
        """The replies to ``count`` GETs sent: per key, the value's length (its bytes went to
        ``sink``), None for a key the node lacks, or the :class:`ErrorReply` the node answered."""
        out: list[int | ErrorReply | None] = []
        for i in range(count):
            line = self._line()
            kind = line[:1]
            if kind == b"$":
                try:
                    n = int(line[1:])
                except ValueError:
                    raise RespProtocolError(f"a bad bulk length from {self.address}: {bytes(line[:64])!r}") from None
                if n < 0:
                    out.append(None)
                    continue
                sink(i, n, self)
                self._expect_crlf()
                out.append(n)
            elif kind == b"-":
                out.append(ErrorReply(line[1:].decode(errors="replace")))
            else:
                raise RespProtocolError(f"unexpected reply to GET from {self.address}: {bytes(line[:64])!r}")
        return out

    # -- reading a value (what a sink calls) -------------------------------------------------------

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly: first from what was already read, then straight from the socket."""
        n = dest.nbytes
        have = min(n, self._end - self._start)
        if have:
            dest[:have] = self._view[self._start: self._start + have]
            self._start += have
        while have < n:
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise RespProtocolError(f"{self.address} closed the connection inside a value")
            have += got

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (a value nobody wants, read off so the pipeline goes on)."""
        while n:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    # -- lifetime -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop any read on this connection now (from any thread); the connection is then dead."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()

    # -- internals ----------------------------------------------------------------------------------

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # compact: a line longer than what is left at the end
            rest = self._end - self._start
            if rest == len(self._buf):
                raise RespProtocolError(f"a reply line from {self.address} is longer than {len(self._buf)} bytes")
            self._view[:rest] = self._view[self._start: self._end]
            self._start, self._end = 0, rest
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise RespProtocolError(f"{self.address} closed the connection")
        self._end += got

    def _line(self) -> bytes:
        """The next reply line, without its CRLF."""
        done = 0  # unread bytes already searched (less one: a CR may end them)
        while True:
            i = self._buf.find(b"\r\n", self._start + done, self._end)
            if i >= 0:
                line = bytes(self._view[self._start: i])
                self._start = i + 2
                return line
            done = max(0, self._end - self._start - 1)
            self._fill()  # may move the unread bytes to the front: ``done`` counts from _start

    def _expect_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start: self._start + 2] != b"\r\n":
            raise RespProtocolError(f"a value from {self.address} is not followed by CRLF")
        self._start += 2


def command(*args: bytes | str) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)
