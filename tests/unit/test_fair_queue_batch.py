"""The batch class of the fair queue: it only takes slots real-time traffic leaves."""

import asyncio

import pytest

from batching.fair_queue import AdmissionPolicy, DeadlineUnmeetable, FairQueue, QueueFull


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def _start(coro, order, label):
    async def run():
        await coro
        order.append(label)

    return asyncio.create_task(run())


async def test_batch_takes_free_slots_only_up_to_its_share():
    q = FairQueue("m", AdmissionPolicy(slots=4, batch_share=0.5))
    assert q.try_acquire_batch() and q.try_acquire_batch()
    assert not q.try_acquire_batch()  # its share (2 of 4) is taken
    assert q.try_acquire() and q.try_acquire()  # real-time still finds the other two at once
    assert q.inflight == 4 and q.batch_inflight == 2


async def test_a_waiting_realtime_request_goes_before_every_waiting_batch_request():
    q = FairQueue("m", AdmissionPolicy(slots=2, batch_share=1.0, queue_rounds=100))
    assert q.try_acquire() and q.try_acquire()
    order: list[str] = []
    tasks = [_start(q.acquire_batch("job", 1.0), order, f"b{i}") for i in range(3)]
    await _settle()
    tasks += [_start(q.acquire("caller", 1.0), order, f"r{i}") for i in range(2)]  # real-time arrives after the batch rows
    await _settle()
    for i in range(5):
        q.release(None, batch=i == 4)  # two initial holders, r0, r1 (real-time), then b0 (batch)
        await _settle()
        assert not (q.size and q.batch_inflight > 0 and order[-1].startswith("b")), order  # no batch grant while real-time waits
    await asyncio.gather(*tasks)
    assert order[:2] == ["r0", "r1"] and sorted(order[2:]) == ["b0", "b1", "b2"]


async def test_batch_never_blocks_the_realtime_fast_path():
    q = FairQueue("m", AdmissionPolicy(slots=3, batch_share=0.34))
    assert q.try_acquire_batch()
    order: list[str] = []
    waiting = [_start(q.acquire_batch("job"), order, f"b{i}") for i in range(5)]
    await _settle()
    assert q.batch_size == 5 and q.size == 0
    assert q.try_acquire() and q.try_acquire()  # batch rows waiting do not make real-time wait
    assert not order
    q.release(None, batch=True)  # the one batch slot frees: the next batch row takes it, nothing more
    await _settle()
    assert order == ["b0"] and q.batch_inflight == 1 and q.inflight == 3
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert q.batch_size == 0


async def test_batch_tenants_share_fairly_among_themselves():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q.try_acquire()
    order: list[str] = []
    tasks = [_start(q.acquire_batch("A"), order, f"A{i}") for i in range(6)]
    await _settle()
    tasks += [_start(q.acquire_batch("B"), order, f"B{i}") for i in range(2)]
    await _settle()
    q.release(None)
    for _ in range(8):
        await _settle()
        q.release(None, batch=True)
    await asyncio.gather(*tasks)
    assert order.index("B0") <= 2 and order.index("B1") <= 4, order


async def test_cancelled_batch_waiter_gives_back_a_granted_slot():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q.try_acquire()
    task = asyncio.create_task(q.acquire_batch("job"))
    await _settle()
    q.release(None)  # grants the batch waiter ...
    task.cancel()  # ... which is cancelled in the same tick
    with pytest.raises(asyncio.CancelledError):
        await task
    assert q.inflight in (0, 1) and q.batch_inflight == q.inflight  # never a leaked slot
    if q.inflight:
        q.release(None, batch=True)
    assert q.inflight == 0 and q.batch_inflight == 0


async def test_batch_queue_is_bounded():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0, max_queue=2))
    assert q.try_acquire()
    tasks = [asyncio.create_task(q.acquire_batch("job")) for _ in range(2)]
    await _settle()
    with pytest.raises(QueueFull):
        await q.acquire_batch("job")
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- counts, bounds and order of the batch class (the mutation pass of fair_queue.py) ---------------


async def _batch_waiters(q, order, tenant, n, **kwargs):
    tasks = [_start(q.acquire_batch(tenant, **kwargs), order, f"{tenant}{i}") for i in range(n)]
    await _settle()
    return tasks


async def _release_batch(q, n):
    for _ in range(n):
        q.release(None, batch=True)
        await _settle()


async def test_batch_admissions_are_counted_one_each_on_both_paths():
    q = FairQueue("m", AdmissionPolicy(slots=2, batch_share=1.0))
    assert q.try_acquire_batch() and q.batch_admitted == 1
    assert q.try_acquire_batch() and q.batch_admitted == 2
    order: list[str] = []
    tasks = await _batch_waiters(q, order, "job", 2)
    await _release_batch(q, 2)
    assert q.batch_admitted == 4 and (q.inflight, q.batch_inflight) == (2, 2)
    await asyncio.gather(*tasks)


