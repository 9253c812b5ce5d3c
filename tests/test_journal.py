"""journald native protocol: what a real datagram socket receives."""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys

import pytest

from kvcached.journal import JournalHandler, encode, priority, stderr_is_journal
from bench.harness.daemon import pool_segments, remove_segments


def parse(data: bytes) -> dict[str, str]:
    """Decode the journal datagram format (both the KEY=value and the binary length form)."""
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out[k.decode()] = v.decode()
            i = nl + 1
        else:
            (n,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            out[line.decode()] = data[nl + 9 : nl + 9 + n].decode()
            i = nl + 9 + n + 1
    return out


@pytest.fixture
def journal(tmp_path):
    path = str(tmp_path / "journal.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(60)  # a daemon starting on a busy box can take seconds before its first record
    yield path, s
    s.close()


def test_records_carry_priority_and_structured_fields(journal):
    path, sock = journal
    log = logging.getLogger("kvcached.test.journal")
    h = JournalHandler(path=path)
    log.addHandler(h)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        log.warning("session %s ended", "s-1", extra={"event": "session_lost", "session_id": "s-1", "tier": "pool"})
        f = parse(sock.recv(65536))
        assert f["MESSAGE"] == "session s-1 ended" and f["PRIORITY"] == "4" and f["SYSLOG_IDENTIFIER"] == "kvcached"
        assert (f["EVENT"], f["SESSION_ID"], f["TIER"]) == ("session_lost", "s-1", "pool")
        assert f["CODE_FUNC"] == "test_records_carry_priority_and_structured_fields" and int(f["CODE_LINE"]) > 0
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("corrupt chunk dropped", extra={"event": "corrupt_chunk", "error_kind": "not_found"})
        f = parse(sock.recv(65536))
        assert f["PRIORITY"] == "3" and "ValueError: boom" in f["MESSAGE"] and f["MESSAGE"].count("\n") >= 2
        assert f["ERROR_KIND"] == "not_found"
    finally:
        log.removeHandler(h)
        h.close()


def test_priorities_and_encoding():
    assert [priority(x) for x in (50, 40, 30, 20, 10, 5)] == [2, 3, 4, 6, 7, 7]
    assert encode({"A": "x"}) == b"A=x\n"
    assert encode({"A": "x\ny"}) == b"A\n" + struct.pack("<Q", 3) + b"x\ny\n"


def test_journal_stream_detection(tmp_path):
    st = os.fstat(2)
    assert stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert not stderr_is_journal({"JOURNAL_STREAM": "1:2"})
    assert not stderr_is_journal({})


def test_plain_lines_when_stderr_is_not_the_journal(tmp_path):
    r = subprocess.run([sys.executable, "-c", "from kvcached.daemon import configure_logging; import logging;"
                        "configure_logging('info'); logging.getLogger('kvcached').info('hello', extra={'event': 'start'})"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, JOURNAL_STREAM="1:2"))
    assert "INFO kvcached: hello" in r.stderr


_HOLDER = r"""
import sys, time, torch
from kvcached_client import Client
from tests.service.conftest import LAYOUT
c = Client(sys.argv[1])
c.put(LAYOUT, list(range(32)), torch.zeros(2, 2, 2, 32, 8))
lease = c.acquire(LAYOUT, list(range(32)))
print("held", flush=True)
time.sleep(600)
"""


def test_daemon_logs_structured_events_to_the_journal(journal, tmp_path):
    path, sock = journal
    stderr_file = open(tmp_path / "stderr", "w")
    st = os.fstat(stderr_file.fileno())
    env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}", KVCACHED_JOURNAL_SOCKET=path)
    cfg = tmp_path / "k.toml"
    cfg.write_text('pool_bytes = "4M"\nnvme_bytes = "64M"\nmetrics_addr = "127.0.0.1:0"\n')
    sock_path = str(tmp_path / "kv.sock")
    exe = os.path.join(os.path.dirname(sys.executable), "kvcached")
    d = subprocess.Popen([exe, "serve", "--config", str(cfg), "--socket", sock_path, "--state-dir", str(tmp_path / "st")],
                         env=env, stdout=subprocess.DEVNULL, stderr=stderr_file)
    records: list[dict[str, str]] = []

    def until(pred):
        while True:
            rec = parse(sock.recv(65536))
            records.append(rec)
            if pred(rec):
                return rec

    try:
        ready = until(lambda r: r.get("EVENT") == "ready")
        assert "ready" in ready["MESSAGE"] and ready["PRIORITY"] == "6"
        h = subprocess.Popen([sys.executable, "-c", _HOLDER, sock_path], stdout=subprocess.PIPE, text=True)
        assert h.stdout.readline().strip() == "held"
        h.kill()
        h.wait()
        lost = until(lambda r: r.get("EVENT") == "session_lost")
        assert "released 1 leases" in lost["MESSAGE"] and lost["SESSION_ID"].startswith("session-")
        d.send_signal(15)
        until(lambda r: r.get("EVENT") == "stopped")
        assert d.wait(30) == 0
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
            remove_segments(pool_segments(d.pid))  # a killed daemon cannot unlink its pool
        stderr_file.close()
    assert (tmp_path / "stderr").read_text() == ""  # everything went to the journal, nothing to stderr
