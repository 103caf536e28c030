from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("forward_s", "total_s", "detail")
    class DetailEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    forward_s: float
    total_s: float
    detail: _containers.ScalarMap[str, float]
    def __init__(self, forward_s: _Optional[float] = ..., total_s: _Optional[float] = ..., detail: _Optional[_Mapping[str, float]] = ...) -> None: ...

class FeatureRows(_message.Message):
    __slots__ = ("pool_id", "offset", "rows", "width", "dtype")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    offset: int
    rows: int
    width: int
    dtype: str
    def __init__(self, pool_id: _Optional[str] = ..., offset: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class FeaturePool(_message.Message):
    __slots__ = ("pool_id", "size", "token", "path", "cuda")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    size: int
    token: bytes
    path: str
    cuda: CudaMemory
    def __init__(self, pool_id: _Optional[str] = ..., size: _Optional[int] = ..., token: _Optional[bytes] = ..., path: _Optional[str] = ..., cuda: _Optional[_Union[CudaMemory, _Mapping]] = ...) -> None: ...

class CudaMemory(_message.Message):
    __slots__ = ("device_uuid", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class OpenFeaturePoolResponse(_message.Message):
    __slots__ = ("timings",)
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    timings: Timings
    def __init__(self, timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("nodes", "max_depth")
    NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    nodes: bytes
    max_depth: int
    def __init__(self, nodes: _Optional[bytes] = ..., max_depth: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "logprobs", "logit_bias", "min_p", "min_tokens", "stop_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., grammar: _Optional[str] = ...) -> None: ...

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfoResponse(_message.Message):
    __slots__ = ("block_size", "target_layer_ids", "feature_dim", "vocab_size", "max_budget", "max_session_tokens", "lane_port", "max_sessions", "timings")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    feature_dim: int
    vocab_size: int
    max_budget: int
    max_session_tokens: int
    lane_port: int
    max_sessions: int
    timings: Timings
    def __init__(self, block_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., feature_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_budget: _Optional[int] = ..., max_session_tokens: _Optional[int] = ..., lane_port: _Optional[int] = ..., max_sessions: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DrafterStartSessionRequest(_message.Message):
    __slots__ = ("session_id", "capacity", "grammar", "prompt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capacity: int
    grammar: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., capacity: _Optional[int] = ..., grammar: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ...) -> None: ...

class DrafterStartSessionResponse(_message.Message):
    __slots__ = ("reused", "timings")
    REUSED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    reused: int
    timings: Timings
    def __init__(self, reused: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DrafterEndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DrafterEndSessionResponse(_message.Message):
    __slots__ = ("existed", "timings")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    timings: Timings
    def __init__(self, existed: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "features", "feature_rows", "root_token", "root_position", "budget", "top_k", "committed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROOT_POSITION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    features: Tensor
    feature_rows: FeatureRows
    root_token: int
    root_position: int
    budget: int
    top_k: int
    committed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., feature_rows: _Optional[_Union[FeatureRows, _Mapping]] = ..., root_token: _Optional[int] = ..., root_position: _Optional[int] = ..., budget: _Optional[int] = ..., top_k: _Optional[int] = ..., committed: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session_id", "features", "feature_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    features: Tensor
    feature_rows: FeatureRows
    def __init__(self, session_id: _Optional[str] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., feature_rows: _Optional[_Union[FeatureRows, _Mapping]] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("context_length", "timings")
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    context_length: int
    timings: Timings
    def __init__(self, context_length: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "timings")
    TREE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTree
    timings: Timings
    def __init__(self, tree: _Optional[_Union[DraftTree, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class VerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_context_length", "eos_token_ids", "num_layers", "hidden_size", "max_tree_size", "max_tree_depth", "max_session_tokens", "lane_port", "max_sessions", "drafts", "timings")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    hidden_size: int
    max_tree_size: int
    max_tree_depth: int
    max_session_tokens: int
    lane_port: int
    max_sessions: int
    drafts: bool
    timings: Timings
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_tree_size: _Optional[int] = ..., max_tree_depth: _Optional[int] = ..., max_session_tokens: _Optional[int] = ..., lane_port: _Optional[int] = ..., max_sessions: _Optional[int] = ..., drafts: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class VerifierStartSessionRequest(_message.Message):
    __slots__ = ("session_id", "capacity", "sampling", "tap_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TAP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capacity: int
    sampling: SamplingParams
    tap_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., capacity: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tap_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifierStartSessionResponse(_message.Message):
    __slots__ = ("timings",)
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    timings: Timings
    def __init__(self, timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class VerifierEndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class VerifierEndSessionResponse(_message.Message):
    __slots__ = ("existed", "timings")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    timings: Timings
    def __init__(self, existed: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStep]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionStep, _Mapping]]] = ...) -> None: ...

class SessionStep(_message.Message):
    __slots__ = ("session_id", "budget", "top_k", "untap", "prompt", "more", "skip_features", "start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    UNTAP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SKIP_FEATURES_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    budget: int
    top_k: int
    untap: bool
    prompt: _containers.RepeatedScalarFieldContainer[int]
    more: bool
    skip_features: int
    start: VerifierStartSessionRequest
    def __init__(self, session_id: _Optional[str] = ..., budget: _Optional[int] = ..., top_k: _Optional[int] = ..., untap: _Optional[bool] = ..., prompt: _Optional[_Iterable[int]] = ..., more: _Optional[bool] = ..., skip_features: _Optional[int] = ..., start: _Optional[_Union[VerifierStartSessionRequest, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("tokens", "logprobs", "timings")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: TokenLogprobs
    timings: Timings
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class DraftBatchRequest(_message.Message):
    __slots__ = ("drafts",)
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ...) -> None: ...

class DraftBatchResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[DraftOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[DraftOutcome, _Mapping]]] = ...) -> None: ...

class DraftOutcome(_message.Message):
    __slots__ = ("draft", "status")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    draft: DraftResponse
    status: CallStatus
    def __init__(self, draft: _Optional[_Union[DraftResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class StepBatchResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[StepOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[StepOutcome, _Mapping]]] = ...) -> None: ...

class StepOutcome(_message.Message):
    __slots__ = ("step", "status", "tree_size", "draft_status")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STATUS_FIELD_NUMBER: _ClassVar[int]
    step: StepResponse
    status: CallStatus
    tree_size: int
    draft_status: CallStatus
    def __init__(self, step: _Optional[_Union[StepResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ..., tree_size: _Optional[int] = ..., draft_status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...
