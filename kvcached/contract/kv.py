"""KV tensors <-> chunk payloads. The only engine module that imports torch.

A prompt's KV is a tensor ``[2, layers, kv_heads, n_tokens, head_dim]``
(K and V stacked). Chunk ``i`` is the slice of tokens
``[i*chunk_tokens, (i+1)*chunk_tokens)``, stored contiguously in that same
axis order, so a pool block can be viewed as a
``[2, layers, kv_heads, chunk_tokens, head_dim]`` tensor with no copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcached.contract.errors import InvalidKV
from kvcached.contract.keys import KVLayout

if TYPE_CHECKING:
    import torch


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidKV(f"torch has no dtype {name!r}")
    return dt


def validate_kv(layout: KVLayout, kv: "torch.Tensor") -> int:
    """Check shape and dtype; return the number of full chunks ``kv`` holds."""
    import torch

    if not isinstance(kv, torch.Tensor):
        raise InvalidKV(f"KV must be a torch.Tensor, got {type(kv).__name__}")
    want = torch_dtype(layout.dtype)
    if kv.dtype != want:
        raise InvalidKV(f"KV dtype is {kv.dtype}, layout {layout.model} needs {want}")
    s = tuple(kv.shape)
    exp = (2, layout.num_layers, layout.num_kv_heads, None, layout.head_dim)
    if len(s) != 5 or any(e is not None and a != e for a, e in zip(s, exp)):
        raise InvalidKV(
            f"KV shape is {list(s)}; expected [2, {layout.num_layers}, {layout.num_kv_heads}, n_tokens, {layout.head_dim}]"
        )
    return s[3] // layout.chunk_tokens


def chunk_view(layout: KVLayout, buf: memoryview) -> "torch.Tensor":
    """A zero-copy tensor over one chunk's bytes (e.g. a pool block)."""
    import torch

    if buf.nbytes != layout.chunk_bytes:
        raise InvalidKV(f"buffer is {buf.nbytes} bytes, a chunk of this layout is {layout.chunk_bytes}")
    return torch.frombuffer(buf, dtype=torch_dtype(layout.dtype)).view(layout.chunk_shape)


def write_chunk(layout: KVLayout, dest: memoryview, kv: "torch.Tensor", position: int) -> None:
    """Copy chunk ``position`` of ``kv`` straight into ``dest`` (one copy, no temporary)."""
    c = layout.chunk_tokens
    chunk_view(layout, dest).copy_(kv[:, :, :, position * c : (position + 1) * c, :])


def chunk_payloads(layout: KVLayout, kv: "torch.Tensor") -> list[memoryview]:
    """Every full chunk of ``kv`` as contiguous bytes (copies), for :meth:`Store.put`."""
    n = validate_kv(layout, kv)
    c = layout.chunk_tokens
    out = []
    for i in range(n):
        t = kv[:, :, :, i * c : (i + 1) * c, :].contiguous().cpu()
        out.append(memoryview(t.view(-1).view(dtype=_byte_dtype()).numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer (typeshed < 3.12 cannot say)
    return out


def _byte_dtype() -> "torch.dtype":
    import torch

    return torch.uint8
