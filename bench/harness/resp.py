"""Plain-socket Redis GETs (RESP), each bulk reply read straight into a caller's buffer: the
network + server floor of bench/remote_tier.py's fetch rows (no client parser)."""

from __future__ import annotations

import socket




class RespConn:
    """One TCP connection to one Redis node; GETs pipelined, each bulk reply read into a buffer."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()

    def send_gets(self, keys: list[bytes]) -> None:
        self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))

    def read_bulk_into(self, dst: memoryview) -> int:
        while True:
            i = self.pending.find(b"\r\n")
            if i >= 0:
                break
            self.pending += self.sock.recv(65536)
        if self.pending[:1] != b"$":
            raise RuntimeError(f"unexpected reply {bytes(self.pending[:64])!r}")
        n = int(self.pending[1:i])
        del self.pending[: i + 2]
        if n < 0:
            return -1
        take = min(len(self.pending), n)
        dst[:take] = self.pending[:take]
        del self.pending[:take]
        got = take
        while got < n:
            r = self.sock.recv_into(dst[got:n])
            if not r:
                raise RuntimeError("connection closed")
            got += r
        while len(self.pending) < 2:
            self.pending += self.sock.recv(65536)
        del self.pending[:2]
        return n

    def close(self) -> None:
        self.sock.close()
