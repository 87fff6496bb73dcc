"""The admission pipeline's logic with a scripted Triton: generation follows traffic splits and the
circuit breaker like ModelInfer; the breaker counts only backend failures, per model version; an
LLM's queue is sized by its engine's concurrent sequences. (The real stack shows every transport
through the pipeline: tests/integration/test_one_pipeline.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from batching.coalescer import CoalescePolicy
from server.dataplane.builder import build_dataplane
from server.dataplane.codecs import serialize_bytes
from server.dataplane.port import GenerateParams
from server.dataplane.metrics import Metrics
from server.dataplane.pipeline import model_slots
from server.dataplane.routing import Split
from server.dataplane.signature import ModelSignature, TensorSpec
from server.dataplane.traffic_policy import Arm
from server.errors import BackendUnavailable, InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.settings import Settings
from server.tenancy.identity import CallContext, Gatekeeper
from tests.backend_fake import FakeBackend


def _llm(name: str, versions=("1",), max_running: int = 16) -> ModelSignature:
    return ModelSignature(
        name, 0,
        {n: TensorSpec(n, "BYTES", (1,), optional=True) for n in ("text_input", "messages", "parameters")},
        {n: TensorSpec(n, "BYTES", (1,)) for n in ("text_output", "info")},
        frozenset(versions), decoupled=True, max_running=max_running,
    )  # fmt: skip


def _answer(request: pb.ModelInferRequest, text: str, info: dict) -> bytes:
    response = pb.ModelStreamInferResponse()
    answer = response.infer_response
    answer.model_name, answer.model_version, answer.id = request.model_name, request.model_version or "1", request.id
    for name, value in (("text_output", text), ("info", json.dumps(info))):
        answer.outputs.add(name=name, datatype="BYTES", shape=[1])
        answer.raw_output_contents.append(serialize_bytes([value.encode()]))
    return response.SerializeToString()


DONE = {"prompt_tokens": 2, "completion_tokens": 1, "finish_reason": "stop"}


def scripted(info: dict = DONE) -> FakeBackend:
    """Answers every generation with one chunk "ok" and ``info``; ``broken`` fails it, ``hold`` holds answers."""
    return FakeBackend("scripted:1", stream_answer=lambda raw: _answer(pb.ModelInferRequest.FromString(raw), "ok", info))


def _dataplane(*signatures: ModelSignature, backend: FakeBackend | None = None, **settings):
    backend = backend if backend is not None else scripted()
    dp = build_dataplane(Settings(breaker_failures=3, **settings), backend, metrics=Metrics(), gate=Gatekeeper(None))
    for s in signatures:
        dp._table.signatures[s.name] = s  # noqa: SLF001 - what refresh() fills in from Triton
    return dp, backend


async def _generate(dp, model="llm", ctx=None):
    return await dp.llm.complete(model, GenerateParams(prompt="hi", max_tokens=1), ctx=ctx or CallContext())


async def test_generation_follows_an_ab_split_and_names_the_arm_that_answered():
    dp, backend = _dataplane(_llm("llm", ("1", "2")))
    dp.router.splits["llm"] = Split("ab", [Arm("control", "1", 50), Arm("treatment", "2", 50)])
    arms = []
    for _ in range(4):
        answer = await _generate(dp, ctx=CallContext())
        assert answer.text == "ok"
        arms.append((answer.arm, answer.version))
    assert [r.model_version for r in backend.stream_requests] == ["1", "2", "1", "2"]  # smooth weighted round robin
    assert arms == [("control", "1"), ("treatment", "2")] * 2
    assert dp.router.splits["llm"].totals["treatment"].requests == 2  # the arm's window saw them


async def test_generation_without_a_split_goes_to_the_live_version():
    dp, backend = _dataplane(_llm("llm", ("1", "2")))
    dp.set_live("llm", "1")
    await _generate(dp)
    assert backend.stream_requests[-1].model_version == "1"


async def test_the_breaker_opens_for_a_failing_generation_backend_and_refuses_without_calling_it():
    dp, backend = _dataplane(_llm("llm"))
    backend.broken = BackendUnavailable("Triton is unavailable: connection refused", retry_after_s=1.0)
    for _ in range(3):
        with pytest.raises(BackendUnavailable, match="connection refused"):
            await _generate(dp)
    sent = len(backend.stream_requests)
    with pytest.raises(BackendUnavailable, match="circuit open") as info:
        await _generate(dp)
    assert info.value.retry_after_s > 0 and len(backend.stream_requests) == sent  # refused before any work


async def test_caller_and_model_errors_never_open_the_breaker():
    dp, backend = _dataplane(_llm("llm"))
    for _ in range(10):  # a tenant's bad requests, refused at validation
        with pytest.raises(InvalidRequest):
            await dp.llm.complete("llm", GenerateParams(prompt="x", messages=[{"role": "user", "content": "y"}]), ctx=CallContext())
    backend.broken = InvalidRequest("max_tokens must be positive")  # the engine refuses the input
    for _ in range(10):
        with pytest.raises(InvalidRequest):
            await _generate(dp)
    backend.broken = None
    assert (await _generate(dp)).text == "ok"


async def test_the_breaker_is_per_model_version():
    dp, backend = _dataplane(_llm("llm"), _llm("other"))
    backend.broken = BackendUnavailable("down")
    for _ in range(3):
        with pytest.raises(BackendUnavailable):
            await _generate(dp, "llm")
    backend.broken = None
    assert (await _generate(dp, "other")).text == "ok"  # another model's circuit is closed
    with pytest.raises(BackendUnavailable, match="circuit open"):
        await _generate(dp, "llm")


async def test_generations_past_the_engines_slots_wait_in_the_fair_queue():
    dp, backend = _dataplane(_llm("llm", max_running=2))
    backend.hold = asyncio.Event()
    tasks = [asyncio.create_task(_generate(dp)) for _ in range(3)]
    for _ in range(20):
        await asyncio.sleep(0)
    queue = dp._pipeline.queues["llm"]  # noqa: SLF001
    assert (queue.inflight, queue.size, len(backend.stream_requests)) == (2, 1, 2)  # the third waits in the frontend
    backend.hold.set()
    assert [a.text for a in await asyncio.gather(*tasks)] == ["ok"] * 3
    assert (queue.inflight, queue.size) == (0, 0)


def test_an_llms_queue_is_sized_by_its_engines_concurrent_sequences():
    assert model_slots(_llm("llm", max_running=7)) == 7
    tabular = ModelSignature("t", 8, {}, {}, coalesce=CoalescePolicy(enabled=False), instances=2)
    assert model_slots(tabular) == 16


async def test_a_lora_adapter_goes_to_its_base_model_as_a_frontend_parameter():
    from server.dataplane.engine_calls import split_adapter
    from server.dataplane.validation import ADAPTER_PARAMETER
    from server.errors import ModelNotFound

    assert split_adapter("llm:pirate") == ("llm", "pirate") and split_adapter("llm") == ("llm", "")
    assert split_adapter("llm:2") == ("llm:2", "") and split_adapter("llm:Pirate") == ("llm:Pirate", "")
    dp, backend = _dataplane(_llm("llm"))
    assert (await _generate(dp, "llm:pirate")).text == "ok"
    sent = backend.stream_requests[-1]
    assert sent.model_name == "llm" and sent.parameters[ADAPTER_PARAMETER].string_param == "pirate"
    await _generate(dp, "llm")
    assert ADAPTER_PARAMETER not in backend.stream_requests[-1].parameters
    with pytest.raises(ModelNotFound):  # not an adapter name: a model nobody serves
        await _generate(dp, "llm:Pirate")
