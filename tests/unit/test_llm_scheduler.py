"""Continuous-batching admission policy (pure)."""

import pytest

from batching.llm_scheduler import ContinuousBatchScheduler, NeverFits, QueueFull, SchedulerConfig


def sched(**kw):
    return ContinuousBatchScheduler(SchedulerConfig(**{"budget_tokens": 1000, **kw}))


def ids(seqs):
    return [s.id for s in seqs]


def test_admits_in_arrival_order_while_the_budget_lasts():
    s = sched()
    for i in range(4):
        s.submit(f"r{i}", 100, 200)  # 300 each: three fit in 1000
    assert ids(s.schedule()) == ["r0", "r1", "r2"]
    assert s.reserved == 900 and list(s.waiting) == ["r3"]
    assert s.schedule() == []  # nothing left, nothing changes
    s.advance()
    s.finish("r1")  # a sequence leaves: the waiting one joins at the next step
    assert ids(s.schedule()) == ["r3"]
    assert s.running.keys() == {"r0", "r2", "r3"} and s.reserved == 900
    assert s.running["r3"].admitted_step == 1 and s.running["r3"].submitted_step == 0


def test_fifo_no_overtaking_of_a_big_head():
    s = sched()
    s.submit("small0", 100, 300)
    assert ids(s.schedule()) == ["small0"]
    s.submit("big", 200, 600)  # 800 does not fit next to 400
    s.submit("small1", 10, 10)  # would fit, but must not jump ahead of "big"
    assert s.schedule() == []
    s.finish("small0")
    assert ids(s.schedule()) == ["big", "small1"]


def test_never_fits_is_rejected_at_submit():
    s = sched(max_context=512)
    with pytest.raises(NeverFits, match="KV-cache budget"):
        sched().submit("huge", 600, 600)
    with pytest.raises(NeverFits, match="context window"):
        s.submit("long", 400, 200)
    assert s.idle


def test_max_running_and_prefill_limits():
    s = sched(budget_tokens=100_000, max_running=2)
    for i in range(3):
        s.submit(f"r{i}", 10, 10)
    assert ids(s.schedule()) == ["r0", "r1"]
    s.finish("r0")
    assert ids(s.schedule()) == ["r2"]
    p = sched(budget_tokens=100_000, max_prefill_tokens=100)
    p.submit("a", 80, 1)
    p.submit("b", 80, 1)
    p.submit("c", 500, 1)
    assert ids(p.schedule()) == ["a"]  # b would exceed the step's prefill tokens
    assert ids(p.schedule()) == ["b"]
    assert ids(p.schedule()) == ["c"]  # a long prompt alone is always admitted


def test_finish_of_a_waiting_sequence_and_unknown_ids():
    s = sched()
    s.submit("a", 500, 400)
    s.submit("b", 500, 400)
    assert ids(s.schedule()) == ["a"]
    assert s.finish("b").id == "b"  # cancelled while waiting
    assert s.finish("nope") is None
    s.finish("a")
    assert s.idle and s.reserved == 0
    assert s.stats.finished == 2


def test_queue_bound_and_duplicates():
    s = sched(max_waiting=2)
    s.submit("a", 1, 1)
    with pytest.raises(ValueError):
        s.submit("a", 1, 1)
    s.submit("b", 1, 1)
    with pytest.raises(QueueFull):
        s.submit("c", 1, 1)
    snap = s.snapshot()
    assert snap["waiting"] == 2 and snap["rejected"] == 1


def test_reservations_never_exceed_the_budget_under_churn():
    import random

    rng = random.Random(7)
    s = sched(budget_tokens=5000, max_running=8)
    n = 0
    for _ in range(500):
        for _ in range(rng.randint(0, 3)):
            s.submit(f"r{n}", rng.randint(1, 400), rng.randint(1, 600))
            n += 1
        s.schedule()
        assert s.reserved == sum(q.need for q in s.running.values()) <= 5000
        assert len(s.running) <= 8
        for sid in list(s.running):
            if rng.random() < 0.2:
                s.finish(sid)
        s.advance()


def test_a_lower_priority_value_is_admitted_first_and_fifo_holds_within_one():
    s = sched(max_running=2)
    s.submit("free0", 10, 10, priority=3)
    s.submit("free1", 10, 10, priority=3)
    s.submit("premium", 10, 10, priority=1)
    s.submit("enterprise", 10, 10, priority=0)
    assert ids(s.schedule()) == ["enterprise", "premium"]  # both arrived last, both go first
    s.finish("enterprise")
    s.finish("premium")
    assert ids(s.schedule()) == ["free0", "free1"]
    assert s.running["free0"].priority == 3


def test_a_high_priority_head_that_does_not_fit_is_not_overtaken():
    s = sched()
    s.submit("running", 100, 300, priority=3)
    assert ids(s.schedule()) == ["running"]
    s.submit("free", 10, 10, priority=3)
    s.submit("premium", 200, 600, priority=0)  # 800 does not fit next to 400
    assert s.schedule() == []  # "free" would fit but must not starve the premium head
    s.finish("running")
    assert ids(s.schedule()) == ["premium", "free"]
