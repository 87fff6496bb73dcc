"""Admission: fast path, weighted fair order across tenants, bounded queue with push-out,
deadline shedding at admission, cancellation and timeouts while queued."""

import asyncio

import pytest

from batching.fair_queue import AdmissionPolicy, DeadlineUnmeetable, FairQueue, QueueFull


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def _enqueue(q, order, tenant, n, weight=1.0, timeout=None):
    async def one(i):
        await q.acquire(tenant, weight, timeout)
        order.append(f"{tenant}{i}")

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await _settle()
    return tasks


async def _serve(q, order, n):
    for _ in range(n):
        q.release(None)
        await _settle()


async def test_free_slots_admit_at_once_without_waiting():
    q = FairQueue("m", AdmissionPolicy(slots=2))
    assert q.try_acquire() and q.try_acquire() and not q.try_acquire()
    q.release(0.01)
    await q.acquire("a")  # returns immediately
    assert q.inflight == 2 and q.size == 0 and q.admitted == 3


async def test_a_flooding_tenant_waits_behind_itself():
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100))
    assert q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 10)
    tasks += await _enqueue(q, order, "B", 2)
    await _serve(q, order, 12)
    await asyncio.gather(*tasks)
    # B arrived behind ten of A's, yet is served alternately with A
    assert order.index("B0") <= 2 and order.index("B1") <= 4
    assert [o for o in order if o[0] == "A"] == [f"A{i}" for i in range(10)]  # FIFO within a tenant


async def test_weights_split_a_saturated_model_by_plan():
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100))
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 30, weight=1.0)
    tasks += await _enqueue(q, order, "B", 30, weight=2.0)
    await _serve(q, order, 30)
    first = order[:30]
    assert sum(o[0] == "B" for o in first) in (19, 20, 21)
    await _serve(q, order, 30)
    await asyncio.gather(*tasks)


async def test_full_queue_refuses_with_a_drain_time_hint_and_pushes_out_the_heaviest_tenant():
    q = FairQueue("m", AdmissionPolicy(slots=1, min_queue=4, max_queue=4, initial_service_s=0.01))
    q.try_acquire()
    order: list[str] = []
    a_tasks = await _enqueue(q, order, "A", 4)
    assert q.size == 4
    with pytest.raises(QueueFull) as info:
        await q.acquire("A")
    assert info.value.retry_after_s == pytest.approx(0.04)
    # B holds less than its share: A's newest waiter is pushed out, B takes its place
    b_tasks = await _enqueue(q, order, "B", 1)
    assert q.size == 4 and q.pushed_out == 1
    with pytest.raises(QueueFull, match="over its share"):
        await a_tasks[3]
    await _serve(q, order, 4)
    await asyncio.gather(*a_tasks[:3], *b_tasks)
    assert order.index("B0") <= 1


async def test_a_deadline_that_cannot_be_met_is_shed_at_admission():
    q = FairQueue("m", AdmissionPolicy(slots=1, initial_service_s=0.1))
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 3)
    # 3 waiting + itself, 100 ms each: ~400 ms + 100 ms service; 250 ms left -> shed now
    with pytest.raises(DeadlineUnmeetable, match="cannot answer within the deadline"):
        await q.acquire("A", timeout=0.25)
    # another tenant with the same deadline jumps ahead under fair queuing: admitted to the queue
    b = asyncio.create_task(q.acquire("B", timeout=0.35))
    await _settle()
    assert q.size == 4 and q.shed == 1
    await _serve(q, order, 4)
    await asyncio.gather(*tasks, b)


async def test_a_deadline_passing_in_the_queue_leaves_the_queue():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    q.try_acquire()
    with pytest.raises(DeadlineUnmeetable):
        await q.acquire("A", timeout=0.02)
    assert q.size == 0
    q.release(None)
    assert q.inflight == 0


async def test_a_cancelled_waiter_leaves_and_never_takes_a_slot():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    q.try_acquire()
    t = asyncio.create_task(q.acquire("A"))
    await _settle()
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert q.size == 0
    q.release(None)
    assert q.inflight == 0 and q.try_acquire()


async def test_a_waiter_cancelled_right_after_its_grant_gives_the_slot_back():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    q.try_acquire()
    t = asyncio.create_task(q.acquire("A"))
    await _settle()
    q.release(None)  # granted
    t.cancel()  # ... and cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await t
    assert q.inflight == 0


