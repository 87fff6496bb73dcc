"""Monthly allowances (requests and tokens per calendar month, UTC) beside the per-minute rates.

:class:`MonthlyQuotas` wraps a rate policy (``QuotaPolicy`` or ``RedisQuotaPolicy``) behind the same
contract, ``await admit(...)`` then ``await release(ticket, tokens)``:

- admission charges one request to this month's counter of each scope with a monthly limit (the
  tenant, and the tenant x model) — refused with ``RESOURCE_EXHAUSTED`` / 429 once a scope has used its
  requests, or its tokens, and told to retry when the month turns — then asks the rate policy; a request
  the rate policy refuses is refunded, so a refusal costs nothing;
- the answer's tokens are added to the counters after it (like the token rate: a request is admitted
  while the month has tokens left, its tokens may then overdraw them);
- the ticket carries the remaining allowance as headers (``x-ratelimit-remaining-requests-month``,
  ``x-ratelimit-remaining-tokens-month``, ``x-ratelimit-reset-month`` in seconds), which the transports
  send with the answer (gRPC trailing metadata, HTTP headers).

Counters live in Redis when ``redis_url`` is set (:class:`RedisMonthlyCounter`: one Lua script per
admission, atomic, shared by every frontend; a hash per scope and month, expiring a week after the
month ends), else in this process (:class:`MemoryMonthlyCounter`). The month is the frontend's UTC
clock's. A tenant without monthly limits never reaches the counters.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from server.errors import BackendUnavailable, Overloaded
from server.tenancy.quota_policy import Quota, scope_labels

log = logging.getLogger(__name__)

REMAINING_REQUESTS = "x-ratelimit-remaining-requests-month"
REMAINING_TOKENS = "x-ratelimit-remaining-tokens-month"
RESET = "x-ratelimit-reset-month"
KEEP_S = 7 * 86400.0  # a month's counters outlive it by a week (to read them back)
DEFAULT_PREFIX = "inferplane:month:"


def month_of(now: float) -> tuple[str, float]:
    """(``YYYY-MM``, seconds until the next month starts), UTC."""
    dt = datetime.fromtimestamp(now, tz=timezone.utc)
    days = calendar.monthrange(dt.year, dt.month)[1]
    start = datetime(dt.year, dt.month, 1, tzinfo=timezone.utc).timestamp()
    return f"{dt.year:04d}-{dt.month:02d}", start + days * 86400.0 - now


def rates_only(quota: Quota | None) -> Quota | None:
    if quota is None or (quota.requests_month is None and quota.tokens_month is None):
        return quota
    return replace(quota, requests_month=None, tokens_month=None)


@dataclass(frozen=True, slots=True)
class QuotaTicket:
    rate: object  # the rate policy's ticket
    keys: tuple[str, ...]  # this month's counter of each scope charged
    headers: tuple[tuple[str, str], ...]  # the remaining allowance, for the answer


class MemoryMonthlyCounter:
    """This process's counters: key -> [requests, tokens]."""

    def __init__(self):
        self._counts: dict[str, list[int]] = {}

    async def charge(self, keys: list[str], limits: list[tuple[int | None, int | None]], ttl_s: float) -> tuple:
        """Charge a request to every key, or none: (0, index, kind) refused, (1, [(req_left, tok_left)...]) admitted."""
        counts = [self._counts.setdefault(k, [0, 0]) for k in keys]
        for i, ((requests, tokens), (req_limit, tok_limit)) in enumerate(zip(counts, limits)):
            if req_limit is not None and requests >= req_limit:
                return 0, i, "requests"
            if tok_limit is not None and tokens >= tok_limit:
                return 0, i, "tokens"
        for c in counts:
            c[0] += 1
        return 1, [(None if rl is None else rl - c[0], None if tl is None else tl - c[1]) for c, (rl, tl) in zip(counts, limits)]

    async def add(self, keys: tuple[str, ...], requests: int, tokens: int, ttl_s: float) -> None:
        for k in keys:
            c = self._counts.setdefault(k, [0, 0])
            c[0] += requests
            c[1] += tokens

    async def close(self) -> None:
        return None


# KEYS: this month's hash of each scope. ARGV: ttl_ms, then per scope: request limit, token limit ('' = none).
# Returns {0, scope index (1-based), kind} (refused, nothing charged) or {1, req_left, tok_left, ...} ('' = none).
_CHARGE = """
local ttl = ARGV[1]
local counts = {}
for i, key in ipairs(KEYS) do
  local c = redis.call('HMGET', key, 'r', 't')
  local r, t = tonumber(c[1]) or 0, tonumber(c[2]) or 0
  local rl, tl = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  if rl and r >= rl then return {0, i, 'requests'} end
  if tl and t >= tl then return {0, i, 'tokens'} end
  counts[i] = {r, t, rl, tl}
end
local out = {1}
for i, key in ipairs(KEYS) do
  local r = redis.call('HINCRBY', key, 'r', 1)
  redis.call('PEXPIRE', key, ttl)
  local c = counts[i]
  table.insert(out, c[3] and tostring(c[3] - r) or '')
  table.insert(out, c[4] and tostring(c[4] - c[2]) or '')
end
return out
"""
_ADD = """
for _, key in ipairs(KEYS) do
  if ARGV[1] ~= '0' then redis.call('HINCRBY', key, 'r', ARGV[1]) end
  if ARGV[2] ~= '0' then redis.call('HINCRBY', key, 't', ARGV[2]) end
  redis.call('PEXPIRE', key, ARGV[3])
end
return 1
"""


