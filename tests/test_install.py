"""scripts/install on a real root, inside a private mount namespace so the host is left as it was.

The namespace gets writable overlays of /etc, /usr/local, /var/lib, /run and /opt;
everything the installer writes lands in the test's temp dir. In there: install, check the
installed unit with ``systemd-analyze verify`` (its ExecStart must exist and be executable),
start the installed binary as the ``kvcached`` user the installer created, on the config it
installed, and ask it for its status through the installed ``kvcachectl`` on the documented
socket; then uninstall and check that the config and state stay (and go with ``--purge``).
The venv is a real one (torch's CPU build and kvcached with its dependencies): about 30 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.requirements import require

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
set -euo pipefail
T="$1"
for d in etc usr/local var/lib run opt; do
    n="${d//\//_}"
    mkdir -p "$T/ov/$n/up" "$T/ov/$n/work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$T/ov/$n/up,workdir=$T/ov/$n/work" "/$d"
done
cd "$REPO"
./scripts/install
echo "== verify"
systemd-analyze verify /etc/systemd/system/kvcached.service
echo "verify ok"
for doc in $(sed -n 's|^Documentation=||p' /etc/systemd/system/kvcached.service); do
    test -s "${doc#file://}" || { echo "Documentation= names $doc, which the install did not write"; exit 1; }
done
test "$(readlink /usr/local/bin/kvcached)" = /opt/kvcached/venv/bin/kvcached
id kvcached
# What systemd would make for the unit: RuntimeDirectory= and StateDirectory=, owned by the user.
install -d -m 0750 -o kvcached -g kvcached /run/kvcached
install -d -m 0710 -o kvcached -g kvcached /var/lib/kvcached
setpriv --reuid kvcached --regid kvcached --init-groups -- env -i PATH=/usr/bin:/bin /usr/local/bin/kvcached serve \
    --config /etc/kvcached/kvcached.toml --pool-bytes 64M --nvme-bytes 256M --metrics-addr off \
    > "$T/daemon.log" 2>&1 &
pid=$!
for i in $(seq 1 300); do
    [ -S /run/kvcached/kvcached.sock ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$T/daemon.log"; exit 1; }
    sleep 0.1
done
echo "== status"
env -i PATH=/usr/bin:/bin /usr/local/bin/kvcachectl status
/usr/local/bin/kvcached-router --help > /dev/null   # the router's console script runs from the venv too
stat -c %U /run/kvcached/kvcached.sock   # made by the daemon, as the user the installer created
ps -o user= -p "$pid"
kill -TERM "$pid"
wait "$pid" || true
echo "== uninstall"
./scripts/install --uninstall
test ! -e /opt/kvcached && test ! -e /etc/systemd/system/kvcached.service && test ! -e /usr/local/bin/kvcached
test -e /etc/kvcached/kvcached.toml && test -d /var/lib/kvcached
./scripts/install --uninstall --purge
test ! -e /etc/kvcached && test ! -e /var/lib/kvcached
echo "all ok"
"""


def test_install_verify_run_as_its_user_and_uninstall(tmp_path):
    require(os.geteuid() == 0, "needs root: it mounts overlays in a private mount namespace")
    for tool in ("unshare", "setpriv", "systemd-analyze", "systemd-sysusers"):
        require(shutil.which(tool), f"{tool} missing: scripts/test installs Debian's systemd and util-linux")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "VIRTUAL_ENV"))}
    env["REPO"] = REPO
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", SCRIPT, "install-test",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "all ok" in r.stdout, "\n".join(
        line for line in out.splitlines() if not line.startswith("WARNING: Location"))[-6000:]
    assert "verify ok" in r.stdout
    status = r.stdout.split("== status", 1)[1]
    assert "unix:/run/kvcached/kvcached.sock" in status or "/run/kvcached/kvcached.sock" in status, status
    assert any(line.strip() == "kvcached" for line in status.splitlines()), status  # ran as the installer's user
    assert "kept /etc/kvcached and /var/lib/kvcached" in r.stdout
    assert not os.path.exists("/opt/kvcached") and not os.path.exists("/etc/systemd/system/kvcached.service")
