"""Tensor parallelism: KvcachedConnector in TP = 2 vLLM CPU engines against the real daemon.

vLLM's CPU build runs TP = 2 here (``engine_proc --tp 2``): ``tensor_parallel_size=2`` with the
multiprocessing executor (one worker process per rank, gloo between them; the engine core stays
in the test's engine process) and ``VLLM_CPU_OMP_THREADS_BIND=nobind``. Without the latter the
CPU build's default ("auto") binds each rank's OpenMP threads to a NUMA node of its own and, on a
one-node machine, refuses to start::

    AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed
    NUMA nodes are [0]. Please try to bind threads manually or decrease DP/TP/PP.

The tiny model has 2 KV heads: each rank holds one and stores it under a layout of its own
(``spec.engine_layouts``: extra ``("tp", "r/2")``), so a 600-token prompt is 4 whole chunks per
rank. TP = 2's greedy tokens are TP = 1's here (float32; checked on 10 prompts of 100 to 600
tokens, 32 tokens each), so the reference is the TP = 1 engine without the connector. The
worker-side connectors live in the worker processes: engine_proc reports only the scheduler's
counters for a TP engine, and the per-rank checks are made on the daemon's side.

The daemon's pool has two slabs here (``pool_slabs = 2``, ``host:0`` and ``host:1``), as a host
with two GPUs has one per GPU, and each worker names its own (``placement = "host:{rank}"``, the
stand-in for its GPU's UUID): vLLM's connector handshake carries it from the worker processes
to the scheduler, which reserves rank r's chunks in slab r.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest
import torch

from kvcached.contract.keys import KVLayout
from kvcached_client import Client
from bench.harness.daemon import Daemon
from tests.vllm.conftest import assert_nothing_pinned, chunk_bytes, daemon_stats, prompt

pytestmark = pytest.mark.slow

CHUNK = 128
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # the tiny model (kvcached_client.vllm.random_model)


def layouts_by_tp(d) -> dict[str, KVLayout]:
    """The daemon's registered layouts by their ("tp", "rank/size") extra."""
    out = {}
    for spec in daemon_stats(d)["layouts_detail"].values():
        lay = KVLayout.from_dict(spec)
        if "tp" in dict(lay.extra):  # not the filler
            out[dict(lay.extra)["tp"]] = lay
    return out


def chunks(c: Client, layout: KVLayout, tokens: list[int]) -> list[np.ndarray]:
    """The cached chunks of ``tokens`` under ``layout``, as [K/V, layers, heads, tokens, head dim]."""
    shape = (2, layout.num_layers, layout.num_kv_heads, layout.chunk_tokens, layout.head_dim)
    return [np.frombuffer(b, np.float32)[:int(np.prod(shape))].reshape(shape) for b in c.get_bytes(layout, tokens)]


@pytest.fixture
def vdaemon(tmp_path):
    """The tiny model's daemon with a pool of two slabs (see the module docstring)."""
    d = Daemon(str(tmp_path / "d2"), pool_bytes="8M", pool_slabs=2, nvme_bytes="64M")
    os.makedirs(d.root, exist_ok=True)
    d.start()
    yield d
    d.stop()


def slab_used(d) -> list[int]:
    return [s["used_bytes"] for s in daemon_stats(d)["pool"]["slabs"]]


def test_tp2_stores_a_fresh_tp2_engine_loads_and_tp1_never_matches(vdaemon, engines, reference):
    p = prompt(600, 41)
    # Starting the engines is most of this test's time: A and B (TP = 2), C (TP = 1, with the
    # connector) and the reference start side by side. B and C are still fresh (nothing in
    # vLLM's own prefix cache) at their first request, after A has stored.
    placed = {"placement": "host:{rank}"}
    # Slab 0 is the fuller one before A stores, so a rank whose placement did not arrive (the daemon
    # then picks the emptiest slab) would put its chunks in slab 1: only the handshake puts rank 0's in 0.
    filler = KVLayout("test/filler@1", num_layers=1, num_kv_heads=1, head_dim=256, dtype="float32", chunk_tokens=256)
    with Client(vdaemon.socket, placement="host:0") as cl:
        assert cl.put(filler, list(range(256)), torch.ones(2, 1, 1, 256, 256)).stored_chunks == 1
    base = filler.chunk_bytes
    assert slab_used(vdaemon) == [base, 0] and base > 4 * chunk_bytes(kv_heads=1)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        starts = [ex.submit(engines, vdaemon.socket, tp=tp, timeout=600, extra=placed) for tp in (2, 2, 1)]
        want_f = ex.submit(reference, [p])
        a, b, c = (f.result() for f in starts)
        want = want_f.result()

    ra = a.generate([p])
    assert ra["num_cached"] == [0] and ra["tokens"] == want  # a miss: computed, then stored
    assert ra["fail_open"] == {} and ra["tracked_requests"] == 0
    a.close()
    # 4 whole chunks (512 of 600 tokens) per rank, each rank under its own layout: 2 x 4,
    # and each rank's in its own slab of the pool (a chunk holds one of the 2 KV heads)
    assert daemon_stats(vdaemon)["indexed_chunks"] == 1 + 2 * 4
    assert slab_used(vdaemon) == [base + 4 * chunk_bytes(kv_heads=1), 4 * chunk_bytes(kv_heads=1)]
    lays = layouts_by_tp(vdaemon)
    assert set(lays) == {"0/2", "1/2", "0/1"}  # A's and B's two ranks, C's one (registered at start)
    assert [lays[r].num_kv_heads for r in ("0/2", "1/2", "0/1")] == [1, 1, 2]
    with Client(vdaemon.socket, session=False) as cl:
        assert [cl.lookup(lays[r], p) for r in ("0/2", "1/2", "0/1")] == [4 * CHUNK, 4 * CHUNK, 0]

    rb = b.generate([p])  # a fresh TP = 2 engine: every rank loads its own chunks
    assert rb["num_cached"] == [4 * CHUNK] and rb["tokens"] == want
    assert rb["scheduler"]["load_tokens"] == 4 * CHUNK
    assert rb["fail_open"] == {} and rb["tracked_requests"] == 0

    rc = c.generate([p])  # TP = 1 never matches TP = 2's chunks ...
    assert rc["num_cached"] == [0] and rc["tokens"] == want
    assert rc["fail_open"] == {}
    assert daemon_stats(vdaemon)["indexed_chunks"] == 1 + 2 * 4 + 4  # ... and stores its own
    assert slab_used(vdaemon) == [base + 4 * chunk_bytes(kv_heads=1) + 4 * chunk_bytes(), 4 * chunk_bytes(kv_heads=1)]

    # What each rank stored is its own KV head: rank r's chunks are head r of TP = 1's (up to
    # float rounding: TP = 2 sums the attention output across ranks in another order).
    with Client(vdaemon.socket, session=False) as cl:
        full = chunks(cl, lays["0/1"], p)
        per_rank = [chunks(cl, lays[f"{r}/2"], p) for r in range(2)]
    assert len(full) == len(per_rank[0]) == len(per_rank[1]) == 4
    assert full[0].shape == (2, LAYERS, KV_HEADS, CHUNK, HEAD_DIM)
    for i in range(4):
        for r in range(2):
            np.testing.assert_allclose(per_rank[r][i], full[i][:, :, r:r + 1], rtol=1e-4, atol=1e-5)
    assert not np.allclose(per_rank[0][0], per_rank[1][0])  # the two heads differ
    assert_nothing_pinned(vdaemon)
