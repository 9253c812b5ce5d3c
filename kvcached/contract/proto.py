"""Protobuf <-> the contract's objects, for both sides of the wire: layouts, token framing,
placements and the pool handle (what a client maps; checked field by field before anything is
mapped). No logic beyond field mapping and validation of shape."""

from __future__ import annotations

from kvcached.contract.errors import InvalidArgument, InvalidLayout, InvalidPoolHandle, InvalidTokens, shown
from kvcached.contract.keys import KVLayout
from kvcached.contract.pool import CudaIpc, PoolHandle, PoolSlab
from kvcached.v1 import kvcached_pb2 as pb

NVME_CHUNK = 2**64 - 1  # offsets entry for a chunk the client reads from NVMe itself


def layout_from_proto(msg: pb.Layout) -> KVLayout:
    if not msg.model:
        raise InvalidLayout("layout.model is required")
    return KVLayout(
        model=msg.model,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype or "bfloat16",
        chunk_tokens=msg.chunk_tokens or 128,
        lora_name=msg.lora_name,
        lora_version=msg.lora_version,
        extra=tuple(sorted(msg.extra.items())),
        vocab_size=msg.vocab_size,
    )


def layout_to_proto(layout: KVLayout) -> pb.Layout:
    return pb.Layout(
        model=layout.model,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        chunk_tokens=layout.chunk_tokens,
        lora_name=layout.lora_name,
        lora_version=layout.lora_version,
        extra=dict(layout.extra),
        vocab_size=layout.vocab_size,
    )


def tokens_from_proto(raw: bytes) -> bytes:
    """Packed little-endian uint32 token ids. The store checks values; this checks framing."""
    if len(raw) % 4:
        raise InvalidTokens(f"tokens field has {len(raw)} bytes; it must be packed little-endian uint32 (4 bytes each)")
    return raw


def pool_handle_to_proto(h: PoolHandle, nvme_path: str = "") -> pb.PoolHandle:
    # block_bytes x num_blocks = the slab's size, for clients older than size_bytes (they map the
    # whole slab and view runs at offsets, which is all a packed pool needs).
    msg = pb.PoolHandle(kind=h.kind, name=h.name, block_bytes=h.align_bytes, num_blocks=h.size_bytes // h.align_bytes,
                        size_bytes=h.size_bytes, align_bytes=h.align_bytes, generation=h.generation,
                        nvme_path=nvme_path)
    if h.cuda is not None:
        c = h.cuda
        msg.ipc_handle, msg.device_uuid, msg.device_index = c.handle, c.device_uuid, c.device_index
        msg.ipc_size_bytes, msg.ipc_offset_bytes = c.size_bytes, c.offset_bytes
        msg.ref_counter_handle, msg.ref_counter_offset = c.ref_counter_handle, c.ref_counter_offset
        msg.event_handle, msg.event_sync_required = c.event_handle, c.event_sync_required
    for slab in h.slabs:
        msg.slabs.add(base=slab.base, placement=slab.placement, handle=pool_handle_to_proto(slab.handle))
    return msg


PLACEMENT_MAX = 128


def placement_from_proto(placement: str) -> str:
    """A request's placement (a device UUID or ``host:K``), checked: short and printable. One
    the daemon has no slab for is not an error (the slab with the most room takes it)."""
    if len(placement) > PLACEMENT_MAX or not placement.isprintable():
        raise InvalidArgument(f"placement {shown(placement[:PLACEMENT_MAX])} is not a device: a GPU UUID or host:K, "
                              f"at most {PLACEMENT_MAX} printable characters")
    return placement


CUDA_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t: CUDA_IPC_HANDLE_SIZE bytes
SHM_NAME_MAX = 255  # NAME_MAX: one file name under /dev/shm
MAX_POOL_BYTES = 2**63 - 1  # what mmap and torch can address (off_t, int64 sizes)


