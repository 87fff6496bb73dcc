from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AutoscaleConfig(_message.Message):
    __slots__ = ("min_replicas", "max_replicas", "target", "signal", "scale_to_zero_after_s", "cold_start_budget_s", "scale_up_window_s", "scale_down_window_s", "max_step_up", "max_step_down", "up_cooldown_s", "down_cooldown_s", "predictive", "tolerance", "unit", "tier", "standby_down_factor")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    SCALE_TO_ZERO_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    COLD_START_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    SCALE_UP_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    SCALE_DOWN_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_UP_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_DOWN_FIELD_NUMBER: _ClassVar[int]
    UP_COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTIVE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STANDBY_DOWN_FACTOR_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    max_replicas: int
    target: float
    signal: str
    scale_to_zero_after_s: float
    cold_start_budget_s: float
    scale_up_window_s: float
    scale_down_window_s: float
    max_step_up: int
    max_step_down: int
    up_cooldown_s: float
    down_cooldown_s: float
    predictive: bool
    tolerance: float
    unit: str
    tier: int
    standby_down_factor: float
    def __init__(self, min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., target: _Optional[float] = ..., signal: _Optional[str] = ..., scale_to_zero_after_s: _Optional[float] = ..., cold_start_budget_s: _Optional[float] = ..., scale_up_window_s: _Optional[float] = ..., scale_down_window_s: _Optional[float] = ..., max_step_up: _Optional[int] = ..., max_step_down: _Optional[int] = ..., up_cooldown_s: _Optional[float] = ..., down_cooldown_s: _Optional[float] = ..., predictive: _Optional[bool] = ..., tolerance: _Optional[float] = ..., unit: _Optional[str] = ..., tier: _Optional[int] = ..., standby_down_factor: _Optional[float] = ...) -> None: ...

class ConfigureAutoscaleRequest(_message.Message):
    __slots__ = ("endpoint", "config")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    config: AutoscaleConfig
    def __init__(self, endpoint: _Optional[str] = ..., config: _Optional[_Union[AutoscaleConfig, _Mapping]] = ...) -> None: ...

class AutoscaleStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AutoscaleStatusResponse(_message.Message):
    __slots__ = ("endpoints_json",)
    ENDPOINTS_JSON_FIELD_NUMBER: _ClassVar[int]
    endpoints_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoints_json: _Optional[_Iterable[str]] = ...) -> None: ...

class ExplainAutoscaleRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    def __init__(self, endpoint: _Optional[str] = ...) -> None: ...

class ExplainAutoscaleResponse(_message.Message):
    __slots__ = ("explain_json",)
    EXPLAIN_JSON_FIELD_NUMBER: _ClassVar[int]
    explain_json: str
    def __init__(self, explain_json: _Optional[str] = ...) -> None: ...

class AutoscaleSignalsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AutoscaleSignalsResponse(_message.Message):
    __slots__ = ("signals_json",)
    SIGNALS_JSON_FIELD_NUMBER: _ClassVar[int]
    signals_json: str
    def __init__(self, signals_json: _Optional[str] = ...) -> None: ...
