"""The fair queue's refusals, counters and bookkeeping as a caller and an operator read them: the
exact refusal each overload verdict gives (its message and retry hint), the counters a dashboard
sums, a cancelled request's place, a weighted tenant's share in the wait estimate, short waits that
never make a queue stand, and no state left for a tenant with nothing waiting (issue 34: the
behaviours the mutation pass found unpinned)."""

from __future__ import annotations

import asyncio

import pytest

from batching.fair_queue import AdmissionPolicy, DeadlineUnmeetable, FairQueue, QueueFull
from batching.overload_policy import OverloadPolicy


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_queue_ttl_expiry_names_the_wait_and_hints_the_time_to_drain_what_is_left():
    q = FairQueue("m", AdmissionPolicy(slots=1, overload=OverloadPolicy(queue_ttl_s=0.06)))
    q.service_s = 0.002
    assert q.try_acquire()
    first = asyncio.create_task(q.acquire("a", timeout=30.0))  # the TTL (60 ms) bounds it, not the deadline
    await asyncio.sleep(0.02)
    second = asyncio.create_task(q.acquire("b", timeout=30.0))
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(r, QueueFull) for r in results), results
    assert results[0].message == "model 'm' is saturated: waited 60.0 ms, its queue budget"
    assert results[0].retry_after_s == pytest.approx(0.002)  # b still waits: one request, 2 ms each
    assert results[1].retry_after_s == 0.001  # nothing left to drain: the floor
    assert q.rejected == 2 and q.shed == 0 and q.size == 0


async def test_requests_whose_deadline_passes_in_the_queue_are_each_counted_as_shed():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    assert q.try_acquire()
    results = await asyncio.gather(q.acquire("a", timeout=0.01), q.acquire("b", timeout=0.01), return_exceptions=True)
    assert all(isinstance(r, DeadlineUnmeetable) for r in results), results
    assert results[0].message == "deadline exceeded waiting for model 'm'"
    assert q.shed == 2 and q.rejected == 0 and q.size == 0


async def test_a_heavy_tenants_waiters_count_at_its_weight_in_a_lighter_tenants_wait_estimate():
    """Tenant A (weight 4) has four waiters, each a quarter round: a weight-1 arrival's tag is one whole
    round, so all four are served before it: 5 x 10 ms expected, + 10 ms service > 40 ms left."""
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100))
    q.service_s = 0.01
    assert q.try_acquire()
    heavy = [asyncio.create_task(q.acquire("A", weight=4.0)) for _ in range(4)]
    await _settle()
    with pytest.raises(DeadlineUnmeetable) as refused:
        await q.acquire("B", weight=1.0, timeout=0.04)
    assert refused.value.message == "model 'm' cannot answer within the deadline: ~60.0 ms expected, 40.0 ms left"
    assert q.size == 4 and q.shed == 1
    for _ in heavy:
        q.release(None)
        await _settle()
    await asyncio.gather(*heavy)


async def test_a_request_cancelled_just_before_a_slot_frees_leaves_the_slot_to_the_next():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    assert q.try_acquire()
    waiters = [asyncio.create_task(q.acquire("a")) for _ in range(2)]
    await _settle()
    waiters[0].cancel()  # its wait is cancelled now; its task unwinds on the next tick
    q.release(None)  # the freed slot must go to the second waiter
    await _settle()
    assert waiters[1].done() and waiters[1].exception() is None
    assert waiters[0].cancelled()
    assert q.inflight == 1 and q.size == 0 and q.admitted == 2


async def test_a_batch_request_cancelled_just_before_a_slot_frees_leaves_it_to_the_next():
    q = FairQueue("m", AdmissionPolicy(slots=2, batch_share=0.5))  # one batch slot
    assert q.try_acquire_batch()
    waiters = [asyncio.create_task(q.acquire_batch("t")) for _ in range(2)]
    await _settle()
    waiters[0].cancel()
    q.release(None, batch=True)
    await _settle()
    assert waiters[1].done() and waiters[1].exception() is None
    assert q.batch_inflight == 1 and q.batch_size == 0


