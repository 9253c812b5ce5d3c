from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached.cli import default_socket, default_state_dir, parse_size


def run(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvcached.cli", *args], capture_output=True, text=True, env=e, timeout=120)


def test_serve_self_check_on_embedded_defaults(tmp_path):
    r = run("serve", env={"STATE_DIRECTORY": str(tmp_path / "state"), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "self-check: ok" in r.stdout
    assert os.path.exists(tmp_path / "state" / "hash.key")
    r2 = run("serve", "--state-dir", str(tmp_path / "state"), "--pool-bytes", "1M", "--nvme-bytes", "0")
    assert r2.returncode == 0, r2.stderr
    assert "self-check: ok" in r2.stdout and "NVMe:" not in r2.stdout


def test_serve_rejects_bad_flags(tmp_path):
    assert run("serve", "--pool-bytes", "lots").returncode == 2
    assert run("serve", "--device", "tpu", "--state-dir", str(tmp_path)).returncode == 2


def test_console_scripts_are_installed():
    bindir = os.path.dirname(sys.executable)
    for name in ("kvcached", "kvcachectl"):
        assert os.access(os.path.join(bindir, name), os.X_OK)
    r = subprocess.run([os.path.join(bindir, "kvcachectl"), "status"], capture_output=True, text=True)
    assert r.returncode == 2 and "not yet" in r.stderr


@pytest.mark.parametrize("text,want", [("0", 0), ("512", 512), ("4k", 4096), ("2M", 2 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30)])
def test_parse_size(text, want):
    assert parse_size(text) == want


def test_default_paths(monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kvcached:/other")
    assert default_state_dir() == "/var/lib/kvcached"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("HOME", "/home/u")
    assert default_state_dir() == "/home/u/.local/state/kvcached"
    monkeypatch.setenv("KVCACHED_SOCKET", "/x.sock")
    assert default_socket() == "/x.sock"
    monkeypatch.delenv("KVCACHED_SOCKET")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/kvcached")
    assert default_socket() == "/run/kvcached/kvcached.sock"
