"""scripts/wheelset.py: the wheel set made from pyproject's own metadata is enough to run the daemon.

The same code scripts/gpu-check uses for the offline GPU machine builds a wheel set for this
machine's python (downloaded through pip's configured index, cached in build/wheelset-test and
reused while the requirement list is unchanged), installs it into a fresh venv that sees nothing
else, starts the real daemon from there, asks it for its status and stops it. A runtime dependency
missing from pyproject.toml (or from the wheel set) makes the start fail: the control below drops
xxhash and checks exactly that, so this test can fail.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from tests.requirements import require

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")
CACHE = os.path.join(REPO, "build", "wheelset-test")

_spec = importlib.util.spec_from_file_location("wheelset", os.path.join(SCRIPTS, "wheelset.py"))
wheelset = importlib.util.module_from_spec(_spec)
sys.modules["wheelset"] = wheelset
_spec.loader.exec_module(wheelset)

PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
MACHINE = platform.machine()
#: What pip prints when no index can be reached (then the test skips, or fails in CI).
NO_NETWORK = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
              "Name or service not known", "ConnectTimeout", "ProxyError", "Network is unreachable")


def clean_env() -> dict[str, str]:
    """This process's environment without anything that would show the venv other packages."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")
           and not k.startswith("KVCACHED_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel_set() -> tuple[str, list[str]]:
    """(a folder of wheels for this python made by wheelset.download, the requirement list)."""
    reqs = wheelset.requirements()
    where = f"cp{PYTHON.replace('.', '')}-{MACHINE}"
    folder = os.path.join(CACHE, where)
    key = hashlib.sha256(json.dumps([reqs, PYTHON, MACHINE, wheelset.platforms(MACHINE)]).encode()).hexdigest()
    stamp = os.path.join(folder, ".key")
    try:
        with open(stamp) as f:
            cached = f.read() == key
    except OSError:
        cached = False
    if cached:  # the same list for the same target as last time: check the folder still covers it
        problems = wheelset.plan(reqs, folder, wheelset.target(PYTHON, MACHINE), installed=False).problems
        cached = not problems
    if not cached:  # into a folder of its own, then renamed: a second pytest process may be at it too
        fresh = f"{folder}.{os.getpid()}"
        shutil.rmtree(fresh, ignore_errors=True)
        try:
            wheelset.download(fresh, reqs, python=PYTHON, machine=MACHINE)
        except RuntimeError as e:
            shutil.rmtree(fresh, ignore_errors=True)
            output = getattr(e, "output", "")
            require(not any(s in output for s in NO_NETWORK), f"no package index reachable to download wheels: {e}")
            raise
        with open(os.path.join(fresh, ".key"), "w") as f:
            f.write(key)
        shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(fresh, folder)
        except OSError:  # another one got there first; this one is as good
            return fresh, reqs
    return folder, reqs


@pytest.fixture(scope="module")
def torch_site(tmp_path_factory) -> str:
    """A site directory holding only torch and what torch itself requires, symlinked from this
    interpreter's environment. torch is the one exception to "only from the wheel set": it is
    huge, pyproject deliberately leaves it out, and the GPU machine's python has it (with its own
    requirements) already; scripts/gpu-check's venv sees it through a site.addsitedir line in a
    .pth, and so does this test's, pointed here and not at the whole of .venv, which has every
    requirement installed and would hide a missing one. What torch requires (typing-extensions,
    setuptools, sympy, ...) comes along, as it does on that machine; the download step checks
    that the wheel set covers everything by itself anyway."""
    from importlib import metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dest = str(tmp_path_factory.mktemp("torch-site"))
    todo, seen = ["torch"], set()
    require(importlib.util.find_spec("torch") is not None, "torch is not installed in the test's python")
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:  # an optional one torch's metadata names but this install lacks
            continue
        root = str(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not os.path.lexists(os.path.join(dest, top)):
                os.symlink(os.path.join(root, top), os.path.join(dest, top))
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return dest


def venv_from_wheels(root: str, wheels: str, reqs: list[str], torch_site: str) -> str:
    """A venv made and filled the way scripts/gpu-check does on the GPU machine (wheelset.make_venv,
    then wheelset.install run by the venv's python: pip install --no-index --find-links WHEELS of
    what is missing); returns its bin folder."""
    python, purelib = wheelset.make_venv(os.path.join(root, "venv"), [torch_site])
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import wheelset; "
            "sys.exit(wheelset.install(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), pip=sys.argv[5]))")
    r = subprocess.run([python, "-c", code, SCRIPTS, wheels, purelib, json.dumps(reqs), sys.executable],
                       capture_output=True, text=True, env=clean_env(), timeout=300)
    assert r.returncode == 0, f"installing from the wheel set failed:\n{r.stdout}{r.stderr}"
    # And again in a new process, without the wheels: all of it is installed (wheelset.install
    # checks after installing, but in the process that may have borrowed packaging from the set).
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import wheelset; "
            "sys.exit(1 if wheelset.check(json.loads(sys.argv[2])).problems else 0)")
    r = subprocess.run([python, "-c", code, SCRIPTS, json.dumps(reqs)], capture_output=True, text=True,
                       env=clean_env(), timeout=60)
    assert r.returncode == 0, f"not all installed:\n{r.stdout}{r.stderr}"
    return os.path.dirname(python)


