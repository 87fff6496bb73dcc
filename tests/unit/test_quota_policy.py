"""Token-bucket quotas: exact counts over a window, retry hints, concurrency caps, token debt —
the same tests on the in-process policy and on the Redis one (its Lua scripts on a real
redis-server, ``redis_url`` in tests/conftest.py; skipped without one), with an injected clock."""

import asyncio
import time
import uuid

import grpc
import pytest

from server.errors import BackendUnavailable, Overloaded, grpc_status, http_error
from server.tenancy.quota_policy import Quota, QuotaPolicy


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture(params=["memory", "redis"])
async def make_policy(request):
    """``make_policy(clock)``: a fresh policy of the parameter's kind (Redis: its own key prefix)."""
    made = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None

    def make(clock):
        if url is None:
            return QuotaPolicy(clock)
        from server.tenancy.redis_quotas import RedisQuotaPolicy

        policy = RedisQuotaPolicy(url, prefix=f"test:{uuid.uuid4().hex}:", clock=clock)
        made.append(policy)
        return policy

    yield make
    for policy in made:
        await policy.close()


async def _count_admitted(policy, n, tenant="a", model="m", q=Quota(), mq=None):
    ok = 0
    for _ in range(n):
        try:
            await policy.release(await policy.admit(tenant, model, q, mq))
            ok += 1
        except Overloaded:
            pass
    return ok


