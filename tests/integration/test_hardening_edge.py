"""Issue 15, classes 2, 4, 7 and 8 on the real stack: caller mistakes are INVALID_ARGUMENT / 400
naming the field (never INTERNAL / 500), error details stay under gRPC's default metadata limit,
pickles are refused under every name, absurd timeouts and malformed HTTP get proper answers.

Each test checks the server is still well afterwards (``tests/stack_health.py``). The auth-on
parts of class 8 (REST /metrics needs an admin key, the CLIs send ``--api-key``) are in
``test_tenancy.py``, beside the stack that has keys.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.rpc import error_details_pb2, status_pb2
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from server.control.registry import safe_formats
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc, generate_pb2
from tests.stack_health import assert_healthy, baseline, valid_request

pytestmark = pytest.mark.integration
import openai  # noqa: E402

LLM = "tiny_llama"
EMBEDDINGS = "minilm_embeddings"
SVC = "/inference.GRPCInferenceService/"
BIG = "9" * 400  # a 400-digit integer literal


def _http(stack, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    host, port = stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _error(body: bytes) -> dict:
    """code, message and details of an error body in either REST shape (Triton's, or OpenAI's)."""
    doc = json.loads(body)
    if isinstance(doc["error"], str):
        return {"code": doc["code"], "message": doc["error"], "details": doc["details"]}
    return doc["error"]


def _text_request(*texts: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=EMBEDDINGS)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(t)) + t for t in texts))
    return request


# ---- class 2: caller mistakes are the caller's, named at the edge ---------------------------------

_OPENAI_BAD = [
    ("/v1/chat/completions", f'{{"model":"{LLM}","messages":[{{"role":"user","content":"\\ud800"}}]}}', "messages[0].content"),
    ("/v1/chat/completions", f'{{"model":"{LLM}","messages":[{{"role":"\\udfff","content":"hi"}}]}}', "messages[0].role"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"x\\ud800y"}}', "prompt"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","stop":["\\udc00"]}}', "stop[0]"),
    ("/v1/embeddings", f'{{"model":"{EMBEDDINGS}","input":["fine","\\ud800"]}}', "input[1]"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","max_tokens":{2**65}}}', "max_tokens"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","max_tokens":{BIG}}}', "max_tokens"),
    ("/v1/chat/completions", f'{{"model":"{LLM}","messages":[{{"role":"user","content":"hi"}}],"max_completion_tokens":{BIG}}}', "max_completion_tokens"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","temperature":{BIG}}}', "temperature"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","temperature":NaN}}', "temperature"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","top_p":Infinity}}', "top_p"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","seed":{2**65}}}', "seed"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","seed":{BIG}}}', "seed"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","deadline_ms":{BIG}}}', "deadline_ms"),
    ("/v1/completions", f'{{"model":"{LLM}","prompt":"hi","deadline_ms":1e300}}', "deadline_ms"),
    ("/v1/embeddings", f'{{"model":"{EMBEDDINGS}","input":"hi","dimensions":{BIG}}}', "dimensions"),
    ("/v1/embeddings", f'{{"model":"{EMBEDDINGS}","input":"hi","dimensions":{2**65}}}', "dimensions"),
    ("/v2/models/minilm_embeddings/infer", '{"inputs":[{"name":"text","datatype":"BYTES","shape":[1,1],"data":["\\ud800"]}]}', "inputs[0].data[0]"),
    ("/v1/models/minilm_embeddings:predict", '{"instances":["\\udbff"]}', "instances[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), _OPENAI_BAD, ids=[f"{p} {f}" for p, _, f in _OPENAI_BAD])
def test_rest_caller_mistakes_are_400_naming_the_field(llm_stack, path, body, field):
    before = baseline(llm_stack)
    status, _, answer = _http(llm_stack, "POST", path, body.encode())
    assert status == 400, answer
    error = _error(answer)
    assert error["code"] == "INVALID_ARGUMENT" and error["details"][0]["field"] == field, error
    assert len(answer) < 1000  # a 400-digit number is not echoed back
    assert_healthy(llm_stack, before, _text_request(b"fine"))


def test_the_openai_sdk_sees_bad_request_for_numbers_too_large(llm_stack):
    # (the SDK itself cannot send a lone surrogate: its JSON encoder refuses; raw bodies above do)
    client = openai.OpenAI(base_url=f"http://{llm_stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        with pytest.raises(openai.BadRequestError, match="seed"):
            client.completions.create(model=LLM, prompt="hi", max_tokens=2, seed=2**65)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "hi"}], max_tokens=2**65)
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model=EMBEDDINGS, input=["hi"], dimensions=2**65)
        assert client.completions.create(model=LLM, prompt="hi", max_tokens=2, seed=7).choices[0].finish_reason
    finally:
        client.close()


def _generate(stack, raw: bytes):
    with grpc.insecure_channel(stack.grpc) as channel:
        call = channel.unary_stream("/inferplane.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, [generate_pb2.GenerateResponse.FromString(m) for m in call(raw, timeout=60)]
        except grpc.RpcError as err:
            return err.code(), err.details()


@pytest.mark.parametrize(
    ("request_bytes", "field"),
    [
        (generate_pb2.GenerateRequest(model=LLM, prompt="hi", max_tokens=4_000_000_000).SerializeToString(), "max_tokens"),
        (generate_pb2.GenerateRequest(model=LLM, prompt="hi", max_tokens=2, temperature=float("nan")).SerializeToString(), "temperature"),
        (generate_pb2.GenerateRequest(model=LLM, prompt="hi", max_tokens=2, top_p=float("inf")).SerializeToString(), "top_p"),
        # a prompt (field 3) whose bytes are not UTF-8: protobuf refuses to parse it
        (generate_pb2.GenerateRequest(model=LLM).SerializeToString() + b"\x1a\x02\xff\xfe", "GenerateRequest"),
        (b"\xff\xff\xff not protobuf", "GenerateRequest"),
    ],
    ids=["max_tokens", "temperature", "top_p", "prompt-not-utf8", "garbage"],
)
def test_grpc_generate_caller_mistakes_are_invalid_argument(llm_stack, request_bytes, field):
    before = baseline(llm_stack)
    code, details = _generate(llm_stack, request_bytes)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (code, details)
    assert_healthy(llm_stack, before, _text_request(b"fine"))


@pytest.mark.parametrize("method", ["ServerReady", "ModelReady", "ModelMetadata", "ModelInfer", "RepositoryIndex"])
def test_grpc_bodies_that_do_not_parse_are_invalid_argument(stack, method):
    with grpc.insecure_channel(stack.grpc) as channel:
        call = channel.unary_unary(SVC + method, request_serializer=None, response_deserializer=None)
        # garbage; and where the message has a string field 1: one that is not UTF-8
        for body in (b"\xff\xff\xff", b"\x0a\x02\xff\xfe")[: 1 if method == "ServerReady" else 2]:
            with pytest.raises(grpc.RpcError) as err:
                call(body, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, err.value.details())


def test_non_utf8_text_is_invalid_argument_before_triton_sees_it(llm_stack):
    """The embedding model's signature says its BYTES input is text: the frontend checks it. The
    answer is the frontend's validation (naming the tensor's raw contents), not the adapter's."""
    before = baseline(llm_stack)
    client = grpcclient.InferenceServerClient(llm_stack.grpc)
    try:
        for text in (b"\xff", b"ok\xe2\x82", b"\xed\xa0\x80"):
            with pytest.raises(InferenceServerException) as err:
                x = grpcclient.InferInput("text", [1, 1], "BYTES")
                x.set_data_from_numpy(np.array([[text]], dtype=np.object_))
                client.infer(EMBEDDINGS, [x])
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value.message()
            # the frontend's own violation; the adapter would say "invalid request: input 'text' row 0 ..."
            assert err.value.message().startswith(f"model '{EMBEDDINGS}': raw_input_contents[0]") and "UTF-8" in err.value.message()
    finally:
        client.close()
    assert_healthy(llm_stack, before, _text_request(b"fine"))


