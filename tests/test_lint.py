"""The code is lint-clean: ruff, with the rules pyproject.toml selects (pyflakes: unused and
undefined names, repeated keys; pycodestyle: layout, line length in the shipped packages), and
the daemon package, the client package (its vLLM and SGLang glue included) and the router
type-check with mypy on the oldest and the newest supported Python."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff() -> str:
    path = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert path, "ruff is not installed: it is in the test extra (./scripts/setup installs it)"
    return path


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_ruff_finds_nothing():
    r = check(".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_configured_rules_catch_what_they_are_for(tmp_path):
    """The check above cannot pass by checking nothing: the same configuration refuses a file
    with an unused import, an undefined name and a repeated key."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return {'a': 1, 'a': 2}[undefined]\n")
    r = check("--config", os.path.join(ROOT, "pyproject.toml"), str(bad))
    assert r.returncode == 1
    assert {"F401", "F601", "F821"} <= {w for line in r.stdout.splitlines() for w in line.split() if w[:1] == "F"}


OLDEST_AND_NEWEST = ("3.10", "3.13")


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", os.devnull,
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


#: Every shipped package: the daemon, the client (with the vLLM connector, checked against vLLM's
#: own types where vLLM is installed, as scripts/setup does for the tests) and the router.
CHECKED = ("kvcached", "kvcached_client", "kvcached_router", "kvcachectl")


@pytest.mark.slow
@pytest.mark.parametrize("python", OLDEST_AND_NEWEST)
def test_mypy_finds_nothing_in_the_shipped_packages(python):
    r = mypy("--python-version", python, *[a for p in CHECKED for a in ("-p", p)])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_catches_a_wrong_id_type(tmp_path):
    """The check above cannot pass by checking nothing: with the same configuration, a plain
    string where the store wants a layout id (a NewType) is an error."""
    bad = tmp_path / "bad.py"
    bad.write_text("from kvcached.store import Store\n\n\ndef f(s: Store, lid: str) -> None:\n"
                   "    s.lookup(lid, b'')\n")
    r = mypy("--config-file", os.path.join(ROOT, "pyproject.toml"), str(bad))
    assert r.returncode == 1 and 'incompatible type "str"; expected "LayoutId"' in r.stdout, r.stdout
