"""Circuit breaker: consecutive failures open, open refuses with a hint, half-open probes close."""

import pytest

from server.dataplane.circuit_breaker import CLOSED, HALF_OPEN, OPEN, BreakerPolicy, BreakerSet, CircuitBreaker
from server.errors import BackendUnavailable, Cancelled, InvalidRequest


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _breaker(threshold=3, open_s=2.0, probes=1):
    clock = Clock()
    return CircuitBreaker("triton-0", BreakerPolicy(threshold, open_s, probes), clock), clock


def _fail(b, n=1, err=BackendUnavailable("down")):
    for _ in range(n):
        b.before()
        b.record(err)


def test_consecutive_failures_open_and_a_success_resets_the_count():
    b, _ = _breaker()
    _fail(b, 2)
    b.before()
    b.record(None)
    _fail(b, 2)
    assert b.state == CLOSED
    _fail(b, 1)
    assert b.state == OPEN


def test_open_refuses_with_the_remaining_time_as_retry_hint():
    b, clock = _breaker()
    _fail(b, 3)
    clock.t += 0.5
    with pytest.raises(BackendUnavailable) as info:
        b.before()
    assert info.value.retry_after_s == pytest.approx(1.5)


def test_half_open_probe_success_closes_failure_reopens():
    b, clock = _breaker()
    _fail(b, 3)
    clock.t += 2.0
    b.before()  # the probe
    assert b.state == HALF_OPEN
    with pytest.raises(BackendUnavailable):
        b.before()  # only one probe at a time
    b.record(BackendUnavailable("still down"))
    assert b.state == OPEN and b.opened_count == 2
    clock.t += 2.0
    b.before()
    b.record(None)
    assert b.state == CLOSED
    b.before()


def test_caller_errors_and_cancellations_do_not_count():
    b, clock = _breaker(threshold=1)
    for err in (InvalidRequest("bad"), Cancelled("gone")):
        b.before()
        b.record(err)
    assert b.state == CLOSED
    _fail(b, 1)
    clock.t += 2.0
    b.before()
    b.record(Cancelled("gone"))  # the probe slot is given back
    b.before()
    b.record(None)
    assert b.state == CLOSED


def test_several_probes_must_all_succeed():
    b, clock = _breaker(threshold=1, probes=2)
    _fail(b, 1)
    clock.t += 2.0
    b.before()
    b.before()
    b.record(None)
    assert b.state == HALF_OPEN
    b.record(None)
    assert b.state == CLOSED


def test_one_breaker_per_replica():
    breakers = BreakerSet(BreakerPolicy(failure_threshold=1))
    breakers["a"].before()
    breakers["a"].record(BackendUnavailable("x"))
    breakers["b"].before()
    assert breakers.states() == {"a": OPEN, "b": CLOSED}
