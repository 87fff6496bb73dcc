"""server.periodic.Periodic: the one periodic background task (flushes, passes, syncs)."""

from __future__ import annotations

import asyncio

from server.periodic import Periodic

HOUR = 3600.0  # the next tick never comes within a test: what runs is the first tick and stop's


def _counting(ticked: asyncio.Event, ticks: list):
    async def tick():
        ticks.append(len(ticks))
        ticked.set()

    return tick


async def test_it_ticks_after_first_s_and_stop_cancels_the_wait():
    ticked, ticks = asyncio.Event(), []
    p = Periodic("t", HOUR, _counting(ticked, ticks), first_s=0.0)
    p.start()
    await ticked.wait()
    await p.stop()
    assert ticks == [0]
    await p.stop()  # twice is nothing
    assert ticks == [0]


async def test_final_ticks_once_more_at_stop():
    """A buffer's last flush: what accumulated since the last tick is written."""
    ticked, ticks = asyncio.Event(), []
    p = Periodic("t", HOUR, _counting(ticked, ticks), first_s=0.0, final=True)
    p.start()
    await ticked.wait()
    await p.stop()
    assert ticks == [0, 1]


async def test_stop_before_any_tick_and_a_failing_tick_end_quietly():
    ticks: list = []
    waiting = Periodic("t", HOUR, _counting(asyncio.Event(), ticks), final=True)  # first tick an hour away
    waiting.start()
    await waiting.stop()
    assert ticks == [0]  # only the final one

    failed = asyncio.Event()

    async def broken():
        failed.set()
        raise RuntimeError("the database is away")

    p = Periodic("t", HOUR, broken, first_s=0.0)
    p.start()
    await failed.wait()
    await p.stop()  # what the task raised ends with it
