"""The one daemon harness (bench/harness/daemon.py), as the benches use it: ``Daemon.temp``."""

from __future__ import annotations

import os
import signal

from bench.harness.daemon import Daemon, pool_segments
from kvcached_client import Client


def test_a_temp_daemon_runs_on_its_settings_only_and_leaves_nothing(tmp_path):
    d = Daemon.temp({"device": "cpu", "pool_bytes": "8M", "nvme_bytes": 0, "log_level": "warning"},
                    prefix="kvc-test-harness-")
    assert "expire_interval" not in d.settings
    b_sock = os.path.join(d.root, "b.sock")
    d.settings["domains"] = {"b": {"pool_bytes": "4M", "socket": b_sock}}
    with d:
        # start() returned after both domains announced themselves: both answer at once
        with Client(d.socket) as a, Client(b_sock) as b:
            assert a.stats()["pool"]["capacity_bytes"] == 8 << 20
            assert b.stats()["pool"]["capacity_bytes"] == 4 << 20
        assert len(d.segments) == 2 and d.segments <= pool_segments(d.proc.pid)
        assert "[domains.b]" in open(d.config).read()
    assert d.exit_code == 0 and d.proc is None  # a clean SIGTERM stop
    assert not os.path.exists(d.root)
    assert not d.segments & pool_segments()  # it removed its own


def test_a_killed_daemons_segments_are_unlinked_and_stop_is_idempotent(tmp_path):
    d = Daemon(str(tmp_path)).start()
    segments = set(d.segments)
    assert segments and segments <= pool_segments()
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    assert not segments & pool_segments()  # nothing in the process could unlink them: the harness did
    assert d.stop() == -signal.SIGKILL and d.exit_code == -signal.SIGKILL
    assert os.path.isdir(tmp_path)  # a root the caller gave is the caller's
