"""The one error table: every domain error, its gRPC status and its HTTP status.

Domain code raises an ``InferplaneError`` subclass and knows nothing of transports. The gRPC
servicers call :func:`grpc_status` and the REST bridge calls :func:`http_error`; both read the
same table, matched on the most specific class. ``tests/unit/test_errors.py`` checks every class
on both transports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "inferplane"


@dataclass(frozen=True)
class Violation:
    """What was wrong with one field of a request: which field, what was expected, what came."""

    field: str
    description: str


@dataclass
class InferplaneError(Exception):
    message: str
    violations: list[Violation] = field(default_factory=list)
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.retry_after_s is not None and not math.isfinite(self.retry_after_s):
            self.retry_after_s = None  # no wait would help (a limit of 0): a refusal without a retry hint

    @property
    def reason(self) -> str:
        """A stable machine-readable name for the error (``ErrorInfo.reason``, JSON ``code``)."""
        return _TABLE[_entry_class(type(self))].reason


class InvalidRequest(InferplaneError):
    """The request is malformed or does not match the model's declared signature."""


class ContentFiltered(InvalidRequest):
    """A safety filter blocked the request (or its answer): ``server.dataplane.safety``."""


class ModelNotFound(InferplaneError):
    """No such model or version (or one the caller may not see)."""


class ModelNotReady(InferplaneError):
    """The model is known but not loaded and ready."""


class BackendUnavailable(InferplaneError):
    """Triton is down, restarting or unreachable."""


class Overloaded(InferplaneError):
    """Refused before any work to protect the service; retry after ``retry_after_s``."""


class RequestTooLarge(InferplaneError):
    """The request body exceeds the configured size limit."""


class UnsupportedMediaType(InferplaneError):
    """The request body's Content-Type is not one the endpoint reads (REST only)."""


class DeadlineExceeded(InferplaneError):
    """The caller's deadline passed, or cannot be met."""


class Cancelled(InferplaneError):
    """The caller went away."""


class Unimplemented(InferplaneError):
    """The operation is not offered by this frontend."""


class BackendError(InferplaneError):
    """The model or Triton failed while serving an otherwise valid request."""


class Unauthenticated(InferplaneError):
    """No API key, or one that is unknown, revoked or expired."""


class PermissionDenied(InferplaneError):
    """The caller is known but may not perform this operation (never used to hide a model)."""


class IdempotencyKeyReused(InferplaneError):
    """The idempotency key was already used with a different request body."""


class Conflict(InferplaneError):
    """The operation conflicts with the current state (e.g. nothing to roll back to, signature required)."""


class DeployFailed(InferplaneError):
    """A deploy did not complete (bad artifact, adapter crash, readiness timeout); the live version still serves."""


@dataclass(frozen=True)
class _Entry:
    grpc_code: grpc.StatusCode
    http_status: int
    reason: str


_TABLE: dict[type[InferplaneError], _Entry] = {
    InvalidRequest: _Entry(grpc.StatusCode.INVALID_ARGUMENT, 400, "INVALID_ARGUMENT"),
    ContentFiltered: _Entry(grpc.StatusCode.INVALID_ARGUMENT, 400, "CONTENT_FILTER"),
    ModelNotFound: _Entry(grpc.StatusCode.NOT_FOUND, 404, "NOT_FOUND"),
    ModelNotReady: _Entry(grpc.StatusCode.UNAVAILABLE, 503, "MODEL_NOT_READY"),
    BackendUnavailable: _Entry(grpc.StatusCode.UNAVAILABLE, 503, "UNAVAILABLE"),
    Overloaded: _Entry(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "RESOURCE_EXHAUSTED"),
    RequestTooLarge: _Entry(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "REQUEST_TOO_LARGE"),
    UnsupportedMediaType: _Entry(grpc.StatusCode.INVALID_ARGUMENT, 415, "UNSUPPORTED_MEDIA_TYPE"),
    DeadlineExceeded: _Entry(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "DEADLINE_EXCEEDED"),
    Cancelled: _Entry(grpc.StatusCode.CANCELLED, 499, "CANCELLED"),
    Unimplemented: _Entry(grpc.StatusCode.UNIMPLEMENTED, 501, "UNIMPLEMENTED"),
    BackendError: _Entry(grpc.StatusCode.INTERNAL, 500, "INTERNAL"),
    Unauthenticated: _Entry(grpc.StatusCode.UNAUTHENTICATED, 401, "UNAUTHENTICATED"),
    PermissionDenied: _Entry(grpc.StatusCode.PERMISSION_DENIED, 403, "PERMISSION_DENIED"),
    IdempotencyKeyReused: _Entry(grpc.StatusCode.FAILED_PRECONDITION, 422, "IDEMPOTENCY_KEY_REUSED"),
    Conflict: _Entry(grpc.StatusCode.FAILED_PRECONDITION, 409, "FAILED_PRECONDITION"),
    DeployFailed: _Entry(grpc.StatusCode.ABORTED, 409, "DEPLOY_FAILED"),
    InferplaneError: _Entry(grpc.StatusCode.INTERNAL, 500, "INTERNAL"),
}

