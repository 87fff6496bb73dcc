"""The overload policy (batching.overload_policy) with an injected clock, and its properties:
bounded wait under any arrival sequence, no refusal while the expected wait is within budget,
a positive retry hint on every refusal; then the fair queue using it (queue TTL, standing queue)."""

from __future__ import annotations

import asyncio
import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.fair_queue import AdmissionPolicy, FairQueue, QueueFull
from batching.overload_policy import BUDGET, DEADLINE, OverloadPolicy, QueueGovernor, expected_wait_s


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_littles_law_wait_is_the_drain_time_of_whoever_is_ahead():
    assert expected_wait_s(0, 4, 0.1) == pytest.approx(0.025)
    assert expected_wait_s(7, 4, 0.1) == pytest.approx(0.2)
    assert expected_wait_s(100, 4, None) == 0.0  # unmeasured: no estimate, no refusal from it


def test_over_the_queue_ttl_is_refused_with_the_time_to_drain_back_within_it():
    g = QueueGovernor(OverloadPolicy(queue_ttl_s=0.05), Clock())
    assert g.admit(ahead=3, slots=2, service_s=0.02, remaining_s=None) is None  # 40 ms <= 50 ms
    refusal = g.admit(ahead=9, slots=2, service_s=0.02, remaining_s=None)  # 100 ms > 50 ms
    assert refusal.verdict == BUDGET and refusal.retry_after_s == pytest.approx(0.05)


def test_a_deadline_that_cannot_be_met_is_its_own_verdict():
    g = QueueGovernor(OverloadPolicy(queue_ttl_s=10.0), Clock())
    refusal = g.admit(ahead=3, slots=1, service_s=0.1, remaining_s=0.25)  # 400 ms wait + 100 ms service
    assert refusal.verdict == DEADLINE


def test_a_standing_queue_shrinks_the_budget_and_a_short_wait_ends_it():
    clock = Clock()
    g = QueueGovernor(OverloadPolicy(queue_ttl_s=1.0, target_s=0.005, interval_s=0.1), clock)
    assert g.dequeued(0.2, service_s=0.01)  # above target: the interval starts, still served
    clock.t = 0.05
    assert g.dequeued(0.2, service_s=0.01) and not g.standing
    clock.t = 0.11  # above target for a whole interval: standing; the budget is now one service time
    assert not g.dequeued(0.2, service_s=0.01) and g.standing and g.dropped == 1
    assert g.budget_s(0.01) == pytest.approx(0.01)
    assert g.admit(ahead=4, slots=1, service_s=0.01, remaining_s=None).verdict == BUDGET  # 50 ms > 10 ms
    assert g.dequeued(0.004, service_s=0.01) and not g.standing  # a short wait: the queue drained
    assert g.admit(ahead=4, slots=1, service_s=0.01, remaining_s=None) is None
    g.standing = True
    g.drained()
    assert not g.standing


def test_without_codel_a_long_wait_is_still_served():
    clock = Clock()
    g = QueueGovernor(OverloadPolicy(codel=False, queue_ttl_s=1.0), clock)
    for t in (0.0, 0.2, 0.4):
        clock.t = t
        assert g.dequeued(0.5, service_s=0.01)
    assert not g.standing


_services = st.floats(min_value=1e-4, max_value=0.5)
_maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731


@given(
    ahead=st.integers(0, 10_000), slots=st.integers(1, 512), service=_maybe(_services),
    remaining=_maybe(st.floats(min_value=0.0, max_value=30.0)), ttl=_maybe(st.floats(min_value=1e-4, max_value=5.0)),
    standing=st.booleans(),
)  # fmt: skip
def test_no_refusal_while_the_expected_wait_is_within_budget(ahead, slots, service, remaining, ttl, standing):
    g = QueueGovernor(OverloadPolicy(queue_ttl_s=ttl), Clock())
    g.standing = standing
    wait = expected_wait_s(ahead, slots, service)
    budget = g.budget_s(service)
    within = (budget is None or wait <= budget) and (remaining is None or not service or wait + service <= remaining)
    refusal = g.admit(ahead, slots, service, remaining)
    assert (refusal is None) == within
    if refusal is not None:
        assert refusal.retry_after_s > 0 and refusal.expected_s == wait


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.05), min_size=1, max_size=300),
    services=st.lists(_services, min_size=1, max_size=300),
    slots=st.integers(1, 8),
    ttl=st.floats(min_value=0.001, max_value=0.5),
    deadlines=st.lists(_maybe(st.floats(min_value=0.0, max_value=2.0)), min_size=1, max_size=300),
    codel=st.booleans(),
)
def test_bounded_wait_under_any_arrival_sequence(gaps, services, slots, ttl, deadlines, codel):
    """A discrete-event queue (FIFO, ``slots`` servers, service times unrelated to the estimate) run by
    the governor: an admitted request is served within its budget or leaves at it, never later."""
    clock = Clock()
    g = QueueGovernor(OverloadPolicy(queue_ttl_s=ttl, codel=codel), clock)
    estimate = None
    busy: list[float] = []  # finish times
    queue: list[tuple[float, float, int]] = []  # (enqueued, expiry, id), FIFO
    waits: list[float] = []
    t = 0.0

    def serve_until(now: float) -> None:
        nonlocal estimate
        while True:
            # the next event before ``now``: a server frees or a waiter's timer fires
            free = busy[0] if busy else None
            expiry = min((e for _, e, _ in queue), default=None)
            nxt = min((x for x in (free, expiry) if x is not None), default=None)
            if nxt is None or nxt > now:
                return
            clock.t = nxt
            if expiry is not None and expiry <= (free if free is not None else expiry):
                queue[:] = [w for w in queue if w[1] > nxt]  # timed out: refused at its budget
                continue
            heapq.heappop(busy)
            while queue and len(busy) < slots:
                enqueued, _, i = queue.pop(0)
                if g.dequeued(nxt - enqueued, estimate):
                    waits.append(nxt - enqueued)
                    s = services[i % len(services)]
                    estimate = s if estimate is None else 0.9 * estimate + 0.1 * s
                    heapq.heappush(busy, nxt + s)
            if not queue:
                g.drained()

    for i, gap in enumerate(gaps):
        t += gap
        serve_until(t)
        clock.t = t
        remaining = deadlines[i % len(deadlines)]
        if len(busy) < slots and not queue:
            heapq.heappush(busy, t + services[i % len(services)])
            waits.append(0.0)
            continue
        if g.admit(len(queue), slots, estimate, remaining) is not None:
            continue
        limit, _ = g.timeout_s(remaining, estimate)
        queue.append((t, t + (limit if limit is not None else 1e9), i))
    serve_until(1e12)
    assert all(w <= ttl + 1e-9 for w in waits), max(waits)


