"""``bench/gpu_check.py``'s ``vllm_paged`` step on the CPU: its expected-layout builder, the
converter checked against it (with positive controls that a scatter-then-gather round trip
cannot see), and the step's whole worker-side run (``paged_check``, the function the GPU step
calls) against a real daemon with a host pool and a CPU paged cache, where the worker copies
synchronously: everything of the CUDA step but its streams, events and timings.
"""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest
import torch

from bench import gpu_check as G
from bench.harness.daemon import Daemon
from kvcached.contract.keys import KVLayout
from kvcached_client import Client
from kvcached_client.vllm.paged import CHANNEL_SPLIT, PagedLayout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

L, H, D, CHUNK, BLOCK = 2, 2, 8, 32, 8  # 4 blocks per chunk
LAYOUT = KVLayout("bench/gpu-check-paged@1", L, H, D, "bfloat16", chunk_tokens=CHUNK)

# Positive controls: converters that are wrong but self-consistent, so gathering back what they
# scattered gives the chunks again (the old check's blind spot).
def _wrong(name: str, to_cache, from_cache) -> PagedLayout:
    def gather(cache, ids, out):
        tmp = torch.empty_like(out)
        CHANNEL_SPLIT.gather(cache, ids, tmp)
        out.copy_(from_cache(tmp))

    return PagedLayout(name, gather, lambda cache, ids, kv: CHANNEL_SPLIT.scatter(cache, ids, to_cache(kv)))


SWAPPED = _wrong("kv-swapped", lambda kv: kv.flip(0), lambda kv: kv.flip(0))
ROLLED = _wrong("token-rolled", lambda kv: kv.roll(1, dims=2), lambda kv: kv.roll(-1, dims=2))  # a token late


def pattern(tokens: int, seed: int = 1) -> torch.Tensor:
    return G.pattern_kv(L, H, tokens, D, torch.bfloat16, seed=seed)


def chunks_of(kv: torch.Tensor) -> list[torch.Tensor]:
    return [kv[:, :, :, i : i + CHUNK].contiguous() for i in range(0, kv.shape[3], CHUNK)]


def test_the_pattern_is_asymmetric_and_exact() -> None:
    kv = G.pattern_kv(L, H, 64, D, torch.float32, seed=3)
    assert bool((kv[0] > 0).all()) and bool((kv[1] < 0).all())  # a K/V swap flips every sign
    assert torch.equal(kv.to(torch.bfloat16).float(), kv) and torch.equal(kv.half().float(), kv)  # exact
    assert kv.abs().unique().numel() > 1000  # of 2,048 possible magnitudes
    assert torch.equal(G.pattern_kv(L, H, 64, D, torch.float32, seed=3), kv)


