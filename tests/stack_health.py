"""Is the whole server still well after a test threw bad input at it? (issue 15)

Shared by the hardening tests and the fuzz step: Triton was never restarted (its process is the
same one and ``inferplane_triton_restarts_total`` did not move), the frontend and Triton both say
ready, and a valid request still answers.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

import grpc
import numpy as np

from server.protogen.inference import grpc_service_pb2 as pb

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def metrics_text(stack) -> str:
    return urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()


def samples(text: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample line of a Prometheus exposition."""
    return [(m.group(1), m.group(2) or "", float(m.group(3))) for m in _SAMPLE.finditer(text)]


def triton_restarts(stack) -> float:
    return sum(v for name, _labels, v in samples(metrics_text(stack)) if name == "inferplane_triton_restarts_total")


@dataclass(frozen=True)
class Baseline:
    triton_pid: int
    restarts: float


def baseline(stack) -> Baseline:
    return Baseline(stack.triton_pid(), triton_restarts(stack))


def _ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerReady",
            request_serializer=pb.ServerReadyRequest.SerializeToString,
            response_deserializer=pb.ServerReadyResponse.FromString,
        )
        return call(pb.ServerReadyRequest(), timeout=10).ready


def valid_request(model: str = "lightgbm_regressor", width: int = 16) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="features", datatype="FP32", shape=[1, width])
    request.raw_input_contents.append(np.full((1, width), 0.25, np.float32).tobytes())
    return request


def answers(address: str, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        return call(request, timeout=30)


def assert_healthy(stack, before: Baseline, request: pb.ModelInferRequest | None = None) -> None:
    """Triton is the same process, never restarted; both servers ready; a valid request answers."""
    assert stack.process.poll() is None, stack.log_tail()
    assert stack.triton_pid() == before.triton_pid, "tritonserver was restarted:\n" + stack.log_tail()
    assert triton_restarts(stack) == before.restarts, stack.log_tail()
    assert _ready(stack.grpc) and _ready(stack.triton)
    if request is not None:
        response = answers(stack.grpc, request)
        assert response.outputs, response
