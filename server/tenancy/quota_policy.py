"""Quotas as token buckets: per tenant and per tenant x model, decided before any work.

A :class:`Quota` names the limits (requests per second, requests per minute, tokens per minute,
concurrent requests); each rate limit is one token bucket whose capacity is the limit and which
refills continuously at ``limit / window``. So over any window the bucket admits at most its
limit plus what refilled — a burst of exactly ``limit`` from a full bucket, then ``limit/window``
per second. Requests are checked against every bucket that applies and charged only when all of
them have room (a refused request costs nothing). Tokens (an LLM request's prompt + completion,
also when the caller left mid-stream; an embedding's input) are charged after the answer:
admission needs the token bucket to be out of debt, the answer's tokens are then taken from it,
possibly into debt, which delays the next request by exactly the overdraft.

Refusals carry ``retry_after_s``: when the fullest blocking bucket has room again (a full
concurrency cap hints 50 ms: a slot frees when some request finishes). A limit of 0 admits no
request at all (its bucket starts empty and never refills), and its refusal carries no retry hint:
no wait would help.

Two policies with one contract, ``await admit(...)`` then ``await release(ticket, tokens)``:
:class:`QuotaPolicy` keeps the buckets in this process — pure, a clock is injected, it never
suspends (its ``admit`` is a coroutine only so both policies are called one way; one decision is a
few dict lookups and float operations, microseconds) — and ``server.tenancy.redis_quotas.RedisQuotaPolicy``
keeps the same buckets in Redis, shared by every frontend process (``--workers N``, several hosts),
when ``redis_url`` is configured. Without Redis each worker process enforces the whole quota.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from server.errors import Overloaded


@dataclass(frozen=True)
class Quota:
    """Limits for one scope; ``None`` is unlimited."""

    rps: float | None = None
    rpm: float | None = None
    tpm: float | None = None  # tokens per minute (LLM prompt + completion, embedding input)
    concurrency: int | None = None
    requests_month: int | None = None  # per calendar month, UTC (server.tenancy.monthly_quotas)
    tokens_month: int | None = None

    @property
    def unlimited(self) -> bool:
        return (
            self.rps is None and self.rpm is None and self.tpm is None and self.concurrency is None
            and self.requests_month is None and self.tokens_month is None
        )  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict | None) -> "Quota":
        d = d or {}
        return cls(
            rps=_opt_float(d.get("rps")),
            rpm=_opt_float(d.get("rpm")),
            tpm=_opt_float(d.get("tpm")),
            concurrency=None if d.get("concurrency") is None else int(d["concurrency"]),
            requests_month=None if d.get("requests_month") is None else int(d["requests_month"]),
            tokens_month=None if d.get("tokens_month") is None else int(d["tokens_month"]),
        )

    def to_dict(self) -> dict:
        fields = (("rps", self.rps), ("rpm", self.rpm), ("tpm", self.tpm), ("concurrency", self.concurrency),
                  ("requests_month", self.requests_month), ("tokens_month", self.tokens_month))  # fmt: skip
        return {k: v for k, v in fields if v is not None}


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; level may go negative (debt)."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity = float(capacity)
        self.rate = float(rate)
        self.level = float(capacity)
        self.stamp = now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.level

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` tokens are available (after :meth:`refill`)."""
        missing = amount - self.level
        if missing <= 0:
            return 0.0
        return missing / self.rate if self.rate > 0 else float("inf")


def request_capacity(limit: float) -> float:
    """A request bucket's size: its limit, at least one whole request (rps=0.5 admits one every 2 s);
    a limit of 0 holds none, so it admits nothing."""
    return max(limit, 1.0) if limit > 0 else 0.0


def refusal(label: str, quota: Quota, kind: str) -> str:
    """Why a request was refused: ``kind`` is the blocking limit (rps | rpm | tpm | concurrency)."""
    if kind == "concurrency":
        return f"{label}: {quota.concurrency} concurrent requests in flight"
    limit, unit = {"rps": (quota.rps, "requests/s"), "rpm": (quota.rpm, "requests/min"), "tpm": (quota.tpm, "tokens/min")}[kind]
    return f"{label}: quota of {limit:g} {unit} exceeded"


