"""What the sync and asyncio clients share: request building and response handling.

Neither flavour does any I/O here; they only differ in how they call the stub.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeGuard

import numpy as np

from kvcached.contract.errors import KvcacheError
from kvcached.contract.keys import KVLayout, TokenInput, normalize_tokens
from kvcached.contract.proto import NVME_CHUNK, layout_to_proto, pool_handle_from_proto
from kvcached.contract.socket_path import default_socket
from kvcached.contract.pool import PoolHandle
from kvcached.v1 import kvcached_pb2 as pb
from kvcached_client.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PoolMappingError,
    UnavailableError,
)
from kvcached_client.pool import PoolMap
from kvcached_client.receipts import PutReceipt

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
#: How NVMe-only chunks reach a client unless it says otherwise. bench/chunk_read.py measured
#: the complete direct path (acquire + read the LMDB file + one copy) 1.5x faster than daemon
#: promotion (acquire + copy NVMe->pool + copy pool->client) on this hardware. A client that
#: cannot open the LMDB file (another user, another container) falls back to "promote".
NVME_READ_DEFAULT = "direct"
NVME_READ_MODES = ("promote", "direct")
#: Errors from releasing a lease that say the daemon no longer holds it: its session ended
#: (FAILED_PRECONDITION), the daemon restarted (NOT_FOUND), or the daemon is down (UNAVAILABLE;
#: a daemon that comes back has none of the old leases).
GONE = (FailedPreconditionError, NotFoundError, UnavailableError)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * MiB),
    ("grpc.max_send_message_length", 256 * MiB),
    # Reconnect quickly after a daemon restart. gRPC's defaults (1 s initial backoff, x1.6,
    # up to 120 s) left a client failing with UNAVAILABLE for seconds after the daemon was back
    # (tests/reliability/test_crash.py); a refused Unix-socket connect costs microseconds.
    # Not grpc.min_reconnect_backoff_ms: gRPC also uses it as the minimum *connect timeout*
    # (20 s by default), and at 100 ms a loaded daemon's new clients failed with "connection
    # attempt timed out before receiving SETTINGS frame" (bench/soak.py).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def target(socket: str | None) -> str:
    """``unix:PATH`` for a socket path (default: $KVCACHED_SOCKET or the runtime dir)."""
    path = socket or default_socket()
    if path.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return path
    return f"unix:{os.path.abspath(path)}"


def pack_tokens(tokens: "TokenInput | torch.Tensor") -> bytes:
    """Token ids as packed little-endian uint32 (what the wire carries)."""
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()  # type: ignore[union-attr]
    try:
        return normalize_tokens(tokens)  # type: ignore[arg-type]
    except KvcacheError as e:
        raise InvalidArgumentError(str(e)) from e


def layout_request(layout: KVLayout) -> pb.RegisterLayoutRequest:
    return pb.RegisterLayoutRequest(layout=layout_to_proto(layout))


def handle_from_proto(msg: pb.PoolHandle) -> PoolHandle:
    """The daemon's pool handle, checked; an unusable one is a :class:`PoolMappingError` (so an
    acquire that wanted direct NVMe reads falls back to promotion, like any mapping failure)."""
    try:
        return pool_handle_from_proto(msg)
    except KvcacheError as e:
        raise PoolMappingError(str(e)) from e




@dataclass(frozen=True)
class Location:
    position: int
    offset: int
    nbytes: int
    nvme_key: bytes = b""  # set when the chunk is to be read from the NVMe tier directly


def locations(msg: pb.ChunkLocations) -> tuple[Location, ...]:
    """Unpack a ChunkLocations message (packed offsets) into one Location per chunk."""
    keys = iter(msg.nvme_keys)
    first, n = msg.first_position, msg.chunk_bytes
    return tuple(
        Location(first + i, off, n, next(keys) if off == NVME_CHUNK else b"") for i, off in enumerate(msg.offsets)
    )


def validate_kv(layout: KVLayout, kv: "torch.Tensor", n_tokens: int) -> None:
    from kvcached.contract.kv import validate_kv as _validate

    try:
        _validate(layout, kv)
    except KvcacheError as e:
        raise InvalidArgumentError(str(e)) from e
    if kv.shape[3] < n_tokens // layout.chunk_tokens * layout.chunk_tokens:
        raise InvalidArgumentError(
            f"kv covers {kv.shape[3]} tokens but the prompt has {n_tokens // layout.chunk_tokens} full chunks "
            f"({n_tokens // layout.chunk_tokens * layout.chunk_tokens} tokens)"
        )


def pool_runs(offsets: "Sequence[int] | np.ndarray", chunk_bytes: int, slab_bases: Sequence[int] = (),
              positions: "Sequence[int] | None" = None) -> list[tuple[int, int]]:
    """(first index, length) of each run of pool chunks laid back to back (offset i + 1 =
    offset i + ``chunk_bytes``), in order; an NVMe chunk (``NVME_CHUNK``) is a run of its own, as
    is every chunk where a slab starts, and, given ``positions``, every chunk whose position does
    not follow the one before. (Blocks start at 64-byte multiples, so chunks of a size that is not
    one are never back to back: every run is of one.) The Python work is per run, not per chunk:
    a prompt stored into free pool room is one run, however many chunks it has."""
    off = np.asarray(offsets, dtype=np.uint64)
    n = len(off)
    if n == 0:
        return []
    nvme = off == np.uint64(NVME_CHUNK)
    breaks = np.ones(n, dtype=bool)  # a run starts at i
    if n > 1:
        breaks[1:] = (off[1:] != off[:-1] + np.uint64(chunk_bytes)) | nvme[1:] | nvme[:-1]
        if positions is not None:
            pos = np.asarray(positions, dtype=np.int64)
            breaks[1:] |= pos[1:] != pos[:-1] + 1
    if len(slab_bases) > 1:
        breaks |= np.isin(off, np.asarray(slab_bases[1:], dtype=np.uint64))
    starts = np.flatnonzero(breaks)
    ends = np.append(starts[1:], n)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def is_tensor(kv: Any) -> "TypeGuard[torch.Tensor]":
    """Whether ``kv`` is one torch tensor (not per-layer KV, a sequence of (keys, values) pairs)."""
    return type(kv).__module__.startswith("torch")


def validate_layers(layout: KVLayout, layers: Any, n_tokens: int) -> None:
    """Check per-layer KV against ``layout`` for a prompt of ``n_tokens``: one (keys, values)
    pair per layer, each [kv_heads, >= full-chunk tokens, head_dim] of the layout's dtype."""
    from kvcached.contract.kv import torch_dtype

    want = torch_dtype(layout.dtype)
    if len(layers) != layout.num_layers:
        raise InvalidArgumentError(f"KV has {len(layers)} layers; layout {layout.model} has {layout.num_layers}")
    full = n_tokens // layout.chunk_tokens * layout.chunk_tokens
    for i, pair in enumerate(layers):
        if len(pair) != 2:
            raise InvalidArgumentError(f"layer {i}'s KV is not a (keys, values) pair")
        for t in pair:
            s = tuple(t.shape)
            if t.dtype != want or len(s) != 3 or s[0] != layout.num_kv_heads or s[2] != layout.head_dim:
                raise InvalidArgumentError(
                    f"layer {i}'s KV is {t.dtype} {list(s)}; layout {layout.model} needs {want} "
                    f"[{layout.num_kv_heads}, n_tokens, {layout.head_dim}]")
            if s[1] < full:
                raise InvalidArgumentError(f"layer {i}'s KV covers {s[1]} tokens but the prompt has {full} in full chunks")


