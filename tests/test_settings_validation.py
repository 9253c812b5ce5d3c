"""Every setting's bad values are refused at load with one line that names the file, the key, the
value and what is allowed; the daemon exits 78 (EX_CONFIG) on them, ``--check-config`` says so
without starting, and a reload with a bad value keeps the running settings.

The table below is written by hand, key by key, from the settings' documented meaning, not from
the code's rules; a setting added without a row here fails ``test_every_setting_has_a_row``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcached.settings import DaemonSettings, SettingsError, load_settings

# key -> bad values: a wrong type first, then values out of range or unknown. None: free text or a
# path whose problems show only when it is used (a socket that cannot be bound, a file that is missing).
BAD: dict[str, list[object] | None] = {
    "socket": [5, ""],
    "state_dir": [True, "  "],
    "socket_mode": [True, "rwx", "999", 0o1777],
    "socket_owner": [5],
    "socket_group": [5, "no-such-group-kvc"],
    "device": [0, "tpu", "cuda:x", "gpu", "cuda:0,", "cuda:,1"],
    "domain": [1, "", "a/b", "x" * 65],
    "hash_key_file": [1, "/nonexistent/kvc.key"],
    "pool_bytes": [[1], "lots", -1, 32],
    "pool_slabs": ["two", 0, 65, 1.5],
    "pool_block_bytes": [{}, "x"],
    "nvme_bytes": [[], "big", -5],
    "nvme_map_bytes": [[], "huge"],
    "write_through": [1, "yes"],
    "trust_client_keys": [1, "yes"],
    "cache_ttl": ["soon", -5, 0],
    "lease_ttl": ["x", 0, -1.5],
    "reservation_ttl": [[], 0],
    "prefetch_distance": [1.5, -1, 1025],
    "max_prompt_tokens": ["many", 0],
    "hash_memo_bytes": [True, "8 megs"],
    "bypass_generation_tokens": ["x", -1],
    "max_sessions": ["x", 0, -1],
    "max_leases_per_session": [2.5, 0],
    "max_reservations_per_session": ["1", 0],
    "writeback": [0, "on"],
    "writeback_low": ["low", -0.1, 1.0, 0.5],  # 0.5: above the default writeback_high (0.10)
    "writeback_high": ["high", 1.5, 0.01],  # 0.01: below the default writeback_low (0.08)
    "writeback_batch_bytes": [True, 0],
    "writeback_wait": ["x", -1],
    "eviction_policy": [1, "lfu", "LRU"],
    "eviction_weight": ["x", -1, 1001],
    "eviction_memory_chunks": [1.0, 1000, 3000, 1 << 29],
    "eviction_admission": [1, "never"],
    "remote_nodes": [7],
    "remote_cluster": ["true"],
    "remote_username": [1],
    "remote_password_file": [1],
    "remote_ttl": ["x", -1],
    "remote_timeout": ["x", 0],
    "remote_write": [1, "sync"],
    "remote_queue_chunks": [1.5, 0],
    "remote_queue_bytes": [False, 0],
    "remote_tls": ["no"],
    "remote_tls_ca": [3],
    "kv_events_endpoint": [3, "http://example"],
    "kv_events_replay_endpoint": [3, "tcp://127.0.0.1:5999"],  # needs kv_events_endpoint
    "kv_events_topic": [3],
    "kv_events_buffer_batches": ["x", 0],
    "kv_events_allow_remote": [1],
    "metrics_addr": [9464],
    "tcp_listen": [5000, "0.0.0.0:5000"],  # plain TCP off loopback without TLS
    "tls_cert": [1],
    "tls_key": [1],
    "allow_insecure_tcp": ["yes"],
    "max_message_bytes": ["x", 1024],
    "call_timeout": ["x", 0],
    "expire_interval": ["x", -1],
    "worker_threads": [1.0, 0],
    "log_level": [3, "verbose"],
    "report_gpu_hour_price": ["x", -1],
    "report_prefill_tokens_per_s": ["x", -0.5],
}

GOOD: dict[str, object] = {"cache_ttl": 60, "eviction_policy": "lru", "pool_bytes": "2M", "writeback_low": 0.05,
                           "socket_mode": "0600", "device": "cpu", "log_level": "WARNING", "prefetch_distance": 0}


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, dict)):
        return "[]" if isinstance(v, list) and not v else ("[1]" if isinstance(v, list) else "{}")
    return repr(v)


def write(tmp_path, key: str, value: object) -> str:
    path = tmp_path / "kvcached.toml"
    base = {"socket": str(tmp_path / "kv.sock"), "state_dir": str(tmp_path / "state")}
    base[key] = value
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in base.items()))
    return str(path)


def test_every_setting_has_a_row():
    keys = {f.name for f in dataclasses.fields(DaemonSettings)} - {"extra_domains"}
    assert keys == set(BAD), f"missing: {sorted(keys - set(BAD))}; unknown: {sorted(set(BAD) - keys)}"


CASES = [(k, v) for k, vs in BAD.items() for v in (vs or [])]


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v!r}"[:60] for k, v in CASES])
def test_a_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, key, value):
    path = write(tmp_path, key, value)
    with pytest.raises(SettingsError) as e:
        load_settings(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    assert key in msg, msg


@pytest.mark.parametrize("key,value", [("cache_ttl", -5), ("eviction_policy", "lfu"), ("prefetch_distance", 1025),
                                       ("writeback_low", -0.1), ("max_sessions", -1), ("device", "tpu")])
def test_the_message_shows_the_value_and_what_is_allowed(tmp_path, key, value):
    with pytest.raises(SettingsError, match=r"is not allowed: .+") as e:
        load_settings(write(tmp_path, key, value))
    assert f"{key} = {value!r}" in str(e.value)


def test_good_values_load(tmp_path):
    for key, value in GOOD.items():
        s = load_settings(write(tmp_path, key, value))
        assert getattr(s, key) is not None


def test_a_domain_table_names_its_domain(tmp_path):
    path = tmp_path / "kvcached.toml"
    path.write_text(f'socket = "{tmp_path}/a.sock"\nstate_dir = "{tmp_path}/s"\n'
                    f'[domains.b]\nsocket = "{tmp_path}/b.sock"\nlease_ttl = 0\n')
    with pytest.raises(SettingsError, match=r"\[domains\.b\] lease_ttl = 0 is not allowed"):
        load_settings(str(path))


def kvcached(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "kvcached")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def test_the_daemon_exits_78_with_one_line_and_check_config_says_so_without_starting(tmp_path):
    bad = write(tmp_path, "writeback_low", 0.5)
    r = kvcached("serve", "--config", bad)
    assert r.returncode == 78, r
    lines = r.stderr.strip().splitlines()
    assert lines == [f"kvcached: {bad}: writeback_low = 0.5 is above writeback_high = 0.1: "
                     "0 <= writeback_low <= writeback_high < 1"], r.stderr
    r = kvcached("serve", "--config", bad, "--check-config")
    assert r.returncode == 78 and "writeback_low" in r.stderr
    good = write(tmp_path, "cache_ttl", 60)
    r = kvcached("serve", "--config", good, "--check-config")
    assert r.returncode == 0 and "configuration OK" in r.stdout, r
    assert not os.path.exists(tmp_path / "kv.sock") and not os.path.exists(tmp_path / "state")  # nothing started


def test_a_reload_with_a_bad_value_keeps_the_running_settings(make_daemon):
    from kvcached_client import Client

    d = make_daemon(lease_ttl=30.0)
    d.settings["lease_ttl"] = 0  # bad
    d.settings["eviction_weight"] = 2.5  # good, but the file as a whole is refused
    d.write_config()
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reload refused" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = d.log()
    assert "reload refused, keeping the running settings" in log and "lease_ttl = 0 is not allowed" in log, log[-2000:]
    assert "Traceback" not in log and "never retrieved" not in log
    assert d.proc.poll() is None
    with Client(d.socket) as c:
        assert c.stats()["eviction"]["weight"] != 2.5  # nothing of the refused file applied
        c.ping()
