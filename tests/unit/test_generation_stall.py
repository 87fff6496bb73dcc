"""A stalled generation (server/dataplane/engine_calls.py: within_stall): the engine's silence past the
limit raises GenerationStalled (a BackendError: INTERNAL / 500 with the reason) and closes the engine's
stream; a slow consumer between chunks is never counted as the engine's silence."""

from __future__ import annotations

import asyncio

import pytest

from server.dataplane.engine_calls import GenerationStalled, within_stall
from server.errors import entry


class Engine:
    """Sends ``count`` items, then waits forever (a stalled engine) unless ``finish``; records closing."""

    def __init__(self, count: int, finish: bool = False):
        self.count, self.finish, self.closed = count, finish, False

    async def stream(self):
        try:
            for i in range(self.count):
                yield i
            if not self.finish:
                await asyncio.Event().wait()
        finally:
            self.closed = True


async def test_silence_past_the_limit_raises_and_closes_the_engine_stream():
    engine = Engine(3)
    got = []
    guarded = within_stall(engine.stream(), 0.05, lambda: "after 3 tokens of chat")
    with pytest.raises(GenerationStalled, match=r"nothing for 0.05s after 3 tokens of chat; the generation was cancelled") as caught:
        async for item in guarded:
            got.append(item)
    assert got == [0, 1, 2]
    await guarded.aclose()
    assert engine.closed  # the engine's stream was cancelled (the sequence is freed)
    assert entry(caught.value).http_status == 500


async def test_a_slow_consumer_is_not_a_stall_and_a_finished_stream_ends():
    engine = Engine(3, finish=True)
    got = []
    async for item in within_stall(engine.stream(), 0.05, lambda: ""):
        await asyncio.sleep(0.1)  # twice the limit between chunks, on the consumer's side
        got.append(item)
    assert got == [0, 1, 2] and engine.closed


async def test_no_limit_waits():
    engine = Engine(2, finish=True)
    assert [i async for i in within_stall(engine.stream(), 0, lambda: "")] == [0, 1]
