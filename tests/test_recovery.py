"""Restart, crash and corruption: the NVMe tier and the rebuilt index."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import lmdb
import pytest

from kvcached.config import StoreConfig
from kvcached.contract.errors import StoreLocked
from kvcached.contract.locations import TierId
from kvcached.store import Store
from kvcached.contract.record import HEADER_SIZE
from tests.conftest import TINY, payload, prompt

CT = TINY.chunk_tokens


def config(state_dir: str, **kw) -> StoreConfig:
    base = dict(
        state_dir=state_dir,
        pool_bytes=TINY.chunk_bytes * 64,
        nvme_bytes=(TINY.chunk_bytes + HEADER_SIZE) * 4096,
    )
    base.update(kw)
    return StoreConfig(**base)


def lmdb_keys(state_dir: str, domain: str = "default") -> set[bytes]:
    env = lmdb.open(os.path.join(state_dir, "nvme", domain), max_dbs=4, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        keys = {bytes(k) for k, _ in txn.cursor()}
    env.close()
    return keys


def test_restart_finds_every_flushed_chunk_with_identical_bytes(tmp_path):
    d = str(tmp_path)
    prompts = {}
    with Store(config(d)) as s:
        lid = s.register_layout(TINY)
        for p in range(20):
            toks = prompt(1 + p % 5, start=1000 * p)
            s.put(lid, toks, [payload(i, salt=p) for i in range(1 + p % 5)])
            prompts[p] = toks
        shared = prompts[0] + prompt(2, start=50_000)  # a branch off prompt 0
        s.put(lid, shared, [payload(0, 0)] + [payload(i, 99) for i in range(1, 3)])
        assert s.flush() == len(s.index)
        before = {n.hash: (n.depth, n.parent.hash if n.parent else None) for n in s.index.nodes()}
    with Store(config(d)) as s:
        assert s.rebuild_report.chunks == len(before)
        assert {n.hash: (n.depth, n.parent.hash if n.parent else None) for n in s.index.nodes()} == before
        s.index.check_invariants()
        for p, toks in prompts.items():
            lease = s.acquire(lid, toks)
            assert lease.matched_tokens == len(toks)
            assert [bytes(s.read_chunk(lease, i)) for i in range(len(toks) // CT)] == [
                payload(i, salt=p) for i in range(len(toks) // CT)
            ]
            s.release(lease.lease_id)
        assert s.lookup(lid, shared) == 3 * CT


def test_pool_only_chunks_are_lost_on_restart_but_nothing_breaks(tmp_path):
    d = str(tmp_path)
    with Store(config(d)) as s:
        lid = s.register_layout(TINY)
        s.put(lid, prompt(2), [payload(0), payload(1)])
        s.flush()
        s.put(lid, prompt(4), [payload(i) for i in range(4)])  # chunks 2, 3 never reach NVMe
    with Store(config(d)) as s:
        assert s.lookup(lid, prompt(4)) == 2 * CT


def test_second_store_on_same_state_is_refused(tmp_path):
    with Store(config(str(tmp_path))):
        with pytest.raises(StoreLocked, match="in use"):
            Store(config(str(tmp_path)))
    Store(config(str(tmp_path))).close()  # free again once the first closed


def test_corrupt_chunk_is_dropped_with_its_subtree_never_served(tmp_path):
    d = str(tmp_path)
    with Store(config(d)) as s:
        lid = s.register_layout(TINY)
        s.put(lid, prompt(4), [payload(i) for i in range(4)])
        s.put(lid, prompt(2) + prompt(1, start=777), [payload(0), payload(1), payload(9)])
        s.flush()
        bad = s.index.match(s.hashes(lid, prompt(4)))[1].hash
    env = lmdb.open(os.path.join(d, "nvme", "default"), max_dbs=4)
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        v = bytearray(txn.get(bad))
        v[HEADER_SIZE + 3] ^= 0x55  # payload damage: the header still parses
        txn.put(bad, bytes(v))
    env.close()
    with Store(config(d)) as s:
        assert s.lookup(lid, prompt(4)) == 4 * CT  # headers are fine, the index is whole
        lease = s.acquire(lid, prompt(4))
        assert lease.matched_tokens == CT  # served only what is intact
        assert bytes(s.read_chunk(lease, 0)) == payload(0)
        assert s.lookup(lid, prompt(4)) == CT  # chunk 1 and everything under it are gone
        assert s.lookup(lid, prompt(2) + prompt(1, start=777)) == CT
        assert s.stats().counters.corrupt_dropped == 1
        s.index.check_invariants()
        s.release(lease.lease_id)
        indexed = {n.hash for n in s.index.nodes()}
    assert lmdb_keys(d) == indexed  # nothing unreachable is left in the file
    with Store(config(d)) as s:
        assert s.rebuild_report.chunks == 1 and s.rebuild_report.orphans_dropped == 0


def test_orphans_and_unknown_layouts_are_dropped_at_rebuild(tmp_path):
    d = str(tmp_path)
    with Store(config(d)) as s:
        lid = s.register_layout(TINY)
        s.put(lid, prompt(3), [payload(i) for i in range(3)])
        s.flush()
        first = s.index.match(s.hashes(lid, prompt(3)))[0].hash
    env = lmdb.open(os.path.join(d, "nvme", "default"), max_dbs=4)
    with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
        txn.delete(first)  # as if evicted just before a crash that lost the children's deletes
    env.close()
    with Store(config(d)) as s:
        assert s.rebuild_report.orphans_dropped == 2 and len(s.index) == 0
    assert lmdb_keys(d) == set()


_WRITER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from tests.conftest import TINY, payload, prompt
from tests.test_recovery import config
from kvcached.store import Store
s = Store(config(sys.argv[1], write_through=True))
lid = s.register_layout(TINY)
for p in range(100000):
    n = 1 + p % 6
    s.put(lid, prompt(n, start=10_000 * p), [payload(i, salt=p % 251) for i in range(n)])
    print(p, flush=True)
"""