def test_queue_bound_follows_measured_capacity():
    q = FairQueue("m", AdmissionPolicy(slots=4, max_queue_delay_s=0.5, min_queue=8, max_queue=1000))
    assert q.bound == 1000  # nothing measured yet
    q.inflight = 1
    q.release(0.01)  # 4 slots / 10 ms = 400 req/s -> 200 in 0.5 s
    assert q.capacity_rps == pytest.approx(400) and q.bound == 200
    q.inflight = 1
    for _ in range(200):
        q.inflight = 1
        q.release(1.0)
    assert q.bound == 8


def test_default_queue_bound_is_two_rounds_of_slots():
    q = FairQueue("m", AdmissionPolicy(slots=8, min_queue=4, max_queue=1000))
    assert q.bound == 16  # before anything is measured, and after: independent of the model's speed
    for service_s in (0.001, 0.5):
        q.inflight = 1
        q.release(service_s)
        assert q.bound == 16
    assert FairQueue("m", AdmissionPolicy(slots=1, min_queue=4)).bound == 4
    assert FairQueue("m", AdmissionPolicy(slots=4096, max_queue=1000)).bound == 1000


async def test_an_arriving_idle_tenant_wins_a_tie_with_the_backlogged_head():
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100))
    assert q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 3)  # finish tags 1, 2, 3
    await _serve(q, order, 1)  # A0 goes: virtual time 1
    tasks += await _enqueue(q, order, "B", 1)  # tag max(1, 0) + 1 = 2, equal to A1's
    await _serve(q, order, 3)
    await asyncio.gather(*tasks)
    assert order == ["A0", "B0", "A1", "A2"]  # B does not wait behind A's head for the same turn


# ---- push-out by share, the wait estimate, resize and the snapshot (the mutation pass of fair_queue.py) ----


async def _full(waiting: dict[str, tuple[int, float]], bound: int):
    """A one-slot queue at its bound, holding ``waiting[tenant] = (requests, weight)``."""
    q = FairQueue("m", AdmissionPolicy(slots=1, min_queue=bound, max_queue=bound, initial_service_s=0.01))
    q.try_acquire()
    order: list[str] = []
    tasks = {t: await _enqueue(q, order, t, n, w) for t, (n, w) in waiting.items()}
    assert q.size == bound
    return q, tasks


async def _arrive(q, tenant, weight=1.0):
    task = asyncio.create_task(q.acquire(tenant, weight))
    await _settle()
    return task


def _cancel(tasks):
    for group in tasks.values():
        for t in group:
            t.cancel()


async def test_an_arrival_at_its_fair_share_pushes_nobody_out():
    q, tasks = await _full({"A": (2, 1.0), "B": (2, 1.0)}, bound=4)
    with pytest.raises(QueueFull) as err:
        await q.acquire("B")  # B would hold 3 of 5 against A's 2: not under its share
    assert err.value.message == "model 'm' is saturated (4 requests waiting)" and q.pushed_out == 0 and q.rejected == 1
    with pytest.raises(QueueFull):
        await q.acquire("B")
    assert q.rejected == 2
    q2, tasks2 = await _full({"A": (2, 1.0), "B": (1, 1.0), "C": (1, 1.0)}, bound=4)
    with pytest.raises(QueueFull):
        await q2.acquire("B")  # 2 and 2: equal, A is not over B's share
    _cancel(tasks)
    _cancel(tasks2)


async def test_an_arrival_under_its_share_pushes_out_the_newest_of_the_tenant_most_over_it():
    q, tasks = await _full({"A": (3, 1.0), "B": (1, 1.0)}, bound=4)
    b = await _arrive(q, "B")  # B would hold 2 against A's 3
    assert q.pushed_out == 1 and q.size == 4
    with pytest.raises(QueueFull) as err:
        await tasks["A"][2]
    assert err.value.message == "model 'm' is saturated; tenant 'A' is over its share"
    assert err.value.retry_after_s == pytest.approx(0.03)  # 3 waiting after the push-out, 10 ms each
    c = await _arrive(q, "C")
    assert q.pushed_out == 2
    _cancel(tasks)
    b.cancel()
    c.cancel()


async def test_shares_are_weighted_for_the_victim_and_for_the_arrival():
    q, tasks = await _full({"A": (3, 4.0), "B": (1, 1.0)}, bound=4)
    with pytest.raises(QueueFull):
        await q.acquire("B")  # premium A holds 3 at weight 4: under B's 2 at weight 1
    q2, tasks2 = await _full({"A": (1, 4.0), "B": (3, 1.0)}, bound=4)
    a = await _arrive(q2, "A", 4.0)  # A at weight 4 would hold 2: under B's 3
    assert q2.pushed_out == 1
    q3, tasks3 = await _full({"X": (3, 2.0), "Y": (2, 1.0)}, bound=5)
    z = await _arrive(q3, "Z")  # X is at 1.5 shares, Y at 2: Y is the one most over its share
    with pytest.raises(QueueFull, match="tenant 'Y'"):
        await tasks3["Y"][1]
    assert not any(t.done() for t in tasks3["X"])
    for group in (tasks, tasks2, tasks3):
        _cancel(group)
    a.cancel()
    z.cancel()