@pytest.mark.parametrize("order", G.ORDERS)
def test_expected_layout_is_what_the_layout_means(order: str) -> None:
    """The builder against an element-by-element reading of the layout's definition."""
    kv, ids, nb = pattern(2 * BLOCK), [3, 0], 5
    got = G.expected_paged(kv, ids, BLOCK, nb, order)
    want = torch.zeros(G.physical_shape(order, L, nb, BLOCK, H, D), dtype=kv.dtype)
    for layer in range(L):
        for j, b in enumerate(ids):
            for t in range(BLOCK):
                for h in range(H):
                    for ch in range(2 * D):
                        value = kv[ch // D, layer, h, j * BLOCK + t, ch % D]
                        if order == "BNHC":
                            want[layer, b, t, h, ch] = value
                        else:
                            want[layer, b, h, t, ch] = value
    assert G.same_bits(got, want)
    assert not bool(G.bits(got[:, [1, 2, 4]]).any())  # blocks not in the plan stay zero


@pytest.mark.parametrize("order", G.ORDERS)
def test_channel_split_matches_the_expected_layout(order: str) -> None:
    kv = pattern(3 * CHUNK)
    fig = G.converter_check(CHANNEL_SPLIT, chunks_of(kv), kv, order, block=BLOCK, rounds=1)
    assert fig["matches_expected_layout"] and fig["bit_exact"] and fig["layout_error"] is None
    assert fig["blocks"] == 3 * CHUNK // BLOCK


@pytest.mark.parametrize("order", G.ORDERS)
@pytest.mark.parametrize("wrong,hint", [(SWAPPED, "K and V swapped"), (ROLLED, "elements differ")])
def test_a_self_consistent_wrong_converter_fails(order: str, wrong: PagedLayout, hint: str) -> None:
    kv = pattern(2 * CHUNK)
    chunks = chunks_of(kv)
    # The round trip alone passes: it cannot tell this converter from the right one.
    phys = torch.zeros(G.physical_shape(order, L, 16, BLOCK, H, D), dtype=kv.dtype)
    views = [G.logical_view(phys[layer], order) for layer in range(L)]
    ids = torch.tensor(G.block_ids_for(8, 16, 11))
    G.scatter_chunks(wrong, views, chunks, ids, CHUNK // BLOCK)
    back = G.gather_chunks(wrong, views, chunks, ids, CHUNK // BLOCK)
    assert all(G.same_bits(a, b) for a, b in zip(chunks, back))
    # The expected layout does.
    with pytest.raises(G.StepFailed, match=f"differs from the expected paged layout: .*{hint}"):
        G.converter_check(wrong, chunks, kv, order, block=BLOCK, rounds=1)


@pytest.mark.parametrize("seed", range(8))
def test_the_checks_block_ids_never_name_vllms_null_block(seed: int) -> None:
    """On the H200 a check whose ids held block 0 saw that block unloaded (the worker skips vLLM's
    null block, as it must): a false failure. Drawn as vLLM draws them, ids are distinct and never 0."""
    from kvcached_client.vllm.worker import NULL_BLOCK

    ids = G.block_ids_for(64, 128, seed)
    assert NULL_BLOCK not in ids and len(set(ids)) == 64 and max(ids) < 128


def test_the_sync_watch_counts_synchronisations() -> None:
    orig = torch.cuda.synchronize

    def syncs() -> None:
        try:
            torch.cuda.synchronize()  # looked up at call time, as the client's code does
        except (AssertionError, RuntimeError):  # no CUDA here
            pass

    with G.SyncWatch(cuda=False) as watch:
        syncs()  # outside a watched call: not counted
        watch.call(syncs)
        assert watch.counts["torch.cuda.synchronize"] == 1 and watch.total == 1 and watch.calls == 1
    assert torch.cuda.synchronize is orig


# -- the step's worker-side run against a real daemon ----------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[Daemon]:
    d = Daemon(str(tmp_path_factory.mktemp("paged") / "d"), pool_bytes="4M", nvme_bytes="64M")
    os.makedirs(d.root, exist_ok=True)
    d.start()
    yield d
    try:
        with Client(d.socket, session=False) as c:
            s = c.stats()
        assert (s["leases_active"], s["reservations_active"]) == (0, 0), s
    finally:
        d.stop()


@pytest.fixture
def no_vllm() -> Iterator[bool]:
    """As on the GPU machine, which has no vLLM: kvcached_client.vllm.plan takes its stand-ins
    for vLLM's base classes (and the test does not pay for vLLM's import). Where vLLM or the
    plan module is already imported (a whole-suite run), they are used as they are; the modules
    imported here without vLLM are dropped again afterwards. Yields whether vLLM was blocked."""
    if "vllm" in sys.modules or "kvcached_client.vllm.plan" in sys.modules:
        yield False
        return
    before = set(sys.modules)
    sys.modules["vllm"] = None  # type: ignore[assignment]  # any import of vllm.* raises ImportError
    try:
        yield True
    finally:
        del sys.modules["vllm"]
        import kvcached_client.vllm as pkg

        for name in set(sys.modules) - before:
            if name.startswith("kvcached_client.vllm."):
                del sys.modules[name]
                pkg.__dict__.pop(name.rsplit(".", 1)[1], None)


def test_the_paged_step_on_a_cpu_daemon(daemon, no_vllm) -> None:
    """``paged_check`` as the GPU step runs it: the converter, then the worker's synchronous and
    asynchronous loads and its store, all against the expected layout, for both orders."""
    fig: dict = {}
    with Client(daemon.socket) as c:
        G.paged_check(c, lambda where="": Client(daemon.socket, placement=where), LAYOUT, 2, fig, device="cpu", rounds=1, block=BLOCK,
                      token_base=1000)
        c.sync()
    if no_vllm:
        from kvcached_client.vllm import plan

        assert plan.KVConnectorMetadata.__module__ == plan.__name__  # the stand-in, as on the GPU machine
    for order in G.ORDERS:
        f, w = fig[order], fig[order]["worker"]
        assert f["matches_expected_layout"] and f["bit_exact"], f
        assert w["sync_load_matches_expected_layout"] and w["layer_reads_after_wait"], w
        assert w["async_load_matches_expected_layout"] and w["store_bit_exact"] and w["stored_chunks"] == 2, w
        assert w["side_streams"] is False  # a CPU cache: the worker copies at once
        assert w["load_seconds"] > 0 and w["store_seconds"] > 0 and w["load_seconds_per_chunk_calls"] > 0
        assert w["converter_batches"] is True and w["load_host_seconds"] > 0
        assert w["store_seconds_per_chunk_calls"] > 0 and w["store_speedup_vs_per_chunk_calls"] > 0
    assert fig["worker_calls_watched"] > 20
    assert fig["worker_synchronize_calls"] == dict.fromkeys(G.SyncWatch.KINDS, 0)


def test_the_worker_with_a_wrong_converter_fails(daemon, no_vllm) -> None:
    """Positive control of the worker-side run: the worker given a K/V-swapped converter loads a
    cache that the expected layout rejects."""
    tokens = [5000 + i for i in range(2 * CHUNK)]
    store = [9000 + i for i in range(2 * CHUNK)]
    with Client(daemon.socket) as c:
        kv = G.put_pattern(c, LAYOUT, tokens, seed=8, device="cpu")
        with G.SyncWatch(cuda=False) as watch, c.acquire(LAYOUT, tokens) as lease:
            with pytest.raises(G.StepFailed, match="synchronous load the paged cache differs .*K and V swapped"):
                G.worker_check(c, lambda where="": Client(daemon.socket, placement=where), LAYOUT, lease, kv, "BNHC", store, converter=SWAPPED,
                               block=BLOCK, rounds=1, watch=watch, store_seed=9, d2d=1.0)
        c.sync()
