"""The per-stream buffer between the engine and an SSE client: bounded, merging text deltas."""

from __future__ import annotations

import asyncio

from server.dataplane.port import Chunk
from server.transports.openai.endpoints import _Pending


def test_a_full_buffer_merges_deltas_and_keeps_every_character():
    pending = _Pending(limit=4)
    for i in range(100):
        pending.put(Chunk(f"{i},"))
    assert len(pending.items) == 4 and pending.merged == 96  # bounded, whatever the client's speed
    assert "".join(c.text for c in pending.items) == "".join(f"{i}," for i in range(100))
    pending.put(Chunk("end", finish_reason="length"))
    pending.put(Chunk("late"))  # never merged into a final chunk
    assert pending.items[-2].finish_reason == "length" and pending.items[-1].text == "late"


def test_error_events_are_never_merged_and_take_returns_everything_in_order():
    async def scenario():
        pending = _Pending(limit=2)
        pending.put(Chunk("a"))
        pending.put({"error": {"code": "INTERNAL"}})
        pending.put(Chunk("b"))
        pending.put(Chunk("c"))  # the last item is a Chunk: merged with it
        first = await pending.take()
        pending.close()
        rest = await pending.take()
        return first, rest

    first, rest = asyncio.run(scenario())
    assert [getattr(i, "text", i) for i in first] == ["a", {"error": {"code": "INTERNAL"}}, "bc"]
    assert rest == []
