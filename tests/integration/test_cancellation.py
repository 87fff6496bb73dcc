"""A caller that goes away costs no model time: a REST client that disconnects or a gRPC caller
that cancels while its request waits for the model is dropped, and the model never runs it.

One ``paced`` model instance (``loadtest.paced_model``: answers after a pause, no CPU); by
default a model without batching gets as many admission slots as it has instances, so a
request waits in the frontend's queue, where leaving removes it — not in Triton's, where a
cancelled unary gRPC request still runs (measured with Triton 2.51 and the Python backend).
R1 holds the model; R2 (REST, disconnected) and R3 (gRPC, cancelled) wait
behind it; R4, sent after them by the same tenant (first-in first-out within a tenant), is
answered only after anything still queued ahead of it. Triton's own statistics then prove how
many requests the model executed: R1 and R4, nothing else.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from loadtest.paced_model import NAME, build_paced_model, sample_features
from server.protogen.inference import grpc_service_pb2 as pb
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

SERVICE_MS = 1500


@pytest.fixture(scope="module")
def paced_stack(tmp_path_factory):
    repo = tmp_path_factory.mktemp("paced_repo")
    build_paced_model(repo, SERVICE_MS, instances=1)
    s = start_stack(repo, tmp_path_factory.mktemp("paced_stack"))  # default admission slots: the 1 instance
    yield s
    stop_stack(s)


def _grpc_request(x: np.ndarray) -> bytes:
    req = pb.ModelInferRequest(model_name=NAME)
    req.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


def _executed(triton: str) -> int:
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(triton)
    try:
        stats = client.get_inference_statistics(NAME, as_json=True)["model_stats"][0]
        return int(stats["inference_stats"].get("success", {}).get("count", 0))
    finally:
        client.close()


def test_disconnected_and_cancelled_callers_never_reach_the_model(paced_stack):
    import aiohttp

    x = sample_features(2)
    before = _executed(paced_stack.triton)

    async def scenario() -> tuple[bytes, bytes]:
        async with grpc.aio.insecure_channel(paced_stack.grpc) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            r1 = asyncio.ensure_future(infer(_grpc_request(x), timeout=30))
            await asyncio.sleep(0.3)  # R1 holds the one slot
            body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
            async with aiohttp.ClientSession() as session:
                with pytest.raises(asyncio.TimeoutError):  # R2: the client gives up and closes the connection
                    await session.post(
                        f"http://{paced_stack.http}/v2/models/{NAME}/infer", json=body, timeout=aiohttp.ClientTimeout(total=0.3)
                    )
            r3 = infer(_grpc_request(x), timeout=30)
            await asyncio.sleep(0.2)
            r3.cancel()  # R3: the caller cancels its call
            with pytest.raises(asyncio.CancelledError):
                await r3
            r4 = await infer(_grpc_request(x), timeout=30)  # queued behind whatever is left of R2/R3
            return await r1, r4

    first, last = asyncio.run(scenario())
    for raw in (first, last):
        response = pb.ModelInferResponse.FromString(raw)
        score = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
        np.testing.assert_allclose(score, x.sum(axis=1), rtol=1e-6)
    wait_until(lambda: _executed(paced_stack.triton) >= before + 2, timeout=10)
    assert _executed(paced_stack.triton) == before + 2  # R1 and R4 only


def test_cancelled_requests_are_counted(paced_stack):
    import urllib.request

    text = urllib.request.urlopen(f"http://{paced_stack.metrics}/metrics", timeout=5).read().decode()
    cancelled = [line for line in text.splitlines() if line.startswith("inferplane_requests_total") and 'code="CANCELLED"' in line]
    assert cancelled and sum(float(line.rsplit(" ", 1)[1]) for line in cancelled) >= 2, json.dumps(cancelled)
