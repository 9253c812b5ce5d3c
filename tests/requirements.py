"""What a test needs from the machine (root, a CLI tool), checked in one place.

On a developer's box a missing requirement skips the test, with the reason. In CI
(``CI=true``, which ``.ci/run`` exports) it fails instead: CI is set up to have all of them
(``scripts/test`` installs the tools), so a skip there would only hide that a check never ran.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def require(condition: object, reason: str) -> None:
    """Skip the calling test (fail it in CI) unless ``condition`` holds. Call it from a test or a
    fixture, not at import time."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI=true but this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def require_redis() -> None:
    """Skip (fail in CI) unless redis-py, redis-server and redis-cli are all here (the servers'
    processes: ``bench.harness.redis_servers``)."""
    from bench.harness.redis_servers import missing

    why = missing()
    require(why is None, why or "")
