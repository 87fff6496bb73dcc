from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CanaryThresholds(_message.Message):
    __slots__ = ("min_samples", "max_error_rate", "max_error_increase", "max_p99_ms", "max_p99_ratio")
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_INCREASE_FIELD_NUMBER: _ClassVar[int]
    MAX_P99_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_P99_RATIO_FIELD_NUMBER: _ClassVar[int]
    min_samples: int
    max_error_rate: float
    max_error_increase: float
    max_p99_ms: float
    max_p99_ratio: float
    def __init__(self, min_samples: _Optional[int] = ..., max_error_rate: _Optional[float] = ..., max_error_increase: _Optional[float] = ..., max_p99_ms: _Optional[float] = ..., max_p99_ratio: _Optional[float] = ...) -> None: ...

class SetCanaryRequest(_message.Message):
    __slots__ = ("name", "version", "percent", "steps", "interval_s", "window_s", "thresholds", "key_header")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    KEY_HEADER_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    percent: float
    steps: _containers.RepeatedScalarFieldContainer[float]
    interval_s: float
    window_s: float
    thresholds: CanaryThresholds
    key_header: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., percent: _Optional[float] = ..., steps: _Optional[_Iterable[float]] = ..., interval_s: _Optional[float] = ..., window_s: _Optional[float] = ..., thresholds: _Optional[_Union[CanaryThresholds, _Mapping]] = ..., key_header: _Optional[str] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TrafficRollbackRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SetBlueGreenRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SwitchRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ExperimentArm(_message.Message):
    __slots__ = ("name", "version", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    weight: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class SetExperimentRequest(_message.Message):
    __slots__ = ("name", "experiment", "arms", "key_header")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    KEY_HEADER_FIELD_NUMBER: _ClassVar[int]
    name: str
    experiment: str
    arms: _containers.RepeatedCompositeFieldContainer[ExperimentArm]
    key_header: str
    def __init__(self, name: _Optional[str] = ..., experiment: _Optional[str] = ..., arms: _Optional[_Iterable[_Union[ExperimentArm, _Mapping]]] = ..., key_header: _Optional[str] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("name", "request_id", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    request_id: str
    value: float
    def __init__(self, name: _Optional[str] = ..., request_id: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ("arm",)
    ARM_FIELD_NUMBER: _ClassVar[int]
    arm: str
    def __init__(self, arm: _Optional[str] = ...) -> None: ...

class AbReportRequest(_message.Message):
    __slots__ = ("name", "alpha")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    name: str
    alpha: float
    def __init__(self, name: _Optional[str] = ..., alpha: _Optional[float] = ...) -> None: ...

class ArmFigures(_message.Message):
    __slots__ = ("name", "version", "weight", "requests", "errors", "error_rate", "latency_mean_ms", "latency_p50_ms", "latency_p99_ms", "outcomes", "outcome_mean")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_MEAN_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    weight: float
    requests: int
    errors: int
    error_rate: float
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    outcomes: int
    outcome_mean: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., weight: _Optional[float] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., error_rate: _Optional[float] = ..., latency_mean_ms: _Optional[float] = ..., latency_p50_ms: _Optional[float] = ..., latency_p99_ms: _Optional[float] = ..., outcomes: _Optional[int] = ..., outcome_mean: _Optional[float] = ...) -> None: ...

class Comparison(_message.Message):
    __slots__ = ("arm", "control", "metric", "test", "statistic", "p_value", "effect", "ci_low", "ci_high", "confidence", "significant")
    ARM_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    TEST_FIELD_NUMBER: _ClassVar[int]
    STATISTIC_FIELD_NUMBER: _ClassVar[int]
    P_VALUE_FIELD_NUMBER: _ClassVar[int]
    EFFECT_FIELD_NUMBER: _ClassVar[int]
    CI_LOW_FIELD_NUMBER: _ClassVar[int]
    CI_HIGH_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SIGNIFICANT_FIELD_NUMBER: _ClassVar[int]
    arm: str
    control: str
    metric: str
    test: str
    statistic: float
    p_value: float
    effect: float
    ci_low: float
    ci_high: float
    confidence: float
    significant: bool
    def __init__(self, arm: _Optional[str] = ..., control: _Optional[str] = ..., metric: _Optional[str] = ..., test: _Optional[str] = ..., statistic: _Optional[float] = ..., p_value: _Optional[float] = ..., effect: _Optional[float] = ..., ci_low: _Optional[float] = ..., ci_high: _Optional[float] = ..., confidence: _Optional[float] = ..., significant: _Optional[bool] = ...) -> None: ...

class AbReportResponse(_message.Message):
    __slots__ = ("name", "experiment", "arms", "comparisons")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    COMPARISONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    experiment: str
    arms: _containers.RepeatedCompositeFieldContainer[ArmFigures]
    comparisons: _containers.RepeatedCompositeFieldContainer[Comparison]
    def __init__(self, name: _Optional[str] = ..., experiment: _Optional[str] = ..., arms: _Optional[_Iterable[_Union[ArmFigures, _Mapping]]] = ..., comparisons: _Optional[_Iterable[_Union[Comparison, _Mapping]]] = ...) -> None: ...

class SetShadowRequest(_message.Message):
    __slots__ = ("name", "version", "percent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    percent: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., percent: _Optional[float] = ...) -> None: ...

class ShadowReportRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ShadowReportResponse(_message.Message):
    __slots__ = ("name", "version", "percent", "sent", "dropped", "errors", "compared", "agreement", "mean_abs_diff", "latency_delta_mean_ms", "latency_delta_p50_ms", "latency_delta_p99_ms", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MEAN_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    LATENCY_DELTA_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_DELTA_P50_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_DELTA_P99_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    percent: float
    sent: int
    dropped: int
    errors: int
    compared: int
    agreement: float
    mean_abs_diff: float
    latency_delta_mean_ms: float
    latency_delta_p50_ms: float
    latency_delta_p99_ms: float
    last_error: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., percent: _Optional[float] = ..., sent: _Optional[int] = ..., dropped: _Optional[int] = ..., errors: _Optional[int] = ..., compared: _Optional[int] = ..., agreement: _Optional[float] = ..., mean_abs_diff: _Optional[float] = ..., latency_delta_mean_ms: _Optional[float] = ..., latency_delta_p50_ms: _Optional[float] = ..., latency_delta_p99_ms: _Optional[float] = ..., last_error: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ArmState(_message.Message):
    __slots__ = ("name", "version", "weight", "window_requests", "window_errors", "window_p99_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_P99_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    weight: float
    window_requests: int
    window_errors: int
    window_p99_ms: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., weight: _Optional[float] = ..., window_requests: _Optional[int] = ..., window_errors: _Optional[int] = ..., window_p99_ms: _Optional[float] = ...) -> None: ...

class TrafficPolicy(_message.Message):
    __slots__ = ("name", "live", "kind", "status", "arms", "step", "steps", "interval_s", "verdict", "green", "shadow_version", "shadow_percent", "key_header", "message")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    GREEN_FIELD_NUMBER: _ClassVar[int]
    SHADOW_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHADOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    KEY_HEADER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    live: str
    kind: str
    status: str
    arms: _containers.RepeatedCompositeFieldContainer[ArmState]
    step: int
    steps: _containers.RepeatedScalarFieldContainer[float]
    interval_s: float
    verdict: str
    green: str
    shadow_version: str
    shadow_percent: float
    key_header: str
    message: str
    def __init__(self, name: _Optional[str] = ..., live: _Optional[str] = ..., kind: _Optional[str] = ..., status: _Optional[str] = ..., arms: _Optional[_Iterable[_Union[ArmState, _Mapping]]] = ..., step: _Optional[int] = ..., steps: _Optional[_Iterable[float]] = ..., interval_s: _Optional[float] = ..., verdict: _Optional[str] = ..., green: _Optional[str] = ..., shadow_version: _Optional[str] = ..., shadow_percent: _Optional[float] = ..., key_header: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TrafficPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: TrafficPolicy
    def __init__(self, policy: _Optional[_Union[TrafficPolicy, _Mapping]] = ...) -> None: ...