# ---- the fair queue with the policy -----------------------------------------------------------


async def test_a_request_the_queue_ttl_expires_is_refused_with_a_retry_hint():
    q = FairQueue("m", AdmissionPolicy(slots=1, overload=OverloadPolicy(queue_ttl_s=0.01)))
    assert q.try_acquire()
    with pytest.raises(QueueFull) as refused:
        await q.acquire("a", timeout=30.0)  # the TTL (10 ms) is shorter than the deadline: the queue's refusal
    assert refused.value.retry_after_s > 0 and "queue budget" in refused.value.message
    assert q.size == 0 and q.rejected == 1


async def test_an_arrival_expecting_more_than_the_ttl_is_refused_at_once():
    clock = Clock()
    q = FairQueue("m", AdmissionPolicy(slots=1, overload=OverloadPolicy(queue_ttl_s=0.05)), clock=clock)
    q.service_s = 0.03
    assert q.try_acquire()
    first = asyncio.create_task(q.acquire("a"))  # 30 ms expected: waits
    await asyncio.sleep(0)
    assert q.size == 1
    for _ in range(2):  # each refusal counted, each naming the wait it would have had and the budget
        with pytest.raises(QueueFull) as refused:
            await q.acquire("b")  # 60 ms expected > 50 ms: refused before it waits
        assert refused.value.message == "model 'm' is saturated: ~60.0 ms expected in its queue, 50.0 ms allowed"
        assert refused.value.retry_after_s == pytest.approx(0.01)
    assert q.rejected == 2 and q.shed == 0 and q.size == 1
    q.release(0.03)
    await first
    assert q.inflight == 1 and q.rejected == 2


async def test_a_standing_queue_drops_the_requests_that_stood_past_their_budget():
    clock = Clock()
    q = FairQueue("m", AdmissionPolicy(slots=1, queue_rounds=100, overload=OverloadPolicy(target_s=0.005, interval_s=0.1)), clock=clock)
    assert q.try_acquire()
    waiters = [asyncio.create_task(q.acquire("a")) for _ in range(4)]
    await asyncio.sleep(0)
    dropped = []
    for t in (0.5, 0.55, 0.65):  # each grant finds its waiters far above target
        clock.t = t
        q.release(None)
        await asyncio.sleep(0)
        dropped.append(q.governor.dropped)
    results = await asyncio.gather(*waiters, return_exceptions=True)
    # the third grant comes a whole interval into the run above target: the queue stands, and both
    # waiters left stood past its budget (one service time, at least the target): refused, not served late
    assert dropped == [0, 0, 2]
    assert results[:2] == [None, None] and all(isinstance(r, QueueFull) and r.retry_after_s > 0 for r in results[2:])
    assert q.size == 0 and q.inflight == 0 and not q.governor.standing  # drained: nothing stands any more


# ---- the process's loop gate ------------------------------------------------------------------


def test_the_loop_gate_admits_everything_while_the_loop_keeps_up():
    from batching.overload_policy import LoopGate, LoopPolicy

    gate = LoopGate(LoopPolicy(target_s=0.01, interval_s=0.1), Clock())
    for _ in range(500):
        gate.sample(0.002)
        assert gate.enter() is None
    assert gate.limit is None and gate.inflight == 500 and gate.refused == 0


