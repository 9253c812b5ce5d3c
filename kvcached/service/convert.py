"""Protobuf <-> domain objects. No logic beyond field mapping and validation of shape."""

from __future__ import annotations

from kvcached.errors import InvalidArgument, InvalidLayout, InvalidPoolHandle, InvalidTokens, shown
from kvcached.keys import KVLayout
from kvcached.locations import POOL
from kvcached.receipts import ChunkLocation, CommitReceipt, LeaseReceipt, ReservationReceipt
from kvcached.tiers.packed import CudaIpc, PoolHandle, PoolSlab
from kvcached.v1 import kvcached_pb2 as pb


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


NVME_CHUNK = 2**64 - 1  # offsets entry for a chunk the client reads from NVMe itself


def locations_to_proto(chunks: tuple[ChunkLocation, ...], chunk_bytes: int, first_position: int = 0) -> pb.ChunkLocations:
    msg = pb.ChunkLocations(first_position=first_position, chunk_bytes=chunk_bytes)
    if all(c.tier == POOL for c in chunks):
        msg.offsets.extend([c.offset for c in chunks])
    else:
        msg.offsets.extend([c.offset if c.tier == POOL else NVME_CHUNK for c in chunks])
        msg.nvme_keys.extend([c.chunk_hash for c in chunks if c.tier != POOL])
    return msg


def lease_to_proto(r: LeaseReceipt, ttl: float) -> pb.AcquireResponse:
    resp = pb.AcquireResponse(lease_id=r.lease_id, matched_tokens=r.matched_tokens, ttl_seconds=ttl,
                              pool_generation=r.pool_generation)
    locs = resp.chunks  # filled in place: building a ChunkLocations and copying it in costs 2x
    locs.first_position = 0
    locs.chunk_bytes = r.chunk_bytes
    if r.all_in_pool:
        locs.offsets.extend(r.offsets)
    else:
        locs.offsets.extend([off if off >= 0 else NVME_CHUNK for off in r.offsets])
        locs.nvme_keys.extend([h for h, off in zip(r.chunk_hashes, r.offsets) if off < 0])
    return resp


def reservation_to_proto(r: ReservationReceipt, ttl: float, chunk_bytes: int) -> pb.ReserveResponse:
    first = r.slots[0].position if r.slots else 0
    return pb.ReserveResponse(
        reservation_id=r.reservation_id,
        cached_tokens=r.cached_tokens,
        in_flight_tokens=r.in_flight_tokens,
        slots=locations_to_proto(r.slots, chunk_bytes, first),
        ttl_seconds=ttl,
        pool_generation=r.pool_generation,
        durable_tokens=r.durable_tokens,
        write_through=r.write_through,
        not_reserved_tokens=r.not_reserved_tokens,
        not_reserved_reason=r.not_reserved_reason,
    )


def commit_to_proto(c: CommitReceipt) -> pb.CommitResponse:
    return pb.CommitResponse(committed_chunks=c.committed_chunks, cached_tokens=c.cached_tokens,
                             durable_tokens=c.durable_tokens, write_through=c.write_through)


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
