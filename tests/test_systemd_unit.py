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


def test_socket_group_the_service_cannot_map_is_refused_with_what_to_do(tmp_path):
    """The unit runs with PrivateUsers=yes: its user namespace maps only root and the service's
    own user and group, so giving the socket and tier files to any other group fails (chown:
    EINVAL). The daemon says so at start (exit 78) instead of failing on the first chown; here
    the namespace is made with unshare, mapping only root, as PrivateUsers=yes maps only the
    service's user. Control: the same config in the initial namespace passes."""
    require(shutil.which("unshare") is not None, "unshare (util-linux) is missing")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True)
    require(probe.returncode == 0, f"cannot create a user namespace here: {probe.stderr.decode().strip()}")
    import grp

    group = next(g.gr_name for g in grp.getgrall() if g.gr_gid not in (0, os.getegid()))
    config = tmp_path / "kvcached.toml"
    config.write_text(f'socket_group = "{group}"\nstate_dir = "{tmp_path / "state"}"\n')
    exe = os.path.join(os.path.dirname(sys.executable), "kvcached")
    cmd = [exe, "serve", "--config", str(config), "--socket", str(tmp_path / "s.sock"), "--check-config"]
    r = subprocess.run(["unshare", "--user", "--map-root-user", *cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 78, r.stdout + r.stderr
    assert f"socket_group = '{group}'" in r.stderr and "PrivateUsers=yes" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no traceback
    control = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert control.returncode == 0, control.stdout + control.stderr