def _entry_class(cls: type) -> type[InferplaneError]:
    for klass in cls.__mro__:
        if klass in _TABLE:
            return klass
    return InferplaneError


def entry(err: InferplaneError) -> _Entry:
    return _TABLE[_entry_class(type(err))]


# ---- what an error may echo ----------------------------------------------------------------
# Messages and violations echo what the caller sent (a datatype, a model name, every unknown
# output). gRPC carries them in trailers — ``grpc-message`` (percent-encoded: up to 3 bytes per
# byte) and ``grpc-status-details-bin`` (base64) — and clients refuse trailers over 8 KiB (soft)
# / 16 KiB (hard) by default. So both transports cap them here, in bytes of UTF-8:
# worst case ~1.5 KiB of grpc-message + ~4 KiB of details, whatever the caller sent.

MAX_MESSAGE_BYTES = 512
MAX_VIOLATIONS = 8  # listed; the rest are counted in one last entry
MAX_FIELD_BYTES = 64
MAX_DESCRIPTION_BYTES = 256


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes (never mid-character), saying how much was left out.
    A lone surrogate (which no protobuf string or UTF-8 header can hold) becomes ``?``."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data.decode("utf-8")
    marker = f"... (+{len(data) - limit} bytes)"
    return data[: max(0, limit - len(marker))].decode("utf-8", "ignore") + marker


def public_message(err: InferplaneError) -> str:
    """The error's message as either transport sends it (capped)."""
    return clip(err.message, MAX_MESSAGE_BYTES)


def public_violations(err: InferplaneError) -> list[Violation]:
    """At most MAX_VIOLATIONS, each capped; one last entry counts those not listed."""
    listed = [
        Violation(clip(v.field, MAX_FIELD_BYTES), clip(v.description, MAX_DESCRIPTION_BYTES))
        for v in err.violations[:MAX_VIOLATIONS]
    ]
    more = len(err.violations) - MAX_VIOLATIONS
    if more > 0:
        listed.append(Violation("(more)", f"{more} more violations not listed"))
    return listed


# ---- gRPC ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrpcStatus:
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def grpc_status(err: InferplaneError) -> GrpcStatus:
    """Status code, message and ``grpc-status-details-bin`` (google.rpc.Status) for an error."""
    e = entry(err)
    message = public_message(err)
    status = status_pb2.Status(code=e.grpc_code.value[0], message=message)
    info = error_details_pb2.ErrorInfo(reason=e.reason, domain=DOMAIN)
    _pack(status, info)
    if err.violations:
        bad = error_details_pb2.BadRequest()
        for v in public_violations(err):
            bad.field_violations.add(field=v.field, description=v.description)
        _pack(status, bad)
    metadata: list[tuple[str, str | bytes]] = []
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(err.retry_after_s * 1000))
        _pack(status, error_details_pb2.RetryInfo(retry_delay=delay))
        metadata.append(("retry-after", f"{max(err.retry_after_s, 0.001):.3f}"))
    metadata.append(("grpc-status-details-bin", status.SerializeToString()))
    return GrpcStatus(e.grpc_code, message, tuple(metadata))


def _pack(status: status_pb2.Status, detail) -> None:
    any_msg = any_pb2.Any()
    any_msg.Pack(detail)
    status.details.append(any_msg)


# ---- HTTP ---------------------------------------------------------------------------------


def http_error(err: InferplaneError, *, openai: bool = False) -> tuple[int, dict, dict[str, str]]:
    """HTTP status, JSON body and headers for an error (``error_body`` says the body's shapes)."""
    e = entry(err)
    details = [{"field": v.field, "description": v.description} for v in public_violations(err)]
    headers: dict[str, str] = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s + 0.4999)))
        headers["x-should-retry"] = "true"
    return e.http_status, error_body(e.reason, public_message(err), details, openai=openai), headers


def error_body(code: str, message: str, details: list[dict], *, openai: bool = False) -> dict:
    """The two REST error shapes. KServe v2 / Triton routes: ``{"error": "<message>", "code", "details"}``
    — a string ``error`` as Triton's HTTP API sends (``tritonclient.http`` reads it), the machine
    reason and the field violations beside it. OpenAI routes: ``{"error": {"message", "type", "code",
    "param", "details"}}``, the OpenAI API's shape (the ``openai`` SDK reads it)."""
    if openai:
        param = details[0]["field"] if details else None
        return {"error": {"message": message, "type": code.lower(), "code": code, "param": param, "details": details}}
    return {"error": message, "code": code, "details": details}

