"""The example under clients/examples runs against a real daemon and shows reuse."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_chat_reuse_example(make_daemon):
    d = make_daemon(pool_bytes="64M")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "clients", "examples", "chat_reuse.py"), "--socket", d.socket,
         "--turns", "3", "--user-tokens", "100", "--reply-tokens", "4"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 3
    cached = [int(row[2]) for row in rows]
    assert cached[0] == 0 and cached[1] >= 384 and cached[2] > cached[1]  # earlier turns are reused
    assert all(row[-1] == "True" for row in rows)  # same replies as the plain model