def write_slots(pool: PoolMap, layout: KVLayout, slots: Sequence[Location], kv: Any) -> None:
    """Copy the reserved chunks of ``kv`` straight into their pool blocks: per run of blocks laid
    back to back (a whole prompt, when the pool had room for it in one piece), one copy from a
    [2, layers, kv_heads, tokens, head_dim] tensor, or one per layer and K/V from per-layer KV
    (``[(keys, values), ...]``, each [kv_heads, tokens, head_dim]), which spares the caller
    stacking its layers into one tensor first (a whole extra copy of the prompt's KV;
    bench/hf_path.py times both)."""
    c = layout.chunk_tokens
    devices = set()
    per_layer = not is_tensor(kv)
    runs = pool_runs([s.offset for s in slots], layout.chunk_bytes, pool.slab_bases(), [s.position for s in slots])
    for i, m in runs:
        s = slots[i]
        block = pool.run_view(layout, s.offset, m)  # [m, 2, L, H, T, D]
        a, b = s.position * c, (s.position + m) * c
        if per_layer:
            for layer, pair in enumerate(kv):
                for j, t in enumerate(pair):  # [H, T, D] -> [m, H, c, D]
                    block[:, j, layer].copy_(t[:, a:b].unflatten(1, (m, c)).transpose(0, 1), non_blocking=True)
        else:
            block.copy_(kv[:, :, :, a:b, :].unflatten(3, (m, c)).permute(3, 0, 1, 2, 4, 5), non_blocking=True)
        devices.add(block.device)
    _sync(devices)  # the commit must not overtake the copies


