"""Quotas shared by every frontend process: :class:`QuotaPolicy`'s token buckets kept in Redis.

With ``--workers N`` (or several hosts) an in-process policy lets each process admit the whole
quota, so a tenant gets N times its limit. Here every decision is one Lua script run atomically
inside Redis — one per admit, one per release — over the same buckets with the same semantics
(server.tenancy.quota_policy): burst = limit, continuous refill, a refused request costs nothing, tokens
charged after the answer possibly into debt, concurrency counted in flight, the refusal's
``retry_after_s`` from the fullest blocking bucket, the same messages.

State per scope (tenant, and tenant x model): a hash ``{prefix}{tenant}/{model}`` with the quota
it was built under (``q``; another quota starts the buckets over, full) and each bucket's level and
refill stamp, which expires once every bucket would be full again (plus ``keep_s``) — an idle
tenant costs nothing, and an expired scope is exactly a full one; and, when the quota caps
concurrency, a sorted set ``…/inflight`` of the tickets in flight, scored by when their lease ends
(``lease_s``, 10 min): a frontend that dies holding tickets frees those slots when their leases end
instead of never (a request running longer than its lease stops counting). The tenant name is the
key's hash tag, so both scopes of a request live in one Redis Cluster slot.

Time is Redis's own clock (``TIME`` inside the script), the same for every process and host; tests
inject a clock, whose readings are passed to the scripts instead. A tenant without quotas never
reaches Redis, nor does the release of a request that holds no concurrency slot and used no tokens
of a token quota. When Redis cannot be reached, admission fails closed (``UNAVAILABLE`` with a retry
hint); a failed release is logged (its slot frees when its lease ends).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from server.errors import BackendUnavailable
from server.tenancy.quota_policy import Quota, refused, scope_labels

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "inferplane:quota:"

# Shared by both scripts: the clock, and numbers written back exactly.
_PRELUDE = """
local function now_s()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
local function expire_after(key, seconds)
  local ms = math.ceil(math.min(seconds, 86400) * 1000)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, string.format('%d', ms)) end
end
"""

# KEYS: per scope, its hash then its in-flight set.
# ARGV: now ('' = Redis TIME), ticket, lease_s, keep_s, then per scope: rps, rpm, tpm, concurrency ('' = none).
# Returns {1} (admitted, charged) or {0, wait_s, scope index (1-based), kind} (refused, nothing charged).
_ADMIT = (
    _PRELUDE
    + """
local now = now_s()
local ticket, lease, keep = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local kinds = {'rps', 'rpm', 'tpm'}
local wait, blocked, blocked_kind = 0, 0, ''
local scopes = {}
for i = 1, #KEYS / 2 do
  local a = 4 + (i - 1) * 4
  local s = {h = KEYS[2 * i - 1], z = KEYS[2 * i], buckets = {}, conc = tonumber(ARGV[a + 4])}
  s.sig = ARGV[a + 1] .. '/' .. ARGV[a + 2] .. '/' .. ARGV[a + 3] .. '/' .. ARGV[a + 4]
  local stored = redis.call('HMGET', s.h, 'q', 'rps', 'rps_t', 'rpm', 'rpm_t', 'tpm', 'tpm_t')
  s.fresh = stored[1] ~= s.sig  -- new, expired, or its quota changed: the buckets start full
  if s.conc then
    redis.call('ZREMRANGEBYSCORE', s.z, '-inf', fmt(now))  -- leases that ended
    if redis.call('ZCARD', s.z) >= s.conc and wait < 0.05 then
      wait, blocked, blocked_kind = 0.05, i, 'concurrency'
    end
  end
  for j, kind in ipairs(kinds) do
    local limit = tonumber(ARGV[a + j])
    if limit then
      local cap, rate = limit, limit / 60
      if kind == 'rps' then rate = limit end
      if kind ~= 'tpm' then cap = limit > 0 and math.max(limit, 1) or 0 end  -- request_capacity
      local level, stamp = cap, now
      if not s.fresh then
        level = tonumber(stored[2 * j]) or cap
        stamp = tonumber(stored[2 * j + 1]) or now
      end
      if now > stamp then
        level = math.min(cap, level + (now - stamp) * rate)
        stamp = now
      end
      local w = 0
      if kind == 'tpm' then
        if level <= 0 then w = (1e-9 - level) / rate end
      elseif level < 1 then
        w = (1 - level) / rate
      end
      if w > wait then wait, blocked, blocked_kind = w, i, kind end
      table.insert(s.buckets, {kind, level, stamp, cap, rate, limit})
    end
  end
  scopes[i] = s
end
if wait > 0 then return {0, fmt(wait), blocked, blocked_kind} end
for _, s in ipairs(scopes) do
  if s.fresh then redis.call('DEL', s.h) end
  local fields, full_in = {'q', s.sig}, 0
  for _, b in ipairs(s.buckets) do
    local kind, level, stamp, cap, rate = b[1], b[2], b[3], b[4], b[5]
    if kind ~= 'tpm' then level = level - 1 else table.insert(fields, 'tq'); table.insert(fields, fmt(b[6])) end
    table.insert(fields, kind); table.insert(fields, fmt(level))
    table.insert(fields, kind .. '_t'); table.insert(fields, fmt(stamp))
    full_in = math.max(full_in, (cap - level) / rate)
  end
  redis.call('HSET', s.h, unpack(fields))
  expire_after(s.h, full_in + keep)
  if s.conc then
    redis.call('ZADD', s.z, fmt(now + lease), ticket)
    expire_after(s.z, lease + keep)
  end
