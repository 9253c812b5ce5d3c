from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached.contract.socket_path import default_socket
from kvcached.settings import (
    DaemonSettings,
    SettingsError,
    default_state_dir,
    load_settings,
    parse_size,
)


def run(*args, env=None, prog="kvcached"):
    e = dict(os.environ)
    e.update(env or {})
    exe = os.path.join(os.path.dirname(sys.executable), prog)
    return subprocess.run([exe, *args], capture_output=True, text=True, env=e, timeout=120)


def test_selfcheck_on_embedded_defaults(tmp_path):
    r = run("selfcheck", env={"STATE_DIRECTORY": str(tmp_path / "state"), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "selfcheck: ok" in r.stdout
    assert os.path.exists(tmp_path / "state" / "hash.key")
    r2 = run("selfcheck", "--state-dir", str(tmp_path / "state"), "--pool-bytes", "1M", "--nvme-bytes", "0")
    assert r2.returncode == 0, r2.stderr
    assert "NVMe: disabled" in r2.stdout


def test_bad_flags_and_config_are_refused(tmp_path):
    assert run("serve", "--pool-bytes", "lots").returncode == 2  # a usage error (argparse)
    r = run("serve", "--device", "tpu", "--state-dir", str(tmp_path))
    assert r.returncode == 78 and "command line: device = 'tpu' is not allowed: auto, cpu" in r.stderr  # EX_CONFIG
    cfg = tmp_path / "k.toml"
    cfg.write_text('pool_bytes = "64M"\nbogus = 1\n')
    r = run("serve", "--config", str(cfg))
    assert r.returncode == 78 and f"{cfg}: unknown setting(s) bogus" in r.stderr


def test_kvcachectl_without_a_daemon_says_so(tmp_path):
    r = run("--socket", str(tmp_path / "none.sock"), "status", prog="kvcachectl")
    assert r.returncode == 3 and "not reachable" in r.stderr
    r = run("--socket", str(tmp_path / "none.sock"), "status", "--json", prog="kvcachectl")
    assert r.returncode == 3 and '"error"' in r.stdout


def test_keygen_writes_a_shared_key_file_and_serve_uses_it(tmp_path):
    key = tmp_path / "domain.key"
    r = run("keygen", str(key), prog="kvcachectl")
    assert r.returncode == 0, r.stderr
    assert oct(key.stat().st_mode & 0o777) == "0o600" and key.stat().st_size == 32
    before = key.read_bytes()
    r = run("keygen", str(key), prog="kvcachectl")
    assert r.returncode == 1 and "never replaced" in r.stderr and key.read_bytes() == before
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'hash_key_file = "{key}"\n')
    r = run("selfcheck", "--config", str(cfg), "--state-dir", str(tmp_path / "state"), "--pool-bytes", "1M",
            "--nvme-bytes", "0")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "state" / "hash.key").exists()  # the shared key, not one of its own
    key.chmod(0o644)
    r = run("serve", "--config", str(cfg), "--state-dir", str(tmp_path / "state"))
    assert r.returncode == 78 and "readable by others" in r.stderr  # refused before anything starts
    cfg.write_text(f'hash_key_file = "{tmp_path / "missing.key"}"\n')
    r = run("serve", "--config", str(cfg), "--state-dir", str(tmp_path / "state"))
    assert r.returncode == 78 and "kvcachectl keygen" in r.stderr


@pytest.mark.parametrize("text,want", [("0", 0), ("512", 512), ("4k", 4096), ("2M", 2 << 20), ("1.5G", 3 << 29),
                                       ("2GiB", 2 << 30), (123, 123)])
def test_parse_size(text, want):
    assert parse_size(text) == want


