"""Typed per-model gRPC APIs on the real stack: fetch each model's .proto (CLI and REST), compile it
with grpcio-tools here, call the generated stubs (sync and aio) and get the OIP answer for the same
rows; reflection lists and describes the typed services; each bad typed input gets an
INVALID_ARGUMENT whose google.rpc.BadRequest names the field."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from model_repository.demo import load_validation
from tests.unit.test_typed_schema import compile_proto

pytestmark = pytest.mark.integration

TABULAR = {"fraud_xgboost": "probability", "lightgbm_regressor": "prediction", "mlp_classifier": "probabilities"}
_COMPILED: dict[tuple[str, str], tuple] = {}  # one compile per package: generated modules live in the default pool


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli.typed", *args], capture_output=True, text=True, timeout=60, env=env)


def fetch_proto(url: str, name: str, version: str = "") -> str:
    result = cli("proto", name, "--url", url, *(["--version", version] if version else []))
    assert result.returncode == 0, result.stderr
    return result.stdout


def compile_stubs(text: str, module: str, out_dir) -> tuple:
    """protoc --python_out --grpc_python_out on the text; (messages module, stubs module)."""
    from grpc_tools import protoc

    key = (module, text)
    if key in _COMPILED:
        return _COMPILED[key]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{module}.proto").write_text(text)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = ["protoc", f"-I{out_dir}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"{module}.proto"]
    assert protoc.main(args) == 0
    sys.path.insert(0, str(out_dir))
    try:
        modules = importlib.import_module(f"{module}_pb2"), importlib.import_module(f"{module}_pb2_grpc")
    finally:
        sys.path.remove(str(out_dir))
    _COMPILED[key] = modules
    return modules


def bad_request(err: grpc.RpcError) -> dict[str, str]:
    """field -> description of the google.rpc.BadRequest in the status details."""
    status = next(status_pb2.Status.FromString(v) for k, v in err.trailing_metadata() if k == "grpc-status-details-bin")
    out = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.update({v.field: v.description for v in bad.field_violations})
    return out


def row_kwargs(messages, kind: str, row: np.ndarray) -> dict:
    fields = [f.name for f in messages.DESCRIPTOR.message_types_by_name[kind].fields]
    return dict(zip(fields, row.tolist()))


def oip(stack, model: str, rows: np.ndarray, output: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        x = grpcclient.InferInput("features", list(rows.shape), "FP32")
        x.set_data_from_numpy(rows)
        return client.infer(model, [x]).as_numpy(output)
    finally:
        client.close()


@pytest.fixture(scope="module")
def stubs(stack, tmp_path_factory):
    out = tmp_path_factory.mktemp("typed_stubs")
    return {model: compile_stubs(fetch_proto(stack.grpc, model), f"{model}_typed", out) for model in TABULAR}


def _stem(model: str) -> str:
    return "".join(w.capitalize() for w in model.split("_"))


def test_the_proto_comes_from_the_cli_and_rest_alike(stack):
    for model in TABULAR:
        text = fetch_proto(stack.grpc, model)
        with urllib.request.urlopen(f"http://{stack.http}/v1/models/{model}/proto", timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            assert r.headers["x-inferplane-schema"] == f"inferplane.models.{model}.v1.{_stem(model)}Service v1"
            assert r.read().decode() == text
        assert f"package inferplane.models.{model}.v1;" in text
    fraud = fetch_proto(stack.grpc, "fraud_xgboost")
    assert "optional float amount = 1;" in fraud and "optional float new_device_logins_7d = 32;" in fraud
    assert fetch_proto(stack.grpc, "fraud_xgboost", "v1") == fraud
    assert "from model version 1" in fetch_proto(stack.grpc, "fraud_xgboost", "1")
    missing = cli("proto", "no_such_model", "--url", stack.grpc)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    assert cli("proto", "fraud_xgboost", "--url", stack.grpc, "--version", "v9").returncode == 1


@pytest.mark.parametrize("model", sorted(TABULAR))
def test_generated_stubs_answer_like_the_oip_call(stack, stubs, model):
    messages, services = stubs[model]
    stem = _stem(model)
    rows = load_validation(stack.repository / model)["features"][:8]
    output = TABULAR[model]
    expected = oip(stack, model, rows, output)
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = getattr(services, f"{stem}ServiceStub")(channel)
        batch = getattr(messages, f"{stem}BatchRequest")(rows=[getattr(messages, f"{stem}Row")(**row_kwargs(messages, f"{stem}Row", r)) for r in rows])
        answer, call = stub.PredictBatch.with_call(batch, timeout=30)
        single = stub.Predict(getattr(messages, f"{stem}Request")(**row_kwargs(messages, f"{stem}Request", rows[0])), timeout=30)
    got = np.array([np.ravel(getattr(r, output)) for r in answer.results], dtype=np.float32)
    np.testing.assert_allclose(got, expected.reshape(len(rows), -1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.ravel(getattr(single, output)), expected[0].ravel(), rtol=1e-5, atol=1e-7)
    assert dict(call.trailing_metadata())["x-inferplane-version"] == "1"


def test_the_aio_stub_answers_concurrent_calls(stack, stubs):
    messages, services = stubs["fraud_xgboost"]
    rows = load_validation(stack.repository / "fraud_xgboost")["features"][:16]
    expected = oip(stack, "fraud_xgboost", rows, "probability").ravel()

    async def calls():
        async with grpc.aio.insecure_channel(stack.grpc) as channel:
            stub = services.FraudXgboostServiceStub(channel)
            requests = [messages.FraudXgboostRequest(**row_kwargs(messages, "FraudXgboostRequest", r)) for r in rows]
            return await asyncio.gather(*(stub.Predict(q, timeout=30) for q in requests))

    got = np.array([r.probability for r in asyncio.run(calls())], dtype=np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _reflect(stack, **request):
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        return list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=30))[0]


def test_reflection_lists_and_describes_the_typed_services(stack, tmp_path):
    listed = {s.name for s in _reflect(stack, list_services="").list_services_response.service}
    typed = {f"inferplane.models.{m}.v1.{_stem(m)}Service" for m in TABULAR}
    assert typed <= listed and "inference.GRPCInferenceService" in listed and "inferplane.v1.Admin" in listed
    assert "inferplane.models.lightgbm_cached.v1.LightgbmCachedService" in listed  # a copy of a demo model
    answer = _reflect(stack, file_containing_symbol="inferplane.models.fraud_xgboost.v1.FraudXgboostService")
    (served,) = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in answer.file_descriptor_response.file_descriptor_proto]
    assert served.name == "inferplane/models/fraud_xgboost/v1/fraud_xgboost.proto"
    compiled = compile_proto(fetch_proto(stack.grpc, "fraud_xgboost"), served.name, tmp_path)
    assert served == compiled  # what grpcurl / Postman see is what protoc makes of the caller's .proto
    by_name = _reflect(stack, file_by_filename="inferplane/models/lightgbm_regressor/v1/lightgbm_regressor.proto")
    assert len(by_name.file_descriptor_response.file_descriptor_proto) == 1
    assert _reflect(stack, file_containing_symbol="inferplane.models.nope.v1.NopeService").error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert _reflect(stack, file_containing_symbol="inference.GRPCInferenceService").file_descriptor_response.file_descriptor_proto


def test_bad_typed_inputs_each_name_their_field(stack, stubs):
    messages, services = stubs["fraud_xgboost"]
    row = load_validation(stack.repository / "fraud_xgboost")["features"][0]
    good = row_kwargs(messages, "FraudXgboostRequest", row)
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = services.FraudXgboostServiceStub(channel)
        predict = channel.unary_unary("/inferplane.models.fraud_xgboost.v1.FraudXgboostService/Predict")
        cases = {
            "missing": (stub.Predict, messages.FraudXgboostRequest(**{k: v for k, v in good.items() if k != "txn_count_24h"})),
            "out of range": (stub.Predict, messages.FraudXgboostRequest(**dict(good, amount=1e6))),
            "not a number": (stub.Predict, messages.FraudXgboostRequest(**dict(good, merchant_risk_score=float("nan")))),
            "batch row": (stub.PredictBatch, messages.FraudXgboostBatchRequest(rows=[messages.FraudXgboostRow(**good), messages.FraudXgboostRow(**dict(good, declines_24h=-1e9))])),
            "too many rows": (stub.PredictBatch, messages.FraudXgboostBatchRequest(rows=[messages.FraudXgboostRow(**good)] * 65)),
            "no rows": (stub.PredictBatch, messages.FraudXgboostBatchRequest()),
            # 'amount' (field 1) sent as a string, as a stub from another schema would
            "wrong type": (predict, b"\x0a\x03abc" + messages.FraudXgboostRequest(**{k: v for k, v in good.items() if k != "amount"}).SerializeToString()),
        }
        expected = {
            "missing": ("txn_count_24h", "required field is missing"),
            "out of range": ("amount", "outside the declared range [-6, 5]"),
            "not a number": ("merchant_risk_score", "nan z-score is outside the declared range"),
            "batch row": ("rows[1].declines_24h", "outside the declared range"),
            "too many rows": ("rows", "expected 1..64 rows (max_batch_size), got 65"),
            "no rows": ("rows", "no rows"),
            "wrong type": ("amount", "wrong type: got a length-delimited"),
        }
        for case, (method, request) in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            field, says = expected[case]
            violations = bad_request(err.value)
            assert says in violations.get(field, ""), (case, violations)
        assert stub.Predict(messages.FraudXgboostRequest(**good), timeout=30).probability > 0  # still serving


def _requests_total(stack, model: str, code: str) -> float:
    with urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=30) as r:
        text = r.read().decode()
    prefix = f'inferplane_requests_total{{code="{code}",model="{model}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_typed_calls_go_through_the_one_pipeline(stack, stubs):
    messages, services = stubs["lightgbm_regressor"]
    row = load_validation(stack.repository / "lightgbm_regressor")["features"][0]
    before = _requests_total(stack, "lightgbm_regressor", "OK")
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = services.LightgbmRegressorServiceStub(channel)
        for _ in range(3):
            stub.Predict(messages.LightgbmRegressorRequest(**row_kwargs(messages, "LightgbmRegressorRequest", row)), timeout=30)
    assert _requests_total(stack, "lightgbm_regressor", "OK") - before == 3  # counted by DataPlane.infer


def test_text_models_get_string_text_and_llms_keep_the_openai_api(llm_stack, tmp_path):
    text = fetch_proto(llm_stack.grpc, "minilm_embeddings")
    assert "optional string text = 1;" in text and "repeated float embedding = 1;" in text and "int32 tokens = 2;" in text
    messages, services = compile_stubs(text, "minilm_typed", tmp_path)
    sentences = ["The capital of France is Paris.", "hello"]
    with grpc.insecure_channel(llm_stack.grpc) as channel:
        stub = services.MinilmEmbeddingsServiceStub(channel)
        single = stub.Predict(messages.MinilmEmbeddingsRequest(text=sentences[0]), timeout=60)
        batch = stub.PredictBatch(messages.MinilmEmbeddingsBatchRequest(rows=[messages.MinilmEmbeddingsRow(text=s) for s in sentences]), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(messages.MinilmEmbeddingsRequest(), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in bad_request(err.value)
    client = grpcclient.InferenceServerClient(llm_stack.grpc)
    try:
        x = grpcclient.InferInput("text", [2, 1], "BYTES")
        x.set_data_from_numpy(np.array([[s.encode()] for s in sentences], dtype=np.object_))
        expected = client.infer("minilm_embeddings", [x]).as_numpy("embedding")
    finally:
        client.close()
    np.testing.assert_allclose(np.array(single.embedding), expected[0], atol=1e-5)
    np.testing.assert_allclose(np.array([r.embedding for r in batch.results]), expected, atol=1e-5)
    assert [r.tokens for r in batch.results][0] > 1
    llm = cli("proto", "tiny_llama", "--url", llm_stack.grpc)
    assert llm.returncode == 1 and "UNIMPLEMENTED" in llm.stderr and "OpenAI" in llm.stderr
    listed = {s.name for s in _reflect(llm_stack, list_services="").list_services_response.service}
    assert "inferplane.models.minilm_embeddings.v1.MinilmEmbeddingsService" in listed
    assert not any("tiny_llama" in s.lower() or "TinyLlama" in s for s in listed)