async def test_the_wait_estimate_counts_only_the_requests_served_before_the_new_tag():
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100, initial_service_s=0.1))
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 10, weight=2.0)  # tags 0.5 .. 5.0
    await _serve(q, order, 4)  # served up to tag 2.0
    # C's tag is 3.0: of A's six left (2.5 .. 5.0), two go before it: wait 3 x 100 ms, plus its own 100 ms
    with pytest.raises(DeadlineUnmeetable):
        await q.acquire("C", timeout=0.3)
    c = await _arrive_with(q, "C", timeout=0.45)
    assert q.shed == 1 and not c.done()
    _cancel({"A": tasks})
    c.cancel()


async def _arrive_with(q, tenant, timeout):
    task = asyncio.create_task(q.acquire(tenant, 1.0, timeout))
    await _settle()
    return task


async def test_more_slots_admit_waiters_at_once_and_a_queue_keeps_at_least_one():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 3)
    q.resize(3)
    await _settle()
    assert order == ["A0", "A1"] and q.inflight == 3 and q.policy.slots == 3
    q.resize(0)
    assert q.policy.slots == 1 and q.inflight == 3  # fewer slots: those past the gate finish
    _cancel({"A": tasks})


async def test_the_snapshot_reports_every_counter():
    q = FairQueue("m", AdmissionPolicy(slots=1, min_queue=2, max_queue=2))
    assert q.snapshot()["service_ms"] is None
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 2)
    with pytest.raises(QueueFull):
        await q.acquire("A")
    q.release(0.02)
    await _settle()
    assert q.snapshot() == {
        "inflight": 1, "waiting": 1, "bound": 2, "service_ms": pytest.approx(20.0), "admitted": 2, "queued": 2,
        "rejected": 1, "shed": 0, "pushed_out": 0, "standing": False, "dropped": 0, "batch_inflight": 0, "batch_waiting": 0, "batch_admitted": 0,
    }  # fmt: skip
    _cancel({"A": tasks})


async def test_a_waiter_cancelled_after_its_grant_leaves_the_counts_straight():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    q.try_acquire()
    t = asyncio.create_task(q.acquire("A"))
    await _settle()
    q.release(None)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    assert (q.size, q.inflight) == (0, 0)
    await q.acquire("A")  # the queue is usable as before
    assert q.inflight == 1


async def test_deadline_shedding_reads_exactly_and_admits_a_deadline_met_to_the_millisecond():
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100, initial_service_s=0.1))
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 3)
    with pytest.raises(DeadlineUnmeetable) as err:
        await q.acquire("A", timeout=0.25)
    assert err.value.message == "model 'm' cannot answer within the deadline: ~500.0 ms expected, 250.0 ms left"
    with pytest.raises(DeadlineUnmeetable):
        await q.acquire("A", timeout=0.45)  # 400 ms of waiting fits, but not with its own 100 ms of service
    assert q.shed == 2
    met = await _arrive_with(q, "A", timeout=0.5)  # 3 ahead + itself, 100 ms each, and its own 100 ms: exactly 500 ms
    assert q.shed == 2 and q.size == 4 and not met.done()
    _cancel({"A": tasks + [met]})


async def test_a_deadline_passing_in_the_queue_is_counted_as_shed():
    q = FairQueue("m", AdmissionPolicy(slots=1))
    q.try_acquire()
    with pytest.raises(DeadlineUnmeetable) as err:
        await q.acquire("A", timeout=0.01)
    assert err.value.message == "deadline exceeded waiting for model 'm'" and (q.shed, q.size) == (1, 0)
    with pytest.raises(DeadlineUnmeetable):
        await q.acquire_batch("job", timeout=0.01)
    assert q.shed == 1  # a batch request's wait is not a real-time deadline missed


async def test_the_default_weight_is_one_and_the_service_time_is_a_moving_average():
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100, ewma_alpha=0.05))
    q.try_acquire()
    order: list[str] = []
    tasks = await _enqueue(q, order, "A", 3)  # the default weight
    tasks += await _enqueue(q, order, "B", 3, weight=1.0)
    q.release(0.02)
    await _settle()
    q.release(0.04)
    await _settle()
    assert q.service_s == pytest.approx(0.95 * 0.02 + 0.05 * 0.04)
    await _serve(q, order, 4)
    assert order == ["A0", "B0", "A1", "B1", "A2", "B2"]
    await asyncio.gather(*tasks)
