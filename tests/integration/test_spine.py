"""The serving spine against the real stack: frontend + embedded Triton on real sockets."""

from __future__ import annotations

import queue
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from google.rpc import error_details_pb2, status_pb2

from model_repository.demo import load_validation, read_metadata
from server.protogen.inference import grpc_service_pb2 as pb

pytestmark = pytest.mark.integration

MODELS = ["mlp_classifier", "fraud_xgboost", "lightgbm_regressor"]
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _rows(stack, model, n=16):
    data = load_validation(stack.repository / model)
    meta = read_metadata(stack.repository / model)
    return data["features"][:n], data["expected"][:n], meta


@pytest.mark.parametrize("model", MODELS)
def test_predictions_match_the_model_evaluated_directly(stack, grpc_client, model):
    features, expected, meta = _rows(stack, model)
    out_name = meta["signature"]["outputs"][0]["name"]
    inp = grpcclient.InferInput("features", list(features.shape), "FP32")
    inp.set_data_from_numpy(features.astype(np.float32))
    result = grpc_client.infer(model, [inp])
    np.testing.assert_allclose(result.as_numpy(out_name), expected, rtol=1e-4, atol=1e-5)
    assert result.get_response().model_version == "1"


async def test_predictions_with_the_aio_client(stack):
    client = grpcclient_aio.InferenceServerClient(stack.grpc)
    try:
        for model in MODELS:
            features, expected, meta = _rows(stack, model, n=5)
            inp = grpcclient_aio.InferInput("features", list(features.shape), "FP32")
            inp.set_data_from_numpy(features.astype(np.float32))
            result = await client.infer(model, [inp], model_version="1")
            np.testing.assert_allclose(result.as_numpy(meta["signature"]["outputs"][0]["name"]), expected, rtol=1e-4, atol=1e-5)
    finally:
        await client.close()


def test_metadata_config_and_readiness(grpc_client):
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("fraud_xgboost")
    assert not grpc_client.is_model_ready("fraud_xgboost", "7")
    meta = grpc_client.get_model_metadata("mlp_classifier")
    assert meta.inputs[0].name == "features" and list(meta.inputs[0].shape) == [-1, 64]
    config = grpc_client.get_model_config("mlp_classifier").config
    assert config.max_batch_size == 64 and config.dynamic_batching.max_queue_delay_microseconds > 0
    stats = grpc_client.get_inference_statistics("fraud_xgboost")
    assert stats.model_stats[0].name == "fraud_xgboost"
    index = {m.name for m in grpc_client.get_model_repository_index().models}
    assert set(MODELS) <= index
    assert grpc_client.get_server_metadata().name == "inferplane"


# ---- the bad-input matrix -------------------------------------------------------------------


def _good(model="fraud_xgboost", rows=2, features=32) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=[rows, features])
    req.raw_input_contents.append(np.zeros((rows, features), np.float32).tobytes())
    return req


def _mutate(fn):
    req = _good()
    fn(req)
    return req.SerializeToString()


def _extra(req):
    req.inputs.add(name="bogus", datatype="FP32", shape=[2, 1])
    req.raw_input_contents.append(b"\0" * 8)


def _missing(req):
    del req.inputs[:]
    del req.raw_input_contents[:]


def _set(field, value):
    def apply(req):
        if field == "datatype":
            req.inputs[0].datatype = value
        elif field == "shape":
            del req.inputs[0].shape[:]
            req.inputs[0].shape.extend(value)
        elif field == "raw":
            req.raw_input_contents[0] = value
        elif field == "version":
            req.model_version = value
        elif field == "model":
            req.model_name = value

    return apply


