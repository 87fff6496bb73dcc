"""The batch class of the fair queue: it only takes slots real-time traffic leaves."""

import asyncio

import pytest

from batching.fair_queue import AdmissionPolicy, FairQueue, QueueFull


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
