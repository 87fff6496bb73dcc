"""Every domain error maps to one gRPC status and one HTTP status, with the same reason."""

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from server import errors as e

EXPECTED = [
    (e.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (e.ContentFiltered, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (e.ModelNotFound, grpc.StatusCode.NOT_FOUND, 404),
    (e.ModelNotReady, grpc.StatusCode.UNAVAILABLE, 503),
    (e.BackendUnavailable, grpc.StatusCode.UNAVAILABLE, 503),
    (e.Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (e.RequestTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    (e.UnsupportedMediaType, grpc.StatusCode.INVALID_ARGUMENT, 415),
    (e.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (e.Cancelled, grpc.StatusCode.CANCELLED, 499),
    (e.Unimplemented, grpc.StatusCode.UNIMPLEMENTED, 501),
    (e.BackendError, grpc.StatusCode.INTERNAL, 500),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, 401),
    (e.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, 403),
    (e.IdempotencyKeyReused, grpc.StatusCode.FAILED_PRECONDITION, 422),
    (e.Conflict, grpc.StatusCode.FAILED_PRECONDITION, 409),
    (e.DeployFailed, grpc.StatusCode.ABORTED, 409),
    (e.InferplaneError, grpc.StatusCode.INTERNAL, 500),
]


def _all_error_classes():
    seen, todo = set(), [e.InferplaneError]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return {c for c in seen if c.__module__ == "server.errors"}


def test_every_error_class_is_in_the_expectations():
    assert _all_error_classes() <= {cls for cls, _, _ in EXPECTED}


@pytest.mark.parametrize(("cls", "grpc_code", "http_status"), EXPECTED)
def test_both_transports_agree(cls, grpc_code, http_status):
    err = cls("something went wrong", [e.Violation("input 'x' shape", "expected [-1, 4], got [2, 3]")])
    status = e.grpc_status(err)
    assert status.code == grpc_code
    assert status.details == "something went wrong"
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    rich = status_pb2.Status.FromString(details)
    assert rich.code == grpc_code.value[0]
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in rich.details)
    assert bad.field_violations[0].field == "input 'x' shape"

    code, body, headers = e.http_error(err)
    assert code == http_status
    violation = [{"field": "input 'x' shape", "description": "expected [-1, 4], got [2, 3]"}]
    assert body == {"error": "something went wrong", "code": err.reason, "details": violation}  # Triton's string error
    code, body, headers = e.http_error(err, openai=True)
    assert code == http_status
    assert body == {"error": {"message": "something went wrong", "type": err.reason.lower(), "code": err.reason,
                              "param": "input 'x' shape", "details": violation}}  # fmt: skip


def test_retry_hint_on_both_transports():
    err = e.Overloaded("queue full", retry_after_s=0.25)
    status = e.grpc_status(err)
    meta = dict(status.trailing_metadata)
    assert meta["retry-after"] == "0.250"
    rich = status_pb2.Status.FromString(meta["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert any(d.Unpack(info) for d in rich.details)
    assert info.retry_delay.ToMilliseconds() == 250
    _, _, headers = e.http_error(err)
    assert headers["Retry-After"] == "1"


@pytest.mark.parametrize("never", [float("inf"), float("nan")])
def test_a_refusal_no_wait_would_help_renders_without_a_retry_hint_on_both_transports(never):
    err = e.Overloaded("quota of 0", retry_after_s=never)
    status = e.grpc_status(err)
    meta = dict(status.trailing_metadata)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after" not in meta
    rich = status_pb2.Status.FromString(meta["grpc-status-details-bin"])
    assert not any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in rich.details)
    code, _, headers = e.http_error(err)
    assert code == 429 and "Retry-After" not in headers


def test_triton_statuses_map_back_to_domain_errors():
    from server.dataplane.backend_errors import ConnectionLost, NotSent, backend_error, stream_error

    assert isinstance(backend_error(grpc.StatusCode.INVALID_ARGUMENT, "x"), e.InvalidRequest)
    assert isinstance(backend_error(grpc.StatusCode.NOT_FOUND, "x"), e.ModelNotFound)
    assert type(backend_error(grpc.StatusCode.DATA_LOSS, "x")) is e.BackendError
    assert type(backend_error(grpc.StatusCode.UNAVAILABLE, "x")) is e.BackendUnavailable
    assert isinstance(backend_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), NotSent)
    assert isinstance(backend_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"), ConnectionLost)
    stub = backend_error(grpc.StatusCode.INTERNAL, "Stub process 'm_0' is not healthy.")
    assert type(stub) is e.BackendUnavailable and stub.retry_after_s == 1.0  # the model's process, not the request
    assert type(stream_error("[request id: 7] invalid request: max_tokens must be positive")) is e.InvalidRequest
    assert type(stream_error("not found: adapter 'pirate'")) is e.ModelNotFound
    assert type(stream_error("CUDA out of memory")) is e.BackendError


# ---- issue 15, class 4: what an error echoes is capped in one place ----------------------------


def test_huge_echoes_are_capped_on_both_transports():
    err = e.InvalidRequest("m" * 100_000 + "é", [e.Violation("f" * 10_000, "d" * 100_000)] * 10_000)
    status = e.grpc_status(err)
    assert len(status.details.encode()) <= e.MAX_MESSAGE_BYTES and status.details.endswith("bytes)")
    assert sum(len(k) + len(v) for k, v in status.trailing_metadata) < 6 << 10
    bad = error_details_pb2.BadRequest()
    rich = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    assert any(d.Unpack(bad) for d in rich.details)
    assert len(bad.field_violations) == e.MAX_VIOLATIONS + 1
    assert bad.field_violations[-1].description == f"{10_000 - e.MAX_VIOLATIONS} more violations not listed"
    _, body, _ = e.http_error(err)
    assert len(body["details"]) == e.MAX_VIOLATIONS + 1 and len(body["error"].encode()) <= e.MAX_MESSAGE_BYTES


def test_clip_never_cuts_a_character_and_replaces_lone_surrogates():
    assert e.clip("short", 100) == "short"
    clipped = e.clip("é" * 1000, 100)
    assert len(clipped.encode()) <= 100 and clipped.endswith("bytes)")
    assert e.clip("a\ud800b", 100) == "a?b"
    e.grpc_status(e.InvalidRequest("unknown model '\udcff'"))  # a protobuf string could not hold it: no crash
