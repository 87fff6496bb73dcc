"""The per-stage timer (``server.dataplane.stage_timing``): contiguous stages that sum to at most the
total, the ``Server-Timing`` text and its parser, and the coalescer batch's hooks, which touch only
the timed members of a call."""

from __future__ import annotations

import asyncio
import contextvars

from server.dataplane import stage_timing
from server.dataplane.stage_timing import PENDING, StageTimer, batch_started, parse, replica_chosen


def test_stages_are_contiguous_and_sum_to_at_most_the_total():
    timer = StageTimer()
    for name in ("decode", "auth", "route"):
        sum(range(2000))  # some work in each stage
        timer.mark(name)
    stages = parse(timer.header())
    assert list(stages) == ["decode", "auth", "route", "total"]
    assert sum(v for k, v in stages.items() if k != "total") <= stages["total"]
    assert sum(ns for _, ns in timer.stages) == timer.last - timer.started  # no gap, no overlap


def test_header_is_milliseconds_floored_to_the_microsecond():
    timer = StageTimer()
    timer.stages = [("decode", 12_345), ("triton", 1_999_999)]
    text = timer.header()
    assert text.startswith("decode;dur=0.012, triton;dur=1.999, total;dur=")


def test_parse_sums_a_stage_named_twice_and_ignores_other_params():
    assert parse('replica;desc="x";dur=0.5, replica;dur=0.25, total;dur=2') == {"replica": 0.75, "total": 2.0}


class _Request:  # the coalescer's members are identified by object identity
    pass


def test_a_batch_marks_only_its_timed_members():
    timed, untimed = _Request(), _Request()
    timer = StageTimer()
    PENDING[id(timed)] = timer
    try:
        done = batch_started([untimed, timed])
        assert done is not None
        replica_chosen()
        done()
    finally:
        PENDING.pop(id(timed), None)
    assert [name for name, _ in timer.stages] == ["coalesce", "replica", "triton"]
    replica_chosen()  # outside the call: the contextvar was reset, nothing marked
    assert len(timer.stages) == 3


def test_a_batch_without_timed_members_makes_nothing():
    assert batch_started([_Request()]) is None
    assert stage_timing._BATCH.get() is None


def test_the_batch_timers_stay_in_the_calling_task():
    timer, request = StageTimer(), _Request()
    PENDING[id(request)] = timer

    async def other_task():
        replica_chosen()  # another request's task: not this call's member

    async def main():
        done = batch_started([request])
        other = asyncio.get_running_loop().create_task(other_task(), context=contextvars.Context())
        await other
        done()

    try:
        asyncio.run(main())
    finally:
        PENDING.pop(id(request), None)
    assert [name for name, _ in timer.stages] == ["coalesce", "triton"]