# ---- class 4: error details fit in what clients accept -------------------------------------------


def _huge_requests():
    wide_datatype = valid_request()
    wide_datatype.inputs[0].datatype = "D" * 10_000
    long_model = valid_request()
    long_model.model_name = "m" * 100_000
    many_outputs = valid_request()
    for i in range(10_000):
        many_outputs.outputs.add(name=f"no_such_output_{i}")
    many_inputs = valid_request()
    for i in range(2_000):
        many_inputs.inputs.add(name=f"x{i}" * 50, datatype="FP32", shape=[1, 16])
    many_inputs.ClearField("raw_input_contents")
    return {"10k-char datatype": (wide_datatype, "INVALID_ARGUMENT"), "100k-char model name": (long_model, "NOT_FOUND"),
            "10k unknown outputs": (many_outputs, "INVALID_ARGUMENT"), "2k unknown inputs": (many_inputs, "INVALID_ARGUMENT")}  # fmt: skip


HUGE = _huge_requests()


@pytest.mark.parametrize("case", sorted(HUGE))
def test_huge_echoes_stay_under_the_default_metadata_limit(stack, case):
    """tritonclient's own gRPC stub, with grpc's default limits, sees the real status, not
    RESOURCE_EXHAUSTED 'received metadata size exceeds hard limit'; trailers stay below 8 KiB."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    before = baseline(stack)
    request, code = HUGE[case]
    with grpc.insecure_channel(stack.grpc) as channel:  # no options: the default metadata limits
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(service_pb2.ModelInferRequest.FromString(request.SerializeToString()), timeout=30)
    assert err.value.code().name == code, (err.value.code(), err.value.details()[:200])
    trailers = err.value.trailing_metadata()
    size = sum(len(k) + len(v) for k, v in trailers) + len(err.value.details().encode())
    assert size < 8 << 10, size
    rich = status_pb2.Status.FromString(dict(trailers)["grpc-status-details-bin"])
    bad = error_details_pb2.BadRequest()
    if case in ("10k unknown outputs", "2k unknown inputs"):
        assert any(d.Unpack(bad) for d in rich.details) and len(bad.field_violations) <= 9
        assert bad.field_violations[-1].field == "(more)" and "more violations not listed" in bad.field_violations[-1].description
    assert_healthy(stack, before, valid_request())


def test_tritonclient_infer_with_10k_unknown_outputs_is_invalid_argument(stack):
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        x = grpcclient.InferInput("features", [1, 16], "FP32")
        x.set_data_from_numpy(np.zeros((1, 16), np.float32))
        outputs = [grpcclient.InferRequestedOutput(f"no_such_output_{i}") for i in range(10_000)]
        with pytest.raises(InferenceServerException) as err:
            client.infer("lightgbm_regressor", [x], outputs=outputs)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value.message()[:200]
    finally:
        client.close()


# ---- class 7: pickles under TensorRT names (and every other name) are refused --------------------


def _protocol4_without_header() -> bytes:
    """``str("x")`` as a protocol-4 opcode stream with no PROTO/FRAME: starts 8c 08 'builtins' 94."""
    name = b"\x8c\x08builtins\x94\x8c\x03str\x94\x93\x94"
    return name + b"\x8c\x01x\x94\x85\x94R\x94."


@pytest.mark.parametrize("filename", ["model.plan", "model.engine", "model.trt", "model.onnx", "model.safetensors", "model.json"])
@pytest.mark.parametrize("kind", ["protocol 4 without PROTO", "protocol 0", "protocol 5"])
def test_registering_a_pickle_is_refused_under_every_name(stack, filename, kind):
    import pickle

    data = {"protocol 4 without PROTO": _protocol4_without_header(), "protocol 0": b"cbuiltins\nstr\n(Vx\ntR.",
            "protocol 5": pickle.dumps({"w": [1.0]}, protocol=5)}[kind]  # fmt: skip
    assert pickle.loads(data) in ("x", {"w": [1.0]})  # it is a real, loadable pickle
    signature = {"inputs": [{"name": "features", "datatype": "FP32", "dims": [16]}], "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}]}
    with grpc.insecure_channel(stack.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        request = admin_pb2.RegisterModelRequest(name="smuggled", artifact=data, filename=filename, signature_json=json.dumps(signature))
        with pytest.raises(grpc.RpcError) as err:
            admin.RegisterModel(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pickle" in err.value.details(), err.value.details()
        listed = admin.ListRegisteredModels(admin_pb2.ListRegisteredModelsRequest(), timeout=30)
        assert "smuggled" not in {m.name for m in listed.models}


# ---- class 8: absurd timeouts, malformed HTTP ---------------------------------------------------

_REST_INFER = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 16], "data": [0.25] * 16}]}).encode()


@pytest.mark.parametrize("value", ["1e10", "inf", "1e300", "Infinity", "100000000"])
def test_a_huge_request_timeout_is_clamped_not_an_immediate_504(stack, value):
    status, _, body = _http(stack, "POST", "/v2/models/lightgbm_regressor/infer", _REST_INFER, {"x-request-timeout": value})
    assert status == 200, body


@pytest.mark.parametrize("value", ["nan", "0", "-1", "abc", "", "1e10x"])
def test_a_request_timeout_that_is_not_seconds_is_400_naming_the_header(stack, value):
    status, _, body = _http(stack, "POST", "/v2/models/lightgbm_regressor/infer", _REST_INFER, {"x-request-timeout": value})
    assert status == 400 and _error(body)["details"][0]["field"] == "x-request-timeout", body


def test_a_grpc_deadline_of_a_century_is_served(stack):
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        x = grpcclient.InferInput("features", [1, 16], "FP32")
        x.set_data_from_numpy(np.zeros((1, 16), np.float32))
        assert client.infer("lightgbm_regressor", [x], client_timeout=5e9).as_numpy("prediction").shape == (1, 1)
    finally:
        client.close()


def _raw_http(stack, data: bytes) -> bytes:
    host, port = stack.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nBad\x00Header: y\r\n\r\n",
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v2/models/x/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello on the plain port
    ],
    ids=["request-line", "header-token", "oversize-header", "oversize-line", "negative-length", "tls"],
)
def test_malformed_http_gets_the_json_error_shape(stack, data):
    answer = _raw_http(stack, data)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ")[1] == b"400", head
    assert b"content-type: application/json" in head.lower(), head
    error = _error(body)
    assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith("malformed HTTP request"), error
    status, _, _ = _http(stack, "GET", "/v2/health/ready")
    assert status == 200


def _valid_onnx() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["features"], ["y"])], "g",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 16])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("filename", ["model.pkl", "model.pt", "model.joblib"])
def test_valid_onnx_bytes_under_a_pickle_name_are_refused_at_register_and_never_deployable(stack, filename):
    """The name alone refuses: a loader that picks its reader by extension would unpickle `model.pkl`."""
    data = _valid_onnx()
    assert safe_formats.detect_format(data) == safe_formats.ONNX  # the bytes themselves are a valid ONNX model
    name = "renamed_" + filename.split(".")[1]
    signature = {"inputs": [{"name": "features", "datatype": "FP32", "dims": [16]}], "outputs": [{"name": "y", "datatype": "FP32", "dims": [16]}]}
    with grpc.insecure_channel(stack.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        request = admin_pb2.RegisterModelRequest(name=name, artifact=data, filename=filename, signature_json=json.dumps(signature))
        with pytest.raises(grpc.RpcError) as err:
            admin.RegisterModel(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"refusing {filename}" in err.value.details() and "pickle" in err.value.details(), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            admin.Deploy(admin_pb2.DeployRequest(ref=name), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        listed = admin.ListRegisteredModels(admin_pb2.ListRegisteredModelsRequest(), timeout=30)
        assert name not in {m.name for m in listed.models}