def test_default_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kvcached:/other")
    assert default_state_dir() == "/var/lib/kvcached"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("HOME", "/home/u")
    assert default_state_dir() == "/home/u/.local/state/kvcached"
    monkeypatch.setenv("KVCACHED_SOCKET", "/x.sock")
    assert default_socket() == "/x.sock"
    monkeypatch.delenv("KVCACHED_SOCKET")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/kvcached")
    assert default_socket() == "/run/kvcached/kvcached.sock"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket() == "/run/user/1000/kvcached.sock"
    # a host that runs the system service: every client finds its socket without a setting
    import kvcached.contract.socket_path as settings_mod

    monkeypatch.setattr(settings_mod, "SYSTEM_SOCKET", str(tmp_path / "run-kvcached.sock"))
    (tmp_path / "run-kvcached.sock").touch()
    assert default_socket() == str(tmp_path / "run-kvcached.sock")
    monkeypatch.setenv("KVCACHED_SOCKET", "/x.sock")  # still the first rule
    assert default_socket() == "/x.sock"
    monkeypatch.delenv("KVCACHED_SOCKET")
    (tmp_path / "run-kvcached.sock").unlink()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket() == f"/tmp/kvcached-{os.getuid()}/kvcached.sock"


def test_config_file_then_flags(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('pool_bytes = "64M"\nsocket_mode = "0600"\ncache_ttl = 10\nwrite_through = true\n'
                   'hash_memo_bytes = "8M"\n')
    s = load_settings(str(cfg), {"pool_bytes": 32 << 20, "nvme_bytes": None})
    assert s.pool_bytes == 32 << 20  # the flag wins
    assert s.socket_mode == 0o600 and s.cache_ttl == 10.0 and s.write_through is True
    assert s.nvme_bytes == 64 << 30  # untouched default
    sc = s.store_config()
    assert sc.pool_bytes == 32 << 20 and sc.write_through and sc.hash_memo_bytes == 8 << 20


@pytest.mark.parametrize(
    "toml,match",
    [('cache_ttl = "soon"', "cache_ttl = 'soon' is not allowed: a number"), ("write_through = 1", "true or false"),
     ('socket_mode = "rwx"', "an octal permission"), ('pool_bytes = "lots"', "a size >= 0"), ("[[x", "k.toml: not valid TOML"),
     ("report_gpu_hour_price = -1", "report_gpu_hour_price = -1 is not allowed: a price >= 0")],
)
def test_bad_config_values(tmp_path, toml, match):
    cfg = tmp_path / "k.toml"
    cfg.write_text(toml + "\n")
    with pytest.raises(SettingsError, match=match):
        load_settings(str(cfg))


def test_report_prices_in_the_config_file_are_read_by_kvcachectl_and_ignored_by_the_daemon(tmp_path):
    plain, priced = tmp_path / "plain.toml", tmp_path / "priced.toml"
    plain.write_text('pool_bytes = "64M"\n')
    priced.write_text('pool_bytes = "64M"\nreport_gpu_hour_price = 2\nreport_prefill_tokens_per_s = 12000.5\n')
    s = load_settings(str(priced))
    assert (s.report_gpu_hour_price, s.report_prefill_tokens_per_s) == (2.0, 12000.5)
    assert load_settings(str(plain)).report_gpu_hour_price == 0.0  # not stated
    assert s.store_config() == load_settings(str(plain)).store_config()


def test_tcp_needs_tls_unless_loopback_or_allowed():
    base = dict(socket="/x", state_dir="/y")
    with pytest.raises(SettingsError, match="refusing plain TCP"):
        DaemonSettings(**base, tcp_listen="0.0.0.0:5000")
    DaemonSettings(**base, tcp_listen="127.0.0.1:5000")
    DaemonSettings(**base, tcp_listen="[::1]:5000")
    DaemonSettings(**base, tcp_listen="0.0.0.0:5000", allow_insecure_tcp=True)
    DaemonSettings(**base, tcp_listen="0.0.0.0:5000", tls_cert="c.pem", tls_key="k.pem")
    with pytest.raises(SettingsError, match="go together"):
        DaemonSettings(**base, tcp_listen="127.0.0.1:5000", tls_cert="c.pem")
