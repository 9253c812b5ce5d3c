"""Protobuf <-> the store's receipts: what only the servicer sends. What both sides convert
(layouts, tokens, placements, the pool handle) is :mod:`kvcached.contract.proto`. No logic
beyond field mapping."""

from __future__ import annotations

from kvcached.contract.locations import POOL
from kvcached.contract.proto import NVME_CHUNK
from kvcached.receipts import ChunkLocation, CommitReceipt, LeaseReceipt, ReservationReceipt
from kvcached.v1 import kvcached_pb2 as pb


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