def sync_devices(pool: PoolMap, offsets: Sequence[int]) -> None:
    """Wait for the GPU work queued on the slabs of these pool offsets (none for a host pool)."""
    try:
        _sync({pool.device_of(off) for off in offsets})
    except PoolMappingError:  # a slab that was never mapped here: nothing of ours is queued on it
        pass


def _sync(devices: "set[torch.device]") -> None:
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        import torch

        for d in cuda:
            torch.cuda.synchronize(d)


def placement_of(device: "str | torch.device | None") -> str:
    """A client's placement: a CUDA device becomes its UUID, a string is taken as is (a UUID or
    ``host:K``), the CPU or None is unplaced ("")."""
    if device is None:
        return ""
    if isinstance(device, str) and not device.startswith("cuda"):
        return "" if device == "cpu" else device
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return ""
    from kvcached.contract.poolmap import device_uuid

    return device_uuid(dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()))


@dataclass(frozen=True)
class LeaseTicket:
    """A lease's chunk locations, to hand to another reader on this host (picklable)."""

    layout: KVLayout
    response: bytes  # the serialized AcquireResponse


@dataclass(frozen=True)
class ReservationTicket:
    """A reservation's slots, for another writer on this host to fill (picklable); the holder
    commits (see :meth:`kvcached_client.client.Reservation.ticket`)."""

    layout: KVLayout
    response: bytes  # the serialized ReserveResponse


def tokens_array(tokens: bytes) -> np.ndarray:
    return np.frombuffer(tokens, dtype="<u4")