end
return {1}
"""
)

# KEYS: per scope, its hash then its in-flight set.
# ARGV: now ('' = Redis TIME), ticket, tokens, keep_s, then per scope: the quota signature and tpm
# it was admitted under ('' = none) — used only when the scope expired while the request ran.
_RELEASE = (
    _PRELUDE
    + """
local now = now_s()
local ticket, tokens, keep = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 1, #KEYS / 2 do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('ZREM', z, ticket)
  if tokens > 0 then
    local stored = redis.call('HMGET', h, 'q', 'tq', 'tpm', 'tpm_t')
    local limit, level, stamp
    if stored[1] then  -- the scope as it is now (its quota may have changed since admission)
      limit, level, stamp = tonumber(stored[2]), tonumber(stored[3]), tonumber(stored[4])
    else  -- expired while the request ran, so full: start it over under the ticket's quota
      limit = tonumber(ARGV[4 + 2 * i])
      if limit then redis.call('HSET', h, 'q', ARGV[3 + 2 * i]) end
    end
    if limit then
      local cap, rate = limit, limit / 60
      level, stamp = level or cap, stamp or now
      if now > stamp then
        level = math.min(cap, level + (now - stamp) * rate)
        stamp = now
      end
      level = level - tokens
      redis.call('HSET', h, 'tq', fmt(limit), 'tpm', fmt(level), 'tpm_t', fmt(stamp))
      expire_after(h, (cap - level) / rate + keep)
    end
  end
end
return 1
"""
)


def _arg(value) -> str:
    return "" if value is None else repr(float(value))


def _quota_args(quota: Quota) -> list[str]:
    return [_arg(quota.rps), _arg(quota.rpm), _arg(quota.tpm), "" if quota.concurrency is None else str(int(quota.concurrency))]


@dataclass(frozen=True, slots=True)
class _Ticket:
    ticket: str
    keys: tuple[str, ...]  # per scope: hash, in-flight set
    scopes: tuple[tuple[str, str], ...]  # per scope: the quota signature and tpm it was admitted under
    holds_slot: bool  # some scope caps concurrency
    counts_tokens: bool  # some scope has a token quota


class RedisQuotaPolicy:
    """Per-tenant and per-(tenant, model) limits in Redis. ``await admit`` then ``await release``."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        lease_s: float = 600.0,
        keep_s: float = 60.0,
        timeout_s: float = 1.0,
        clock: Callable[[], float] | None = None,
    ):
        from redis import asyncio as aioredis

        self.client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix
        self.lease_s = lease_s
        self.keep_s = keep_s
        self._clock = clock
        self._admit = self.client.register_script(_ADMIT)
        self._release = self.client.register_script(_RELEASE)
        self._ids = itertools.count()
        self._process = os.urandom(6).hex()  # tickets unique across processes and hosts
        self.refused = 0

    async def close(self) -> None:
        await self.client.aclose()

    def _now(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _keys(self, tenant: str, model: str) -> tuple[str, str]:
        scope = f"{self.prefix}{{{tenant}}}/{model}"
        return scope, scope + "/inflight"

    async def admit(self, tenant: str, model: str, tenant_quota: Quota, model_quota: Quota | None = None) -> _Ticket | tuple:
        """Charge one request to the tenant's and the tenant x model's limits, or raise Overloaded.

        Returns a ticket to hand to :meth:`release` when the request is answered.
        """
        from redis.exceptions import RedisError

        scopes = []
        tenant_label, model_label = scope_labels(tenant, model)
        if not tenant_quota.unlimited:
            scopes.append((tenant_label, tenant_quota, ""))
        if model_quota is not None and not model_quota.unlimited:
            scopes.append((model_label, model_quota, model))
        if not scopes:
            return ()
        ticket = f"{self._process}-{next(self._ids)}"
        keys: list[str] = []
        args = [self._now(), ticket, repr(float(self.lease_s)), repr(float(self.keep_s))]
        signatures = []
        for _, quota, scope_model in scopes:
            keys.extend(self._keys(tenant, scope_model))
            quota_args = _quota_args(quota)
            args.extend(quota_args)
            signatures.append(("/".join(quota_args), quota_args[2]))
        try:
            answer = await self._admit(keys=keys, args=args)
        except RedisError as err:
            raise BackendUnavailable(f"the quota store (Redis) is unreachable: {err}", retry_after_s=1.0) from None
        if int(answer[0]) != 1:
            self.refused += 1
            label, quota, _ = scopes[int(answer[2]) - 1]
            kind = answer[3].decode() if isinstance(answer[3], bytes) else str(answer[3])
            wait = float(answer[1].decode() if isinstance(answer[1], bytes) else answer[1])
            raise refused(label, quota, kind, wait)
        return _Ticket(
            ticket, tuple(keys), tuple(signatures),
            holds_slot=any(q.concurrency is not None for _, q, _ in scopes),
            counts_tokens=any(q.tpm is not None for _, q, _ in scopes),
        )  # fmt: skip

    async def release(self, ticket: _Ticket | tuple, tokens: float = 0.0) -> None:
        """The request was answered: free its concurrency slot, charge the tokens it used.

        Finishes even when the caller is cancelled meanwhile (a lost release would hold a slot
        until its lease ends)."""
        if not ticket or not (ticket.holds_slot or (tokens and ticket.counts_tokens)):
            return
        args = [self._now(), ticket.ticket, repr(float(tokens)), repr(float(self.keep_s))]
        for signature, tpm in ticket.scopes:
            args.extend((signature, tpm))
        try:
            await asyncio.shield(self._release(keys=list(ticket.keys), args=args))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the answer is out already; the lease bounds a lost slot
            log.warning("releasing a quota ticket in Redis failed (%s); its slot frees when its lease ends", err)
