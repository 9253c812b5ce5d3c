"""The shipped unit: systemd-analyze verify is clean and the hardening scores OK or better."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.requirements import require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "systemd", "kvcached.service")
ANALYZE = shutil.which("systemd-analyze")


@pytest.fixture
def unit(tmp_path):
    require(ANALYZE, "systemd-analyze missing: scripts/test installs Debian's systemd")
    # verify checks that ExecStart exists: point it at this checkout's console script.
    text = open(UNIT).read().replace("/usr/bin/kvcached", os.path.join(os.path.dirname(sys.executable), "kvcached"))
    path = tmp_path / "kvcached.service"
    path.write_text(text)
    return str(path)


def test_verify_has_no_warnings(unit):
    r = subprocess.run([ANALYZE, "verify", unit], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_security_exposure_is_ok_or_better(unit):
    r = subprocess.run([ANALYZE, "security", "--offline=yes", unit], capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert m.group(2) in ("PERFECT", "SAFE", "OK"), m.group(0)
    assert float(m.group(1)) < 4.0


def test_the_remote_tier_drop_in_keeps_the_unit_valid_and_ok(unit):
    """remote-tier.conf only widens IPAddressAllow for the Redis nodes: the unit with it still
    verifies cleanly and scores OK (checked with its [Service] lines merged into the unit)."""
    drop_in = open(os.path.join(ROOT, "systemd", "remote-tier.conf")).read()
    lines = [ln for ln in drop_in.splitlines() if ln and not ln.startswith(("#", "["))]
    assert lines and all(ln.startswith("IPAddressAllow=") for ln in lines)
    text = open(unit).read().replace("IPAddressAllow=localhost\n", "IPAddressAllow=localhost\n" + "\n".join(lines) + "\n")
    assert lines[0] in text
    merged = os.path.join(os.path.dirname(unit), "merged", "kvcached.service")
    os.makedirs(os.path.dirname(merged))
    open(merged, "w").write(text)
    r = subprocess.run([ANALYZE, "verify", merged], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr
    r = subprocess.run([ANALYZE, "security", "--offline=yes", merged], capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", r.stdout + r.stderr)
    assert m and m.group(2) in ("PERFECT", "SAFE", "OK"), r.stdout + r.stderr


def test_unit_contract():
    text = open(UNIT).read()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID",
                 "StateDirectory=kvcached", "RuntimeDirectory=kvcached", "User=kvcached", "DeviceAllow=char-nvidia-uvm rw"):
        assert line in text, line
    assert "u kvcached" in open(os.path.join(ROOT, "systemd", "kvcached.sysusers")).read()


def test_default_config_loads():
    from kvcached.settings import load_settings

    s = load_settings(os.path.join(ROOT, "systemd", "kvcached.toml"))
    assert s.socket == "/run/kvcached/kvcached.sock" and s.socket_mode == 0o660 and s.state_dir == "/var/lib/kvcached"