def test_sigkill_during_commits_leaves_a_consistent_file(tmp_path):
    d = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, d, root], stdout=subprocess.PIPE, text=True)
    seen = 0
    deadline = time.monotonic() + 60
    while seen < 150 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen = int(line) + 1
    proc.send_signal(signal.SIGKILL)  # mid-stream: the writer is busy committing
    proc.wait()
    assert seen >= 150, "writer made no progress"
    assert glob.glob(f"/dev/shm/kvcached.default.{proc.pid}.*"), "a killed process leaves its pool behind"
    with Store(config(d)) as s:
        assert not glob.glob(f"/dev/shm/kvcached.default.{proc.pid}.*")  # ...and the next start removes it
        lid = s.register_layout(TINY)
        s.index.check_invariants()
        indexed = {n.hash for n in s.index.nodes()}
        assert all(n.tiers == TierId.NVME for n in s.index.nodes())
        # Every prompt acknowledged before the kill is there, with the right bytes.
        for p in range(seen):
            n = 1 + p % 6
            lease = s.acquire(lid, prompt(n, start=10_000 * p))
            assert lease.matched_tokens == n * CT, f"prompt {p} lost"
            for i in range(n):
                assert bytes(s.read_chunk(lease, i)) == payload(i, salt=p % 251)
            s.release(lease.lease_id)
        assert s.stats().counters.corrupt_dropped == 0
    assert lmdb_keys(d) == indexed  # the index equals the LMDB contents


def test_progress_log_line_when_not_interactive(tmp_path, caplog):
    d = str(tmp_path)
    with Store(config(d)) as s:
        lid = s.register_layout(TINY)
        s.put(lid, prompt(2), [payload(0), payload(1)])
        s.flush()
    with caplog.at_level("INFO", logger="kvcached"):
        Store(config(d)).close()
    msgs = [r.getMessage() for r in caplog.records if "rebuilding index" in r.getMessage()]
    assert len(msgs) == 1 and "2 chunks indexed" in msgs[0] and msgs[0].endswith(" s")


def test_json_stats_after_restart(tmp_path):
    with Store(config(str(tmp_path))) as s:
        assert json.loads(json.dumps(s.stats().to_dict()))["nvme"]["admitting"] is True