async def test_rpm_admits_exactly_the_limit_in_a_burst_then_refills_at_limit_per_minute(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    q = Quota(rpm=60)
    assert await _count_admitted(policy, 100, q=q) == 60
    clock.t += 10.0  # 10 s refill 10 requests
    assert await _count_admitted(policy, 100, q=q) == 10
    clock.t += 60.0
    assert await _count_admitted(policy, 100, q=q) == 60  # capped at capacity


async def test_exact_count_over_a_window_of_steady_arrivals(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    q = Quota(rps=5)
    ok = 0
    for _ in range(1000):  # 100 req/s offered for 10 s
        ok += await _count_admitted(policy, 1, q=q)
        clock.t += 0.01
    assert ok == 5 + 50 - 1 or ok == 5 + 50  # initial burst + 10 s x 5/s (boundary tick)


async def test_refusal_carries_the_time_until_the_bucket_has_room(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    q = Quota(rps=2)
    await policy.admit("a", "m", q)
    await policy.admit("a", "m", q)
    with pytest.raises(Overloaded) as info:
        await policy.admit("a", "m", q)
    assert info.value.retry_after_s == pytest.approx(0.5)
    assert info.value.message == "tenant 'a': quota of 2 requests/s exceeded"
    clock.t += 0.5
    await policy.admit("a", "m", q)


async def test_the_hint_comes_from_the_fullest_blocking_bucket(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    q, mq = Quota(rps=10), Quota(rpm=1)
    await policy.admit("a", "m", q, mq)
    with pytest.raises(Overloaded) as info:  # rpm on the model scope blocks for 60 s, rps not at all
        await policy.admit("a", "m", q, mq)
    assert info.value.retry_after_s == pytest.approx(60.0)
    assert info.value.message == "tenant 'a' on model 'm': quota of 1 requests/min exceeded"


async def test_a_refused_request_costs_nothing_in_the_other_buckets(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    q = Quota(rps=1, rpm=10)
    for _ in range(5):
        assert await _count_admitted(policy, 3, q=q) == 1  # 1 admitted, 2 refused by rps
        clock.t += 1.0
    # had the 10 refusals been charged to rpm, it would be 5 in debt; it holds 10 - 5 + 5/6 + 1/6
    assert await _count_admitted(policy, 1, q=q) == 1
    with pytest.raises(Overloaded) as info:
        await policy.admit("a", "m", q)
    assert "1 requests/s" in info.value.message and info.value.retry_after_s == pytest.approx(1.0)


async def test_tenant_and_tenant_model_limits_both_apply(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    tq, mq = Quota(rpm=10), Quota(rpm=3)
    assert await _count_admitted(policy, 5, model="m1", q=tq, mq=mq) == 3
    assert await _count_admitted(policy, 10, model="m2", q=tq, mq=mq) == 3
    assert await _count_admitted(policy, 10, model="m3", q=tq) == 4  # the tenant's 10 are spent
    assert await _count_admitted(policy, 10, tenant="b", model="m1", q=tq, mq=mq) == 3  # other tenants unaffected


async def test_concurrency_cap(make_policy):
    policy = make_policy(Clock())
    q = Quota(concurrency=2)
    t1 = await policy.admit("a", "m", q)
    await policy.admit("a", "m", q)
    with pytest.raises(Overloaded) as info:
        await policy.admit("a", "m", q)
    assert info.value.retry_after_s == pytest.approx(0.05)
    assert info.value.message == "tenant 'a': 2 concurrent requests in flight"
    await policy.release(t1)
    await policy.admit("a", "m", q)
    with pytest.raises(Overloaded):  # two in flight again
        await policy.admit("a", "m", q)


async def test_tokens_per_minute_are_charged_after_the_answer_and_debt_delays_the_next(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    q = Quota(tpm=600)  # 10 tokens/s
    await policy.release(await policy.admit("a", "m", q), tokens=500)
    await policy.release(await policy.admit("a", "m", q), tokens=200)  # 100 tokens of debt
    with pytest.raises(Overloaded) as info:
        await policy.admit("a", "m", q)
    assert info.value.retry_after_s == pytest.approx(10.0, rel=1e-3)
    assert info.value.message == "tenant 'a': quota of 600 tokens/min exceeded"
    clock.t += 10.01
    await policy.admit("a", "m", q)


async def test_a_changed_quota_starts_fresh_and_keeps_counting_requests_in_flight(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    assert await _count_admitted(policy, 10, q=Quota(rpm=2)) == 2
    assert await _count_admitted(policy, 10, q=Quota(rpm=5)) == 5
    held = await policy.admit("a", "m", Quota(concurrency=1, tpm=100))
    with pytest.raises(Overloaded):
        await policy.admit("a", "m", Quota(concurrency=1, rpm=50))  # another quota, the same request in flight
    await policy.release(held)
    await policy.release(await policy.admit("a", "m", Quota(concurrency=1, rpm=50)))


async def test_two_policies_on_one_store_share_the_buckets(redis_url):
    """Two frontend processes: each admits from the same buckets (the in-memory policy cannot)."""
    from server.tenancy.redis_quotas import RedisQuotaPolicy

    clock = Clock()
    prefix = f"test:{uuid.uuid4().hex}:"
    one, two = (RedisQuotaPolicy(redis_url, prefix=prefix, clock=clock) for _ in range(2))
    try:
        q = Quota(rpm=7, concurrency=3)
        assert sum([await _count_admitted(p, 5, q=q) for p in (one, two)]) == 7
        clock.t += 60.0
        held = [await p.admit("a", "m", q) for p in (one, two, one)]
        with pytest.raises(Overloaded, match="3 concurrent"):
            await two.admit("a", "m", q)
        await two.release(held[0])  # a ticket is released wherever the request ends
        await two.admit("a", "m", q)
    finally:
        await one.close()
        await two.close()


# ---- only one of the two ------------------------------------------------------------------------


async def test_unlimited_costs_no_state_in_memory():
    policy = QuotaPolicy(Clock())
    assert await policy.admit("a", "m", Quota()) == ()
    assert not policy._scopes


async def _redis_policy(redis_url, **kwargs):
    from server.tenancy.redis_quotas import RedisQuotaPolicy

    return RedisQuotaPolicy(redis_url, prefix=f"test:{uuid.uuid4().hex}:", **kwargs)


async def test_redis_unlimited_touches_nothing_and_idle_scopes_expire(redis_url):
    clock = Clock()
    policy = await _redis_policy(redis_url, clock=clock, keep_s=60.0)
    try:
        assert await policy.admit("a", "m", Quota(), Quota()) == ()
        assert await policy.client.keys(policy.prefix + "*") == []
        ticket = await policy.admit("a", "m", Quota(rpm=60), Quota(concurrency=2))
        scope, inflight = policy._keys("a", "")
        model_scope, model_inflight = policy._keys("a", "m")
        assert sorted(await policy.client.keys(policy.prefix + "*")) == sorted(k.encode() for k in (scope, model_scope, model_inflight))
        # the rpm bucket is full again 1 s after one request: it expires after that plus keep_s
        assert 51_000 < await policy.client.pttl(scope) <= 61_000
        assert 600_000 < await policy.client.pttl(model_inflight) <= 660_000  # the lease, plus keep_s
        await policy.release(ticket, tokens=5)  # no token quota: only the slot is freed
        assert await policy.client.zcard(model_inflight) == 0
        await policy.release(await policy.admit("a", "m", Quota(tpm=60)), tokens=120)  # 2 min of debt
        assert 170_000 < await policy.client.pttl(scope) <= 180_000
    finally:
        await policy.close()


async def test_redis_a_lease_frees_the_slot_of_a_process_that_died(redis_url):
    clock = Clock()
    dead = await _redis_policy(redis_url, clock=clock, lease_s=30.0)
    alive = type(dead)(redis_url, prefix=dead.prefix, clock=clock, lease_s=30.0)
    try:
        q = Quota(concurrency=1)
        await dead.admit("a", "m", q)  # never released
        with pytest.raises(Overloaded):
            await alive.admit("a", "m", q)
        clock.t += 30.0
        await alive.admit("a", "m", q)
    finally:
        await dead.close()
        await alive.close()


async def test_redis_uses_its_own_clock_when_none_is_injected(redis_url):
    policy = await _redis_policy(redis_url)
    try:
        q = Quota(rpm=3)
        started = time.monotonic()
        assert await _count_admitted(policy, 10, q=q) == 3
        with pytest.raises(Overloaded) as info:
            await policy.admit("a", "m", q)
        elapsed = time.monotonic() - started
        # one request refills in 20 s: the hint is 20 s less what Redis's clock saw pass since the bucket was made
        # (at most what this test measured around it, however slow the machine; 0.05 s for the two clocks)
        assert 20.0 - elapsed - 0.05 <= info.value.retry_after_s <= 20.0
    finally:
        await policy.close()


async def test_redis_unreachable_refuses_admission_as_unavailable():
    from server.tenancy.redis_quotas import RedisQuotaPolicy
    from server.runtime.supervisor import free_port

    policy = RedisQuotaPolicy(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    try:
        with pytest.raises(BackendUnavailable) as info:
            await policy.admit("a", "m", Quota(rpm=1))
        assert info.value.retry_after_s == 1.0
        assert await policy.admit("a", "m", Quota()) == ()  # no quota: Redis is not asked
    finally:
        await policy.close()


async def test_a_cancelled_release_still_frees_the_slot(redis_url):
    policy = await _redis_policy(redis_url, clock=Clock())
    try:
        q = Quota(concurrency=1)
        ticket = await policy.admit("a", "m", q)
        task = asyncio.create_task(policy.release(ticket))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the shielded script finishes on its own
            if await policy.client.zcard(policy._keys("a", "")[1]) == 0:
                break
            await asyncio.sleep(0.01)
        await policy.admit("a", "m", q)
    finally:
        await policy.close()


def test_quota_dict_round_trip():
    q = Quota(rps=1.5, tpm=1000, concurrency=4)
    assert Quota.from_dict(q.to_dict()) == q
    assert Quota.from_dict(None).unlimited


def test_monthly_limits_survive_the_stored_form_under_their_own_names():
    q = Quota(rps=2, requests_month=10_000, tokens_month=5_000_000)
    assert q.to_dict() == {"rps": 2, "requests_month": 10_000, "tokens_month": 5_000_000}
    back = Quota.from_dict({"requests_month": "10000", "tokens_month": 5_000_000.0})  # a stored row's JSON
    assert (back.requests_month, back.tokens_month) == (10_000, 5_000_000)
    assert type(back.requests_month) is int and type(back.tokens_month) is int
    assert Quota.from_dict({"requests_month": 7}) == Quota(requests_month=7)


# ---- the in-process policy's edges (the mutation pass of quota_policy.py) ---------------------------------


async def _refused(policy, *args) -> Overloaded:
    with pytest.raises(Overloaded) as err:
        await policy.admit(*args)
    return err.value


async def test_refusals_are_counted_one_each():
    policy = QuotaPolicy(Clock())
    assert policy.refused == 0
    await policy.admit("a", "m", Quota(rps=1))
    for n in (1, 2):
        await _refused(policy, "a", "m", Quota(rps=1))
        assert policy.refused == n


async def test_requests_in_flight_are_counted_per_tenant_and_per_model():
    policy = QuotaPolicy(Clock())
    assert policy.inflight("a") == 0 and policy.inflight("a", "m") == 0
    ticket = await policy.admit("a", "m", Quota(concurrency=5), Quota(concurrency=5))
    await policy.admit("a", "other", Quota(concurrency=5))
    assert (policy.inflight("a"), policy.inflight("a", "m"), policy.inflight("a", "other"), policy.inflight("b")) == (2, 1, 0, 0)
    await policy.release(ticket)
    assert (policy.inflight("a"), policy.inflight("a", "m")) == (1, 0)


async def test_on_a_tie_the_tenants_own_limit_is_named():
    policy = QuotaPolicy(Clock())
    await policy.admit("a", "m", Quota(rps=1), Quota(rps=1))
    assert (await _refused(policy, "a", "m", Quota(rps=1), Quota(rps=1))).message == "tenant 'a': quota of 1 requests/s exceeded"
    both_full = QuotaPolicy(Clock())
    await both_full.admit("a", "m", Quota(concurrency=1), Quota(concurrency=1))
    err = await _refused(both_full, "a", "m", Quota(concurrency=1), Quota(concurrency=1))
    assert err.message == "tenant 'a': 1 concurrent requests in flight" and err.retry_after_s == 0.05


async def test_a_token_bucket_blocks_at_zero_and_admits_with_any_tokens_left():
    clock = Clock()
    policy = QuotaPolicy(clock)
    q = Quota(tpm=60)
    await policy.release(await policy.admit("a", "m", q), tokens=59.5)
    await policy.release(await policy.admit("a", "m", q), tokens=0.5)  # 0.5 left: admitted, now exactly 0
    err = await _refused(policy, "a", "m", q)
    assert err.message == "tenant 'a': quota of 60 tokens/min exceeded" and err.retry_after_s == pytest.approx(1e-9)
    clock.t += 1.0  # one token refilled
    await policy.release(await policy.admit("a", "m", q))


async def test_token_debt_on_both_scopes_names_the_tenant():
    policy = QuotaPolicy(Clock())
    q = Quota(tpm=60)
    await policy.release(await policy.admit("a", "m", q, q), tokens=61)
    err = await _refused(policy, "a", "m", q, q)
    assert err.message == "tenant 'a': quota of 60 tokens/min exceeded" and err.retry_after_s == pytest.approx(1.0)


async def test_a_release_without_tokens_charges_none_and_a_scope_without_a_token_limit_ignores_them():
    policy = QuotaPolicy(Clock())
    for _ in range(3):
        await policy.release(await policy.admit("a", "m", Quota(tpm=1)))  # no tokens used: never in debt
    await policy.release(await policy.admit("a", "m", Quota(rps=100)), tokens=5)
    assert policy.inflight("a") == 0


@pytest.mark.parametrize(
    "quota, message",
    [
        (Quota(rps=0), "tenant 'a': quota of 0 requests/s exceeded"),
        (Quota(rpm=0), "tenant 'a': quota of 0 requests/min exceeded"),
        (Quota(rps=5, rpm=0), "tenant 'a': quota of 0 requests/min exceeded"),
        (Quota(tpm=0), "tenant 'a': quota of 0 tokens/min exceeded"),
    ],
)
async def test_a_quota_of_zero_admits_no_request_not_even_the_first_and_hints_no_retry(make_policy, quota, message):
    """A limit of 0 is "nothing": the very first request is refused, and so is every later one, however
    long the caller waits (the bucket never refills), so the refusal carries no retry hint to wait for."""
    clock = Clock()
    policy = make_policy(clock)
    for _ in range(3):
        err = await _refused(policy, "a", "m", quota)
        assert err.message == message and err.retry_after_s is None
        clock.t += 3600.0


async def test_a_zero_quota_refusal_is_answered_as_resource_exhausted_and_429_without_a_retry_hint():
    """What callers read for a limit of 0: the quota's status on both transports, and no hint to wait."""
    err = await _refused(QuotaPolicy(Clock()), "a", "m", Quota(rps=0))
    status = grpc_status(err)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry-after" not in {k for k, _ in status.trailing_metadata}
    code, body, headers = http_error(err)
    assert code == 429 and "Retry-After" not in headers and "quota of 0 requests/s" in body["error"]


async def test_a_model_quota_of_zero_refuses_that_model_only(make_policy):
    policy = make_policy(Clock())
    err = await _refused(policy, "a", "m", Quota(rps=10), Quota(rps=0))
    assert err.message == "tenant 'a' on model 'm': quota of 0 requests/s exceeded" and err.retry_after_s is None
    await policy.release(await policy.admit("a", "other", Quota(rps=10), Quota(rps=1)))


async def test_a_fractional_rate_still_admits_one_whole_request_from_a_full_bucket(make_policy):
    clock = Clock()
    policy = make_policy(clock)
    await policy.release(await policy.admit("a", "m", Quota(rps=0.5)))
    assert (await _refused(policy, "a", "m", Quota(rps=0.5))).retry_after_s == pytest.approx(2.0)
    clock.t += 2.0
    await policy.release(await policy.admit("a", "m", Quota(rps=0.5)))


async def test_any_positive_token_level_admits():
    policy = QuotaPolicy(Clock())
    q = Quota(tpm=60)
    await policy.release(await policy.admit("a", "m", q), tokens=60 - 5e-10)  # a sliver of a token left
    await policy.release(await policy.admit("a", "m", q))
