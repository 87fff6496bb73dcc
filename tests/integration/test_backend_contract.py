"""The backend contract (``server.dataplane.backend.Backend``), one suite against each backend:
``TritonClient`` to a real tritonserver process, a ``ReplicaSet`` of two such clients, an
``InProcessTriton`` over the same repository, and the unit tests' ``FakeBackend`` — so the fake
every unit test uses answers as the real ones do.

One in-process Triton lives at a time in a process: the module's backends are module-scoped and
stopped before the next module starts its own.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from model_repository.demo import load_validation
from server import errors
from server.dataplane.replicas import Member, ReplicaPolicy, ReplicaSet
from server.dataplane.triton_client import TritonClient
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime.inprocess import InProcessTriton
from server.runtime.supervisor import TritonSupervisor
from tests.backend_fake import FakeBackend

pytestmark = pytest.mark.integration

MODEL, SPARE = "fraud_xgboost", "mlp_classifier"  # SPARE gets unloaded and loaded again
KINDS = ("triton_client", "replica_set", "in_process", "fake")


@pytest_asyncio.fixture(scope="module")
async def remote(demo_repository, tmp_path_factory):
    """A real tritonserver process (the gRPC backends' Triton; the other two need none, but a
    module-scoped async fixture cannot be asked for on demand)."""
    supervisor = TritonSupervisor(demo_repository, tmp_path_factory.mktemp("contract_triton"))
    await supervisor.start()
    yield supervisor
    await supervisor.stop()


async def _client(target: str) -> TritonClient:
    client = TritonClient(target)
    client.connect()
    for model in (MODEL, SPARE):
        await client.load_model(model)
    return client


@pytest_asyncio.fixture(scope="module", params=KINDS)
async def backend(request, remote, demo_repository, tmp_path_factory):
    kind = request.param
    if kind == "fake":
        yield FakeBackend("fake", (MODEL, SPARE))
        return
    if kind == "in_process":
        triton = await InProcessTriton.start(demo_repository, tmp_path_factory.mktemp("contract_inprocess"), models=(MODEL, SPARE))
        yield triton
        await triton.stop()
        return
    target = remote.grpc_target
    if kind == "triton_client":
        client = await _client(target)
        yield client
        await client.close()
        return
    members = [Member(name, await _client(target)) for name in ("a", "b")]  # two members, one Triton behind both
    replicas = ReplicaSet(policy=ReplicaPolicy(wait_for_member_s=0.5))
    for member in members:
        await replicas.add_member(member)
    yield replicas
    await replicas.close()


def _request(demo_repository, request_id: str = "r1", model: str = MODEL) -> pb.ModelInferRequest:
    features = load_validation(demo_repository / MODEL)["features"][:2].astype(np.float32)
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="features", datatype="FP32", shape=list(features.shape))
    request.raw_input_contents.append(features.tobytes())
    return request


async def _ready(backend) -> set[str]:
    return {m.name for m in await backend.repository_index(ready_only=True)}


async def test_health_and_index(backend):
    assert await backend.server_live() and await backend.server_ready()
    assert isinstance(backend.target, str) and backend.target
    index = {(m.name, m.version, m.state) for m in await backend.repository_index()}
    assert (MODEL, "1", "READY") in index
    assert {MODEL, SPARE} <= await _ready(backend)


async def test_model_config_and_metadata(backend):
    assert (await backend.model_config(MODEL)).name == MODEL
    assert (await backend.model_config(MODEL, "1")).name == MODEL
    metadata = await backend.model_metadata(MODEL)
    assert metadata.name == MODEL and "1" in metadata.versions
    with pytest.raises(errors.InferplaneError, match="no_such_model"):
        await backend.model_config("no_such_model")
    with pytest.raises(errors.InferplaneError, match="no_such_model"):
        await backend.model_metadata("no_such_model")


async def test_infer_and_send_batch_answer_alike(backend, demo_repository):
    request = _request(demo_repository, "r1")
    answer = pb.ModelInferResponse.FromString(await backend.infer_raw(request.SerializeToString(), 30.0, model=MODEL))
    assert (answer.model_name, answer.id) == (MODEL, "r1")
    again = pb.ModelInferResponse.FromString(await backend.send_batch(request.SerializeToString(), 30.0, request))
    assert list(again.raw_output_contents) == list(answer.raw_output_contents)
    alone = pb.ModelInferResponse.FromString(await backend.send_batch(request.SerializeToString(), 30.0))
    assert list(alone.raw_output_contents) == list(answer.raw_output_contents)


async def test_a_request_for_an_unknown_model_is_a_domain_error(backend, demo_repository):
    with pytest.raises(errors.InferplaneError, match="no_such_model"):
        await backend.infer_raw(_request(demo_repository, model="no_such_model").SerializeToString(), 5.0)


async def test_a_stream_answers_each_request_and_takes_kv_reports(backend, demo_repository):
    stream = backend.stream_raw(timeout=30.0, model=MODEL)
    for request_id in ("s1", "s2"):
        await stream.write(_request(demo_repository, request_id).SerializeToString())
    await stream.done_writing()
    answers = [pb.ModelStreamInferResponse.FromString(raw) async for raw in stream]
    assert sorted(a.infer_response.id for a in answers) == ["s1", "s2"]
    assert all(a.error_message == "" and a.infer_response.model_name == MODEL for a in answers)
    stream.report_kv(0.5)  # every stream takes the engine's report (a replica set scores by it)


async def test_statistics_count_the_models_requests(backend, demo_repository):
    async def count() -> int:
        stats = await backend.model_statistics(MODEL)
        return sum(s.inference_count for s in stats.model_stats if s.name == MODEL)

    before = await count()
    await backend.infer_raw(_request(demo_repository, "st").SerializeToString(), 30.0)
    after = await _wait_for(count, lambda n: n >= before + 2)
    assert after >= before + 2, "a request of two rows counts two inferences"
    every = await backend.model_statistics()
    assert MODEL in {s.name for s in every.model_stats}


async def test_unload_then_load_again(backend, demo_repository):
    await backend.unload_model(SPARE)
    assert SPARE not in await _wait_for(lambda: _ready(backend), lambda ready: SPARE not in ready)  # the unload happened
    await backend.load_model(SPARE)
    assert SPARE in await _wait_for(lambda: _ready(backend), lambda ready: SPARE in ready)
    assert (await backend.model_config(SPARE)).name == SPARE


async def _wait_for(read, done, timeout: float = 30.0):
    """Read until ``done(value)`` (Triton updates statistics and unloads after it answered); a wait, not a timing claim."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while True:
        value = await read()
        if done(value) or loop.time() > until:
            return value
        await asyncio.sleep(0.05)
