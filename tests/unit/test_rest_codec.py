"""The REST codec: KServe v2 JSON / binary bodies <-> ModelInferRequest / ModelInferResponse,
the KServe v1 instances form, and the OpenAPI document built from the route table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from server.transports.rest import codec as rest_codec
from server.dataplane.codecs import serialize_bytes
from server.errors import InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.dataplane.signature import ModelSignature, TensorSpec


def _sig(max_batch_size=8, **inputs) -> ModelSignature:
    specs = {name: TensorSpec(name, dt, dims) for name, (dt, dims) in inputs.items()}
    return ModelSignature(
        name="m",
        max_batch_size=max_batch_size,
        inputs=specs,
        outputs={"y": TensorSpec("y", "FP32", (1,))},
        versions=frozenset({"1"}),
        required=frozenset(specs),
    )


def _body(doc: dict) -> bytes:
    return json.dumps(doc).encode()


# ---- v2 requests ---------------------------------------------------------------------------


def test_json_request_becomes_raw_contents():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    body = _body(
        {
            "id": "r1",
            "parameters": {"priority": 2, "binary_data_output": True},
            "inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": x.tolist()}],
            "outputs": [{"name": "y", "parameters": {"binary_data": False, "classification": 0}}],
        }
    )
    request, plan = rest_codec.decode_infer_request(body, None, "m", "1")
    assert (request.model_name, request.model_version, request.id) == ("m", "1", "r1")
    assert list(request.inputs[0].shape) == [2, 3] and request.inputs[0].datatype == "FP32"
    assert request.raw_input_contents[0] == x.tobytes()
    assert request.parameters["priority"].int64_param == 2
    assert "binary_data_output" not in request.parameters  # HTTP-only, never forwarded
    assert "binary_data" not in request.outputs[0].parameters
    assert request.outputs[0].parameters["classification"].int64_param == 0
    assert plan.is_binary("y") is False and plan.is_binary("other") is True


def test_binary_extension_request_slices_body():
    a = np.arange(4, dtype=np.int32)
    b = np.array([1.5, 2.5], dtype=np.float64)
    header = _body(
        {
            "inputs": [
                {"name": "a", "shape": [4], "datatype": "INT32", "parameters": {"binary_data_size": a.nbytes}},
                {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["hé", "x"]},
                {"name": "b", "shape": [2], "datatype": "FP64", "parameters": {"binary_data_size": b.nbytes}},
            ]
        }
    )
    body = header + a.tobytes() + b.tobytes()
    request, plan = rest_codec.decode_infer_request(body, len(header), "m")
    assert request.raw_input_contents[0] == a.tobytes()
    assert request.raw_input_contents[1] == serialize_bytes([s.encode() for s in ["hé", "x"]])
    assert request.raw_input_contents[2] == b.tobytes()
    assert not plan.default_binary
    assert "binary_data_size" not in request.inputs[0].parameters


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"inputs": {"x": 1}}, "inputs"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, "inputs[0]"),
        ({"inputs": [{"name": "x", "shape": "1", "datatype": "FP32", "data": [1]}]}, "inputs[0].shape"),
        ({"inputs": [{"name": "x", "shape": [2**64], "datatype": "FP32", "data": [1]}]}, "inputs[0].shape[0]"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [[1], [2, 3]]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": [1]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "NOPE", "data": [1]}]}, "inputs[0].data"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [None]}]}, "inputs[0].data"),
        ({"inputs": [{"name": 3, "shape": [1], "datatype": "FP32", "data": [1]}]}, "inputs[0].name"),
        ({"parameters": {"p": [1]}, "inputs": []}, "parameters.p"),
        ({"parameters": {"binary_data_output": "yes"}, "inputs": []}, "parameters.binary_data_output"),
        ({"id": 7, "inputs": []}, "id"),
        ([1, 2], "request body"),
    ],
)
def test_malformed_requests_name_the_field(doc, field):
    with pytest.raises(InvalidRequest) as info:
        rest_codec.decode_infer_request(_body(doc), None, "m")
    assert info.value.violations[0].field == field


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe\x00", b"[" * 100_000, b"nan"])
def test_not_json_is_invalid_request(body):
    with pytest.raises(InvalidRequest):
        rest_codec.decode_infer_request(body, None, "m")


def test_binary_sizes_must_account_for_the_whole_body():
    header = _body({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]})
    with pytest.raises(InvalidRequest, match="do not fit"):
        rest_codec.decode_infer_request(header + b"\0" * 4, len(header), "m")
    with pytest.raises(InvalidRequest, match="not claimed"):
        rest_codec.decode_infer_request(header + b"\0" * 12, len(header), "m")
    with pytest.raises(InvalidRequest):
        rest_codec.header_length("-1", 10)
    with pytest.raises(InvalidRequest):
        rest_codec.header_length("11", 10)
    with pytest.raises(InvalidRequest):
        rest_codec.header_length("abc", 10)
    assert rest_codec.header_length(None, 10) is None


def test_element_count_is_left_to_the_dataplane():
    """A short tensor still decodes: the data plane's validation reports it, exactly as for gRPC."""
    body = _body({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}]})
    request, _ = rest_codec.decode_infer_request(body, None, "m")
    assert len(request.raw_input_contents[0]) == 12


# ---- v2 responses --------------------------------------------------------------------------


def _response() -> tuple[bytes, np.ndarray, list[bytes]]:
    y = np.array([[0.25, 0.5], [1.0, -2.0]], dtype=np.float32)
    words = [b"cat", "caf\u00e9".encode()]
    response = pb.ModelInferResponse(model_name="m", model_version="1", id="r1")
    response.outputs.add(name="y", datatype="FP32", shape=[2, 2])
    response.outputs.add(name="w", datatype="BYTES", shape=[2])
    response.raw_output_contents.extend([y.tobytes(), serialize_bytes(words)])
    return response.SerializeToString(), y, words