async def test_a_full_batch_queue_names_its_size_and_hints_the_drain_time():
    q = FairQueue("m", AdmissionPolicy(slots=2, batch_share=0.5, max_queue=2))
    assert q.try_acquire_batch()  # the one batch slot
    order: list[str] = []
    tasks = await _batch_waiters(q, order, "job", 2)
    with pytest.raises(QueueFull) as err:
        await q.acquire_batch("job")
    assert err.value.message == "model 'm' has 2 batch requests waiting" and err.value.retry_after_s == 0.001  # nothing measured yet
    q.release(0.01, batch=True)  # 10 ms per request measured; it grants the next waiter
    await _settle()
    tasks += await _batch_waiters(q, order, "job", 1)
    with pytest.raises(QueueFull) as err:
        await q.acquire_batch("job")
    assert err.value.retry_after_s == pytest.approx(0.01)  # 2 waiting x 10 ms over 2 slots
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_batch_grants_stop_at_the_free_slots_and_at_the_batch_share():
    q = FairQueue("m", AdmissionPolicy(slots=2, batch_share=1.0))
    assert q.try_acquire() and q.try_acquire()
    order: list[str] = []
    tasks = await _batch_waiters(q, order, "job", 3)
    q.release(None)
    await _settle()
    assert (q.inflight, q.batch_inflight, order) == (2, 1, ["job0"])  # one slot freed: one grant
    q2 = FairQueue("m", AdmissionPolicy(slots=4, batch_share=0.25))
    for _ in range(4):
        q2.try_acquire()
    tasks2 = await _batch_waiters(q2, [], "job", 2)
    q2.release(None)
    q2.release(None)
    await _settle()
    assert (q2.inflight, q2.batch_inflight) == (3, 1)  # the batch share is one slot: the other stays free
    for t in tasks + tasks2:
        t.cancel()
    await asyncio.gather(*tasks, *tasks2, return_exceptions=True)


async def test_two_batch_grants_at_once_are_both_counted():
    q = FairQueue("m", AdmissionPolicy(slots=4, batch_share=0.5))
    for _ in range(4):
        q.try_acquire()
    order: list[str] = []
    tasks = await _batch_waiters(q, order, "job", 3)
    q.resize(6)  # two more slots: both go to batch waiters, the share (3) is not yet reached
    await _settle()
    assert q.batch_inflight == 2 and len(order) == 2
    q.release(None)
    await _settle()
    assert q.batch_inflight == 3 and len(order) == 3
    await asyncio.gather(*tasks)


async def test_batch_tenants_share_by_weight_and_the_default_weight_is_one():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q.try_acquire_batch()
    order: list[str] = []
    tasks = await _batch_waiters(q, order, "A", 4)  # the default weight
    tasks += await _batch_waiters(q, order, "B", 2, weight=1.0)
    await _release_batch(q, 6)
    assert order == ["A0", "B0", "A1", "B1", "A2", "A3"]
    q2 = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q2.try_acquire_batch()
    order2: list[str] = []
    tasks += await _batch_waiters(q2, order2, "A", 4, weight=2.0)
    tasks += await _batch_waiters(q2, order2, "B", 2, weight=1.0)
    await _release_batch(q2, 6)
    assert order2 == ["A0", "A1", "B0", "A2", "A3", "B1"]  # A at twice B's weight: two turns to one
    await asyncio.gather(*tasks)


async def test_a_cancelled_batch_waiter_is_skipped_and_the_next_granted():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q.try_acquire_batch()
    order: list[str] = []
    tasks = await _batch_waiters(q, order, "job", 2)
    tasks[0].cancel()
    await _settle()
    assert q.batch_size == 1
    await _release_batch(q, 1)
    assert order == ["job1"] and q.batch_size == 0
    q.release(None, batch=True)
    q.try_acquire()  # a real-time request holds the slot: the next batch request must wait in the emptied queue
    late = _start(q.acquire_batch("late"), order, "late")
    await _settle()
    q.release(None)
    await _settle()
    assert order[-1] == "late"  # after the batch queue emptied, a waiting batch request still works
    await asyncio.gather(*tasks[1:], late)


async def test_a_batch_waiter_leaves_at_its_deadline():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q.try_acquire()
    with pytest.raises(DeadlineUnmeetable) as err:
        await q.acquire_batch("job", timeout=0.01)
    assert err.value.message == "deadline exceeded waiting for model 'm' (batch)" and q.batch_size == 0


async def test_a_batch_waiter_cancelled_after_its_grant_leaves_the_counts_straight():
    q = FairQueue("m", AdmissionPolicy(slots=1, batch_share=1.0))
    assert q.try_acquire()
    task = asyncio.create_task(q.acquire_batch("job"))
    await _settle()
    q.release(None)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (q.batch_size, q.inflight, q.batch_inflight) == (0, 0, 0)
