"""A stream message is validated exactly like a unary request: every request parameter the unary
path refuses is refused in-stream with the same code and the same message (never Triton's INTERNAL).

Each case is sent twice on the real stack: as ModelInfer (the status and its details) and as one
ModelStreamInfer message (the in-stream ``error_message``, ``"<REASON>: <message>"``); both must
say INVALID_ARGUMENT with the same text, and the stream goes on answering a good message after it.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from server.dataplane.validation import ADAPTER_PARAMETER, PRIORITY_PARAMETER, RESERVED_PARAMETERS, SHARED_MEMORY_PARAMETERS, TENSOR_PARAMETERS
from server.protogen.inference import grpc_service_pb2 as pb

pytestmark = pytest.mark.integration

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _good(request_id: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="fraud_xgboost", id=request_id)
    req.inputs.add(name="features", datatype="FP32", shape=[2, 32])
    req.raw_input_contents.append(np.zeros((2, 32), np.float32).tobytes())
    return req


def _request_param(key: str, kind: str, value):
    def apply(req: pb.ModelInferRequest) -> None:
        setattr(req.parameters[key], kind, value)

    return apply


def _output_param(key: str, kind: str, value):
    def apply(req: pb.ModelInferRequest) -> None:
        setattr(req.outputs.add(name="probability").parameters[key], kind, value)

    return apply


def _input_param(key: str, kind: str, value):
    def apply(req: pb.ModelInferRequest) -> None:
        setattr(req.inputs[0].parameters[key], kind, value)

    return apply


# (case, mutation, the field the error names): every request parameter ``check_parameters`` refuses
CASES = [
    ("negative classification", _output_param("classification", "int64_param", -1), "outputs[0].parameters.classification"),
    ("classification as text", _output_param("classification", "string_param", "3"), "outputs[0].parameters.classification"),
    ("negative binary_data_size", _input_param("binary_data_size", "int64_param", -4), "inputs[0].parameters.binary_data_size"),
    ("binary_data as a number", _output_param("binary_data", "int64_param", 1), "outputs[0].parameters.binary_data"),
    ("shared memory input", _input_param("shared_memory_region", "string_param", "r"), "inputs[0].parameters.shared_memory_region"),
    ("shared memory output", _output_param("shared_memory_region", "string_param", "r"), "outputs[0].parameters.shared_memory_region"),
    ("negative priority", _request_param("priority", "int64_param", -1), "parameters.priority"),
    ("negative timeout", _request_param("timeout", "int64_param", -5), "parameters.timeout"),
    ("sequence_start as a number", _request_param("sequence_start", "int64_param", 1), "parameters.sequence_start"),
    ("sequence_end as text", _request_param("sequence_end", "string_param", "yes"), "parameters.sequence_end"),
    ("empty final response as a number", _request_param("triton_enable_empty_final_response", "int64_param", 1),
     "parameters.triton_enable_empty_final_response"),
    ("binary_data_output as a number", _request_param("binary_data_output", "int64_param", 1), "parameters.binary_data_output"),
    ("priority as a double", _request_param("priority", "double_param", 1.0), "parameters.priority"),
    ("timeout as text", _request_param("timeout", "string_param", "5"), "parameters.timeout"),
    ("binary_data_size as text", _input_param("binary_data_size", "string_param", "4"), "inputs[0].parameters.binary_data_size"),
    ("shared memory byte size", _input_param("shared_memory_byte_size", "int64_param", 4), "inputs[0].parameters.shared_memory_byte_size"),
    ("shared memory offset", _output_param("shared_memory_offset", "int64_param", 0), "outputs[0].parameters.shared_memory_offset"),
    ("frontend's adapter parameter", _request_param("inferplane_adapter", "string_param", "a"), "parameters.inferplane_adapter"),
    ("sequence_id as a double", _request_param("sequence_id", "double_param", 1.5), "parameters.sequence_id"),
    ("custom parameter as a double", _request_param("headers", "double_param", 2.0), "parameters.headers"),
    ("frontend's own parameter", _request_param("inferplane_priority", "int64_param", 0), "parameters.inferplane_priority"),
    ("parameter without a name", _request_param("", "bool_param", True), "parameters"),
]


def test_every_parameter_the_validator_knows_has_a_case():
    """A parameter added to ``server.dataplane.validation`` without a stream case here fails this."""
    named = {field.rsplit(".", 1)[-1] for _, _, field in CASES}
    known = {*RESERVED_PARAMETERS, *SHARED_MEMORY_PARAMETERS, *TENSOR_PARAMETERS, PRIORITY_PARAMETER, ADAPTER_PARAMETER}
    assert known <= named, sorted(known - named)


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.grpc, options=[("grpc.enable_retries", 0)]) as ch:
        yield ch


def _unary_error(channel, body: bytes) -> grpc.RpcError:
    call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        call(body, timeout=20)
    return info.value


def _stream(channel, bodies: list[bytes]) -> list[pb.ModelStreamInferResponse]:
    call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=pb.ModelStreamInferResponse.FromString)
    return list(call(iter(bodies), timeout=30))


@pytest.mark.parametrize(("case", "mutate", "field"), CASES, ids=[c[0] for c in CASES])
def test_stream_message_gets_the_unary_error(channel, case, mutate, field):
    bad = _good("bad")
    mutate(bad)
    unary = _unary_error(channel, bad.SerializeToString())
    assert unary.code() == grpc.StatusCode.INVALID_ARGUMENT, unary.details()
    assert field in unary.details()

    responses = _stream(channel, [bad.SerializeToString(), _good("after").SerializeToString()])
    errors = [r for r in responses if r.error_message]
    answers = [r for r in responses if not r.error_message]
    assert len(errors) == 1 and errors[0].infer_response.id == "bad", [r.error_message for r in responses]
    assert errors[0].error_message == f"INVALID_ARGUMENT: {unary.details()}"
    assert [a.infer_response.id for a in answers] == ["after"]  # the stream still serves after the refusal