def start_daemon(bin_dir: str, root: str, sock_dir: str) -> tuple[subprocess.Popen, list[str], bool]:
    """Start ``kvcached serve`` from ``bin_dir``; wait for its startup announcement or its exit.
    Returns (the process, its output so far, whether it announced itself)."""
    config = os.path.join(root, "kvcached.toml")
    open(config, "w").close()  # no /etc/kvcached/kvcached.toml
    proc = subprocess.Popen(
        [os.path.join(bin_dir, "kvcached"), "serve", "--config", config, "--socket", os.path.join(sock_dir, "kv.sock"),
         "--state-dir", os.path.join(root, "state"), "--device", "cpu", "--pool-bytes", "4M", "--nvme-bytes", "64M",
         "--metrics-addr", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env())
    output: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if line.startswith("  layouts:"):  # the last line of the startup announcement
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    for _ in range(1200):
        if ready.wait(0.05) or proc.poll() is not None:
            break
    return proc, output, ready.is_set()


@pytest.mark.parametrize("drop", [None, "xxhash"], ids=["complete", "control-without-xxhash"])
def test_the_daemon_runs_from_the_wheel_set_alone(wheel_set, torch_site, tmp_path, drop):
    wheels, reqs = wheel_set
    if drop is not None:
        # The control: the list as it would be had pyproject forgotten one runtime dependency,
        # and the wheel set downloaded from that list (nothing else requires xxhash, which the
        # check below confirms: the set still covers the shortened list).
        reqs = [r for r in reqs if wheelset.canonicalize_name(wheelset.Requirement(r).name) != drop]
        assert len(reqs) == len(wheel_set[1]) - 1
        short = tmp_path / "wheels"
        short.mkdir()
        for f in os.listdir(wheels):
            if f.endswith(".whl") and not f.startswith(drop + "-"):
                os.symlink(os.path.join(wheels, f), short / f)
        wheels = str(short)
        assert not wheelset.plan(reqs, wheels, wheelset.target(PYTHON, MACHINE), installed=False).problems
    bin_dir = venv_from_wheels(str(tmp_path), wheels, reqs, torch_site)
    seen = subprocess.run(
        [os.path.join(bin_dir, "python"), "-c",
         "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None "
         "for m in ('torch', 'kvcached', 'xxhash', 'hypothesis')}))"],
        capture_output=True, text=True, env=clean_env(), check=True)
    # torch through its own site directory, kvcached from the checkout, and nothing else of .venv
    # (hypothesis is installed there but is no runtime requirement).
    assert json.loads(seen.stdout) == {"torch": True, "kvcached": True, "xxhash": drop is None, "hypothesis": False}

    sock_dir = tempfile.mkdtemp(prefix="kvws-")  # short: a Unix socket path has at most 107 bytes
    proc = None
    try:
        proc, output, announced = start_daemon(bin_dir, str(tmp_path), sock_dir)
        if drop is not None:
            assert not announced, "the daemon started without " + drop + ":\n" + "".join(output)
            rc = proc.wait(30)
            assert rc != 0 and f"No module named '{drop}'" in "".join(output), "".join(output)
            return
        assert announced, f"the daemon did not start (exit {proc.poll()}):\n" + "".join(output)
        st = subprocess.run([os.path.join(bin_dir, "kvcachectl"), "--socket", os.path.join(sock_dir, "kv.sock"),
                             "status", "--json"], capture_output=True, text=True, env=clean_env(), timeout=60)
        assert st.returncode == 0, st.stdout + st.stderr
        assert json.loads(st.stdout)["up"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(output)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
