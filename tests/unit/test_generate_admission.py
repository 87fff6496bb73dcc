"""``inferplane.v1.Generation/Generate`` under the process's in-flight bound (server.dataplane.loop_gate),
in process on a real socket: a grpc.aio server with the platform's DomainErrorInterceptor and the real
``Admission``, a grpc.aio client stub. The engine is a fake driven by events (pure accounting here; the
real stack's case is tests/integration/test_llm.py), so nothing waits on time: a generation holds its
place while its first chunk is withheld, and gives it back once at its last chunk, its error, or its
cancellation; past the bound a call is RESOURCE_EXHAUSTED with the retry hint and reaches no engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from batching.overload_policy import LoopGate, LoopPolicy
from server.dataplane.port import Chunk
from server.dataplane.loop_gate import Admission
from server.errors import InvalidRequest, ModelNotFound
from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc
from server.transports.grpc.context import DomainErrorInterceptor
from server.transports.grpc.generation import add_to_server


class _FakeLLM:
    """``generate`` records each call; its stream waits for ``release``, yields a chunk, waits for
    ``more`` (set unless a test clears it), yields the last, or fails (``fail_first`` before any chunk,
    ``fail_after_first`` after one)."""

    def __init__(self):
        self.release = asyncio.Event()
        self.more = asyncio.Event()
        self.more.set()
        self.calls: list[str] = []
        self.closed = 0
        self.fail_first: Exception | None = None
        self.fail_after_first: Exception | None = None

    def generate(self, model, params, ctx=None):
        self.calls.append(model)

        async def gen():
            try:
                if self.fail_first is not None:
                    raise self.fail_first
                await self.release.wait()
                yield Chunk("Hello", None, 5, 1)
                await self.more.wait()
                if self.fail_after_first is not None:
                    raise self.fail_after_first
                yield Chunk(" world", "stop", 5, 2)
            finally:
                self.closed += 1

        return gen()


@pytest.fixture
async def served():
    llm = _FakeLLM()
    admission = Admission(LoopGate(LoopPolicy(ceiling=1)))
    server = grpc.aio.server(interceptors=(DomainErrorInterceptor(),))
    add_to_server(llm, server, admission)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_retries", 0)])
    try:
        yield llm, admission.gate, generate_pb2_grpc.GenerationStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


def _request(model: str = "m") -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(model=model, prompt="hi", max_tokens=4)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def _retry_delay_ms(err: grpc.aio.AioRpcError) -> int:
    details = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
    info = error_details_pb2.RetryInfo()
    assert details, err
    assert any(any_msg.Unpack(info) for any_msg in status_pb2.Status.FromString(details).details), err
    return info.retry_delay.ToMilliseconds()


async def test_a_generation_holds_its_place_to_its_last_chunk_and_past_the_bound_is_refused_before_any_work(served):
    llm, gate, stub = served
    llm.more.clear()
    held = stub.Generate(_request("held"), timeout=30)
    first = asyncio.ensure_future(held.read())
    await asyncio.wait_for(_until(lambda: llm.calls == ["held"]), 30)
    assert gate.inflight == 1  # admitted, no chunk yet: it holds the place
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in stub.Generate(_request("probe"), timeout=30)]
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "in flight" in err.details() and _retry_delay_ms(err) > 0
    assert float(dict(err.trailing_metadata())["retry-after"]) > 0
    assert llm.calls == ["held"] and gate.refused == 1  # the refused call reached no engine
    llm.release.set()
    assert (await first).text == "Hello"
    assert gate.inflight == 1  # between chunks: still held
    llm.more.set()
    last = await held.read()
    assert (last.text, last.finish_reason, last.usage.total_tokens) == (" world", "stop", 7)
    assert await held.read() is grpc.aio.EOF and await held.code() == grpc.StatusCode.OK
    await asyncio.wait_for(_until(lambda: gate.inflight == 0), 30)
    again = [r async for r in stub.Generate(_request("after"), timeout=30)]  # the place is free again
    assert [r.text for r in again] == ["Hello", " world"] and llm.calls == ["held", "after"]
    await asyncio.wait_for(_until(lambda: gate.inflight == 0), 30)
    assert llm.closed == 2


async def test_a_cancelled_generation_gives_its_place_back(served):
    llm, gate, stub = served
    call = stub.Generate(_request(), timeout=30)
    reading = asyncio.ensure_future(call.read())
    await asyncio.wait_for(_until(lambda: gate.inflight == 1 and llm.calls), 30)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await asyncio.wait_for(_until(lambda: gate.inflight == 0 and llm.closed == 1), 30)
    llm.release.set()
    assert [r.text async for r in stub.Generate(_request(), timeout=30)] == ["Hello", " world"]


@pytest.mark.parametrize("where", ["bad request", "before the first chunk", "after the first chunk"])
async def test_a_failed_generation_gives_its_place_back_once(served, where):
    llm, gate, stub = served
    llm.release.set()
    request = _request()
    if where == "bad request":
        request.messages.add(role="user", content="and a prompt")  # both: INVALID_ARGUMENT before the engine
    elif where == "before the first chunk":
        llm.fail_first = ModelNotFound("model 'm' is not served")
    else:
        llm.fail_after_first = InvalidRequest("the engine gave up")
    if where == "after the first chunk":  # phase two: the last message carries the error
        responses = [r async for r in stub.Generate(request, timeout=30)]
        assert [r.text for r in responses] == ["Hello", ""] and responses[-1].error.code == "INVALID_ARGUMENT"
    else:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in stub.Generate(request, timeout=30)]
        assert caught.value.code() == (grpc.StatusCode.INVALID_ARGUMENT if where == "bad request" else grpc.StatusCode.NOT_FOUND)
    await asyncio.wait_for(_until(lambda: gate.inflight == 0), 30)
    llm.fail_first = llm.fail_after_first = None
    assert [r.text async for r in stub.Generate(_request(), timeout=30)] == ["Hello", " world"]  # not leaked
    await asyncio.wait_for(_until(lambda: gate.inflight == 0), 30)
    assert gate.refused == 0 and gate.inflight == 0  # given back exactly once: never below zero
