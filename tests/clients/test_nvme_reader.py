"""The client's direct NVMe reader keeps working while the daemon's LMDB file grows."""

from __future__ import annotations

import subprocess
import sys

from kvcached_client.nvme import _acquire_env, _release_env

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
    env, db = _acquire_env(path)
    try:
        with env.begin(db=db, buffers=True) as txn:
            assert bytes(txn.get(b"k0")) == bytes([0]) * 16384
        write(path, 1, 2000)  # ~32 MiB: past py-lmdb's default 10 MiB reader map
        with env.begin(db=db, buffers=True) as txn:  # raised MapResizedError before the fix
            assert bytes(txn.get(b"k1999")) == bytes([1999 % 251]) * 16384
            assert bytes(txn.get(b"k0")) == bytes([0]) * 16384
    finally:
        _release_env(path)
