"""The NVMe tier's LMDB map grows when full, safely while other threads hold transactions.

LMDB may only resize a map while no transaction of the process is open: with a
write transaction open it refuses, and under an open read transaction it
unmaps the reader's pages (the process dies with SIGSEGV when the reader
touches its buffer). The tier's :class:`~kvcached.contract.lmdbgate.TxnGate`
makes the resize wait. Readers are paused *inside* their transaction by
wrapping the tier's copy/encode function: that pause is the one fault these
tests cannot cause otherwise.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

import kvcached.tiers.nvme as nvme_mod
from kvcached.contract.errors import TierFull
from kvcached.contract.lmdbgate import TxnGate
from kvcached.tiers.nvme import NvmeTier
from kvcached.contract.record import RecordBuffer
from tests.tiers.test_nvme import meta, put

VALUE = 32 << 10


def payload(i: int, size: int = VALUE) -> bytes:
    return bytes([i % 251]) * size


def fill_until_growth(t: NvmeTier, start: int) -> int:
    """Put chunks start, start+1, ... until the map has grown once; returns the next index."""
    grows, i = t.map_grows, start
    while t.map_grows == grows:
        put(t, meta(i), payload(i))
        i += 1
    return i


def test_a_full_map_grows_then_refuses_at_its_limit(tmp_path):
    t = NvmeTier(str(tmp_path / "nv"), 64 << 20, map_size=256 << 10, max_map_size=1 << 20)
    stored = 0
    with pytest.raises(TierFull, match="map"):
        for i in range(1, 200):
            put(t, meta(i), payload(i))
            stored += 1
    assert t.map_grows >= 1 and t.map_size == 1 << 20  # grew to the limit, not past it
    assert stored > (256 << 10) // VALUE  # more than the first map could hold
    assert t.admitting is False
    assert all(bytes(t.read(meta(i).chunk_hash)) == payload(i) for i in range(1, stored + 1))  # refused, not lost
    t.close()


def test_growth_waits_for_a_reader_inside_its_transaction(tmp_path, monkeypatch):
    t = NvmeTier(str(tmp_path / "nv"), 64 << 20, map_size=256 << 10)
    put(t, meta(1), payload(1))
    inside, release = threading.Event(), threading.Event()
    real_copy = nvme_mod.copy_verified

    def paused_copy(value, key, dest):  # the reader holds its buffer across the pause
        inside.set()
        release.wait(10)
        real_copy(value, key, dest)

    monkeypatch.setattr(nvme_mod, "copy_verified", paused_copy)
    got = bytearray(VALUE)
    reader = threading.Thread(target=t.read_into, args=(meta(1).chunk_hash, memoryview(got)))
    reader.start()
    assert inside.wait(10)
    monkeypatch.setattr(nvme_mod, "copy_verified", real_copy)  # only the first reader pauses

    filled: list[int] = []
    writer = threading.Thread(target=lambda: filled.append(fill_until_growth(t, 2)))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive(), "the map grew under an open read transaction"
    assert t.map_grows == 0
    release.set()
    reader.join(10)
    writer.join(10)
    assert not writer.is_alive() and t.map_grows == 1
    assert bytes(got) == payload(1)
    assert all(bytes(t.read(meta(i).chunk_hash)) == payload(i) for i in range(1, filled[0]))
    t.close()


def _write_batch_inside_growth(monkeypatch) -> threading.Event:
    """Arrange: the next growth finds the write-back thread inside a write_batch transaction,
    paused there for 0.5 s. Returns the event that lets it go on."""
    inside, release = threading.Event(), threading.Event()
    real_record, real_grow = RecordBuffer.record, NvmeTier._grow_map
    batch_thread: list[threading.Thread] = []

    def paused_record(self, m, data):
        if batch_thread and threading.current_thread() is batch_thread[0]:
            inside.set()
            release.wait(10)
        return real_record(self, m, data)

    def grow_with_a_batch_open(self, seen, new, why):
        if not batch_thread:  # the first growth: start a write-back batch and let it enter its txn
            th = threading.Thread(target=self.write_batch, args=([(meta(250), payload(250))],))
            batch_thread.append(th)
            th.start()
            assert inside.wait(10)
        real_grow(self, seen, new, why)

    monkeypatch.setattr(RecordBuffer, "record", paused_record)
    monkeypatch.setattr(NvmeTier, "_grow_map", grow_with_a_batch_open)
    release_later = threading.Timer(0.5, release.set)
    release_later.start()
    return release


def test_growth_waits_for_a_write_back_batch_in_its_transaction(tmp_path, monkeypatch):
    t = NvmeTier(str(tmp_path / "nv"), 64 << 20, map_size=256 << 10)
    release = _write_batch_inside_growth(monkeypatch)
    nxt = fill_until_growth(t, 1)  # its growth waits ~0.5 s for the batch, then succeeds
    assert release.is_set() and t.map_grows == 1
    assert all(bytes(t.read(meta(i).chunk_hash)) == payload(i) for i in range(1, nxt))
    t.close()


def test_positive_control_without_the_gate_the_same_growth_fails(tmp_path, monkeypatch):
    """The mutation the test above must catch: a resize that does not wait for open transactions."""
    monkeypatch.setattr(TxnGate, "resize", lambda self: contextlib.nullcontext())
    t = NvmeTier(str(tmp_path / "nv"), 64 << 20, map_size=256 << 10)
    release = _write_batch_inside_growth(monkeypatch)
    with pytest.raises(TierFull, match="write transaction is active"):
        fill_until_growth(t, 1)
    release.set()


def test_a_delete_grows_a_map_full_at_its_limit(tmp_path):
    """Deletes write pages too; one on a map full at its limit may grow past the limit."""
    t = NvmeTier(str(tmp_path / "nv"), 64 << 20, map_size=256 << 10, max_map_size=256 << 10)
    stored = 0
    with pytest.raises(TierFull):
        for i in range(1, 100):
            put(t, meta(i), payload(i))
            stored += 1
    for i in range(1, stored + 1):
        assert t.delete(meta(i).chunk_hash)
    assert t.chunk_count == 0
    t.close()


def test_the_daemon_side_reads_see_each_value_whole_across_many_growths(tmp_path):
    """Readers on two threads loop over every stored chunk while a third keeps filling a map
    that grows many times: every read is whole and right."""
    t = NvmeTier(str(tmp_path / "nv"), 256 << 20, map_size=256 << 10, max_map_size=64 << 20)
    for i in range(1, 4):
        put(t, meta(i), payload(i))
    stop, bad, reads = threading.Event(), [], [0]

    def read_loop():
        buf = bytearray(VALUE)
        while not stop.is_set():
            for i in range(1, 4):
                t.read_into(meta(i).chunk_hash, memoryview(buf))
                if bytes(buf) != payload(i):
                    bad.append(i)
                reads[0] += 1
            t.read(meta(1).chunk_hash)  # the copying read too
            time.sleep(0.001)  # let the writer have the GIL between rounds (2-core boxes)

    readers = [threading.Thread(target=read_loop) for _ in range(2)]
    for r in readers:
        r.start()
    i = 4
    while t.map_grows < 4:  # big values: fewer commits (each one syncs) per growth
        put(t, meta(i), payload(i, 256 << 10))
        i += 1
    stop.set()
    for r in readers:
        r.join(10)
    assert not bad and reads[0] > 0
    assert t.map_size > 1 << 20
    t.close()
    assert os.path.exists(tmp_path / "nv" / "data.mdb")