def test_a_standing_loop_cuts_the_limit_then_recovers_and_lifts_it():
    from batching.overload_policy import LoopGate, LoopPolicy

    clock = Clock()
    gate = LoopGate(LoopPolicy(target_s=0.01, interval_s=0.1, min_limit=4, decrease=0.5), clock)
    for _ in range(40):
        assert gate.enter() is None
    gate.sample(0.05)  # above target: the interval starts
    clock.t = 0.05
    gate.sample(0.05)
    assert gate.limit is None  # not a whole interval yet
    clock.t = 0.1
    gate.sample(0.05)
    assert gate.limit == 20  # half of the 40 in flight
    retry = gate.enter()
    assert retry == pytest.approx(0.05) and gate.refused == 1 and gate.inflight == 40
    for _ in range(25):
        gate.exit()
    assert gate.enter() is None  # 15 in flight < 20: admitted
    clock.t = 0.2
    gate.sample(0.05)  # still standing a whole interval later: cut again, from what is in flight
    assert gate.limit == 8
    while gate.limit is not None:  # the lag fell: the limit grows, then lifts
        gate.sample(0.001)
    assert gate.enter() is None


@given(lags=st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=200), arrivals=st.lists(st.integers(0, 50), max_size=200))
def test_the_loop_gate_never_cuts_below_its_floor_nor_refuses_under_it(lags, arrivals):
    from batching.overload_policy import LoopGate, LoopPolicy

    clock = Clock()
    gate = LoopGate(LoopPolicy(min_limit=8), clock)
    for i, lag in enumerate(lags):
        clock.t = i * 0.05
        gate.sample(lag)
        for _ in range(arrivals[i % len(arrivals)] if arrivals else 0):
            before = gate.inflight
            refused = gate.enter() is not None
            assert gate.limit is None or gate.limit >= 8
            assert not (refused and before < 8)
        while gate.inflight > 4:
            gate.exit()


# ---- the process's in-flight bound (LoopPolicy.ceiling, INFERPLANE_MAX_INFLIGHT) -------------


def test_the_in_flight_bound_refuses_past_it_with_the_time_to_drain_what_is_in_flight():
    from batching.overload_policy import LoopGate, LoopPolicy

    clock = Clock()
    gate = LoopGate(LoopPolicy(ceiling=4, rate_window_s=0.1), clock)
    for _ in range(4):
        assert gate.enter() is None
    assert gate.enter() == pytest.approx(0.001)  # nothing measured yet: the floor, never zero
    assert gate.refused == 1 and gate.inflight == 4  # a refusal holds nothing
    for i in range(40):  # 40 completions over 0.2 s, each slot refilled at once: 200 answers a second
        clock.t = (i + 1) * 0.005
        gate.exit()
        assert gate.enter() is None
    assert gate.rate == pytest.approx(200.0)
    assert gate.enter() == pytest.approx(4 / 200.0)  # 4 in flight at 200/s: 20 ms to drain
    gate.exit()
    assert gate.enter() is None  # a slot freed: admitted again


def test_an_idle_gap_is_not_read_as_a_slow_drain():
    from batching.overload_policy import LoopGate, LoopPolicy

    clock = Clock()
    gate = LoopGate(LoopPolicy(ceiling=2, rate_window_s=0.1), clock)
    clock.t = 100.0  # idle since the start
    assert gate.enter() is None  # busy from here: one request always in flight
    for i in range(20):
        assert gate.enter() is None
        clock.t += 0.01
        gate.exit()
    assert gate.rate == pytest.approx(100.0, rel=0.1)  # the window started at the first arrival, not at t=0


@given(steps=st.lists(st.tuples(st.sampled_from(["enter", "exit", "tick"]), st.floats(0.0, 0.5)), max_size=300),
       ceiling=st.integers(1, 16))  # fmt: skip
def test_in_flight_never_passes_the_bound_and_nothing_is_refused_under_it(steps, ceiling):
    from batching.overload_policy import MIN_RETRY_S, LoopGate, LoopPolicy

    clock = Clock()
    gate = LoopGate(LoopPolicy(ceiling=ceiling), clock)
    for op, dt in steps:
        clock.t += dt
        if op == "enter":
            before = gate.inflight
            retry = gate.enter()
            assert (retry is None) == (before < ceiling)  # refused exactly when full (no lag samples: no AIMD limit)
            assert retry is None or (MIN_RETRY_S <= retry < float("inf"))
        elif op == "exit" and gate.inflight:
            gate.exit()
        assert 0 <= gate.inflight <= ceiling


def test_a_models_queue_ttl_comes_from_its_config_parameter():
    from server.dataplane.pipeline import QUEUE_TTL_PARAMETER, model_overload
    from server.dataplane.signature import ModelSignature

    default = OverloadPolicy(queue_ttl_s=0.5)

    def sig(value: str | None) -> ModelSignature:
        return ModelSignature("m", 0, {}, {}, params={} if value is None else {QUEUE_TTL_PARAMETER: value})

    assert model_overload(sig("40"), default) == OverloadPolicy(queue_ttl_s=0.04)
    assert model_overload(sig(None), default) is default
    assert model_overload(sig("soon"), default) is default  # not a number: the default, with a warning
    assert model_overload(sig("0"), default) is default
