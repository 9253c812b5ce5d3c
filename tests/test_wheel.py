"""The project's wheel: built with the command docs/operations.md prints, it holds the daemon, the
client and the router (stubs and dashboard included), and installed into a venv of its own it
gives the three console scripts, which start the daemon and talk to it.

The new venv sees the dependencies of this test's venv through a site directory (a .pth line),
not the checkout: the editable install's finder comes after the venv's own site-packages, and the
test checks that ``kvcached`` is imported from the wheel. What the dependencies themselves must
be is tests/test_wheelset.py's job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: The build command as docs/operations.md prints it (checked below), run from the checkout.
BUILD = ".venv/bin/pip wheel --no-deps --no-build-isolation -w dist ."


def test_the_documented_build_command_is_the_one_tested():
    assert f"`{BUILD}`" in (ROOT / "docs" / "operations.md").read_text() or BUILD in (
        ROOT / "docs" / "operations.md").read_text()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), "."]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("kvcached_sidecar-*.whl")
    return whl


def test_the_wheel_holds_every_package_and_the_console_scripts(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("kvcached/daemon.py", "kvcached/v1/kvcached_pb2.py", "kvcached/dashboards/kvcached.json",
                 "kvcached/tiers/packed.py", "kvcached_client/client.py", "kvcached_client/vllm/connector.py",
                 "kvcached_router/server.py", "kvcachectl/__init__.py", "kvcachectl/doctor.py",
                 "kvcached/contract/keys.py", "kvcached/contract/poolmap.py"):
        assert must in names, must
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    assert set(re.findall(r"^(kvcached|kvcachectl|kvcached-router) =", scripts, re.M)) == {"kvcached", "kvcachectl",
                                                                                "kvcached-router"}


def test_installed_from_the_wheel_the_daemon_runs_and_answers(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                        "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCACHED_SOCKET", "VIRTUAL_ENV")}
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import kvcached, kvcached_client, kvcached_router; print(kvcached.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert where.returncode == 0 and where.stdout.startswith(site), where.stdout + where.stderr
    sock = tmp_path / "kv.sock"
    daemon = subprocess.Popen([str(venv / "bin" / "kvcached"), "serve", "--socket", str(sock), "--state-dir",
                               str(tmp_path / "state"), "--device", "cpu", "--pool-bytes", "4M", "--nvme-bytes", "64M",
                               "--metrics-addr", "off"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        status = subprocess.run([str(venv / "bin" / "kvcachectl"), "--socket", str(sock), "status"],
                                capture_output=True, text=True, env=env, timeout=60)
        assert status.returncode == 0 and "up, kvcached" in status.stdout, status.stdout + status.stderr
        router = subprocess.run([str(venv / "bin" / "kvcached-router"), "--help"], capture_output=True, text=True,
                                env=env, timeout=60)
        assert router.returncode == 0 and "usage" in router.stdout.lower(), router.stderr
    finally:
        daemon.terminate()
        out, _ = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, out
