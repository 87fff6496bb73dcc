"""The fuzz step (issue 15): hypothesis throws malformed requests at the real stack over gRPC
(ModelInfer, raw bytes, ModelStreamInfer) and REST (v2 infer JSON and binary extension, v1
predict, OpenAI chat / completions / embeddings), then checks the server is well.

Asserted for every example: no INTERNAL / UNKNOWN / UNAVAILABLE / DATA_LOSS status, no 5xx (a
deadline the caller chose may pass: DEADLINE_EXCEEDED / 504), no in-stream INTERNAL error. At the
end (``test_zz_...``, the last test of the step): Triton never restarted (same process,
``inferplane_triton_restarts_total`` unchanged), ``/metrics`` stayed bounded (no caller-invented
model name became a label; the series count did not grow with them), and valid requests answer.

Bounded in time: ``max_examples`` per test sized so the step (stack start included) takes ~2-3
minutes on a 2-core machine. Run it with ``pytest -m fuzz tests/fuzz`` (``make test`` does, after
the normal suite).
"""

from __future__ import annotations

import http.client
import json
import re

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.protogen.inference import grpc_service_pb2 as pb
from tests.fuzz import strategies as fz
from tests.stack_health import assert_healthy, metrics_text, samples, valid_request

pytestmark = [pytest.mark.fuzz, pytest.mark.integration]

SVC = "/inference.GRPCInferenceService/"
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
# an adapter's failure as Triton relays it in a stream: "TypeError: ...", "UnicodeDecodeError: ..."
_ADAPTER_FAULT = re.compile(r"^(INTERNAL|UNKNOWN|UNAVAILABLE)\b|^\w+(Error|Exception): ")
# new series over the whole step: every label set a served model can have once it has answered every
# kind of call and every code (histogram buckets x codes x versions, tenant series, the autoscaler's
# signals, batch sizes) — a budget per served model, however many distinct names the fuzz sent
SERIES_PER_MODEL = 150


def _fuzz(n: int):
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _remember(stack, name: str) -> None:
    if fz.MARKER in name:
        stack.unknown_names.add(name)


def _tally(stack, test: str, outcome) -> None:
    """What the fuzz got back, per test (printed at the end: how deep the examples reached)."""
    counts = stack.outcomes.setdefault(test, {})
    key = getattr(outcome, "name", str(outcome))
    counts[key] = counts.get(key, 0) + 1


def _unary(stack, raw: bytes):
    with grpc.insecure_channel(stack.grpc) as channel:
        call = channel.unary_unary(SVC + "ModelInfer", request_serializer=None, response_deserializer=None)
        try:
            call(raw, timeout=60)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details() or ""


@_fuzz(3000)
@given(request=fz.infer_requests())
def test_model_infer_protobuf_mutations(fuzz_stack, request):
    _remember(fuzz_stack, request.model_name)
    code, details = _unary(fuzz_stack, request.SerializeToString())
    _tally(fuzz_stack, "ModelInfer protobuf", code)
    assert code not in FORBIDDEN, (code, details[:300], request.model_name[:60])


@_fuzz(1000)
@given(raw=fz.raw_infer_bodies())
def test_model_infer_damaged_bytes(fuzz_stack, raw):
    code, details = _unary(fuzz_stack, raw)
    _tally(fuzz_stack, "ModelInfer bytes", code)
    assert code not in FORBIDDEN, (code, details[:300])


