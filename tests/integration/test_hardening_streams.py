"""Issue 15, class 1 (a tenant's request takes Triton down), through ModelStreamInfer: Triton 2.51
crashes (SIGSEGV or an abort in its stream writer) when one stream carries requests of a decoupled
model (the LLM) and of a non-decoupled one (the embeddings) — reproduced against Triton directly
within a few dozen such streams. The frontend gives each model of a caller's stream its own Triton
stream, so mixed streams through it leave Triton running and every message answered."""

from __future__ import annotations

import json

import grpc
import pytest

from server.dataplane import codecs
from server.protogen.inference import grpc_service_pb2 as pb
from tests.stack_health import assert_healthy, baseline

pytestmark = pytest.mark.integration

SVC = "/inference.GRPCInferenceService/"
ROUNDS = 120


def _embedding(i: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="minilm_embeddings", id=f"e{i}")
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(codecs.serialize_bytes([b"mixed stream"]))
    return request


def _generation(i: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny_llama", id=f"g{i}")
    for name, value in (("text_input", b"hi"), ("parameters", json.dumps({"max_tokens": 2, "ignore_eos": True}).encode())):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        request.raw_input_contents.append(codecs.serialize_bytes([value]))
    return request


def test_streams_mixing_a_decoupled_and_a_plain_model_never_crash_triton(llm_stack):
    before = baseline(llm_stack)
    with grpc.insecure_channel(llm_stack.grpc) as channel:
        call = channel.stream_stream(SVC + "ModelStreamInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip
        for i in range(ROUNDS):
            responses = list(call(iter([_embedding(i), _generation(i), _embedding(i + ROUNDS)]), timeout=60))
            assert not [r.error_message for r in responses if r.error_message], responses
            ids = {r.infer_response.id for r in responses}
            assert {f"e{i}", f"g{i}", f"e{i + ROUNDS}"} <= ids
    assert_healthy(llm_stack, before, _embedding(0))


def test_a_unary_call_to_a_streaming_model_is_the_callers_mistake(llm_stack):
    """ModelInfer (gRPC) and v2 infer (REST) to a decoupled model: 400 / INVALID_ARGUMENT naming the
    calls that stream, not Triton's UNIMPLEMENTED (a 501 reads as a server fault)."""
    import http.client

    with grpc.insecure_channel(llm_stack.grpc) as channel:
        call = channel.unary_unary(SVC + "ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            call(_generation(0), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ModelStreamInfer" in err.value.details()
    host, port = llm_stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]})
    conn.request("POST", "/v2/models/tiny_llama/infer", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    doc = json.loads(response.read())
    conn.close()
    assert response.status == 400 and doc["code"] == "INVALID_ARGUMENT" and "/v1/chat/completions" in doc["error"]