def test_response_as_json():
    raw, y, words = _response()
    body, header_len = rest_codec.encode_infer_response(raw, rest_codec.OutputPlan())
    assert header_len is None
    doc = json.loads(body)
    assert doc["model_name"] == "m" and doc["model_version"] == "1" and doc["id"] == "r1"
    assert np.array_equal(np.array(doc["outputs"][0]["data"], dtype=np.float32).reshape(2, 2), y)
    assert doc["outputs"][1]["data"] == ["cat", "caf\u00e9"]


def test_response_with_binary_outputs_reads_back_with_tritonclient():
    from tritonclient.http import InferResult

    raw, y, words = _response()
    body, header_len = rest_codec.encode_infer_response(raw, rest_codec.OutputPlan(default_binary=True, binary={"w": False}))
    assert header_len is not None
    result = InferResult.from_response_body(body, header_length=header_len)
    assert np.array_equal(result.as_numpy("y"), y)
    assert result.as_numpy("w").tolist() == ["cat", "caf\u00e9"]


def test_non_utf8_bytes_output_in_json_is_an_invalid_request():
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="w", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_bytes([b"\xff"]))
    with pytest.raises(InvalidRequest, match="binary_data"):
        rest_codec.encode_infer_response(response.SerializeToString(), rest_codec.OutputPlan())


# ---- KServe v1 -----------------------------------------------------------------------------


def test_instances_single_input_batched():
    sig = _sig(x=("FP32", (3,)))
    (request,) = rest_codec.decode_instances(_body({"instances": [[1, 2, 3], [4, 5, 6]]}), sig)
    assert list(request.inputs[0].shape) == [2, 3] and request.inputs[0].datatype == "FP32"
    assert request.raw_input_contents[0] == np.arange(1, 7, dtype=np.float32).tobytes()


def test_instances_multi_input_and_unknown_names_reach_validation():
    sig = _sig(a=("INT64", (2,)), b=("FP32", (1,)))
    (request,) = rest_codec.decode_instances(_body({"instances": [{"a": [1, 2], "b": [0.5], "zz": [1]}]}), sig)
    assert [t.name for t in request.inputs] == ["a", "b", "zz"]
    assert request.raw_input_contents[0] == np.array([[1, 2]], dtype=np.int64).tobytes()
    assert request.raw_input_contents[2] == b""
    with pytest.raises(InvalidRequest, match="each instance must be an object"):
        rest_codec.decode_instances(_body({"instances": [[1, 2]]}), sig)
    with pytest.raises(InvalidRequest, match="missing"):
        rest_codec.decode_instances(_body({"instances": [{"a": [1, 2], "b": [1]}, {"a": [1, 2]}]}), sig)
    with pytest.raises(InvalidRequest):
        rest_codec.decode_instances(_body({"instances": []}), sig)


def test_instances_without_batch_dimension_are_one_request_each():
    sig = _sig(max_batch_size=0, x=("FP32", (2,)))
    requests = rest_codec.decode_instances(_body({"instances": [[1, 2], [3, 4]]}), sig)
    assert [list(r.inputs[0].shape) for r in requests] == [[2], [2]]


def test_predictions_rows_and_objects():
    def response(**outputs):
        r = pb.ModelInferResponse(model_name="m")
        for name, arr in outputs.items():
            r.outputs.add(name=name, datatype="FP32", shape=list(arr.shape))
            r.raw_output_contents.append(arr.tobytes())
        return r.SerializeToString()

    y = np.array([[0.5], [0.25]], dtype=np.float32)
    assert rest_codec.encode_predictions([response(y=y)], batched=True) == [[0.5], [0.25]]
    z = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    assert rest_codec.encode_predictions([response(y=y, z=z)], batched=True) == [
        {"y": [0.5], "z": [1.0, 2.0]},
        {"y": [0.25], "z": [3.0, 4.0]},
    ]
    assert rest_codec.encode_predictions([response(y=y[0]), response(y=y[1])], batched=False) == [[0.5], [0.25]]


# ---- metadata and the OpenAPI document -----------------------------------------------------


def test_model_config_keeps_int64_as_numbers():
    from server.protogen.inference import model_config_pb2

    config = model_config_pb2.ModelConfig(name="m", max_batch_size=8)
    config.input.add(name="x", data_type=model_config_pb2.TYPE_FP32, dims=[64])
    config.dynamic_batching.max_queue_delay_microseconds = 100
    raw = pb.ModelConfigResponse(config=config).SerializeToString()
    doc = rest_codec.model_config_json(raw)
    assert doc["input"][0]["dims"] == [64]
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert doc["max_batch_size"] == 8


def test_openapi_document_describes_every_registered_route():
    from server.composition import ROUTES, create_app, openapi_document
    from server.dataplane.metrics import Metrics

    doc = openapi_document()
    app = create_app(None, Metrics(), max_body_bytes=1 << 20)
    registered = {(r.method, r.resource.canonical) for r in app.router.routes()}
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert registered == documented == {(r.method, r.path) for r in ROUTES}
    infer = doc["paths"]["/v2/models/{name}/infer"]["post"]
    assert {"400", "404", "413", "415", "500", "503"} <= set(infer["responses"])
    assert [p["name"] for p in infer["parameters"]] == ["name", rest_codec.HEADER_LENGTH]
    # every $ref resolves
    text = json.dumps(doc)
    for name in doc["components"]["schemas"]:
        text = text.replace(f'"#/components/schemas/{name}"', "")
    assert "#/components/schemas/" not in text
