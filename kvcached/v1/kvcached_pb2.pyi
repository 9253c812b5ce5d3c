from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens", "lora_name", "lora_version", "extra", "vocab_size")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int
    lora_name: str
    lora_version: str
    extra: _containers.ScalarMap[str, str]
    vocab_size: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_version: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class RegisterLayoutResponse(_message.Message):
    __slots__ = ("layout_id", "chunk_bytes")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    chunk_bytes: int
    def __init__(self, layout_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout_id", "tokens")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    tokens: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout_id: _Optional[str] = ..., tokens: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkLocations(_message.Message):
    __slots__ = ("first_position", "chunk_bytes", "offsets", "nvme_keys")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NVME_KEYS_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    chunk_bytes: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    nvme_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, first_position: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., nvme_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("layout_id", "tokens", "session_id", "ttl_seconds", "read_nvme_directly", "no_cache", "placement")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_NVME_DIRECTLY_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    tokens: bytes
    session_id: str
    ttl_seconds: float
    read_nvme_directly: bool
    no_cache: bool
    placement: str
    def __init__(self, layout_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., session_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., read_nvme_directly: _Optional[bool] = ..., no_cache: _Optional[bool] = ..., placement: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "matched_tokens", "chunks", "ttl_seconds", "pool_generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    matched_tokens: int
    chunks: ChunkLocations
    ttl_seconds: float
    pool_generation: str
    def __init__(self, lease_id: _Optional[str] = ..., matched_tokens: _Optional[int] = ..., chunks: _Optional[_Union[ChunkLocations, _Mapping]] = ..., ttl_seconds: _Optional[float] = ..., pool_generation: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids", "session_id")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_ids", "ttl_seconds", "session_id")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    ttl_seconds: float
    session_id: str
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., ttl_seconds: _Optional[float] = ..., session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("layout_id", "tokens", "session_id", "ttl_seconds", "no_store", "expected_output_tokens", "skip_empty", "placement")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_STORE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_EMPTY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    tokens: bytes
    session_id: str
    ttl_seconds: float
    no_store: bool
    expected_output_tokens: int
    skip_empty: bool
    placement: str
    def __init__(self, layout_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., session_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., no_store: _Optional[bool] = ..., expected_output_tokens: _Optional[int] = ..., skip_empty: _Optional[bool] = ..., placement: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "cached_tokens", "in_flight_tokens", "slots", "ttl_seconds", "pool_generation", "durable_tokens", "write_through", "not_reserved_tokens", "not_reserved_reason")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_THROUGH_FIELD_NUMBER: _ClassVar[int]
    NOT_RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOT_RESERVED_REASON_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    cached_tokens: int
    in_flight_tokens: int
    slots: ChunkLocations
    ttl_seconds: float
    pool_generation: str
    durable_tokens: int
    write_through: bool
    not_reserved_tokens: int
    not_reserved_reason: str
    def __init__(self, reservation_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., in_flight_tokens: _Optional[int] = ..., slots: _Optional[_Union[ChunkLocations, _Mapping]] = ..., ttl_seconds: _Optional[float] = ..., pool_generation: _Optional[str] = ..., durable_tokens: _Optional[int] = ..., write_through: _Optional[bool] = ..., not_reserved_tokens: _Optional[int] = ..., not_reserved_reason: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "chunks", "session_id")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    chunks: int
    session_id: str
    def __init__(self, reservation_id: _Optional[str] = ..., chunks: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed_chunks", "cached_tokens", "durable_tokens", "write_through")
    COMMITTED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_THROUGH_FIELD_NUMBER: _ClassVar[int]
    committed_chunks: int
    cached_tokens: int
    durable_tokens: int
    write_through: bool
    def __init__(self, committed_chunks: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., durable_tokens: _Optional[int] = ..., write_through: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_ids", "session_id")
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_ids: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    def __init__(self, reservation_ids: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class AcquireReserveRequest(_message.Message):
    __slots__ = ("layout_id", "tokens", "session_id", "lease_ttl_seconds", "reservation_ttl_seconds", "read_nvme_directly", "no_cache", "no_store", "expected_output_tokens", "placement")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_NVME_DIRECTLY_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    NO_STORE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    tokens: bytes
    session_id: str
    lease_ttl_seconds: float
    reservation_ttl_seconds: float
    read_nvme_directly: bool
    no_cache: bool
    no_store: bool
    expected_output_tokens: int
    placement: str
    def __init__(self, layout_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., session_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[float] = ..., reservation_ttl_seconds: _Optional[float] = ..., read_nvme_directly: _Optional[bool] = ..., no_cache: _Optional[bool] = ..., no_store: _Optional[bool] = ..., expected_output_tokens: _Optional[int] = ..., placement: _Optional[str] = ...) -> None: ...

class AcquireReserveResponse(_message.Message):
    __slots__ = ("lease", "reservation")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    lease: AcquireResponse
    reservation: ReserveResponse
    def __init__(self, lease: _Optional[_Union[AcquireResponse, _Mapping]] = ..., reservation: _Optional[_Union[ReserveResponse, _Mapping]] = ...) -> None: ...

class CommitReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "chunks", "lease_ids", "session_id")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    chunks: int
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    def __init__(self, reservation_id: _Optional[str] = ..., chunks: _Optional[int] = ..., lease_ids: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class CommitReleaseResponse(_message.Message):
    __slots__ = ("commit", "released")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    commit: CommitResponse
    released: int
    def __init__(self, commit: _Optional[_Union[CommitResponse, _Mapping]] = ..., released: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("client_name", "release_lease_ids", "abort_reservation_ids", "seq", "call_id", "acquire_reserve", "commit_release", "commit", "acquire", "reserve", "lookup")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_RESERVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    release_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    abort_reservation_ids: _containers.RepeatedScalarFieldContainer[str]
    seq: int
    call_id: int
    acquire_reserve: AcquireReserveRequest
    commit_release: CommitReleaseRequest
    commit: CommitRequest
    acquire: AcquireRequest
    reserve: ReserveRequest
    lookup: LookupRequest
    def __init__(self, client_name: _Optional[str] = ..., release_lease_ids: _Optional[_Iterable[str]] = ..., abort_reservation_ids: _Optional[_Iterable[str]] = ..., seq: _Optional[int] = ..., call_id: _Optional[int] = ..., acquire_reserve: _Optional[_Union[AcquireReserveRequest, _Mapping]] = ..., commit_release: _Optional[_Union[CommitReleaseRequest, _Mapping]] = ..., commit: _Optional[_Union[CommitRequest, _Mapping]] = ..., acquire: _Optional[_Union[AcquireRequest, _Mapping]] = ..., reserve: _Optional[_Union[ReserveRequest, _Mapping]] = ..., lookup: _Optional[_Union[LookupRequest, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "pool_generation", "acked_seq", "stream_calls", "call_id", "error", "acquire_reserve", "commit_release", "commit", "acquire", "reserve", "lookup")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    STREAM_CALLS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_RESERVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_generation: str
    acked_seq: int
    stream_calls: bool
    call_id: int
    error: CallError
    acquire_reserve: AcquireReserveResponse
    commit_release: CommitReleaseResponse
    commit: CommitResponse
    acquire: AcquireResponse
    reserve: ReserveResponse
    lookup: LookupResponse
    def __init__(self, session_id: _Optional[str] = ..., pool_generation: _Optional[str] = ..., acked_seq: _Optional[int] = ..., stream_calls: _Optional[bool] = ..., call_id: _Optional[int] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., acquire_reserve: _Optional[_Union[AcquireReserveResponse, _Mapping]] = ..., commit_release: _Optional[_Union[CommitReleaseResponse, _Mapping]] = ..., commit: _Optional[_Union[CommitResponse, _Mapping]] = ..., acquire: _Optional[_Union[AcquireResponse, _Mapping]] = ..., reserve: _Optional[_Union[ReserveResponse, _Mapping]] = ..., lookup: _Optional[_Union[LookupResponse, _Mapping]] = ...) -> None: ...

class PoolHandleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("kind", "name", "ipc_handle", "block_bytes", "num_blocks", "generation", "device_uuid", "nvme_path", "ipc_size_bytes", "ipc_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_index", "size_bytes", "align_bytes", "slabs")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    NVME_PATH_FIELD_NUMBER: _ClassVar[int]
    IPC_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IPC_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIGN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLABS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    ipc_handle: bytes
    block_bytes: int
    num_blocks: int
    generation: str
    device_uuid: str
    nvme_path: str
    ipc_size_bytes: int
    ipc_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_index: int
    size_bytes: int
    align_bytes: int
    slabs: _containers.RepeatedCompositeFieldContainer[PoolSlab]
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., generation: _Optional[str] = ..., device_uuid: _Optional[str] = ..., nvme_path: _Optional[str] = ..., ipc_size_bytes: _Optional[int] = ..., ipc_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_index: _Optional[int] = ..., size_bytes: _Optional[int] = ..., align_bytes: _Optional[int] = ..., slabs: _Optional[_Iterable[_Union[PoolSlab, _Mapping]]] = ...) -> None: ...

class PoolSlab(_message.Message):
    __slots__ = ("base", "placement", "handle")
    BASE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    base: int
    placement: str
    handle: PoolHandle
    def __init__(self, base: _Optional[int] = ..., placement: _Optional[str] = ..., handle: _Optional[_Union[PoolHandle, _Mapping]] = ...) -> None: ...

class PutBytesRequest(_message.Message):
    __slots__ = ("layout_id", "tokens", "chunks", "session_id", "no_store", "expected_output_tokens", "placement")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NO_STORE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    tokens: bytes
    chunks: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    no_store: bool
    expected_output_tokens: int
    placement: str
    def __init__(self, layout_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., chunks: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., no_store: _Optional[bool] = ..., expected_output_tokens: _Optional[int] = ..., placement: _Optional[str] = ...) -> None: ...

class GetBytesRequest(_message.Message):
    __slots__ = ("layout_id", "tokens", "session_id")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    tokens: bytes
    session_id: str
    def __init__(self, layout_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., session_id: _Optional[str] = ...) -> None: ...

class GetBytesResponse(_message.Message):
    __slots__ = ("matched_tokens", "chunks")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    chunks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, matched_tokens: _Optional[int] = ..., chunks: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("doctor",)
    DOCTOR_FIELD_NUMBER: _ClassVar[int]
    doctor: bool
    def __init__(self, doctor: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json", "version", "uptime_seconds", "listen")
    JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    json: str
    version: str
    uptime_seconds: float
    listen: str
    def __init__(self, json: _Optional[str] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., listen: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("layout_id", "prefix_tokens")
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layout_id: str
    prefix_tokens: bytes
    def __init__(self, layout_id: _Optional[str] = ..., prefix_tokens: _Optional[bytes] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("chunks", "bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    def __init__(self, chunks: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("flushed_chunks", "leases_active")
    FLUSHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    flushed_chunks: int
    leases_active: int
    def __init__(self, flushed_chunks: _Optional[int] = ..., leases_active: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