class RedisMonthlyCounter:
    """The counters in Redis, shared by every frontend process (and host)."""

    def __init__(self, client):
        self.client = client  # redis.asyncio.Redis (the rate policy's connection)
        self._charge = client.register_script(_CHARGE)
        self._add = client.register_script(_ADD)

    async def charge(self, keys: list[str], limits: list[tuple[int | None, int | None]], ttl_s: float) -> tuple:
        from redis.exceptions import RedisError

        args = [str(int(ttl_s * 1000))] + [("" if v is None else str(int(v))) for pair in limits for v in pair]
        try:
            answer = await self._charge(keys=keys, args=args)
        except RedisError as err:
            raise BackendUnavailable(f"the quota store (Redis) is unreachable: {err}", retry_after_s=1.0) from None
        if int(answer[0]) != 1:
            kind = answer[2].decode() if isinstance(answer[2], bytes) else str(answer[2])
            return 0, int(answer[1]) - 1, kind
        values = [v.decode() if isinstance(v, bytes) else str(v) for v in answer[1:]]
        ints = [None if v == "" else int(v) for v in values]
        return 1, list(zip(ints[0::2], ints[1::2]))

    async def add(self, keys: tuple[str, ...], requests: int, tokens: int, ttl_s: float) -> None:
        await self._add(keys=list(keys), args=[str(int(requests)), str(int(tokens)), str(int(ttl_s * 1000))])

    async def close(self) -> None:
        return None  # the connection is the rate policy's


class MonthlyQuotas:
    """A rate policy plus monthly allowances. ``await admit`` then ``await release``."""

    def __init__(self, rate, counter, *, prefix: str = DEFAULT_PREFIX, clock: Callable[[], float] = time.time):
        self.rate = rate
        self.counter = counter
        self.prefix = prefix
        self._clock = clock

    @property
    def refused(self) -> int:
        return self.rate.refused

    async def close(self) -> None:
        await self.counter.close()
        close = getattr(self.rate, "close", None)
        if close is not None:
            await close()

    async def admit(self, tenant: str, model: str, tenant_quota: Quota, model_quota: Quota | None = None):
        tenant_label, model_label = scope_labels(tenant, model)
        scopes = [(label, q, m) for label, q, m in ((tenant_label, tenant_quota, ""), (model_label, model_quota, model))
                  if q is not None and (q.requests_month is not None or q.tokens_month is not None)]  # fmt: skip
        if not scopes:
            return await self.rate.admit(tenant, model, rates_only(tenant_quota), rates_only(model_quota))
        month, reset_s = month_of(self._clock())
        ttl_s = reset_s + KEEP_S
        keys = [f"{self.prefix}{{{tenant}}}/{m}/{month}" for _, _, m in scopes]
        answer = await self.counter.charge(keys, [(q.requests_month, q.tokens_month) for _, q, _ in scopes], ttl_s)
        if answer[0] != 1:
            label, quota, _ = scopes[answer[1]]
            limit = quota.requests_month if answer[2] == "requests" else quota.tokens_month
            raise Overloaded(f"{label}: monthly quota of {limit:g} {answer[2]} used up (it resets at the start of next month, UTC)", retry_after_s=reset_s)
        try:
            rate_ticket = await self.rate.admit(tenant, model, rates_only(tenant_quota), rates_only(model_quota))
        except BaseException:
            await self.counter.add(tuple(keys), -1, 0, ttl_s)  # refused by the rates: the month is not charged
            raise
        requests_left = [r for r, _ in answer[1] if r is not None]
        tokens_left = [t for _, t in answer[1] if t is not None]
        headers = [(RESET, str(int(reset_s)))]
        if requests_left:
            headers.append((REMAINING_REQUESTS, str(max(0, min(requests_left)))))
        if tokens_left:
            headers.append((REMAINING_TOKENS, str(max(0, min(tokens_left)))))
        return QuotaTicket(rate_ticket, tuple(keys), tuple(headers))

    async def release(self, ticket, tokens: float = 0.0) -> None:
        if isinstance(ticket, QuotaTicket):
            if tokens:
                _, reset_s = month_of(self._clock())
                try:
                    await self.counter.add(ticket.keys, 0, int(tokens), reset_s + KEEP_S)
                except Exception as err:  # the answer is out already; the month undercounts these tokens
                    log.warning("adding %d tokens to the monthly quota failed (%s)", int(tokens), err)
            ticket = ticket.rate
        await self.rate.release(ticket, tokens)
