"""What the scheduler side tells the worker side each step, and what comes back.

Both travel between processes (vLLM pickles them to its workers), so they hold plain data:
token ids packed as bytes, block ids, lease tickets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcached.keys import KVLayout
from kvcached_client._core import LeaseTicket


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
    """Store the request's full prompt chunks computed so far (the daemon skips those it has).

    ``tokens`` are the prompt's first ``len(block_ids) * block_size`` tokens, packed;
    ``block_ids`` their blocks, in order."""

    req_id: str
    layouts: tuple[KVLayout, ...]  # per tensor-parallel rank
    tokens: bytes
    block_ids: tuple[int, ...]


@dataclass
class KvcachedMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class KvcachedWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose loads of this step are done (so the scheduler may release their leases)."""

    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcachedWorkerMetadata)
        return KvcachedWorkerMetadata(self.loaded | other.loaded)