def refused(label: str, quota: Quota, kind: str, wait: float) -> Overloaded:
    """The refusal both policies raise; a limit that never refills (0) gets no retry hint."""
    return Overloaded(refusal(label, quota, kind), retry_after_s=wait if wait != float("inf") else None)


def scope_labels(tenant: str, model: str) -> tuple[str, str]:
    """How a refusal names the tenant's scope and the tenant x model scope."""
    return f"tenant '{tenant}'", f"tenant '{tenant}' on model '{model}'"


CONCURRENCY_RETRY_S = 0.05


@dataclass
class _Scope:
    quota: Quota
    buckets: list[tuple[TokenBucket, str]]  # request buckets and their kind (rps | rpm)
    tokens: TokenBucket | None
    inflight: int = 0


class QuotaPolicy:
    """Per-tenant and per-(tenant, model) limits in this process. ``admit`` then ``release``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._scopes: dict[tuple[str, str], _Scope] = {}
        self.refused = 0

    def _scope(self, tenant: str, model: str, quota: Quota) -> _Scope | None:
        """The scope's state; its buckets start over (full) when its quota changed. The scope object
        itself stays: tickets of requests in flight hold it, and their release must find it."""
        if quota.unlimited:
            return None
        key = (tenant, model)
        scope = self._scopes.get(key)
        if scope is None or scope.quota != quota:
            now = self._clock()
            buckets = []
            if quota.rps is not None:
                buckets.append((TokenBucket(request_capacity(quota.rps), quota.rps, now), "rps"))
            if quota.rpm is not None:
                buckets.append((TokenBucket(request_capacity(quota.rpm), quota.rpm / 60.0, now), "rpm"))
            tokens = TokenBucket(quota.tpm, quota.tpm / 60.0, now) if quota.tpm is not None else None
            if scope is None:
                scope = self._scopes[key] = _Scope(quota, buckets, tokens)
            else:
                scope.quota, scope.buckets, scope.tokens = quota, buckets, tokens
        return scope

    async def admit(self, tenant: str, model: str, tenant_quota: Quota, model_quota: Quota | None = None) -> tuple:
        """Charge one request to the tenant's and the tenant x model's limits, or raise Overloaded.

        Returns a ticket to hand to :meth:`release` when the request is answered. Never suspends.
        """
        now = self._clock()
        scopes = []
        tenant_label, model_label = scope_labels(tenant, model)
        for label, scope in (
            (tenant_label, self._scope(tenant, "", tenant_quota)),
            (model_label, self._scope(tenant, model, model_quota) if model_quota else None),
        ):
            if scope is not None:
                scopes.append((label, scope))
        wait = 0.0
        blocked = None
        for label, scope in scopes:
            q = scope.quota
            if q.concurrency is not None and scope.inflight >= q.concurrency:
                if wait < CONCURRENCY_RETRY_S:
                    wait, blocked = CONCURRENCY_RETRY_S, (label, q, "concurrency")
            for bucket, kind in scope.buckets:
                bucket.refill(now)
                w = bucket.wait_for(1.0)
                if w > wait:
                    wait, blocked = w, (label, q, kind)
            if scope.tokens is not None:
                scope.tokens.refill(now)
                if scope.tokens.level <= 0:
                    w = scope.tokens.wait_for(1e-9)
                    if w > wait:
                        wait, blocked = w, (label, q, "tpm")
        if wait > 0:
            self.refused += 1
            raise refused(*blocked, wait)
        for _, scope in scopes:
            for bucket, _ in scope.buckets:
                bucket.level -= 1.0
            scope.inflight += 1
        return tuple(s for _, s in scopes)

    async def release(self, ticket: tuple, tokens: float = 0.0) -> None:
        """The request was answered: free its concurrency slot, charge the tokens it used. Never suspends."""
        now = self._clock()
        for scope in ticket:
            scope.inflight -= 1
            if tokens and scope.tokens is not None:
                scope.tokens.refill(now)
                scope.tokens.level -= tokens

    def inflight(self, tenant: str, model: str = "") -> int:
        scope = self._scopes.get((tenant, model))
        return scope.inflight if scope else 0
