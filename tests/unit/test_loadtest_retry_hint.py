"""The load generator's callers that honour a refusal's retry hint (issue 30: refusal latency
measured by a client that is not itself the flood): the hint read from gRPC trailers and HTTP
headers, and a closed-loop caller that waits it out. Short runs; bounds that a slower machine only
makes easier (fewer calls), never a timed assertion."""

from __future__ import annotations

import math

import grpc
import pytest

from loadtest.engine import LoadSpec, Stats, clock, run_engine
from loadtest.protocol import CallError, GrpcDriver, retry_hint

HINT_S = 0.25


@pytest.mark.parametrize("pairs, seconds", [
    ((("retry-after", "2"),), 2.0),
    ((("Retry-After", "0.5"),), 0.5),
    ((("grpc-retry-pushback-ms", "250"),), 0.25),
    ((("x-other", "1"), ("retry-after", "3")), 3.0),
    ((("retry-after", "-1"),), 0.0),
    ((("retry-after", "soon"),), None),
    ((), None),
    (None, None),
])  # fmt: skip
def test_the_hint_is_read_from_metadata_and_headers(pairs, seconds):
    assert retry_hint(pairs) == seconds


class _Refuser:
    """A gRPC server on the test's loop whose ModelInfer refuses every call with RESOURCE_EXHAUSTED
    and ``retry-after`` (or no hint), counting the calls."""

    def __init__(self, hint: str | None) -> None:
        self.hint, self.calls = hint, 0

    async def infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.calls += 1
        if self.hint is not None:
            context.set_trailing_metadata((("retry-after", self.hint),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")

    async def __aenter__(self) -> str:
        self.server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {"ModelInfer": grpc.unary_unary_rpc_method_handler(self.infer, request_deserializer=None, response_serializer=None)},
        )
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"grpc://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(None)


async def _refused(hint: str | None, honor: bool, callers: int = 2, duration: float = 0.6) -> tuple[Stats, int]:
    refuser = _Refuser(hint)
    async with refuser as target:
        driver = GrpcDriver(target, timeout=5.0)
        await driver.open()
        try:
            spec = LoadSpec(concurrency=callers, warmup=0.0, duration=duration, honor_retry_after=honor)
            stats = await run_engine(driver, [b""], spec, clock(), Stats())
        finally:
            await driver.close()
    return stats, refuser.calls


async def test_the_grpc_refusal_carries_its_hint_to_the_caller():
    refuser = _Refuser("1.5")
    async with refuser as target:
        driver = GrpcDriver(target, timeout=5.0)
        await driver.open()
        session = await driver.session(0)
        with pytest.raises(CallError) as raised:
            await session.call(b"")
        await driver.close()
    assert raised.value.code == "RESOURCE_EXHAUSTED" and raised.value.retry_after == 1.5


async def test_a_caller_that_honours_the_hint_waits_it_out_between_refusals():
    stats, calls = await _refused(str(HINT_S), honor=True)
    # each caller: one call, then a wait of the hint, ...: at most ceil(window / hint) calls each, however
    # fast the machine (a slower one makes fewer)
    assert 2 <= calls <= 2 * math.ceil(0.6 / HINT_S)
    assert stats.backoffs >= 2 and stats.errors["RESOURCE_EXHAUSTED"][0] == calls
    assert stats.refused.count == calls  # each refusal's latency is still measured


async def test_a_hint_longer_than_the_run_leaves_each_caller_one_call():
    stats, calls = await _refused("30", honor=True)
    assert calls == 2 and stats.backoffs == 2  # each caller waits to the window's end


async def test_without_the_flag_or_without_a_hint_the_caller_sends_again_at_once():
    # the same 30 s hint not honoured, and no hint to honour: each caller comes straight back (two
    # loopback round trips in 0.6 s are all it takes to exceed one call per caller)
    stats, calls = await _refused("30", honor=False)
    assert calls > 2 and stats.backoffs == 0
    stats, calls = await _refused(None, honor=True)
    assert calls > 2 and stats.backoffs == 0
