"""pyproject.toml promises Python >= 3.10, whose standard library has no ``tomllib`` (3.11 added
it; ``tomli`` is the same parser, a dependency on 3.10). This machine runs 3.11 only, so a child
interpreter is made to look like 3.10 for the code that asks: ``sys.version_info`` reads 3.10,
``import tomllib`` fails, and ``tomli`` is importable. Every package then has to import (the client
first: ``from kvcached_client import Client`` once failed on 3.10) and read TOML through tomli."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import sys
    import tomllib as _parser
    sys.modules["tomli"] = _parser  # what "pip install tomli" gives 3.10
    sys.modules["tomllib"] = None  # import tomllib -> ModuleNotFoundError, as on 3.10
    sys.version_info = (3, 10, 14, "final", 0)

    from kvcached_client import AsyncClient, Client  # noqa: F401
    import kvcached.settings as settings
    import kvcached.daemon  # noqa: F401
    import kvcached.cli  # noqa: F401
    import kvcached_router.config as router_config

    assert settings.tomllib is _parser and router_config.tomllib is _parser
    cfg, router = sys.argv[1], sys.argv[2]
    s = settings.load_settings(cfg)
    assert s.pool_bytes == 64 << 20, s.pool_bytes
    try:
        settings.load_settings(router)  # not this file's keys: refused, through tomli's own error path
    except settings.SettingsError:
        pass
    else:
        raise AssertionError("unknown keys were accepted")
    with open(router, "w") as f:
        f.write("listen = [broken")
    try:
        router_config.load_config(router)
    except router_config.RouterConfigError as e:
        assert "TOML" in str(e) or "Invalid" in str(e) or "Expected" in str(e) or router in str(e), e
    else:
        raise AssertionError("broken TOML was accepted")
    print("ok")
    """
)


def test_the_packages_import_and_read_toml_without_tomllib(tmp_path):
    cfg = tmp_path / "kvcached.toml"
    cfg.write_text('pool_bytes = "64M"\n')
    router = tmp_path / "router.toml"
    router.write_text('policy = "cache"\n')
    r = subprocess.run([sys.executable, "-c", CHILD, str(cfg), str(router)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
