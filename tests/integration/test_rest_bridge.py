"""The REST bridge on the real stack: tritonclient.http (JSON and binary) answers exactly like
tritonclient.grpc for every demo model, the KServe v1 form, metrics and OpenAPI, the documented
4xx for bad requests (the server keeps serving), and schemathesis against /openapi.json.

A few tests run the aiohttp app in-process over a stub data plane, for what the real stack
cannot show cheaply (a chunked body over a small limit, a bug inside a handler).
"""

from __future__ import annotations

import http.client
import json
import socket

import numpy as np
import pytest

from model_repository.demo import DEMO_MODELS
from model_repository.layout import load_validation

import tritonclient.http as httpclient  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.integration

BATCH = 32  # rows per request (the demo models take up to 64)
JSON = {"Content-Type": "application/json"}


def _call(stack, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One HTTP request on a fresh connection: (status, headers, body)."""
    host, port = stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _error(body: bytes) -> dict:
    doc = json.loads(body)
    assert set(doc) == {"error", "code", "details"} and isinstance(doc["error"], str), doc
    return {"code": doc["code"], "message": doc["error"], "details": doc["details"]}


@pytest.fixture(scope="module")
def http_client(stack):
    assert stack.http, "the frontend's ready line has no http= field"
    client = httpclient.InferenceServerClient(stack.http)
    yield client
    client.close()


@pytest.fixture
def assert_still_serving(stack, http_client):
    """After a test that sent something bad: the bridge is live and answers a real inference."""
    yield
    assert http_client.is_server_live() and http_client.is_server_ready()
    status, _, body = _call(
        stack, "POST", "/v1/models/lightgbm_regressor:predict", json.dumps({"instances": [[0.0] * 16]}).encode(), JSON
    )
    assert status == 200, body


def _validation(stack, model: str) -> tuple[np.ndarray, np.ndarray]:
    data = load_validation(stack.repository / model)
    return data["features"][:BATCH].astype(np.float32), data["expected"][:BATCH]


def _grpc_infer(stack, model: str, x: np.ndarray, output: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        tensor = grpcclient.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer(model, [tensor]).as_numpy(output)
    finally:
        client.close()


def _output_name(http_client, model: str) -> str:
    (output,) = http_client.get_model_metadata(model)["outputs"]
    return output["name"]


# ---- parity with gRPC ----------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("model", DEMO_MODELS)
def test_tritonclient_http_equals_grpc(stack, http_client, model, binary):
    x, expected = _validation(stack, model)
    output = _output_name(http_client, model)
    tensor = httpclient.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    requested = [httpclient.InferRequestedOutput(output, binary_data=binary)]
    result = http_client.infer(model, [tensor], outputs=requested, request_id="parity")
    got = result.as_numpy(output)
    described = result.get_response()
    assert described["id"] == "parity" and described["model_name"] == model
    assert ("binary_data_size" in described["outputs"][0].get("parameters", {})) == binary

    want = _grpc_infer(stack, model, x, output)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)  # bit-identical: same Triton, same bytes
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)


def test_binary_data_output_default_and_explicit_version(stack, http_client):
    """No outputs named: tritonclient asks binary_data_output and gets every output in binary."""
    x, _ = _validation(stack, "mlp_classifier")
    tensor = httpclient.InferInput("features", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = http_client.infer("mlp_classifier", [tensor], model_version="1")
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == BATCH * 10 * 4
    assert np.array_equal(result.as_numpy("probabilities"), _grpc_infer(stack, "mlp_classifier", x, "probabilities"))


def _int_shapes(metadata: dict) -> dict:
    for tensor in metadata["inputs"] + metadata["outputs"]:
        tensor["shape"] = [int(d) for d in tensor["shape"]]
    return metadata


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_metadata_config_and_readiness_equal_grpc(stack, http_client, model):
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        want = _int_shapes(client.get_model_metadata(model, as_json=True))  # as_json gives int64 as strings
        assert http_client.get_model_metadata(model) == want
        assert http_client.get_model_metadata(model, "1") == want
        rest_config = http_client.get_model_config(model)
        grpc_config = client.get_model_config(model, as_json=True)["config"]
        assert rest_config["name"] == grpc_config["name"] == model
        assert rest_config["max_batch_size"] == int(grpc_config["max_batch_size"])
        assert rest_config["input"][0]["dims"] == [int(d) for d in grpc_config["input"][0]["dims"]]
        assert http_client.is_model_ready(model) and http_client.is_model_ready(model, "1")
    finally:
        client.close()
    assert not http_client.is_model_ready(model, "999")
    assert not http_client.is_model_ready("no_such_model")
    assert http_client.is_server_live() and http_client.is_server_ready()
    assert http_client.get_server_metadata()["name"] == "inferplane"


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_kserve_v1_predict_equals_grpc(stack, http_client, model):
    x, _ = _validation(stack, model)
    x = x[:5]
    status, headers, body = _call(stack, "POST", f"/v1/models/{model}:predict", json.dumps({"instances": x.tolist()}).encode(), JSON)
    assert status == 200, body
    assert headers["Content-Type"].startswith("application/json")
    predictions = np.array(json.loads(body)["predictions"], dtype=np.float32)
    assert np.array_equal(predictions, _grpc_infer(stack, model, x, _output_name(http_client, model)))
    # the object form (input name -> row) means the same
    rows = [{"features": row} for row in x.tolist()]
    status, _, body2 = _call(stack, "POST", f"/v1/models/{model}:predict", json.dumps({"instances": rows}).encode())
    assert status == 200 and json.loads(body2) == json.loads(body)


# ---- operations ----------------------------------------------------------------------------


def test_metrics_is_the_same_registry(stack, http_client):
    tensor = httpclient.InferInput("features", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 16), np.float32))
    http_client.infer("lightgbm_regressor", [tensor])
    status, headers, rest = _call(stack, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    host, port = stack.metrics.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    scraped = conn.getresponse().read()
    conn.close()

    def ok_count(text: bytes) -> float:
        for line in text.decode().splitlines():
            if line.startswith("inferplane_requests_total{") and 'model="lightgbm_regressor"' in line and 'code="OK"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert ok_count(rest) >= 1 and ok_count(rest) == ok_count(scraped)


def test_openapi_is_the_route_table(stack):
    from server.composition import openapi_document

    status, headers, body = _call(stack, "GET", "/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == json.loads(json.dumps(openapi_document()))


# ---- bad requests: the documented 4xx, and the server keeps serving --------------------------


def _grpc_error(stack, request_bytes: bytes):
    """What the gRPC path answers for the same ModelInferRequest (code name, message)."""
    import grpc

    with grpc.insecure_channel(stack.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(request_bytes, timeout=10)
    return info.value.code().name, info.value.details()


@pytest.mark.usefixtures("assert_still_serving")
def test_wrong_tensor_length_is_the_grpc_error(stack):
    from server.protogen.inference import grpc_service_pb2 as pb

    x = np.zeros(15, np.float32)
    doc = {"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": x.tolist()}]}
    status, _, body = _call(stack, "POST", "/v2/models/lightgbm_regressor/infer", json.dumps(doc).encode(), JSON)
    assert status == 400
    error = _error(body)
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["details"][0]["field"] == "raw_input_contents[0] (input 'features')"

    request = pb.ModelInferRequest(model_name="lightgbm_regressor")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(x.tobytes())
    code, message = _grpc_error(stack, request.SerializeToString())
    assert code == "INVALID_ARGUMENT" and message == error["message"]


@pytest.mark.usefixtures("assert_still_serving")
def test_tritonclient_http_sees_the_error_status(stack, http_client):
    tensor = httpclient.InferInput("features", [1, 63], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 63), np.float32))
    with pytest.raises(InferenceServerException) as info:
        http_client.infer("mlp_classifier", [tensor])
    assert info.value.status() == "400"
    assert "features" in info.value.message() and "63" in info.value.message()  # the string error names the tensor
    assert "features" in str(info.value)  # str() works: tritonclient reads the string error


@pytest.mark.usefixtures("assert_still_serving")
@pytest.mark.parametrize(
    "path, body, headers, status, code",
    [
        ("/v2/models/lightgbm_regressor/infer", b'{"inputs": [', JSON, 400, "INVALID_ARGUMENT"),
        ("/v2/models/lightgbm_regressor/infer", b"\xff\xfe garbage", {}, 400, "INVALID_ARGUMENT"),
        ("/v2/models/lightgbm_regressor/infer", b"[" * 200_000, JSON, 400, "INVALID_ARGUMENT"),
        ("/v2/models/lightgbm_regressor/infer", b"{}", {"Content-Type": "text/plain"}, 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("/v1/models/lightgbm_regressor:predict", b"{}", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("/v1/models/lightgbm_regressor:predict", b'{"instances": 3}', JSON, 400, "INVALID_ARGUMENT"),
        ("/v1/models/lightgbm_regressor:predict", b'{"instances": [[1, "a"]]}', JSON, 400, "INVALID_ARGUMENT"),
        ("/v2/models/no_such_model/infer", b'{"inputs": []}', JSON, 404, "NOT_FOUND"),
        ("/v2/models/lightgbm_regressor/versions/7/infer", b'{"inputs": []}', JSON, 404, "NOT_FOUND"),
        ("/v1/models/no_such_model:predict", b'{"instances": [[1]]}', JSON, 404, "NOT_FOUND"),
        (
            "/v2/models/lightgbm_regressor/infer",
            b'{"inputs":[{"name":"features","shape":[1,16],"datatype":"FP32","parameters":{"binary_data_size":64}}]}',
            {**JSON, "Inference-Header-Content-Length": "200"},
            400,
            "INVALID_ARGUMENT",
        ),
    ],
    ids=["truncated-json", "not-utf8", "deep-nesting", "text-plain", "form", "instances-not-array",
         "instances-mixed", "unknown-model", "unknown-version", "v1-unknown-model", "bad-header-length"],
)  # fmt: skip
def test_bad_requests_get_the_documented_4xx(stack, path, body, headers, status, code):
    got, response_headers, answer = _call(stack, "POST", path, body, headers)
    assert got == status, answer
    assert response_headers["Content-Type"].startswith("application/json")
    assert _error(answer)["code"] == code


@pytest.mark.usefixtures("assert_still_serving")
def test_unknown_path_and_method_have_the_error_shape(stack):
    status, _, body = _call(stack, "GET", "/v2/nothing/here")
    assert status == 404 and _error(body)["code"] == "NOT_FOUND"
    status, headers, body = _call(stack, "DELETE", "/v2/health/live")
    assert status == 405 and _error(body)["code"] == "METHOD_NOT_ALLOWED" and "GET" in headers["Allow"]


@pytest.mark.usefixtures("assert_still_serving")
def test_huge_body_is_refused_before_it_is_read(stack):
    """A declared Content-Length over the limit gets 413 without the body being sent."""
    host, port = stack.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/models/lightgbm_regressor/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n{\"inputs\": ["
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert _error(body)["code"] == "REQUEST_TOO_LARGE"


@pytest.mark.usefixtures("assert_still_serving")
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_really_sent(stack, chunked):
    """A binary request just over the limit, actually sent (chunked: no length to check up front)."""
    size = stack.max_request_bytes + 1024
    rows = size // 64
    header = json.dumps(
        {"inputs": [{"name": "features", "shape": [rows, 16], "datatype": "FP32", "parameters": {"binary_data_size": rows * 64}}]}
    ).encode()
    payload = header + bytes(rows * 64)
    body = (payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)) if chunked else payload
    headers = {"Inference-Header-Content-Length": str(len(header))}
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
    host, port = stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v2/models/lightgbm_regressor/infer", body=body, headers=headers, encode_chunked=chunked)
        response = conn.getresponse()
        status, answer = response.status, response.read()
    finally:
        conn.close()
    assert status == 413 and _error(answer)["code"] == "REQUEST_TOO_LARGE"


# ---- schemathesis against the live /openapi.json -----------------------------------------------

MAX_EXAMPLES = 12  # per operation and mode: ~20 operations x 2 modes stays well under a minute


def test_schemathesis_conformance(stack):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    base_url = f"http://{stack.http}"
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance, response_headers_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13  # schemathesis leaves out the document it was loaded from
    failures: list[str] = []
    positive, negative = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
    for operation in operations:
        # random names only ever reach "unknown model"; a real one lets random bodies reach validation
        real = {k: v for k, v in {"name": "lightgbm_regressor", "version": "1"}.items() if "{%s}" % k in operation.path}
        if "/repository/models/" in operation.path:
            real = {}  # load/unload of a real model would change the shared stack (tested on their own)
        runs = [(positive, None), (negative, None)] + ([(positive, real)] if real else [])
        for mode, fixed in runs:

            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), report_multiple_bugs=False)  # fmt: skip
            @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed))
            def run(case):
                case.call_and_validate(base_url=base_url, checks=checks, timeout=30)

            try:
                run()
            except Unsatisfiable:  # nothing in this operation can be made invalid (no body, free-form strings)
                continue
            except Exception as err:  # collect every operation's failure, then fail once
                failures.append(f"{operation.label} [{mode.value} {fixed or ''}]: {str(err)[:1500]}")
    assert not failures, "\n\n".join(failures)
    # and nothing it sent broke the stack
    status, _, _ = _call(stack, "GET", "/v2/health/ready")
    assert status == 200


def test_the_readme_curl_example_runs_as_written(stack):
    """The quick start's curl command, run as a user would paste it (only the port is this stack's)."""
    import shlex
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("curl") is None:
        pytest.fail("curl is not installed: the README's REST example cannot be checked")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```bash\ncurl ", 1)[1].split("```", 1)[0]
    command = "curl " + block.replace("\\\n", " ").strip()
    command = command.replace("localhost:8000", stack.http)
    out = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    predictions = json.loads(out.stdout)["predictions"]
    assert len(predictions) == 1 and isinstance(predictions[0], (float, list))


def test_tritonclient_http_repository_and_statistics_extensions(stack, http_client):
    """Triton's repository and statistics extensions over REST, called by tritonclient.http itself."""
    from tests.conftest import CACHED_MODEL

    index = http_client.get_model_repository_index()
    ready = {(m["name"], m.get("version")) for m in index if m["state"] == "READY"}
    assert ("lightgbm_regressor", "1") in ready and ("fraud_xgboost", "1") in ready
    stats = http_client.get_inference_statistics("lightgbm_regressor")
    assert [s["name"] for s in stats["model_stats"]] == ["lightgbm_regressor"]
    assert isinstance(stats["model_stats"][0]["inference_stats"]["success"]["count"], int)
    everything = http_client.get_inference_statistics()
    assert {"lightgbm_regressor", "fraud_xgboost"} <= {s["name"] for s in everything["model_stats"]}
    with pytest.raises(InferenceServerException) as err:
        http_client.load_model(CACHED_MODEL, config='{"max_batch_size": 2}')
    assert err.value.status() == "400" and "deploy" in err.value.message() and "deploy" in str(err.value)
    http_client.unload_model(CACHED_MODEL)
    assert not http_client.is_model_ready(CACHED_MODEL)
    http_client.load_model(CACHED_MODEL)
    assert http_client.is_model_ready(CACHED_MODEL)


def test_grpc_load_with_a_config_override_is_refused(grpc_client):
    from tests.conftest import CACHED_MODEL

    with pytest.raises(InferenceServerException) as err:
        grpc_client.load_model(CACHED_MODEL, config='{"max_batch_size": 2}')
    assert "INVALID_ARGUMENT" in str(err.value.status()) and "deploy" in err.value.message()
