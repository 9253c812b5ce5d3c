"""A real daemon whose LMDB map must grow while a client holds leases on NVMe chunks and reads
them straight from the file: every read is whole and right, every request is served or
refused (never failed), and the map grows, then stops at its limit."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from kvcached_client import Client
from kvcached_client.nvme import CorruptChunkError
from tests.service.test_daemon import FAT, PROMPT, demote_prompt

#: Flip one byte of an LMDB value in another process (py-lmdb opens a file once per process,
#: and the client library already holds this one).
CORRUPT = (
    "import lmdb, sys\n"
    "env = lmdb.open(sys.argv[1], max_dbs=4, subdir=True, map_size=1 << 30)\n"
    "db = env.open_db(b'chunks')\n"
    "with env.begin(write=True, db=db) as txn:\n"
    "    v = bytearray(txn.get(bytes.fromhex(sys.argv[2])))\n"
    "    v[-1] ^= 0xFF\n"
    "    txn.put(bytes.fromhex(sys.argv[2]), bytes(v))\n"
)


class ReadLoop:
    """Reads the lease's NVMe chunks from the file, over and over, and checks every byte."""

    def __init__(self, lease, want: dict[int, torch.Tensor]) -> None:
        self.lease, self.want = lease, want
        self.reads = self.wrong = self.corrupt = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        out = torch.empty(FAT.chunk_shape)
        while not self._stop.is_set():
            for i, want in self.want.items():
                try:
                    self.lease.copy_chunk(i, out)
                except CorruptChunkError:
                    self.corrupt += 1
                    continue
                except Exception as e:  # any other failure is a failed request
                    self.errors.append(repr(e))
                    continue
                self.reads += 1
                self.wrong += not torch.equal(out, want)
            self._stop.wait(0.002)

    def __enter__(self) -> "ReadLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_leased_nvme_chunks_stay_whole_while_the_map_grows_to_its_limit(make_daemon):
    d = make_daemon(pool_bytes="2M", nvme_map_bytes="1M", writeback=False)  # map limit: 4 MiB
    a = torch.randn(2, 4, 4, 48, 64)
    want = {1: a[:, :, :, 16:32].contiguous(), 2: a[:, :, :, 32:48].contiguous()}
    with Client(d.socket, nvme_read="direct") as c, Client(d.socket) as w:
        demote_prompt(c, a)  # chunks 1 and 2 live only on NVMe, read from the file by this client
        start = c.stats()["nvme"]
        with c.acquire(FAT, PROMPT) as lease, ReadLoop(lease, want) as loop:
            assert [i for i, loc in enumerate(lease.locations) if loc.nvme_key] == [1, 2]
            prompts = {}
            for k in range(40):  # 120 chunks of 128 KiB through a 2 MiB pool: ~15 MiB to NVMe
                toks = [50_000 + 100 * k + i for i in range(48)]
                prompts[k] = torch.full((2, 4, 4, 48, 64), float(k))
                w.put(FAT, toks, prompts[k])  # raises on a failed request
            served = 0
            for k, kv in prompts.items():  # each is served whole, partly, or missed; never wrong
                toks = [50_000 + 100 * k + i for i in range(48)]
                with w.acquire(FAT, toks) as got:
                    if len(got):  # chunks hit, from the first
                        assert torch.equal(got.kv(), kv[:, :, :, :len(got) * FAT.chunk_tokens])
                        served += 1
        end = w.stats()["nvme"]
        print(f"map {start['map_bytes']} -> {end['map_bytes']} bytes, {end['map_grows']} growths; "
              f"{loop.reads} direct reads, {served}/40 prompts served after")
        assert loop.errors == [] and loop.wrong == 0 and loop.corrupt == 0
        assert loop.reads > 0 and served > 0
        assert end["map_grows"] >= 1 and end["map_bytes"] == 4 * start["map_bytes"]  # grew, to its limit
        with c.acquire(FAT, PROMPT) as lease:  # the leased chunks were pinned: all still there
            assert len(lease) == 3 and torch.equal(lease.kv(), a)
        assert d.proc is not None and d.proc.poll() is None


def test_positive_control_the_read_loop_counts_a_corrupt_chunk(make_daemon):
    d = make_daemon(pool_bytes="2M", writeback=False)
    a = torch.randn(2, 4, 4, 48, 64)
    want = {1: a[:, :, :, 16:32].contiguous()}
    with Client(d.socket, nvme_read="direct") as c:
        demote_prompt(c, a)
        with c.acquire(FAT, PROMPT) as lease:
            key = lease.locations[1].nvme_key
            path = f"{d.state_dir}/nvme/default"  # <state_dir>/nvme/<domain>
            subprocess.run([sys.executable, "-c", CORRUPT, path, key.hex()], check=True)
            with ReadLoop(lease, want) as loop:
                while loop.corrupt == 0 and not loop.errors and loop.reads < 1000:
                    threading.Event().wait(0.01)
            assert loop.corrupt > 0 and loop.reads == 0  # the detector fires; nothing wrong was used
