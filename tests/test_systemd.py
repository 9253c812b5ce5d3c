"""sd_notify against a real AF_UNIX datagram socket: the unit, and the daemon under it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvcached.systemd import Notifier
from bench.harness.daemon import pool_segments, remove_segments


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(30)
    yield path, s
    s.close()


def messages(sock: socket.socket, until: str, timeout: float = 30) -> list[dict[str, str]]:
    """Read datagrams until one has the key ``until``; each parsed into a dict."""
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = sock.recv(4096).decode()
        msg = dict(line.split("=", 1) for line in data.splitlines())
        out.append(msg)
        if until in msg:
            return out
    raise AssertionError(f"no {until} within {timeout} s: {out}")


def test_notifier_sends_datagrams(notify_socket):
    path, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    assert n.enabled and n.watchdog_interval == 2.0
    n.ready("3 chunks")
    assert sock.recv(4096) == b"READY=1\nSTATUS=3 chunks"
    n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    n.reloading()
    msg = sock.recv(4096).decode()
    assert msg.startswith("RELOADING=1\nMONOTONIC_USEC=") and int(msg.split("=")[-1]) > 0
    n.extend_timeout(1.5)
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=1500000"
    n.close()


def test_without_systemd_everything_is_a_no_op():
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval is None
    assert n.ready("x") is False and n.watchdog() is False


def test_watchdog_is_for_the_named_pid_only():
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_abstract_socket_address():
    name = f"kvcached-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready("ok")
        assert s.recv(100) == b"READY=1\nSTATUS=ok"
    finally:
        s.close()


def test_daemon_lifecycle_under_systemd(notify_socket, tmp_path):
    path, sock = notify_socket
    sock_path = str(tmp_path / "kv.sock")
    cfg = tmp_path / "k.toml"
    cfg.write_text('pool_bytes = "4M"\nnvme_bytes = "64M"\nlease_ttl = 30.0\nmetrics_addr = "127.0.0.1:0"\n')
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")  # pings every 0.2 s
    exe = os.path.join(os.path.dirname(sys.executable), "kvcached")
    p = subprocess.Popen([exe, "serve", "--config", str(cfg), "--socket", sock_path, "--state-dir", str(tmp_path / "st")],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = messages(sock, "READY")
        ready = first[-1]
        assert os.path.exists(sock_path)  # READY only after the socket is bound
        assert "chunks" in ready["STATUS"] and "pool" in ready["STATUS"]
        assert all("READY" not in m for m in first[:-1])
        pings = [m for m in messages(sock, "WATCHDOG") if "WATCHDOG" in m]
        pings += [m for m in messages(sock, "WATCHDOG") if "WATCHDOG" in m]
        assert len(pings) >= 2
        cfg.write_text('pool_bytes = "4M"\nnvme_bytes = "64M"\nlease_ttl = 5.0\n')
        p.send_signal(signal.SIGHUP)
        seen = messages(sock, "RELOADING")
        assert "MONOTONIC_USEC" in seen[-1]
        assert "READY" in [k for m in messages(sock, "READY") for k in m]
        p.send_signal(signal.SIGTERM)
        assert "STOPPING" in messages(sock, "STOPPING")[-1]
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
            remove_segments(pool_segments(p.pid))  # a killed daemon cannot unlink its pool