MATRIX = [
    ("unknown model", _mutate(_set("model", "nope")), grpc.StatusCode.NOT_FOUND, None, "unknown model 'nope'"),
    ("unknown version", _mutate(_set("version", "9")), grpc.StatusCode.NOT_FOUND, None, "unknown version '9'"),
    ("missing input", _mutate(_missing), grpc.StatusCode.INVALID_ARGUMENT, "input 'features'", "required input missing"),
    ("extra input", _mutate(_extra), grpc.StatusCode.INVALID_ARGUMENT, "inputs[1].name", "unknown input 'bogus'"),
    ("wrong datatype", _mutate(_set("datatype", "INT32")), grpc.StatusCode.INVALID_ARGUMENT, "input 'features' datatype", "expected FP32, got INT32"),
    ("wrong rank", _mutate(_set("shape", [64])), grpc.StatusCode.INVALID_ARGUMENT, "input 'features' shape", "expected rank 2"),
    ("wrong fixed dim", _mutate(_set("shape", [2, 31])), grpc.StatusCode.INVALID_ARGUMENT, "input 'features' shape[1]", "expected 32, got 31"),
    ("batch over max", _good(rows=65).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "input 'features' shape[0]", "1..64"),
    ("raw too short", _mutate(_set("raw", b"\0" * 255)), grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents[0] (input 'features')", "expected 256 bytes"),
    ("raw too long", _mutate(_set("raw", b"\0" * 257)), grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents[0] (input 'features')", "got 257"),
    ("raw count mismatch", _mutate(lambda r: r.raw_input_contents.append(b"\0" * 4)), grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents", "one per input"),
    ("garbage protobuf", b"\xff\xff\xff\xff garbage", grpc.StatusCode.INVALID_ARGUMENT, None, "not a valid inference.ModelInferRequest"),
]


@pytest.fixture(scope="module")
def raw_infer(stack):
    channel = grpc.insecure_channel(stack.grpc, options=[("grpc.max_send_message_length", 64 << 20), ("grpc.enable_retries", 0)])
    yield channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    channel.close()


def _bad_request_fields(err: grpc.RpcError) -> list[str]:
    details = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
    assert details, "every error carries google.rpc.Status details"
    status = status_pb2.Status.FromString(details)
    bad = error_details_pb2.BadRequest()
    for any_msg in status.details:
        if any_msg.Unpack(bad):
            return [v.field for v in bad.field_violations]
    return []


@pytest.mark.parametrize(("case", "body", "code", "field", "fragment"), MATRIX, ids=[m[0] for m in MATRIX])
def test_bad_input_matrix(raw_infer, case, body, code, field, fragment):
    with pytest.raises(grpc.RpcError) as info:
        raw_infer(body, timeout=10)
    err = info.value
    assert err.code() == code, err.details()
    assert fragment in err.details()
    fields = _bad_request_fields(err)
    if field is not None:
        assert field in fields


def test_oversize_message_is_refused(raw_infer, stack):
    big = _good(rows=1)
    big.raw_input_contents[0] = b"\0" * (stack.max_request_bytes + 1024)
    with pytest.raises(grpc.RpcError) as info:
        raw_infer(big.SerializeToString(), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_server_still_answers_after_the_matrix(raw_infer):
    for _ in range(3):
        for case in MATRIX:
            with pytest.raises(grpc.RpcError):
                raw_infer(case[1], timeout=10)
    response = pb.ModelInferResponse.FromString(raw_infer(_good().SerializeToString(), timeout=10))
    assert response.model_name == "fraud_xgboost"
    assert np.frombuffer(response.raw_output_contents[0], np.float32).shape == (2,)


# ---- streaming ------------------------------------------------------------------------------


def _requests_total(stack, model: str, code: str) -> float:
    text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
    prefix = f'inferplane_requests_total{{code="{code}",model="{model}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_stream_infer_answers_valid_and_reports_invalid_in_stream(stack):
    features, expected, _ = _rows(stack, "lightgbm_regressor", n=4)
    ok_before = _requests_total(stack, "lightgbm_regressor", "OK")
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(stack.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        good = grpcclient.InferInput("features", list(features.shape), "FP32")
        good.set_data_from_numpy(features.astype(np.float32))
        bad = grpcclient.InferInput("features", [4, 3], "FP32")
        bad.set_data_from_numpy(np.zeros((4, 3), np.float32))
        client.async_stream_infer("lightgbm_regressor", [good], request_id="a")
        client.async_stream_infer("lightgbm_regressor", [bad], request_id="b")
        client.async_stream_infer("lightgbm_regressor", [good], request_id="c")
        got = [results.get(timeout=20) for _ in range(3)]
    finally:
        client.stop_stream()
        client.close()
    answers = [r for r, e in got if e is None]
    errors = [e for r, e in got if e is not None]
    assert len(answers) == 2 and len(errors) == 1
    assert "INVALID_ARGUMENT" in str(errors[0]) and "shape[1]" in str(errors[0])
    for answer in answers:
        np.testing.assert_allclose(answer.as_numpy("prediction"), expected, rtol=1e-4, atol=1e-5)
    # the answered stream requests are counted like unary ones (when their final response passed)
    assert _requests_total(stack, "lightgbm_regressor", "OK") - ok_before == 2


# ---- health, reflection, admin, metrics ----------------------------------------------------------


def test_grpc_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"inference.GRPCInferenceService", "inferplane.v1.Admin", "grpc.health.v1.Health"} <= names
        responses = list(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")]))
        )
        assert responses[0].file_descriptor_response.file_descriptor_proto


def test_admin_lists_models_with_their_signatures(stack):
    from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(stack.grpc) as channel:
        models = {m.name: m for m in admin_pb2_grpc.AdminStub(channel).ListModels(admin_pb2.ListModelsRequest()).models}
    assert set(MODELS) <= set(models)
    mlp = models["mlp_classifier"]
    assert mlp.state == "READY" and list(mlp.versions) == ["1"] and mlp.max_batch_size == 64
    assert mlp.inputs[0].datatype == "FP32" and list(mlp.inputs[0].dims) == [64]


def test_metrics_count_requests_by_model_version_and_code(stack, grpc_client):
    features, _, _ = _rows(stack, "fraud_xgboost", n=2)
    inp = grpcclient.InferInput("features", list(features.shape), "FP32")
    inp.set_data_from_numpy(features.astype(np.float32))
    grpc_client.infer("fraud_xgboost", [inp])
    bad = grpcclient.InferInput("features", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(Exception):
        grpc_client.infer("fraud_xgboost", [bad])
    text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
    assert 'inferplane_requests_total{code="OK",model="fraud_xgboost",version="1"}' in text
    assert 'inferplane_requests_total{code="INVALID_ARGUMENT",model="fraud_xgboost",version="1"}' in text
    assert 'inferplane_request_duration_seconds_bucket{le="0.005",model="fraud_xgboost"}' in text
    assert 'inferplane_inflight_requests{model="fraud_xgboost"} 0.0' in text


def test_response_cache_opt_in_is_reported_as_a_hit_rate(stack, grpc_client):
    from tests.conftest import CACHED_MODEL, wait_until

    features, expected, _ = _rows(stack, "lightgbm_regressor", n=3)
    for _ in range(5):
        inp = grpcclient.InferInput("features", list(features.shape), "FP32")
        inp.set_data_from_numpy(features.astype(np.float32))
        np.testing.assert_allclose(grpc_client.infer(CACHED_MODEL, [inp]).as_numpy("prediction"), expected, rtol=1e-4, atol=1e-5)
    stats = grpc_client.get_inference_statistics(CACHED_MODEL).model_stats[0].inference_stats
    assert stats.cache_hit.count >= 4 and stats.cache_miss.count >= 1

    def ratio():
        text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(f'inferplane_response_cache_hit_ratio{{model="{CACHED_MODEL}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return None

    wait_until(lambda: (ratio() or 0) >= 0.5, timeout=10, explain=ratio)
    uncached = grpc_client.get_inference_statistics("lightgbm_regressor").model_stats[0].inference_stats
    assert uncached.cache_hit.count == 0