def pool_handle_from_proto(msg: pb.PoolHandle) -> PoolHandle:
    """The daemon's pool handle, checked before a client maps anything with it: a handle that
    could not describe a real pool raises :class:`InvalidPoolHandle` saying which field is wrong."""
    _check_pool_handle(msg)
    slabs = []
    end = 0
    for i, m in enumerate(msg.slabs):
        if m.handle.slabs:
            raise InvalidPoolHandle(f"the daemon's pool handle is unusable: slab {i} has slabs of its own")
        if m.base != end:
            raise InvalidPoolHandle(f"the daemon's pool handle is unusable: slab {i} starts at {m.base}, "
                                    f"not where slab {i - 1} ends ({end})" if i else
                                    f"the daemon's pool handle is unusable: slab 0 starts at {m.base}, not 0")
        one = pool_handle_from_proto(m.handle)
        if one.kind != msg.kind or one.generation != msg.generation:
            raise InvalidPoolHandle(f"the daemon's pool handle is unusable: slab {i} is of another kind or generation")
        slabs.append(PoolSlab(m.base, m.placement, one))
        end = m.base + one.size_bytes
    cuda = None
    if msg.kind == "cuda":
        cuda = CudaIpc(msg.device_index, msg.device_uuid, msg.ipc_handle, msg.ipc_size_bytes, msg.ipc_offset_bytes,
                       msg.ref_counter_handle, msg.ref_counter_offset, msg.event_handle, msg.event_sync_required)
    if msg.size_bytes:
        size, align = msg.size_bytes, msg.align_bytes
    else:  # an older daemon: one chunk per block, and the slab is block_bytes x num_blocks
        size, align = msg.block_bytes * msg.num_blocks, msg.block_bytes
    return PoolHandle(msg.kind, msg.name, size, align, msg.generation, cuda, tuple(slabs))


def _check_pool_handle(msg: pb.PoolHandle) -> None:
    def bad(why: str) -> InvalidPoolHandle:
        return InvalidPoolHandle(f"the daemon's pool handle is unusable: {why}")

    if msg.kind not in ("shm", "cuda"):
        raise bad(f"kind {shown(msg.kind)} is not one this client maps (shm, cuda); use put_bytes/get_bytes")
    size = msg.size_bytes or msg.block_bytes * msg.num_blocks
    if size == 0:
        raise bad("a pool of 0 bytes")
    if size > MAX_POOL_BYTES:
        raise bad(f"a pool of {size} bytes is more than {MAX_POOL_BYTES} bytes")
    if msg.size_bytes and (not msg.align_bytes or msg.size_bytes % msg.align_bytes):
        raise bad(f"a pool of {msg.size_bytes} bytes is not a multiple of its alignment {msg.align_bytes}")
    if not msg.generation:
        raise bad("no generation (a client could not tell this pool from the next one)")
    if msg.kind == "shm":
        name = msg.name
        if (not name or name in (".", "..") or "/" in name or "\0" in name
                or len(name.encode()) > SHM_NAME_MAX):
            raise bad(f"shared-memory segment name {shown(name)} is not one file name under /dev/shm")
        return
    if len(msg.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
        raise bad(f"CUDA IPC handle of {len(msg.ipc_handle)} bytes; it has {CUDA_IPC_HANDLE_BYTES}")
    if msg.event_handle and len(msg.event_handle) != CUDA_IPC_HANDLE_BYTES:
        raise bad(f"CUDA IPC event handle of {len(msg.event_handle)} bytes; it has {CUDA_IPC_HANDLE_BYTES}")
    if msg.event_sync_required and not msg.event_handle:
        raise bad("event_sync_required without an event handle to wait on")
    if not msg.device_uuid:
        raise bad("no device_uuid (the client finds the daemon's GPU by it)")
    if msg.ipc_size_bytes < size:
        raise bad(f"the shared CUDA storage has {msg.ipc_size_bytes} bytes, fewer than the pool's {size}")