@_fuzz(300)
@given(messages=st.lists(st.one_of(fz.infer_requests(), st.just(None)), min_size=1, max_size=5))
def test_model_stream_infer_messages(fuzz_stack, messages):
    """A stream mixing mutated messages and valid ones (None: a valid lightgbm request)."""
    requests = [m if m is not None else valid_request() for m in messages]
    for r in requests:
        _remember(fuzz_stack, r.model_name)
    with grpc.insecure_channel(fuzz_stack.grpc) as channel:
        call = channel.stream_stream(SVC + "ModelStreamInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip
        try:
            responses = list(call(iter(requests), timeout=60))
        except grpc.RpcError as err:
            assert err.code() not in FORBIDDEN, (err.code(), err.details())
            return
    for response in responses:
        _tally(fuzz_stack, "ModelStreamInfer", response.error_message.split(":", 1)[0][:24] if response.error_message else "OK")
        assert not _ADAPTER_FAULT.search(response.error_message), response.error_message[:300]
    assert responses, "every message gets an answer or an error"


def _rest(stack, path: str, body: bytes, headers: dict[str, str]):
    host, port = stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _rest_ok(status: int, body: bytes) -> bool:
    if status == 504 or status < 500:
        if status >= 400:  # an error answer has the JSON error shape
            return "error" in json.loads(body)
        return True
    return False


@_fuzz(1500)
@given(case=fz.rest_infer_bodies())
def test_rest_v2_infer_bodies(fuzz_stack, case):
    path, body, headers = case
    status, answer = _rest(fuzz_stack, path, body, headers)
    _tally(fuzz_stack, "REST v2 infer", status)
    assert _rest_ok(status, answer), (status, answer[:300], path[:80], body[:200])


@_fuzz(400)
@given(case=fz.rest_predict_bodies())
def test_rest_v1_predict_bodies(fuzz_stack, case):
    path, body, headers = case
    status, answer = _rest(fuzz_stack, path, body, headers)
    _tally(fuzz_stack, "REST v1 predict", status)
    assert _rest_ok(status, answer), (status, answer[:300], body[:200])


@_fuzz(1500)
@given(case=fz.openai_bodies())
def test_openai_bodies(fuzz_stack, case):
    path, body, headers = case
    status, answer = _rest(fuzz_stack, path, body, headers)
    _tally(fuzz_stack, f"OpenAI {path}", status)
    if status == 200 and answer.startswith(b"data:"):  # a stream: an error inside it must not be a server fault
        for line in answer.split(b"\n\n"):
            if line.startswith(b"data: {") and b'"error"' in line:
                error = json.loads(line[6:])["error"]
                assert error.get("status", 400) < 500 or error.get("status") == 504, error
        return
    assert _rest_ok(status, answer), (status, answer[:300], path, body[:300])


_UNKNOWN = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=4, max_size=16).map(lambda s: f"{fz.MARKER}_{s}")


@_fuzz(150)
@given(name=_UNKNOWN, transport=st.sampled_from(["unary", "stream", "rest-v2", "rest-v1", "openai"]))
def test_unknown_model_names_on_every_transport(fuzz_stack, name, transport):
    """Each is NOT_FOUND; none may become a metric label (checked at the end)."""
    _remember(fuzz_stack, name)
    request = valid_request()
    request.model_name = name
    if transport == "unary":
        code, _ = _unary(fuzz_stack, request.SerializeToString())
        assert code == grpc.StatusCode.NOT_FOUND
    elif transport == "stream":
        with grpc.insecure_channel(fuzz_stack.grpc) as channel:
            call = channel.stream_stream(SVC + "ModelStreamInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                         response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip
            [response] = list(call(iter([request]), timeout=60))
        assert response.error_message.startswith("NOT_FOUND"), response.error_message
    else:
        path = {"rest-v2": f"/v2/models/{name}/infer", "rest-v1": f"/v1/models/{name}:predict", "openai": "/v1/embeddings"}[transport]
        body = {"rest-v2": {"inputs": []}, "rest-v1": {"instances": [[0.5] * 16]}, "openai": {"model": name, "input": "x"}}[transport]
        status, answer = _rest(fuzz_stack, path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        assert status == 404, answer


def test_zz_the_server_is_well_after_the_fuzz(fuzz_stack):
    """Runs last in the step: Triton never restarted, /metrics bounded, valid requests answer."""
    assert_healthy(fuzz_stack, fuzz_stack.before, valid_request())
    status, body = _rest(fuzz_stack, "/v2/models/lightgbm_regressor/infer",
                         json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}).encode(),
                         {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, body
    print("\nfuzz outcomes:", json.dumps(fuzz_stack.outcomes, indent=1, sort_keys=True))
    text = metrics_text(fuzz_stack)
    leaked = sorted({m.group(0) for m in re.finditer(rf'"[^"]*{fz.MARKER}[^"]*"', text)})
    series = len(samples(text))
    assert not leaked, (
        f"{len(leaked)} caller-invented model names became metric labels (of {len(fuzz_stack.unknown_names)} sent), "
        f"e.g. {leaked[:3]}; /metrics has {series} series (was {fuzz_stack.series_before})"
    )
    served = sum(1 for p in fuzz_stack.repository.iterdir() if (p / "config.pbtxt").exists())
    assert series - fuzz_stack.series_before <= SERIES_PER_MODEL * served, (series, fuzz_stack.series_before, served)
