"""The client's direct NVMe reader keeps working while the daemon's LMDB file grows."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from kvcached_client.nvme import _acquire_env, _release_env

ROOT = pathlib.Path(__file__).resolve().parents[2]

WRITE = (
    "import lmdb, sys\n"
    "env = lmdb.open(sys.argv[1], map_size=1 << 30, subdir=True, max_dbs=4)\n"
    "db = env.open_db(b'chunks')\n"
    "with env.begin(write=True, db=db) as txn:\n"
    "    for i in range(int(sys.argv[2]), int(sys.argv[3])):\n"
    "        txn.put(b'k%d' % i, bytes([i % 251]) * 16384)\n"
)


def write(path: str, start: int, stop: int) -> None:
    """Another process (as the daemon is) writes chunks start..stop-1."""
    subprocess.run([sys.executable, "-c", WRITE, path, str(start), str(stop)], check=True)


def test_reads_survive_the_file_growing_past_what_was_mapped_at_open(tmp_path):
    path = str(tmp_path / "nvme")
    write(path, 0, 1)
    env, db, _gate = _acquire_env(path)
    try:
        with env.begin(db=db, buffers=True) as txn:
            assert bytes(txn.get(b"k0")) == bytes([0]) * 16384
        write(path, 1, 2000)  # ~32 MiB: past py-lmdb's default 10 MiB reader map
        with env.begin(db=db, buffers=True) as txn:  # raised MapResizedError before the fix
            assert bytes(txn.get(b"k1999")) == bytes([1999 % 251]) * 16384
            assert bytes(txn.get(b"k0")) == bytes([0]) * 16384
    finally:
        _release_env(path)


GROW = (
    "import sys\n"
    "from kvcached.tiers.nvme import NvmeTier\n"
    "from tests.tiers.test_nvme import meta, put\n"
    "t = NvmeTier(sys.argv[1], 64 << 20, map_size=256 << 10, max_map_size=64 << 20)\n"
    "for i in range(int(sys.argv[2]), int(sys.argv[3])):\n"
    "    put(t, meta(i), bytes([i]) * 32768)\n"
    "print(t.map_grows, t.map_size)\n"
)


def test_a_reader_adopts_the_daemons_grown_map_when_the_file_outgrows_its_own(tmp_path, monkeypatch):
    """A reader that mapped less than the daemon later grew to (a tier beyond READER_MAP_BYTES)
    adopts the new size and reads on; without the adoption every read fails."""
    import kvcached_client.nvme as reader_mod
    import torch

    from kvcached.contract.keys import KVLayout
    from tests.tiers.test_nvme import meta

    path = str(tmp_path / "nvme")

    def grow(start: int, stop: int) -> list[int]:
        out = subprocess.run([sys.executable, "-c", GROW, path, str(start), str(stop)], check=True,
                             capture_output=True, text=True, cwd=ROOT)
        return [int(x) for x in out.stdout.split()]

    grow(1, 2)
    monkeypatch.setattr(reader_mod, "READER_MAP_BYTES", 256 << 10)
    layout = KVLayout("t/x@1", num_layers=1, num_kv_heads=1, head_dim=4096, dtype="uint8", chunk_tokens=4)
    assert layout.chunk_bytes == 32768
    r = reader_mod.NvmeReader()
    r.open(path)
    try:
        out = torch.empty(layout.chunk_shape, dtype=torch.uint8)
        r.read_into(layout, meta(1).chunk_hash, out)
        assert bytes(out.numpy().tobytes()) == bytes([1]) * 32768
        grows, size = grow(2, 60)  # ~2 MiB: the daemon's map grew past the reader's 256 KiB
        assert grows >= 1 and size > 1 << 20
        r.read_into(layout, meta(59).chunk_hash, out)  # MapResizedError before the adoption
        assert bytes(out.numpy().tobytes()) == bytes([59]) * 32768
    finally:
        r.close()
