"""Token-bucket quotas: exact counts over a window, retry hints, concurrency caps, token debt."""

import pytest

from server.errors import Overloaded
from server.quota_policy import Quota, QuotaPolicy


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _count_admitted(policy, n, tenant="a", model="m", q=Quota(), mq=None):
    ok = 0
    for _ in range(n):
        try:
            policy.release(policy.admit(tenant, model, q, mq))
            ok += 1
        except Overloaded:
            pass
    return ok


def test_rpm_admits_exactly_the_limit_in_a_burst_then_refills_at_limit_per_minute():
    clock = Clock()
    policy = QuotaPolicy(clock)
    q = Quota(rpm=60)
    assert _count_admitted(policy, 100, q=q) == 60
    clock.t += 10.0  # 10 s refill 10 requests
    assert _count_admitted(policy, 100, q=q) == 10
    clock.t += 60.0
    assert _count_admitted(policy, 100, q=q) == 60  # capped at capacity


def test_exact_count_over_a_window_of_steady_arrivals():
    clock = Clock()
    policy = QuotaPolicy(clock)
    q = Quota(rps=5)
    ok = 0
    for _ in range(1000):  # 100 req/s offered for 10 s
        ok += _count_admitted(policy, 1, q=q)
        clock.t += 0.01
    assert ok == 5 + 50 - 1 or ok == 5 + 50  # initial burst + 10 s x 5/s (boundary tick)


def test_refusal_carries_the_time_until_the_bucket_has_room():
    clock = Clock()
    policy = QuotaPolicy(clock)
    q = Quota(rps=2)
    policy.admit("a", "m", q)
    policy.admit("a", "m", q)
    with pytest.raises(Overloaded) as info:
        policy.admit("a", "m", q)
    assert info.value.retry_after_s == pytest.approx(0.5)
    assert "2 requests/s" in info.value.message
    clock.t += 0.5
    policy.admit("a", "m", q)


def test_a_refused_request_costs_nothing_in_the_other_buckets():
    clock = Clock()
    policy = QuotaPolicy(clock)
    q = Quota(rps=1, rpm=10)
    for _ in range(5):
        _count_admitted(policy, 3, q=q)  # 1 admitted, 2 refused by rps
        clock.t += 1.0
    # 5 admitted so far; the rpm bucket holds 10 - 5 + refill(5 s) = 5.83
    assert policy._scopes[("a", "")].buckets[1][0].refill(clock.t) == pytest.approx(10 - 5 + 5 / 6, abs=1e-6)


def test_tenant_and_tenant_model_limits_both_apply():
    clock = Clock()
    policy = QuotaPolicy(clock)
    tq, mq = Quota(rpm=10), Quota(rpm=3)
    assert _count_admitted(policy, 5, model="m1", q=tq, mq=mq) == 3
    assert _count_admitted(policy, 10, model="m2", q=tq, mq=mq) == 3
    assert _count_admitted(policy, 10, model="m3", q=tq) == 4  # the tenant's 10 are spent
    assert _count_admitted(policy, 10, tenant="b", model="m1", q=tq, mq=mq) == 3  # other tenants unaffected


def test_concurrency_cap():
    policy = QuotaPolicy(Clock())
    q = Quota(concurrency=2)
    t1 = policy.admit("a", "m", q)
    policy.admit("a", "m", q)
    with pytest.raises(Overloaded) as info:
        policy.admit("a", "m", q)
    assert info.value.retry_after_s > 0
    policy.release(t1)
    policy.admit("a", "m", q)
    assert policy.inflight("a") == 2


def test_tokens_per_minute_are_charged_after_the_answer_and_debt_delays_the_next():
    clock = Clock()
    policy = QuotaPolicy(clock)
    q = Quota(tpm=600)  # 10 tokens/s
    policy.release(policy.admit("a", "m", q), tokens=500)
    policy.release(policy.admit("a", "m", q), tokens=200)  # 100 tokens of debt
    with pytest.raises(Overloaded) as info:
        policy.admit("a", "m", q)
    assert info.value.retry_after_s == pytest.approx(10.0, rel=1e-3)
    assert "tokens/min" in info.value.message
    clock.t += 10.01
    policy.admit("a", "m", q)


def test_unlimited_costs_no_state_and_a_changed_quota_starts_fresh():
    clock = Clock()
    policy = QuotaPolicy(clock)
    assert policy.admit("a", "m", Quota()) == ()
    assert not policy._scopes
    assert _count_admitted(policy, 10, q=Quota(rpm=2)) == 2
    assert _count_admitted(policy, 10, q=Quota(rpm=5)) == 5


def test_quota_dict_round_trip():
    q = Quota(rps=1.5, tpm=1000, concurrency=4)
    assert Quota.from_dict(q.to_dict()) == q
    assert Quota.from_dict(None).unlimited
