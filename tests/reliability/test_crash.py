"""Daemon crash: SIGKILL the daemon at random moments under a put/acquire load from several
client processes, restart it each time, and check the durability contract (stated in full in
``bench/harness/crash.py``, which holds the workers and the driver, :class:`CrashLoop`; shared with
``bench/crash_loop.py``, which runs the long version, >= 20 kills).

One daemon serves two trust domains, so one SIGKILL hits both durability modes at once:
``default`` is write-back and ``wt`` is write-through.
"""

from __future__ import annotations

import signal

from bench.harness.crash import CrashLoop, assert_contract


def test_sigkill_under_load_loses_no_durable_chunk_and_serves_no_corrupt_one(tmp_path):
    loop = CrashLoop(str(tmp_path), workers=3, kills=5, seed=7, load_s=(0.6, 1.4), down_s=(0.2, 0.5),
                     bytes_sample=100, log=print)
    r = loop.run()
    print({k: v for k, v in r.items() if k not in ("restarts", "recovery_s", "index_checks")})
    assert_contract(r)
    assert r["kills"] == 5 and len(r["index_checks"]) == 3  # kills 1, 3 and the last restart with workers paused
    # The load was real in both modes, and what was durable was checked byte for byte at the end.
    final = r["restarts"][-1]["durable"]
    assert r["chunks_written"] >= 100 and r["chunks_read_by_workers"] >= 100, r["counters"]
    assert final["unique_durable_chunks"] >= 50 and final["bytes_checked_chunks"] >= final["found_chunks"], final
    assert r["counters"]["batches_durable"] >= 1 and r["counters"]["held_rechecked"] >= 1, r["counters"]
    # Clients came back on their own, fast (gRPC's default reconnect backoff alone took seconds).
    # The median is the regression check; the max only bounds one slow outlier on a busy 2-core box.
    assert r["recovery_median_s"] < 1.5 and r["recovery_max_s"] < 10.0, r["recovery_s"]


def test_a_direct_nvme_reader_keeps_working_across_restarts_as_the_file_grows(make_daemon):
    """The same client reads NVMe chunks straight from the LMDB file before and after SIGKILL +
    restart, with the file grown by more than py-lmdb's default 10 MiB map in between."""
    import torch
    from kvcached.contract.keys import KVLayout
    from kvcached_client import Client

    fat = KVLayout("test/crash-fat@1", num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", chunk_tokens=16)
    d = make_daemon(pool_bytes="2M", nvme_bytes="256M")  # 16 blocks of one chunk
    a = torch.randn(2, 4, 4, 2 * 16, 64)
    with Client(d.socket, nvme_read="direct") as c:
        c.put(fat, list(range(32)), a)
        c.flush()
        d.stop(signal.SIGKILL)
        d.start()  # everything is on NVMe only now
        with c.acquire(fat, list(range(32))) as lease:  # the client opens the LMDB file: ~0.5 MiB
            assert lease.matched_tokens == 32 and torch.equal(lease.kv(), a)
        for k in range(1, 121):  # 120 x 128 KiB more, demoted/flushed to NVMe
            c.put(fat, [100_000 * k + i for i in range(16)], torch.zeros(2, 4, 4, 16, 64))
        c.flush()
        assert c.stats()["nvme"]["file_bytes"] > 12 << 20
        d.stop(signal.SIGKILL)
        d.start()
        with c.acquire(fat, list(range(32))) as lease:
            assert lease.matched_tokens == 32 and torch.equal(lease.kv(), a)
