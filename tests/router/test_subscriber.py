"""The router's view of a real daemon, from its KV event stream: what a client puts shows up,
what is evicted goes, a late subscriber catches up by replay, and a daemon restart (its stream
numbered from 0 again, its index rebuilt from NVMe) is followed."""

from __future__ import annotations

import asyncio
import time

from kvcached.contract.keys import ChunkHasher, Namespace, load_shared_key, write_new_key
from kvcached_client import Client
from kvcached_router.index import HostIndex
from kvcached_router.subscriber import EventSubscriber
from bench.harness.daemon import Daemon
from tests.service.conftest import LAYOUT

CT = LAYOUT.chunk_tokens


def prompt(k: int, chunks: int = 3) -> list[int]:
    return list(range(1000 * k, 1000 * k + chunks * CT))


def put(sock: str, k: int) -> None:
    with Client(sock) as c:
        c.put_bytes(LAYOUT, prompt(k), [bytes([k, i]) * (LAYOUT.chunk_bytes // 2) for i in range(3)])


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_the_index_follows_a_daemon_through_replay_eviction_and_restart(tmp_path):
    key = str(tmp_path / "domain.key")
    write_new_key(key)
    hasher = ChunkHasher(load_shared_key(key))
    root = hasher.root(Namespace("default", LAYOUT))

    def hashes(k: int) -> list[bytes]:
        import numpy as np

        return hasher.chain(root, np.asarray(prompt(k), dtype="<u4").tobytes(), CT)

    ev, rp = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    d = Daemon(str(tmp_path), hash_key_file=key, kv_events_endpoint=ev, kv_events_replay_endpoint=rp,
               pool_bytes="4M", nvme_bytes="16M").start()

    async def scenario() -> dict:
        put(d.socket, 1)  # before anyone listens: only a replay can tell
        ix = HostIndex()
        sub = EventSubscriber("a", ix, ev, rp)
        sub.start()
        await asyncio.wait_for(sub.synced.wait(), 10)
        await until(lambda: ix.prefix(hashes(1)) == 3)
        await asyncio.to_thread(put, d.socket, 2)
        await until(lambda: ix.prefix(hashes(2)) == 3)
        with Client(d.socket) as c:
            c.evict(c.register(LAYOUT), prompt(2)[:CT])
        await until(lambda: ix.prefix(hashes(2)) == 0)
        assert ix.prefix(hashes(1)) == 3 and sub.holes == 0
        # A restart: SIGTERM flushes the pool to NVMe; the new process rebuilds its index from it
        # and starts a new stream (sequence 0: AllBlocksCleared and a snapshot).
        await asyncio.to_thread(d.stop)
        await asyncio.to_thread(d.start)
        await until(lambda: sub.restarts >= 1 and ix.prefix(hashes(1)) == 3, 20)
        await asyncio.to_thread(put, d.socket, 3)
        await until(lambda: ix.prefix(hashes(3)) == 3)
        out = {"restarts": sub.restarts, "cleared": ix.cleared, "holes": sub.holes, "held": len(ix)}
        await sub.stop()
        return out

    try:
        out = asyncio.run(scenario())
        with Client(d.socket) as c:
            assert out["held"] == c.stats()["indexed_chunks"]  # the same picture as the daemon's
        assert out["restarts"] == 1 and out["cleared"] >= 2 and out["holes"] == 0
    finally:
        d.stop()
