from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Quota(_message.Message):
    __slots__ = ("rps", "rpm", "tpm", "concurrency", "requests_month", "tokens_month")
    RPS_FIELD_NUMBER: _ClassVar[int]
    RPM_FIELD_NUMBER: _ClassVar[int]
    TPM_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MONTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MONTH_FIELD_NUMBER: _ClassVar[int]
    rps: float
    rpm: float
    tpm: float
    concurrency: int
    requests_month: int
    tokens_month: int
    def __init__(self, rps: _Optional[float] = ..., rpm: _Optional[float] = ..., tpm: _Optional[float] = ..., concurrency: _Optional[int] = ..., requests_month: _Optional[int] = ..., tokens_month: _Optional[int] = ...) -> None: ...

class Grants(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelQuotas(_message.Message):
    __slots__ = ("quotas",)
    class QuotasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Quota
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Quota, _Mapping]] = ...) -> None: ...
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    quotas: _containers.MessageMap[str, Quota]
    def __init__(self, quotas: _Optional[_Mapping[str, Quota]] = ...) -> None: ...

class TenantChanges(_message.Message):
    __slots__ = ("team", "plan", "grants", "quota", "model_quotas", "admin")
    TEAM_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    MODEL_QUOTAS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    team: str
    plan: str
    grants: Grants
    quota: Quota
    model_quotas: ModelQuotas
    admin: bool
    def __init__(self, team: _Optional[str] = ..., plan: _Optional[str] = ..., grants: _Optional[_Union[Grants, _Mapping]] = ..., quota: _Optional[_Union[Quota, _Mapping]] = ..., model_quotas: _Optional[_Union[ModelQuotas, _Mapping]] = ..., admin: _Optional[bool] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "team", "plan", "models", "quota", "model_quotas", "admin")
    class ModelQuotasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Quota
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Quota, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    MODEL_QUOTAS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    team: str
    plan: str
    models: _containers.RepeatedScalarFieldContainer[str]
    quota: Quota
    model_quotas: _containers.MessageMap[str, Quota]
    admin: bool
    def __init__(self, name: _Optional[str] = ..., team: _Optional[str] = ..., plan: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., quota: _Optional[_Union[Quota, _Mapping]] = ..., model_quotas: _Optional[_Mapping[str, Quota]] = ..., admin: _Optional[bool] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("key_id", "tenant", "state", "created_at", "revoked_at", "expires_at")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant: str
    state: str
    created_at: float
    revoked_at: float
    expires_at: float
    def __init__(self, key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., state: _Optional[str] = ..., created_at: _Optional[float] = ..., revoked_at: _Optional[float] = ..., expires_at: _Optional[float] = ...) -> None: ...

class CreateKeyRequest(_message.Message):
    __slots__ = ("tenant", "changes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    changes: TenantChanges
    def __init__(self, tenant: _Optional[str] = ..., changes: _Optional[_Union[TenantChanges, _Mapping]] = ...) -> None: ...

class CreateKeyResponse(_message.Message):
    __slots__ = ("key_id", "key", "tenant")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    key: str
    tenant: Tenant
    def __init__(self, key_id: _Optional[str] = ..., key: _Optional[str] = ..., tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class RevokeKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RevokeKeyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotateKeyRequest(_message.Message):
    __slots__ = ("key_id", "grace_s")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    grace_s: float
    def __init__(self, key_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class RotateKeyResponse(_message.Message):
    __slots__ = ("key_id", "key", "replaces")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    key: str
    replaces: str
    def __init__(self, key_id: _Optional[str] = ..., key: _Optional[str] = ..., replaces: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ...) -> None: ...

class SetTenantRequest(_message.Message):
    __slots__ = ("name", "changes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    changes: TenantChanges
    def __init__(self, name: _Optional[str] = ..., changes: _Optional[_Union[TenantChanges, _Mapping]] = ...) -> None: ...

class SetTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("by", "since", "until")
    BY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    by: str
    since: str
    until: str
    def __init__(self, by: _Optional[str] = ..., since: _Optional[str] = ..., until: _Optional[str] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("key", "version", "requests", "tokens", "compute_s", "input_tokens", "output_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: str
    requests: int
    tokens: int
    compute_s: float
    input_tokens: int
    output_tokens: int
    def __init__(self, key: _Optional[str] = ..., version: _Optional[str] = ..., requests: _Optional[int] = ..., tokens: _Optional[int] = ..., compute_s: _Optional[float] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("by", "since", "rows")
    BY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    by: str
    since: float
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    def __init__(self, by: _Optional[str] = ..., since: _Optional[float] = ..., rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ...) -> None: ...
