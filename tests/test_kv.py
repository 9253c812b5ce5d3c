from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcached.contract.errors import InvalidKV
from kvcached.contract.kv import chunk_payloads, chunk_view, validate_kv, write_chunk
from tests.conftest import TINY, prompt

BF16 = dataclasses.replace(TINY, dtype="bfloat16")


def kv_for(layout, n_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, layout.num_layers, layout.num_kv_heads, n_tokens, layout.head_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, layout.dtype))


@pytest.mark.parametrize("layout", [TINY, BF16], ids=["float32", "bfloat16"])
def test_put_tensor_acquire_view_is_bit_exact(make_store, layout):
    store = make_store(layout=layout)
    lid = store.register_layout(layout)
    kv = kv_for(layout, 3 * layout.chunk_tokens + 2)  # 3 full chunks and a partial one
    toks = prompt(3)
    store.put(lid, toks + [1, 2], chunk_payloads(layout, kv))
    lease = store.acquire(lid, toks)
    for i in range(3):
        view = chunk_view(layout, store.read_chunk(lease, i))
        c = layout.chunk_tokens
        assert view.shape == layout.chunk_shape
        assert torch.equal(view, kv[:, :, :, i * c : (i + 1) * c, :])


def test_write_chunk_goes_straight_into_a_reserved_block(store, lid):
    kv = kv_for(TINY, 2 * TINY.chunk_tokens, seed=3)
    r = store.reserve(lid, prompt(2))
    for loc in r.slots:
        write_chunk(TINY, store.pool.reserved_view(store.writes.reservations.get(r.reservation_id).payload.slots[loc.position]), kv, loc.position)
    store.commit(r.reservation_id)
    lease = store.acquire(lid, prompt(2))
    assert torch.equal(chunk_view(TINY, store.read_chunk(lease, 1)), kv[:, :, :, 4:8, :])


@pytest.mark.parametrize(
    "kv,match",
    [
        (torch.zeros(2, 1, 2, 8, 4, dtype=torch.float16), "dtype"),
        (torch.zeros(2, 1, 3, 8, 4), "shape"),
        (torch.zeros(1, 1, 2, 8, 4), "shape"),
        (torch.zeros(2, 1, 2, 8), "shape"),
        ([[0.0]], "torch.Tensor"),
    ],
    ids=["wrong-dtype", "wrong-heads", "not-stacked", "4d", "not-a-tensor"],
)
def test_bad_kv_is_refused(kv, match):
    with pytest.raises(InvalidKV, match=match):
        validate_kv(TINY, kv)


def test_chunk_view_checks_size():
    with pytest.raises(InvalidKV, match="bytes"):
        chunk_view(TINY, memoryview(bytearray(10)))
