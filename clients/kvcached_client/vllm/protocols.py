"""What the scheduler side reads of vLLM's objects, as structural types (``typing.Protocol``).

:mod:`~kvcached_client.vllm.scheduler` is typed against these rather than against vLLM's classes:
it does not import vLLM itself, its tests drive it with stand-ins that have the few attributes a
test needs, and it type-checks the same whether vLLM is installed or not.
:class:`~kvcached_client.vllm.connector.KvcachedConnector` types its hooks with vLLM's own classes
and hands those objects on, so where vLLM is installed mypy checks that vLLM's classes still have
what these protocols describe (vLLM 0.32; each protocol's docstring names the class it stands for).

Every member is a read-only property: the connector never writes to vLLM's objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol


class VllmSamplingParams(Protocol):
    """``vllm.sampling_params.SamplingParams``: the request's output budget."""

    @property
    def max_tokens(self) -> int | None: ...


class VllmLoRARequest(Protocol):
    """``vllm.lora.request.LoRARequest``: the adapter a request runs with (part of its layout)."""

    @property
    def lora_name(self) -> str: ...

    @property
    def lora_int_id(self) -> int: ...

    @property
    def lora_path(self) -> str: ...


class VllmRequest(Protocol):
    """``vllm.v1.request.Request``: what the scheduler side reads of a request.

    ``request_id``, ``prompt_token_ids`` (once the request is known to be cacheable) and
    ``all_token_ids`` are read as they are; the others with ``getattr`` and a default, as the
    scheduler side always did (a stand-in in a test has only some of them)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """The prompt and the output so far (read when a finished request's answer is stored)."""
        ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """``{"kvcached": {"no_store": ..., "no_cache": ...}}``: the request's cache policy."""
        ...

    @property
    def sampling_params(self) -> VllmSamplingParams | None: ...

    @property
    def lora_request(self) -> VllmLoRARequest | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def mm_features(self) -> Sequence[object]:
        """Multimodal inputs: such a request does not use the cache."""
        ...

    @property
    def prompt_embeds(self) -> object:
        """A tensor, or None: a request with prompt embeddings does not use the cache."""
        ...


class VllmBlocks(Protocol):
    """``vllm.v1.core.kv_cache_manager.KVCacheBlocks``: the blocks vLLM allocated for a request."""

    def get_block_ids(self) -> Sequence[Sequence[int]]:
        """Per KV-cache group, the block ids in order."""
        ...


class VllmNewRequest(Protocol):
    """``vllm.v1.core.sched.output.NewRequestData``: a request scheduled for the first time (or
    again after a preemption, with new blocks)."""

    @property
    def req_id(self) -> str: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]:
        """Per KV-cache group."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...


class VllmCachedRequests(Protocol):
    """``vllm.v1.core.sched.output.CachedRequestData``: the requests scheduled before, one entry
    per request in each sequence."""

    @property
    def req_ids(self) -> Sequence[str]: ...

    @property
    def resumed_req_ids(self) -> AbstractSet[str]:
        """Resumed after a preemption: their ``new_block_ids`` replace their blocks."""
        ...

    @property
    def new_block_ids(self) -> Sequence[Sequence[Sequence[int]] | None]:
        """Per request, per KV-cache group, the blocks added this step (None: none)."""
        ...

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class VllmSchedulerOutput(Protocol):
    """``vllm.v1.core.sched.output.SchedulerOutput``: one step's schedule."""

    @property
    def preempted_req_ids(self) -> AbstractSet[str] | None: ...

    @property
    def scheduled_new_reqs(self) -> Sequence[VllmNewRequest]: ...

    @property
    def scheduled_cached_reqs(self) -> VllmCachedRequests: ...

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def total_num_scheduled_tokens(self) -> int:
        """0: vLLM scheduled nothing this step (read with ``getattr``)."""
        ...


class VllmConnectorOutput(Protocol):
    """``vllm.v1.outputs.KVConnectorOutput``: what the workers' connectors reported for a step."""

    @property
    def kv_connector_worker_meta(self) -> object:
        """The ranks' reports merged (read with ``getattr``): the scheduler side takes only a
        :class:`~kvcached_client.vllm.plan.KvcachedWorkerMetadata`."""
        ...


__all__ = ["VllmBlocks", "VllmCachedRequests", "VllmConnectorOutput", "VllmLoRARequest", "VllmNewRequest",
           "VllmRequest", "VllmSamplingParams", "VllmSchedulerOutput"]
