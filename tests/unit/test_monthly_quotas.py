"""Monthly quotas: requests and tokens per calendar month beside the rates, the refund of a request the
rates refuse, the remaining allowance as headers, a new month starting over — in this process, and in
a real Redis shared by two policies (two frontends' worth of state in one test process)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest

from server.errors import Overloaded
from server.tenancy.monthly_quotas import (
    REMAINING_REQUESTS, REMAINING_TOKENS, RESET, MemoryMonthlyCounter, MonthlyQuotas, QuotaTicket, RedisMonthlyCounter, month_of,
)  # fmt: skip
from server.tenancy.quota_policy import Quota, QuotaPolicy

DEC = datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
JAN = datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp()


def test_month_of():
    assert month_of(DEC + 5) == ("2026-12", JAN - DEC - 5)
    assert month_of(JAN)[0] == "2027-01"


async def _scenario(make):
    """``make(clock)`` -> a MonthlyQuotas; the same expectations for every counter."""
    now = [DEC + 86400]
    quotas = make(lambda: now[0])
    tenant = Quota(requests_month=3, tokens_month=100)
    tickets = []
    for left in (2, 1, 0):
        t = await quotas.admit("acme", "m", tenant)
        assert isinstance(t, QuotaTicket) and dict(t.headers)[REMAINING_REQUESTS] == str(left)
        assert dict(t.headers)[REMAINING_TOKENS] == "100" and int(dict(t.headers)[RESET]) == int(JAN - now[0])
        tickets.append(t)
    with pytest.raises(Overloaded, match="monthly quota of 3 requests used up") as err:
        await quotas.admit("acme", "m", tenant)
    assert err.value.retry_after_s == pytest.approx(JAN - now[0])
    # tokens: charged after the answer, may overdraw; the next admission is refused on tokens
    bigger = Quota(requests_month=10, tokens_month=100)
    await quotas.release(tickets[0], 150)
    with pytest.raises(Overloaded, match="100 tokens"):
        await quotas.admit("acme", "m", bigger)
    # the next month starts over
    now[0] = JAN + 1
    t = await quotas.admit("acme", "m", tenant)
    assert dict(t.headers)[REMAINING_REQUESTS] == "2"
    # a per-model monthly quota: the tightest remaining is the header
    t = await quotas.admit("acme", "m2", Quota(requests_month=50), Quota(requests_month=2))
    assert dict(t.headers)[REMAINING_REQUESTS] == "1"
    # a request the rates refuse is not charged to the month
    rated = Quota(rps=1, requests_month=100)
    first = await quotas.admit("globex", "m", rated)
    with pytest.raises(Overloaded, match="requests/s"):
        await quotas.admit("globex", "m", rated)
    now[0] += 1.0
    again = await quotas.admit("globex", "m", rated)
    assert dict(first.headers)[REMAINING_REQUESTS] == "99" and dict(again.headers)[REMAINING_REQUESTS] == "98"
    # no monthly limit: the rate policy's own ticket, no headers, no counter
    plain = await quotas.admit("plain", "m", Quota(rpm=10))
    assert not isinstance(plain, QuotaTicket)
    await quotas.release(plain, 5)


def test_monthly_quotas_in_this_process():
    asyncio.run(_scenario(lambda clock: MonthlyQuotas(QuotaPolicy(clock=clock), MemoryMonthlyCounter(), clock=clock)))


def test_monthly_quotas_in_redis_are_shared_by_two_frontends(redis_url):
    from server.tenancy.redis_quotas import RedisQuotaPolicy

    async def run():
        now = [DEC + 86400]
        made = []

        def make(clock):
            rates = RedisQuotaPolicy(redis_url, prefix="t-monthly-rate:", clock=clock)
            q = MonthlyQuotas(rates, RedisMonthlyCounter(rates.client), prefix="t-monthly:", clock=clock)
            made.append(q)
            return q

        await _scenario(make)
        # two frontends (two policies, two connections) over one Redis: one allowance
        a, b = make(lambda: now[0]), make(lambda: now[0])
        quota = Quota(requests_month=4)
        admitted = 0
        for policy in (a, b, a, b, a, b):
            try:
                await policy.admit("shared", "m", quota)
                admitted += 1
            except Overloaded:
                pass
        assert admitted == 4
        for q in made:
            await q.close()

    asyncio.run(run())
