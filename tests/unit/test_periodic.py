"""server.periodic.Periodic: the one periodic background task (flushes, passes, syncs)."""

from __future__ import annotations

import asyncio

from server.control.registry.audit_buffer import AuditBuffer
from server.periodic import Buffer, Periodic

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


async def test_a_buffer_writes_in_one_batch_and_a_failed_write_runs_its_policy():
    """Buffer: the flushed kind. The base loses a failed batch (counted); the audit buffer keeps it for the next flush."""
    written: list = []
    down = [True]

    def write(batch):
        if down[0]:
            raise ConnectionError("away")
        written.append(batch)

    lossy = Buffer("t", HOUR, write, capacity=10)
    lossy._pending.extend([{"n": 1}, {"n": 2}])
    assert await lossy.flush() == 0 and lossy.dropped == 2 and not lossy._pending
    down[0] = False
    lossy._pending.append({"n": 3})
    assert await lossy.flush() == 1 and written == [[{"n": 3}]]

    down[0] = True
    audit = AuditBuffer(lambda batch: write(batch) or len(batch), capacity=10)
    audit.add({"n": 4})
    assert await audit.flush() == 0 and list(audit._pending) == [{"n": 4}]  # kept
    down[0] = False
    assert await audit.flush() == 1 and audit.written == 1 and written[-1] == [{"n": 4}]
