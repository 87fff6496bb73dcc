"""Per-stage timing on the real stack: a caller that sends ``inferplane-timing`` reads each stage
of its request (``Server-Timing`` on REST, trailing metadata on gRPC); every stage of the unary
path is there, in order, summing to at most the total; a caller that does not ask gets no
breakdown; the answer's bytes are the same either way. On the OIP routes, the typed API's Predict
and the OpenAI routes (chat completions, completions, embeddings; a stream's header too)."""

from __future__ import annotations

import http.client
import json
import struct

import grpc
import numpy as np
import pytest

from model_repository.demo import load_validation
from model_repository.llm import TINY_NAME
from server.dataplane.stage_timing import SERVER_TIMING, TIMING_HEADER, parse
from server.dataplane.wire import varint
from server.protogen.inference import grpc_service_pb2 as pb

pytestmark = pytest.mark.integration

INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL = "fraud_xgboost"
# the unary path's stages, in order (server.dataplane.stage_timing); one Triton behind a replica set
STAGES = ["decode", "auth", "route", "quota", "validation", "admission", "coalesce", "replica", "triton", "answer", "exit", "encode", "total"]


def _request() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="features", datatype="FP32", shape=[4, 32])
    req.raw_input_contents.append(np.random.default_rng(3).standard_normal((4, 32), dtype=np.float32).tobytes())
    return req


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.grpc) as ch:
        yield ch


def _grpc(channel, metadata=()):
    call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    answer, info = call.with_call(_request().SerializeToString(), metadata=metadata, timeout=30)
    return answer, dict(info.trailing_metadata())


def _assert_breakdown(value: str) -> None:
    stages = parse(value)
    assert list(stages) == STAGES, value
    assert sum(ms for name, ms in stages.items() if name != "total") <= stages["total"], value
    assert stages["triton"] > 0, value  # the Triton call is the request's largest real stage, never zero


def test_grpc_trailing_metadata_carries_the_breakdown_when_asked(channel):
    plain, trailing = _grpc(channel)
    assert SERVER_TIMING not in trailing  # not asked: nothing
    timed, trailing = _grpc(channel, ((TIMING_HEADER, "1"),))
    _assert_breakdown(trailing[SERVER_TIMING])
    assert pb.ModelInferResponse.FromString(timed).raw_output_contents == pb.ModelInferResponse.FromString(plain).raw_output_contents


def _rest(stack, headers: dict):
    host, port = stack.http.rsplit(":", 1)
    data = np.random.default_rng(3).standard_normal((4, 32), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [4, 32], "data": data.flatten().tolist()}]})
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", f"/v2/models/{MODEL}/infer", body=body, headers={"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_rest_server_timing_header_when_asked(stack):
    status, headers, plain = _rest(stack, {})
    assert status == 200 and "server-timing" not in headers
    status, headers, timed = _rest(stack, {"Inferplane-Timing": "1"})
    assert status == 200, timed
    _assert_breakdown(headers["server-timing"])
    assert json.loads(timed) == json.loads(plain)


def test_a_refused_request_still_answers_without_a_breakdown(channel):
    """A refusal is a status (the breakdown is for answered requests); the timer never breaks it."""
    bad = _request()
    bad.inputs[0].shape[1] = 31
    call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        call(bad.SerializeToString(), metadata=((TIMING_HEADER, "1"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _grpc(channel, ((TIMING_HEADER, "1"),))  # and the next timed call is whole


# ---- the typed API (server.transports.typed.service) ------------------------------------------

TYPED_PREDICT = "/inferplane.models.fraud_xgboost.v1.FraudXgboostService/Predict"
# the typed check of the model's visibility comes before decode; parse() sums it with the pipeline's auth
TYPED_STAGES = ["auth", "decode", *[s for s in STAGES if s not in ("decode", "auth")]]


def _typed_request(stack) -> bytes:
    """A FraudXgboostRequest by hand (its fields are ``optional float`` 1..32, one per feature): no stubs to compile."""
    row = load_validation(stack.repository / MODEL)["features"][0]
    return b"".join(varint(number << 3 | 5) + struct.pack("<f", value) for number, value in enumerate(row.tolist(), start=1))


def test_typed_predict_carries_the_breakdown_when_asked(stack, channel):
    predict = channel.unary_unary(TYPED_PREDICT, request_serializer=None, response_deserializer=None)
    plain, info = predict.with_call(_typed_request(stack), timeout=30)
    assert SERVER_TIMING not in dict(info.trailing_metadata())
    timed, info = predict.with_call(_typed_request(stack), metadata=((TIMING_HEADER, "1"),), timeout=30)
    value = dict(info.trailing_metadata())[SERVER_TIMING]
    stages = parse(value)
    assert list(stages) == TYPED_STAGES and value.startswith("auth;"), value
    assert sum(ms for name, ms in stages.items() if name != "total") <= stages["total"] and stages["triton"] > 0, value
    assert timed == plain  # the same typed answer, timed or not


# ---- the OpenAI routes (server.transports.openai.endpoints) -----------------------------------

EMBEDDINGS = "minilm_embeddings"
# an LLM's generation does not pass the coalescer (no coalesce / replica / triton / answer stages)
OPENAI_STAGES = ["decode", "auth", "route", "quota", "validation", "admission"]


def _openai(stack, path: str, doc: dict, headers: dict):
    host, port = stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(doc), headers={"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "doc"),
    [
        ("/v1/embeddings", {"model": EMBEDDINGS, "input": ["stage timing"]}),
        ("/v1/chat/completions", {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 5}),
        ("/v1/completions", {"model": TINY_NAME, "prompt": "hi", "max_tokens": 3, "seed": 5}),
    ],
    ids=["embeddings", "chat", "completions"],
)
def test_openai_routes_answer_server_timing_when_asked(llm_stack, path, doc):
    status, headers, plain = _openai(llm_stack, path, doc, {})
    assert status == 200 and "server-timing" not in headers, plain
    status, headers, timed = _openai(llm_stack, path, doc, {"Inferplane-Timing": "1"})
    assert status == 200, timed
    stages = parse(headers["server-timing"])
    assert list(stages)[: len(OPENAI_STAGES)] == OPENAI_STAGES and list(stages)[-2:] == ["encode", "total"], headers["server-timing"]
    assert sum(ms for name, ms in stages.items() if name != "total") <= stages["total"]
    strip = ("id", "created")  # a completion's id and clock differ per call; the rest is the same answer
    assert {k: v for k, v in json.loads(timed).items() if k not in strip} == {k: v for k, v in json.loads(plain).items() if k not in strip}


def test_an_openai_stream_sends_the_stages_until_its_first_event(llm_stack):
    doc = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 5, "stream": True}
    status, headers, body = _openai(llm_stack, "/v1/chat/completions", doc, {"Inferplane-Timing": "1"})
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
    stages = parse(headers["server-timing"])
    assert list(stages)[: len(OPENAI_STAGES)] == OPENAI_STAGES and "total" in stages and "encode" not in stages, headers["server-timing"]
