"""`inferplane serve --triton-mode in-process`: the whole platform with Triton inside the frontend
process (libtritonserver through its C API), next to the default stack (a tritonserver child over
loopback gRPC). The same callers get the same answers and the same errors; concurrent callers' requests
are merged into one Triton call over their own buffers; a clean stop leaves no process behind."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from server.protogen.inference import grpc_service_pb2 as pb
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration

TABULAR = ["fraud_xgboost", "lightgbm_regressor", "mlp_classifier"]
SVC = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def inprocess(demo_repository, tmp_path_factory):
    s = start_stack(demo_repository, tmp_path_factory.mktemp("inprocess"), "--triton-mode", "in-process", "--workers", "1")
    yield s
    if s.process.poll() is None:
        stop_stack(s)


def _features(model: str, rows: int) -> np.ndarray:
    width = {"fraud_xgboost": 32, "lightgbm_regressor": 16, "mlp_classifier": 64}[model]
    return np.random.default_rng(rows).normal(size=(rows, width)).astype(np.float32)


def _outputs(address: str, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(address)
    try:
        inp = grpcclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(model, [inp], client_timeout=30)
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
    finally:
        client.close()


def test_the_ready_line_names_in_process_and_no_tritonserver_child(inprocess):
    assert inprocess.triton == "in-process"
    children = [p.name() for p in psutil.Process(inprocess.process.pid).children(recursive=True)]
    assert "tritonserver" not in children, children


@pytest.mark.parametrize("model", TABULAR)
def test_same_answers_as_the_stack_with_a_tritonserver_child(inprocess, stack, model):
    x = _features(model, 5)
    ours, theirs = _outputs(inprocess.grpc, model, x), _outputs(stack.grpc, model, x)
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-6, err_msg=name)


def test_rest_and_model_metadata_answer_in_process(inprocess):
    x = _features("fraud_xgboost", 3)
    client = httpclient.InferenceServerClient(inprocess.http)
    try:
        inp = httpclient.InferInput("features", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        rest = client.infer("fraud_xgboost", [inp]).as_numpy("probability")
        assert client.get_model_metadata("fraud_xgboost")["name"] == "fraud_xgboost"
    finally:
        client.close()
    np.testing.assert_allclose(rest, _outputs(inprocess.grpc, "fraud_xgboost", x)["probability"], rtol=1e-6)


def test_a_bad_request_is_invalid_argument_naming_the_input(inprocess):
    request = pb.ModelInferRequest(model_name="fraud_xgboost")
    request.inputs.add(name="features", datatype="FP32", shape=[2, 31])
    request.raw_input_contents.append(np.zeros((2, 31), np.float32).tobytes())
    with grpc.insecure_channel(inprocess.grpc) as channel:
        call = channel.unary_unary(SVC + "ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "features" in err.value.details()


def test_concurrent_callers_are_merged_and_each_gets_its_own_rows(inprocess):
    rows = [_features("fraud_xgboost", n + 1) for n in range(48)]

    async def call_all():
        async with grpc.aio.insecure_channel(inprocess.grpc) as channel:
            call = channel.unary_unary(SVC + "ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip

            async def one(x):
                request = pb.ModelInferRequest(model_name="fraud_xgboost")
                request.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
                request.raw_input_contents.append(x.tobytes())
                response = await call(request, timeout=60)
                return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(x.shape[0], -1)

            return await asyncio.gather(*(one(x) for x in rows))

    answers = asyncio.run(call_all())
    for x, got in zip(rows, answers):  # each caller's own rows, in its own order
        np.testing.assert_allclose(got, _outputs(inprocess.grpc, "fraud_xgboost", x)["probability"], rtol=1e-6)
    metrics = urllib.request.urlopen(f"http://{inprocess.metrics}/metrics", timeout=10).read().decode()
    merged = [
        line for line in metrics.splitlines()
        if line.startswith('inferplane_batch_requests_bucket{le="1.0",model="fraud_xgboost"}')
        or line.startswith('inferplane_batch_requests_count{model="fraud_xgboost"}')
    ]  # fmt: skip
    alone, calls = (float(line.rsplit(" ", 1)[1]) for line in sorted(merged))
    assert calls > alone, f"no Triton call carried more than one request: {merged}"


def test_stream_infer_in_process(inprocess):
    x = _features("mlp_classifier", 2)
    request = pb.ModelInferRequest(model_name="mlp_classifier", id="s1")
    request.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    with grpc.insecure_channel(inprocess.grpc) as channel:
        call = channel.stream_stream(SVC + "ModelStreamInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip
        replies = list(call(iter([request, request]), timeout=30))
    assert [r.error_message for r in replies] == ["", ""]
    assert [r.infer_response.id for r in replies] == ["s1", "s1"]


def test_a_clean_stop_leaves_no_process(inprocess):
    pid = inprocess.process.pid
    children = psutil.Process(pid).children(recursive=True)
    assert stop_stack(inprocess) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
