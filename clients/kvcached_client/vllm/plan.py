"""What the scheduler side tells the worker side each step, and what comes back.

Both travel between processes (vLLM pickles them to its workers), so they hold plain data:
block ids, lease and reservation tickets, and the key of the *attempt* they belong to (one
AcquireReserve of one request: a preempted request that comes back makes a new attempt, and
the old one's reports must not be taken for the new one's).

Every plan handed to a worker is reported back by every tensor-parallel rank exactly once, when
that rank's copies for it have *completed* (not merely been queued on a CUDA stream). The
scheduler side releases a lease, commits a reservation or gives its room back only after every
rank reported every plan it was given for it: under vLLM's async scheduling a request can be
aborted or preempted while the worker still runs the step that copies its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcached_client._core import LeaseTicket, ReservationTicket

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # the worker's data path runs without vLLM too (bench/gpu_check.py on a bare GPU machine)
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorHandshakeMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass


@dataclass(frozen=True)
class LoadPlan:
    """Copy cached chunks into a request's blocks.

    Block ``block_ids[g][j]`` of KV-cache group ``g`` receives the tokens ``[(first_block + j) *
    block_size, ...)`` of the prompt for that group's layers (one group unless the model mixes
    attention kinds). Block id 0 is vLLM's null block: a sliding-window group gets it for the
    blocks before its window, and nothing is copied there. ``tickets[r]`` is tensor-parallel rank
    r's lease (None: its acquire failed), and ``loadable_blocks[r]`` how many of the blocks that
    lease covers; the blocks past it are reported to vLLM as failed loads, so vLLM recomputes
    them.

    ``load_before`` is when the daemon may end the leases, less a margin for the copies
    (``time.monotonic()``, one clock for every process of a Linux host): a worker that would copy
    later refuses the whole plan (failed blocks) instead of reading pool blocks the daemon may
    have handed to other chunks by then. ``async_load``: vLLM waits for the request in
    WAITING_FOR_REMOTE_KVS, and the worker reports it in ``get_finished`` once the copies are
    done on every rank; otherwise the load feeds this step's forward."""

    req_id: str
    key: int  # the attempt
    first_block: int
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group
    tickets: tuple[LeaseTicket | None, ...]
    loadable_blocks: tuple[int, ...]
    load_before: float
    async_load: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids[0])

    def failed_block_ids(self, done: int) -> list[int]:
        """Every group's (real) blocks from the ``done``-th on: what vLLM must recompute."""
        return [b for ids in self.block_ids for b in ids[done:] if b != NULL_BLOCK]


#: vLLM's null block (``BlockPool.null_block``): stands for blocks a request does not hold.
NULL_BLOCK = 0


@dataclass(frozen=True)
class SavePlan:
    """Write the request's blocks ``from_block <= b < to_block`` into the reserved chunks they
    belong to (reserved positions only). ``block_ids[g]`` are group ``g``'s ids of those blocks, in
    order. After it the reserved chunks before ``to_chunk`` are whole: that is what a worker reports
    as written. Without sliding-window layers the range is whole chunks,
    written once they are whole; with them, each step's computed blocks (the last one may be
    partial, and is written again with the next step's), since vLLM frees windowed blocks as the
    request advances. ``tickets[r]`` is rank r's reservation (None: nothing to write for it).
    ``finish``: the request has finished and vLLM keeps its blocks until this plan is reported
    (its answer's chunks; :meth:`~kvcached_client.vllm.scheduler.SchedulerSide.request_finished`):
    every rank reports it in ``get_finished``'s "finished sending" once its copies are done."""

    req_id: str
    key: int  # the attempt
    tickets: tuple[ReservationTicket | None, ...]  # per tensor-parallel rank
    from_block: int
    to_block: int
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group, blocks from_block .. to_block - 1
    blocks_per_chunk: int
    to_chunk: int  # the reserved chunks before it are whole once this plan is written
    finish: bool = False


@dataclass(frozen=True)
class KvcachedHandshake(KVConnectorHandshakeMetadata):
    """A worker's word to the scheduler side at start: the device its KV cache is on (a GPU's
    UUID, ``host:K``, or "" for none), which picks its slab of the daemon's pool."""

    placement: str


@dataclass
class KvcachedMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class KvcachedWorkerMetadata(KVConnectorWorkerMetadata):
    """What one or more ranks finished since their last report, keyed by (attempt, rank):

    * ``loaded``: how many of the attempt's load plans completed on that rank (copies done);
    * ``load_failed``: attempts some of whose blocks could not be loaded on some rank;
    * ``saved``: per save plan completed, the chunk up to which the attempt's reserved chunks are
      written on that rank (-1: a write failed, commit nothing more).

    vLLM merges the ranks' reports with :meth:`aggregate` (and the connector merges one rank's
    reports of several steps the same way), so nothing is lost or counted twice."""

    loaded: dict[tuple[int, int], int] = field(default_factory=dict)
    load_failed: set[int] = field(default_factory=set)
    saved: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcachedWorkerMetadata)
        loaded = dict(self.loaded)
        for k, n in other.loaded.items():
            loaded[k] = loaded.get(k, 0) + n
        saved = {k: list(v) for k, v in self.saved.items()}
        for k, v in other.saved.items():
            saved.setdefault(k, []).extend(v)
        return KvcachedWorkerMetadata(loaded, self.load_failed | other.load_failed, saved)

    def __bool__(self) -> bool:
        return bool(self.loaded or self.load_failed or self.saved)
