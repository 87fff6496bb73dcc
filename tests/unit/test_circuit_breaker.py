"""Circuit breaker: consecutive failures open, open refuses with a hint, half-open probes close."""

import asyncio

import pytest

from server.dataplane.circuit_breaker import CLOSED, HALF_OPEN, OPEN, BreakerPolicy, BreakerSet, CircuitBreaker, counts_as_failure
from server.errors import BackendError, BackendUnavailable, Cancelled, DeadlineExceeded, InferplaneError, InvalidRequest


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


# ---- the rest of the contract (the mutation pass of circuit_breaker.py) ----------------------------


def test_the_default_policy_opens_after_five_failures_for_two_seconds_with_one_probe():
    clock = Clock()
    b = CircuitBreaker("t", clock=clock)
    _fail(b, 4)
    assert b.state == CLOSED
    _fail(b, 1)
    assert (b.state, b.opened_count) == (OPEN, 1)
    clock.t += 1.999
    with pytest.raises(BackendUnavailable) as err:
        b.before()
    assert err.value.message == "Triton replica t is failing; circuit open"
    clock.t += 0.001  # exactly open_s later: the probe goes
    b.before()
    assert b.state == HALF_OPEN
    with pytest.raises(BackendUnavailable) as err:
        b.before()
    assert err.value.message == "Triton replica t is being probed; circuit half-open" and err.value.retry_after_s == 0.1


def test_a_closed_circuit_counts_failures_from_zero_again():
    b, clock = _breaker(threshold=3)
    _fail(b, 3)
    clock.t += 2.0
    b.before()
    b.record(None)
    assert (b.state, b.failures) == (CLOSED, 0)
    _fail(b, 2)
    assert b.state == CLOSED  # two of three: the failures before the opening are forgotten
    _fail(b, 1)
    assert (b.state, b.opened_count) == (OPEN, 2)


def test_a_neutral_end_gives_back_only_a_probe_slot_that_was_taken():
    b, clock = _breaker(threshold=1, probes=2)
    _fail(b, 1)
    clock.t += 2.0
    b.before()
    b.neutral()
    b.neutral()  # a second neutral end frees nothing more: still two probes, not three
    b.before()
    b.before()
    with pytest.raises(BackendUnavailable):
        b.before()


@pytest.mark.parametrize(
    ("err", "counts"),
    [
        (BackendUnavailable("down"), True), (BackendError("boom"), True), (DeadlineExceeded("slow"), True),
        (RuntimeError("bug"), True), (OSError("reset"), True),
        (InferplaneError("generic"), False), (InvalidRequest("bad"), False), (Cancelled("gone"), False),
        (KeyboardInterrupt(), False), (SystemExit(), False), (GeneratorExit(), False), (asyncio.CancelledError(), False),
    ],
)  # fmt: skip
def test_only_errors_that_say_the_replica_is_sick_count(err, counts):
    assert counts_as_failure(err) is counts


def test_a_breaker_set_hands_out_one_breaker_per_replica_on_its_clock():
    clock = Clock()
    breakers = BreakerSet(BreakerPolicy(failure_threshold=1, open_s=5.0), clock)
    assert breakers["a"] is breakers["a"] and breakers["a"].name == "a"
    _fail(breakers["a"], 1)
    clock.t += 5.0
    breakers["a"].before()
    assert breakers.states() == {"a": HALF_OPEN}