async def test_a_cancelled_request_is_not_the_one_pushed_out_for_its_tenant():
    """A's newest waiter was cancelled: when the full queue pushes A out, its newest *waiting* request
    (A1) gets QueueFull; the ones still queued are all served."""
    q = FairQueue("m", AdmissionPolicy(slots=1, min_queue=4, max_queue=4))
    assert q.try_acquire()
    a = [asyncio.create_task(q.acquire("A")) for _ in range(3)]
    b = [asyncio.create_task(q.acquire("B"))]
    await _settle()
    a[2].cancel()
    await _settle()
    assert q.size == 3
    b.append(asyncio.create_task(q.acquire("B")))
    await _settle()
    assert q.size == 4
    c = asyncio.create_task(q.acquire("C"))  # full: A and B hold two each, C none; A is first of the heaviest
    await _settle()
    assert a[1].done() and isinstance(a[1].exception(), QueueFull)
    assert "tenant 'A' is over its share" in a[1].exception().message
    assert q.size == 4 and q.pushed_out == 1
    for _ in range(4):
        q.release(None)
        await _settle()
    await asyncio.gather(a[0], *b, c)
    assert q.size == 0 and q.inflight == 1


async def test_short_waits_never_make_the_queue_stand_however_long_the_busy_run():
    """A queue busy for 0.16 s (one request always waiting) whose every request waits 8 ms, under
    one service time (10 ms): never standing, nothing dropped. The clock starts far from zero."""
    clock = Clock(100.0)
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100, overload=OverloadPolicy(target_s=0.005, interval_s=0.1)), clock=clock)
    assert q.try_acquire()
    served = [asyncio.create_task(q.acquire("a"))]
    await _settle()
    for k in range(1, 21):
        clock.t = 100.0 + k * 0.008
        served.append(asyncio.create_task(q.acquire("a")))
        await _settle()
        q.release(0.01)  # grants the one that waited 8 ms
        await _settle()
        assert served[k - 1].done() and served[k - 1].exception() is None
    assert q.governor.dropped == 0 and not q.governor.standing and q.rejected == 0
    q.release(0.01)
    await asyncio.gather(*served)


async def test_a_standing_queue_drop_is_a_counted_refusal_with_the_time_to_drain_what_is_left():
    """Four requests wait from t=0; grants at 0.5 s and 0.55 s serve two (the run above target is not
    yet an interval long); at 0.65 s the queue stands and the two left, which stood far past one
    service time (20 ms), are refused: each a QueueFull with the time to drain what is still queued."""
    clock = Clock()
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100, overload=OverloadPolicy(target_s=0.005, interval_s=0.1)), clock=clock)
    assert q.try_acquire()
    waiters = [asyncio.create_task(q.acquire("a")) for _ in range(4)]
    await _settle()
    for t in (0.5, 0.55, 0.65):
        clock.t = t
        q.release(0.02)
        await _settle()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert results[:2] == [None, None]
    assert all(isinstance(r, QueueFull) and r.message == "model 'm' is saturated (a standing queue)" for r in results[2:]), results
    assert results[2].retry_after_s == pytest.approx(0.02)  # one more was still queued behind it: 20 ms
    assert results[3].retry_after_s == 0.001  # the last: nothing left, the floor
    assert q.rejected == 2 and q.governor.dropped == 2 and q.size == 0


async def test_a_tenant_with_nothing_waiting_holds_no_state_in_the_queue():
    """Tenants come and go (a model may serve thousands): once every request of theirs was served,
    the queue keeps nothing of them."""
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100))
    assert q.try_acquire()
    tasks = [asyncio.create_task(q.acquire(t)) for t in ("A", "A", "B")]
    await _settle()
    for _ in tasks:
        q.release(None)
        await _settle()
    await asyncio.gather(*tasks)
    assert q._tenants == {}