class LeaseBase:
    """What both lease flavours hold: the pinned prefix's packed locations, read lazily."""

    def __init__(self, client: Any, layout: KVLayout, resp: pb.AcquireResponse) -> None:
        self._client = client
        self.layout = layout
        self.lease_id: str = resp.lease_id
        self.matched_tokens: int = resp.matched_tokens
        self._response = resp
        self._chunks = resp.chunks
        self._offsets = list(resp.chunks.offsets)
        self._generation: str = resp.pool_generation
        self.session_id: str = ""  # the session it was granted under: the daemon binds it there
        self.ttl_seconds: float = resp.ttl_seconds
        self.released = False
        self._nvme_cache: dict[int, "torch.Tensor"] = {}  # NVMe chunks read directly, on the pool's device
        self._cuda_reads: "set[torch.device]" = set()  # GPUs whose pool blocks were viewed (read or handed out)

    def __len__(self) -> int:
        return len(self._offsets)

    def ticket(self) -> LeaseTicket:
        """What another client (another process on this host) needs to read this lease's chunks
        with ``open_lease``: picklable, a few bytes per chunk. The lease must stay held until
        that reader is done."""
        return LeaseTicket(self.layout, self._response.SerializeToString())

    @property
    def locations(self) -> tuple[Location, ...]:
        return locations(self._chunks)

    def _check_live(self) -> None:
        if self.released:
            raise FailedPreconditionError("the lease was released; its chunks may already hold other data")

    def _nvme_key(self, i: int) -> bytes:
        """LMDB key of chunk ``i`` (an NVME_CHUNK entry); the position map is built once."""
        keys = self.__dict__.get("_nvme_keys")
        if keys is None:
            it = iter(self._chunks.nvme_keys)
            keys = self._nvme_keys = {j: next(it) for j, off in enumerate(self._offsets) if off == NVME_CHUNK}
        return keys[i]

    def chunk(self, i: int) -> "torch.Tensor":
        """Chunk ``i`` as a [2, layers, kv_heads, chunk_tokens, head_dim] tensor on the pool's
        device: a view of the pool (no copy), or, for a chunk read straight from NVMe, a new
        tensor (read into host memory, then moved to the pool's device)."""
        self._check_live()
        if self._offsets[i] == NVME_CHUNK:
            t = self._nvme_cache.get(i)
            if t is None:
                t = self._nvme_cache[i] = self._read_nvme(i).to(self._client._pool.device)
            return t
        return self._pool_chunk(i)

    def copy_chunk(self, i: int, out: "torch.Tensor") -> "torch.Tensor":
        """Copy chunk ``i`` into ``out`` (same shape and dtype, any device).

        Prefer this to ``out.copy_(lease.chunk(i))`` for chunks read from NVMe directly: it
        copies from the LMDB page cache straight into a contiguous host ``out`` (one copy), and
        into any other ``out`` through one host tensor, never through the pool's device.
        """
        self._check_live()
        if self._offsets[i] == NVME_CHUNK and i not in self._nvme_cache:
            if out.device.type == "cpu" and out.is_contiguous():
                self._client._nvme.read_into(self.layout, self._nvme_key(i), out)
                return out
            return out.copy_(self._read_nvme(i))
        return out.copy_(self.chunk(i))

    def kv(self) -> "torch.Tensor":
        """The whole matched prefix as one new tensor [2, layers, kv_heads, matched_tokens, head_dim]
        (a copy) on the pool's device, whichever tier each chunk came from."""
        import torch

        from kvcached.contract.kv import torch_dtype

        c, lay = self.layout.chunk_tokens, self.layout
        out = torch.empty((2, lay.num_layers, lay.num_kv_heads, len(self) * c, lay.head_dim),
                          dtype=torch_dtype(lay.dtype), device=self._client._pool.device)
        self.copy_into(out)
        return out

    def copy_into(self, out: "torch.Tensor", first: int = 0) -> "torch.Tensor":
        """Copy chunks ``first``.. into ``out`` ([2, layers, kv_heads, tokens, head_dim], tokens
        a multiple of the chunk size, any device): one copy per run of pool blocks laid back to
        back (usually the whole prompt), chunk by chunk only for chunks read from NVMe."""
        self._check_live()
        c = self.layout.chunk_tokens
        n = min(len(self) - first, out.shape[3] // c)
        for i, k in self._runs(first, n):
            dest = out[:, :, :, (i - first) * c : (i - first + k) * c]
            if k == 1:
                self.copy_chunk(i, dest)
            else:
                dest.unflatten(3, (k, c)).copy_(self._pool_run(i, k).permute(1, 2, 3, 0, 4, 5))
        return out

    def runs(self) -> "list[tuple[int, torch.Tensor]]":
        """The whole prefix as (first chunk, tensor [k, 2, layers, kv_heads, chunk_tokens, head_dim])
        pairs in order: a view of the pool (no copy) per run of blocks laid back to back, usually
        one for the whole prompt; a chunk read from NVMe is a run of one (read as :meth:`chunk`
        does). A reader that walks runs instead of calling :meth:`chunk` per chunk does Python
        work per run, not per chunk."""
        self._check_live()
        return [(i, self._pool_run(i, k) if k > 1 else self.chunk(i).unsqueeze(0))
                for i, k in self._runs(0, len(self))]

    def chunk_views(self, first: int = 0, n: int | None = None) -> "list[torch.Tensor]":
        """Chunks ``first``.. (``n`` of them, default all) as tensors [2, layers, kv_heads,
        chunk_tokens, head_dim], as :meth:`chunk` gives them, but cut from one view per run of
        blocks laid back to back: the per-chunk work is torch's, not a pool lookup each. For
        readers that need each chunk apart (paged engines scatter chunks to scattered pages)."""
        self._check_live()
        n = len(self) - first if n is None else min(n, len(self) - first)
        out: "list[torch.Tensor]" = []
        for i, k in self._runs(first, max(0, n)):
            if k == 1:
                out.append(self.chunk(i))
            else:
                out.extend(self._pool_run(i, k).unbind(0))
        return out

    def _runs(self, first: int, n: int) -> list[tuple[int, int]]:
        """Runs of chunks ``first``..``first + n - 1`` (see :func:`pool_runs`)."""
        pool = self._client._pool
        return [(first + i, k) for i, k in pool_runs(self._offsets[first:first + n], self.layout.chunk_bytes,
                                                     pool.slab_bases())]

    def _pool_run(self, i: int, k: int) -> "torch.Tensor":
        """Chunks ``i``..``i + k - 1``, laid back to back in the pool, as one view [k, 2, L, H, T, D]."""
        return self._pool_view(i, lambda pool: pool.run_view(self.layout, self._offsets[i], k))

    def _read_nvme(self, i: int) -> "torch.Tensor":
        """NVMe chunk ``i``, read from the LMDB file into a new host tensor."""
        return self._client._nvme.read(self.layout, self._nvme_key(i))

    def _sync_device(self) -> None:
        """Wait for the GPU work still queued on this lease's pool blocks; call before releasing.

        Reads of a CUDA pool (``out.copy_(lease.chunk(i))``, :meth:`kv`) are asynchronous: a
        lease released while a kernel still reads its block lets the daemon hand the block to a
        writer in another process, whose bytes the kernel may then read. So a lease that handed
        out a view of a CUDA pool synchronises that device (all its streams: the views may be
        read on any). A host pool, or a lease that handed out no CUDA view, costs nothing here.
        """
        _sync(self._cuda_reads)

    def _pool_chunk(self, i: int) -> "torch.Tensor":
        return self._pool_view(i, lambda pool: pool.view(self.layout, self._offsets[i], self._chunks.chunk_bytes))

    def _pool_view(self, i: int, make: "Callable[[PoolMap], torch.Tensor]") -> "torch.Tensor":
        """``make(pool)``: a view of pool blocks from chunk ``i`` on, checked against the lease."""
        pool = self._client._pool
        view = make(pool)
        if pool.generation != self._generation:
            # The daemon restarted and this client mapped the new pool: the lease's offsets point
            # into blocks the new daemon owns (tests/reliability/test_crash.py read wrong bytes).
            raise FailedPreconditionError("the daemon restarted since this lease was granted; "
                                          "its chunks are gone, acquire again")
        device = pool.device_of(self._offsets[i])
        if device.type == "cuda":
            self._cuda_reads.add(device)
        return view


class ReservationBase:
    """What both clients' reservations hold and do without a call: the slots to write, their
    pool views, tickets, the receipt of a put that wrote nothing. The clients add ``commit``
    and ``abort`` (a call, blocking or awaited)."""

    def __init__(self, client: Any, layout: KVLayout, resp: pb.ReserveResponse, session_id: str) -> None:
        self._client = client
        self.layout = layout
        self._response = resp
        self.reservation_id: str = resp.reservation_id
        self.session_id = session_id
        self.slots: tuple[Location, ...] = locations(resp.slots)
        self.cached_tokens: int = resp.cached_tokens
        self.in_flight_tokens: int = resp.in_flight_tokens
        self.durable_tokens: int = resp.durable_tokens
        self.write_through: bool = resp.write_through
        #: Full chunks after the reserved ones that found no room (a full pool), and why.
        self.not_reserved_tokens: int = resp.not_reserved_tokens
        self.not_reserved_reason: str = resp.not_reserved_reason
        self._generation: str = resp.pool_generation
        self.done = not self.reservation_id  # nothing was reserved: nothing to commit

    @property
    def opened(self) -> bool:
        """Whether the daemon opened a reservation (False: nothing to write, nothing to commit)."""
        return bool(self.reservation_id)

    def receipt(self) -> PutReceipt:
        """What a put that wrote nothing reports: the prompt as cached when reserved."""
        return PutReceipt(0, self.cached_tokens, self.durable_tokens, self.in_flight_tokens, self.write_through,
                          self.not_reserved_tokens, self.not_reserved_reason)

    def view(self, slot: Location) -> "torch.Tensor":
        """The pool block reserved for ``slot`` (no copy): write the chunk's KV into it."""
        if self.done:
            raise FailedPreconditionError("the reservation was committed or aborted")
        pool = self._client._pool
        if pool.generation != self._generation:
            raise FailedPreconditionError("the daemon restarted since this reservation was made; reserve again")
        return pool.view(self.layout, slot.offset, slot.nbytes)

    def ticket(self) -> ReservationTicket:
        """What another client on this host needs to write this reservation's slots
        (``open_reservation``); this reservation's holder still commits it."""
        return ReservationTicket(self.layout, self._response.SerializeToString())

    def _commit_request(self, release: "Sequence[LeaseBase]", chunks: int | None
                        ) -> "pb.CommitRequest | pb.CommitReleaseRequest":
        """The commit's request (CommitRelease when it also gives ``release`` back), after
        synchronising the devices that wrote the slots and those that read the leases; marks
        this reservation and those leases done: a commit is not retried."""
        if self.done:
            raise FailedPreconditionError("the reservation was already committed or aborted")
        if self.slots and self._client._pool.generation == self._generation:
            sync_devices(self._client._pool, [s.offset for s in self.slots])
        self.done = True
        ids = [lease.lease_id for lease in release if not lease.released and lease.lease_id]
        for lease in release:
            lease._sync_device()
            lease.released = True
        if not ids:
            return pb.CommitRequest(reservation_id=self.reservation_id, session_id=self.session_id, chunks=chunks)
        return pb.CommitReleaseRequest(reservation_id=self.reservation_id, lease_ids=ids, session_id=self.session_id,
                                       chunks=chunks)


class CacheRequestBase:
    """One request's lease and reservation (see ``acquire_reserve``); the clients add ``finish``."""

    def __init__(self, client: Any, lease: LeaseBase, reservation: ReservationBase) -> None:
        self._client = client
        self.lease = lease
        self.reservation = reservation

    @property
    def matched_tokens(self) -> int:
        return self.lease.matched_tokens

    def write(self, kv: "torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]") -> None:
        """Copy the reserved chunks of ``kv``, the prompt's KV from its first token, into their
        pool room: one tensor [2, layers, kv_heads, >= tokens, head_dim], or per layer a (keys,
        values) pair of [kv_heads, >= tokens, head_dim] tensors, as an engine's cache holds them
        (no need to stack them into one tensor first)."""
        slots = self.reservation.slots
        if slots:
            layout = self.reservation.layout
            n = (slots[-1].position + 1) * layout.chunk_tokens
            if is_tensor(kv):
                validate_kv(layout, kv, n)
            else:
                validate_layers(layout, kv, n)
            write_slots(self._client._pool, layout, slots, kv)
