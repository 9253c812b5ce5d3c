"""The code is lint-clean: ruff, with the rules pyproject.toml selects (pyflakes: unused and
undefined names, repeated keys; pycodestyle: layout, line length in the shipped packages)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
