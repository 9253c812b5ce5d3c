"""Free loopback TCP ports for the servers the tests and benches start (Redis, the router, hosts)."""

from __future__ import annotations

import random
import socket


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1, each with its +10000 cluster-bus port free too,
    all below the kernel's ephemeral range: a port the kernel may hand to an outgoing connection
    (what ``bind(0)`` returns) can be taken between choosing it and a server binding it, or
    while a killed server is down, and a test would then fail on "address already in use"."""
    lo, _ = _ephemeral_range()
    top = min(lo, 65536) - 10000  # the bus port (+10000) stays below the ephemeral range too
    rng = random.Random()
    out: list[int] = []
    for _ in range(10000):
        if len(out) == n:
            return out
        port = rng.randrange(10000, max(top, 10001))
        if port in out:
            continue
        ok = True
        for p in (port, port + 10000):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            out.append(port)
    raise RuntimeError(f"no {n} free ports below the ephemeral range ({lo}-)")
