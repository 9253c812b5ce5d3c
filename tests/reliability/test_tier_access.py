"""Tier files follow the domain socket's access, and the filesystem enforces it.

A client allowed on a domain's socket (its group) must be able to map that domain's pool and
read its NVMe tier directly; anyone else must be refused by the kernel, not by the daemon's
good will. The clients here start as root, import everything, then drop to ``nobody`` (with or
without the socket's group) before touching the daemon, so every check is a real permission
check at connect/open/mmap time.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from kvcached_client import Client
from bench.harness.daemon import Daemon
from tests.reliability.conftest import LAYOUT
from tests.requirements import require

CT = LAYOUT.chunk_tokens
GROUP = "daemon"  # a system group every Debian host has; the test makes nobody a member or not


@pytest.fixture(autouse=True)
def as_root() -> None:
    require(os.geteuid() == 0, "switching to another user needs root (CI runs as root)")


CHILD = r"""
import json, os, sys
import torch
from kvcached_client import Client
from kvcached_client.errors import KvcachedError
from tests.reliability.conftest import LAYOUT

sock, nvme_dir, shm, with_group = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
os.setgroups([int(sys.argv[5])] if with_group else [])
os.setgid(65534)
os.setuid(65534)  # nobody, from here on
out = {}

def attempt(name, fn):
    try:
        out[name] = fn()
    except PermissionError as e:
        out[name] = "EACCES"
    except KvcachedError as e:
        out[name] = f"{e.code.name}"

def read_pool():
    with open(shm, "rb") as f:
        return len(f.read(4096))

def read_nvme():
    with open(os.path.join(nvme_dir, "data.mdb"), "rb") as f:
        return len(f.read(4096))

def acquire(mode):
    with Client(sock, nvme_read=mode, timeout=5) as c:
        toks = list(range(3 * LAYOUT.chunk_tokens))
        with c.acquire(LAYOUT, toks) as lease:
            return [lease.matched_tokens, lease.kv().sum().item()]

attempt("shm", read_pool)
attempt("nvme_file", read_nvme)
attempt("pool_read", lambda: acquire("promote"))
print(json.dumps(out))
"""


@pytest.fixture
def shared_root():
    """A root directory others may traverse (pytest's tmp_path is 0700)."""
    root = tempfile.mkdtemp(prefix="kvcached-access-")
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _child(d: Daemon, shm: str, with_group: bool) -> dict:
    nvme_dir = os.path.join(d.state_dir, "nvme", "default")
    gid = grp.getgrnam(GROUP).gr_gid
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", CHILD, d.socket, nvme_dir, shm, "1" if with_group else "0", str(gid)],
                       capture_output=True, text=True, timeout=120, cwd=repo)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tier_files_grant_exactly_the_socket_group(shared_root):
    d = Daemon(shared_root, socket_group=GROUP, socket_mode="0660").start()
    try:
        kv = torch.randn(2, 2, 2, 3 * CT, 8)
        toks = list(range(3 * CT))
        with Client(d.socket) as c:
            assert c.put(LAYOUT, toks, kv).stored_chunks == 3
            assert c.flush() == 3  # on NVMe too
            shm = os.path.join("/dev/shm", c.pool_handle().name)
        gid = grp.getgrnam(GROUP).gr_gid
        nvme_dir = os.path.join(d.state_dir, "nvme", "default")
        expected = {
            d.socket: 0o660, shm: 0o660, nvme_dir: 0o750,
            os.path.join(nvme_dir, "data.mdb"): 0o640, os.path.join(nvme_dir, "lock.mdb"): 0o660,
        }
        for path, mode in expected.items():
            st = os.stat(path)
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, gid), path
        assert stat.S_IMODE(os.stat(os.path.join(d.state_dir, "hash.key")).st_mode) == 0o600  # the key stays private
        assert stat.S_IMODE(os.stat(d.state_dir).st_mode) & 0o077 == 0o011  # enter, not list

        member = _child(d, shm, with_group=True)
        assert member["shm"] == 4096 and member["nvme_file"] == 4096
        assert member["pool_read"] == [3 * CT, pytest.approx(kv.sum().item(), rel=1e-5)]

        stranger = _child(d, shm, with_group=False)
        assert stranger == {"shm": "EACCES", "nvme_file": "EACCES", "pool_read": "UNAVAILABLE"}
    finally:
        d.stop(signal.SIGKILL)


def test_a_private_socket_keeps_the_tier_files_private(shared_root):
    d = Daemon(shared_root, socket_mode="0600").start()
    try:
        with Client(d.socket) as c:
            shm = os.path.join("/dev/shm", c.pool_handle().name)
        nvme_dir = os.path.join(d.state_dir, "nvme", "default")
        for path in (shm, nvme_dir, os.path.join(nvme_dir, "data.mdb"), os.path.join(nvme_dir, "lock.mdb")):
            assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, path
        assert _child(d, shm, with_group=True) == {"shm": "EACCES", "nvme_file": "EACCES", "pool_read": "UNAVAILABLE"}
    finally:
        d.stop(signal.SIGKILL)
