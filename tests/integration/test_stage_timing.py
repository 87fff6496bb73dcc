"""Per-stage timing on the real stack: a caller that sends ``inferplane-timing`` reads each stage
of its request (``Server-Timing`` on REST, trailing metadata on gRPC); every stage of the unary
path is there, in order, summing to at most the total; a caller that does not ask gets no
breakdown; the answer's bytes are the same either way."""

from __future__ import annotations

import http.client
import json

import grpc
import numpy as np
import pytest

from server.dataplane.stage_timing import SERVER_TIMING, TIMING_HEADER, parse
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
