"""What the scheduler side tells the worker side each step, and what comes back.

Both travel between processes (vLLM pickles them to its workers), so they hold plain data:
block ids, lease and reservation tickets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcached_client._core import LeaseTicket, ReservationTicket


@dataclass(frozen=True)
class LoadPlan:
    """Copy cached chunks into a request's blocks, before its forward.

    Block ``block_ids[j]`` receives the tokens ``[(first_block + j) * block_size, ...)`` of the
    prompt. ``tickets[r]`` is tensor-parallel rank r's lease (None: its acquire failed), and
    ``loadable_blocks[r]`` how many of the blocks that lease covers; the blocks past it are
    reported to vLLM as failed loads, so vLLM recomputes them."""

    req_id: str
    first_block: int
    block_ids: tuple[int, ...]
    tickets: tuple[LeaseTicket | None, ...]
    loadable_blocks: tuple[int, ...]


@dataclass(frozen=True)
class SavePlan:
    """Write the request's reserved chunks ``from_chunk <= position < to_chunk`` (whole now)
    into their pool room. ``tickets[r]`` is rank r's reservation (None: nothing to write for
    it); ``block_ids`` the blocks of the prompt's first ``to_chunk`` chunks, in order. The
    scheduler side commits once the worker reports them written."""

    req_id: str
    tickets: tuple[ReservationTicket | None, ...]  # per tensor-parallel rank
    from_chunk: int
    to_chunk: int
    block_ids: tuple[int, ...]


@dataclass
class KvcachedMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class KvcachedWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose loads of this step are done (so the scheduler may release their leases),
    and, per (request, rank), the chunk up to which its reserved chunks are written (-1: a
    write failed, commit nothing more)."""

    loaded: set[str] = field(default_factory=set)
    saved: dict[tuple[str, int], int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcachedWorkerMetadata)
        saved = dict(self.saved)
        for key, n in other.saved.items():
            saved[key] = min(saved[key], n) if key in saved else n
        return KvcachedWorkerMetadata(self.loaded | other.loaded, saved)
