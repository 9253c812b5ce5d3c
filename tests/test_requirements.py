"""tests/requirements.py: a missing requirement skips a test, except in CI, where it fails it."""

from __future__ import annotations

import pytest

from tests.requirements import require


def test_a_missing_requirement_skips_outside_ci(monkeypatch):
    for value in (None, "", "false", "1"):
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
            require(False, "no frobnicator")


def test_a_missing_requirement_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but this test cannot run: no frobnicator"):
        require(None, "no frobnicator")


def test_a_met_requirement_does_nothing(monkeypatch):
    for value in ("true", "false"):
        monkeypatch.setenv("CI", value)
        require("/usr/bin/frobnicate", "no frobnicator")
        require(True, "no frobnicator")
