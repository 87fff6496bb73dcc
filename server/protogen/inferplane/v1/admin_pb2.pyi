from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "versions", "state", "reason", "backend", "max_batch_size", "inputs", "outputs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[str]
    state: str
    reason: str
    backend: str
    max_batch_size: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[str]] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., backend: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelStatus
    def __init__(self, model: _Optional[_Union[ModelStatus, _Mapping]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorDecl(_message.Message):
    __slots__ = ("name", "datatype", "dims", "has_range", "range_lo", "range_hi")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    HAS_RANGE_FIELD_NUMBER: _ClassVar[int]
    RANGE_LO_FIELD_NUMBER: _ClassVar[int]
    RANGE_HI_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    has_range: bool
    range_lo: float
    range_hi: float
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ..., has_range: _Optional[bool] = ..., range_lo: _Optional[float] = ..., range_hi: _Optional[float] = ...) -> None: ...

class ModelVersionInfo(_message.Message):
    __slots__ = ("name", "version", "sha256", "format", "framework", "size_bytes", "inputs", "outputs", "training_run", "dataset_version", "experiment", "parent", "owner_team", "metrics", "tags", "hardware_json", "created_at", "created_by", "has_validation_set", "signing_key_id")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    DATASET_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    OWNER_TEAM_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    HAS_VALIDATION_SET_FIELD_NUMBER: _ClassVar[int]
    SIGNING_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    sha256: str
    format: str
    framework: str
    size_bytes: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorDecl]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorDecl]
    training_run: str
    dataset_version: str
    experiment: str
    parent: str
    owner_team: str
    metrics: _containers.ScalarMap[str, float]
    tags: _containers.ScalarMap[str, str]
    hardware_json: str
    created_at: str
    created_by: str
    has_validation_set: bool
    signing_key_id: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ..., format: _Optional[str] = ..., framework: _Optional[str] = ..., size_bytes: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorDecl, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorDecl, _Mapping]]] = ..., training_run: _Optional[str] = ..., dataset_version: _Optional[str] = ..., experiment: _Optional[str] = ..., parent: _Optional[str] = ..., owner_team: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., tags: _Optional[_Mapping[str, str]] = ..., hardware_json: _Optional[str] = ..., created_at: _Optional[str] = ..., created_by: _Optional[str] = ..., has_validation_set: _Optional[bool] = ..., signing_key_id: _Optional[str] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("name", "artifact", "filename", "format", "signature_json", "validation_npz", "companions", "metrics", "tags", "hardware_json", "training_run", "dataset_version", "experiment", "parent", "owner_team", "description", "artifact_signature")
    class CompanionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_JSON_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_NPZ_FIELD_NUMBER: _ClassVar[int]
    COMPANIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_JSON_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    DATASET_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    OWNER_TEAM_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    name: str
    artifact: bytes
    filename: str
    format: str
    signature_json: str
    validation_npz: bytes
    companions: _containers.ScalarMap[str, bytes]
    metrics: _containers.ScalarMap[str, float]
    tags: _containers.ScalarMap[str, str]
    hardware_json: str
    training_run: str
    dataset_version: str
    experiment: str
    parent: str
    owner_team: str
    description: str
    artifact_signature: str
    def __init__(self, name: _Optional[str] = ..., artifact: _Optional[bytes] = ..., filename: _Optional[str] = ..., format: _Optional[str] = ..., signature_json: _Optional[str] = ..., validation_npz: _Optional[bytes] = ..., companions: _Optional[_Mapping[str, bytes]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., tags: _Optional[_Mapping[str, str]] = ..., hardware_json: _Optional[str] = ..., training_run: _Optional[str] = ..., dataset_version: _Optional[str] = ..., experiment: _Optional[str] = ..., parent: _Optional[str] = ..., owner_team: _Optional[str] = ..., description: _Optional[str] = ..., artifact_signature: _Optional[str] = ...) -> None: ...

class RegisterModelChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: RegisterModelRequest
    data: bytes
    def __init__(self, header: _Optional[_Union[RegisterModelRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("version", "created")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    version: ModelVersionInfo
    created: bool
    def __init__(self, version: _Optional[_Union[ModelVersionInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class RegisteredModel(_message.Message):
    __slots__ = ("name", "owner_team", "latest_version", "version_count", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_TEAM_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_COUNT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner_team: str
    latest_version: int
    version_count: int
    description: str
    def __init__(self, name: _Optional[str] = ..., owner_team: _Optional[str] = ..., latest_version: _Optional[int] = ..., version_count: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class ListRegisteredModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRegisteredModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[RegisteredModel]
    def __init__(self, models: _Optional[_Iterable[_Union[RegisteredModel, _Mapping]]] = ...) -> None: ...

class ShowModelRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ShowModelResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[ModelVersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[ModelVersionInfo, _Mapping]]] = ...) -> None: ...

class GetLineageRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetLineageResponse(_message.Message):
    __slots__ = ("chain",)
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    chain: _containers.RepeatedCompositeFieldContainer[ModelVersionInfo]
    def __init__(self, chain: _Optional[_Iterable[_Union[ModelVersionInfo, _Mapping]]] = ...) -> None: ...

class ServingOptions(_message.Message):
    __slots__ = ("instances", "max_batch", "queue_delay_us", "has_max_batch", "has_queue_delay_us", "cache", "has_cache", "threads", "coalesce", "coalesce_max_inflight", "coalesce_window_us")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    HAS_MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    HAS_QUEUE_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    HAS_CACHE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    COALESCE_FIELD_NUMBER: _ClassVar[int]
    COALESCE_MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    COALESCE_WINDOW_US_FIELD_NUMBER: _ClassVar[int]
    instances: int
    max_batch: int
    queue_delay_us: int
    has_max_batch: bool
    has_queue_delay_us: bool
    cache: bool
    has_cache: bool
    threads: int
    coalesce: bool
    coalesce_max_inflight: int
    coalesce_window_us: int
    def __init__(self, instances: _Optional[int] = ..., max_batch: _Optional[int] = ..., queue_delay_us: _Optional[int] = ..., has_max_batch: _Optional[bool] = ..., has_queue_delay_us: _Optional[bool] = ..., cache: _Optional[bool] = ..., has_cache: _Optional[bool] = ..., threads: _Optional[int] = ..., coalesce: _Optional[bool] = ..., coalesce_max_inflight: _Optional[int] = ..., coalesce_window_us: _Optional[int] = ...) -> None: ...

class DeployResult(_message.Message):
    __slots__ = ("endpoint", "version", "previous", "switch_ms", "total_ms", "loaded_versions", "reloaded", "message")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RELOADED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    version: int
    previous: int
    switch_ms: float
    total_ms: float
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    reloaded: bool
    message: str
    def __init__(self, endpoint: _Optional[str] = ..., version: _Optional[int] = ..., previous: _Optional[int] = ..., switch_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., loaded_versions: _Optional[_Iterable[int]] = ..., reloaded: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class DeployRequest(_message.Message):
    __slots__ = ("ref", "serving")
    REF_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ref: str
    serving: ServingOptions
    def __init__(self, ref: _Optional[str] = ..., serving: _Optional[_Union[ServingOptions, _Mapping]] = ...) -> None: ...

class DeployResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: DeployResult
    def __init__(self, result: _Optional[_Union[DeployResult, _Mapping]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: DeployResult
    def __init__(self, result: _Optional[_Union[DeployResult, _Mapping]] = ...) -> None: ...

class DeploymentEntry(_message.Message):
    __slots__ = ("version", "state", "actor", "created_at", "ended_at", "serving_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    SERVING_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: str
    actor: str
    created_at: str
    ended_at: str
    serving_json: str
    def __init__(self, version: _Optional[int] = ..., state: _Optional[str] = ..., actor: _Optional[str] = ..., created_at: _Optional[str] = ..., ended_at: _Optional[str] = ..., serving_json: _Optional[str] = ...) -> None: ...

class EndpointInfo(_message.Message):
    __slots__ = ("name", "live", "previous", "routed", "ready_versions", "loaded_versions", "serving_json", "history")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    READY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SERVING_JSON_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    live: int
    previous: int
    routed: str
    ready_versions: _containers.RepeatedScalarFieldContainer[int]
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    serving_json: str
    history: _containers.RepeatedCompositeFieldContainer[DeploymentEntry]
    def __init__(self, name: _Optional[str] = ..., live: _Optional[int] = ..., previous: _Optional[int] = ..., routed: _Optional[str] = ..., ready_versions: _Optional[_Iterable[int]] = ..., loaded_versions: _Optional[_Iterable[int]] = ..., serving_json: _Optional[str] = ..., history: _Optional[_Iterable[_Union[DeploymentEntry, _Mapping]]] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointInfo]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointInfo, _Mapping]]] = ...) -> None: ...

class GetEndpointRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetEndpointResponse(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: EndpointInfo
    def __init__(self, endpoint: _Optional[_Union[EndpointInfo, _Mapping]] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("at", "actor", "action", "target", "outcome", "detail")
    AT_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    at: str
    actor: str
    action: str
    target: str
    outcome: str
    detail: str
    def __init__(self, at: _Optional[str] = ..., actor: _Optional[str] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., outcome: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("limit", "target")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    limit: int
    target: str
    def __init__(self, limit: _Optional[int] = ..., target: _Optional[str] = ...) -> None: ...

class ListAuditResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ...) -> None: ...

class TypedSchemaInfo(_message.Message):
    __slots__ = ("major", "revision", "model_version", "service", "file_name", "state")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    major: int
    revision: int
    model_version: str
    service: str
    file_name: str
    state: str
    def __init__(self, major: _Optional[int] = ..., revision: _Optional[int] = ..., model_version: _Optional[str] = ..., service: _Optional[str] = ..., file_name: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class GetModelProtoRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class GetModelProtoResponse(_message.Message):
    __slots__ = ("proto", "schema", "served")
    PROTO_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    proto: str
    schema: TypedSchemaInfo
    served: _containers.RepeatedCompositeFieldContainer[TypedSchemaInfo]
    def __init__(self, proto: _Optional[str] = ..., schema: _Optional[_Union[TypedSchemaInfo, _Mapping]] = ..., served: _Optional[_Iterable[_Union[TypedSchemaInfo, _Mapping]]] = ...) -> None: ...

class RetireSchemaRequest(_message.Message):
    __slots__ = ("name", "major")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    major: str
    def __init__(self, name: _Optional[str] = ..., major: _Optional[str] = ...) -> None: ...

class RetireSchemaResponse(_message.Message):
    __slots__ = ("served",)
    SERVED_FIELD_NUMBER: _ClassVar[int]
    served: _containers.RepeatedCompositeFieldContainer[TypedSchemaInfo]
    def __init__(self, served: _Optional[_Iterable[_Union[TypedSchemaInfo, _Mapping]]] = ...) -> None: ...
