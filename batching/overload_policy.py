"""Overload as a queueing policy: who may wait in a model's queue, and for how long.

A bigger queue does not serve more past capacity; it only makes every admitted request late. So
the queue in front of a model (``batching.fair_queue``) asks this policy three things:

- **admission** (Little's law): the queue drains at the measured service rate ``slots /
  service_s``, so a request that finds ``ahead`` requests before it expects to wait
  ``(ahead + 1) x service_s / slots``. It is refused at once when that wait exceeds its *budget*:
  the model's queue TTL (``inferplane.queue_ttl_ms``), the short budget of a standing queue
  (below), and — a separate verdict, for the caller's own choice — its remaining deadline less one
  service time. While the expected wait is within budget nothing is refused.
- **expiry**: no request waits longer than its budget whatever the arrival sequence — the queue
  arms one timer for the shorter of the TTL and the deadline, and a request the TTL expires is
  refused like one refused at the door (a retry hint), not failed.
- **standing time** (CoDel, as Facebook's adaptive queues use it): a queue whose every request
  waited longer than ``target`` for a whole ``interval`` is standing — it no longer absorbs a
  burst, it is a backlog. While it stands the budget shrinks to ``target``: arrivals expecting
  longer are refused at once (fast, cheap refusals instead of seconds of queueing), and granted
  requests that already waited longer are dropped instead of served late. The first request that
  waited less than ``target`` ends it. ``target`` is at least one service time (a model whose calls
  take 50 ms has not "stood" after 5 ms).

Every refusal carries ``retry_after_s``: how long the queue needs to drain to within budget.

Pure: no asyncio, no I/O; the clock is injected. The admission pipeline maps a refusal to
``RESOURCE_EXHAUSTED`` / 429 (``server.errors.Overloaded``), a deadline verdict to DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_RETRY_S = 0.001

# verdicts
BUDGET, DEADLINE = "budget", "deadline"


@dataclass(frozen=True)
class OverloadPolicy:
    queue_ttl_s: float | None = None  # the model's queue budget (None: none of its own)
    codel: bool = True  # drop to ``target`` once the queue's standing time grows
    target_s: float = 0.005  # a standing queue: every request of an interval waited longer (at least one service time)
    interval_s: float = 0.100


@dataclass(frozen=True)
class Refusal:
    verdict: str  # BUDGET (overload: retry later) or DEADLINE (this request's deadline cannot be met)
    expected_s: float  # the wait it would have had
    budget_s: float  # what it was allowed
    retry_after_s: float


def expected_wait_s(ahead: float, slots: int, service_s: float | None) -> float:
    """Little's law: ``ahead`` requests before this one drain at ``slots / service_s`` per second."""
    return 0.0 if not service_s else (ahead + 1) * service_s / max(1, slots)


class QueueGovernor:
    """One model queue's overload state: its CoDel clock and the verdicts above."""

    def __init__(self, policy: OverloadPolicy = OverloadPolicy(), clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._above_since: float | None = None  # the first dequeue of the current run above target
        self.standing = False
        self.dropped = 0  # granted requests dropped for their standing time

    def target_s(self, service_s: float | None) -> float:
        return max(self.policy.target_s, service_s or 0.0)

    def budget_s(self, service_s: float | None) -> float | None:
        """How long an arriving request may wait (None: no bound but its deadline)."""
        ttl = self.policy.queue_ttl_s
        if self.standing:
            target = self.target_s(service_s)
            return target if ttl is None else min(ttl, target)
        return ttl

    def admit(self, ahead: float, slots: int, service_s: float | None, remaining_s: float | None) -> Refusal | None:
        """None: may wait. Otherwise why not, with a retry hint."""
        wait = expected_wait_s(ahead, slots, service_s)
        if remaining_s is not None and service_s and wait + service_s > remaining_s:
            return Refusal(DEADLINE, wait, max(0.0, remaining_s - service_s), self._retry(wait, remaining_s - service_s))
        budget = self.budget_s(service_s)
        if budget is not None and wait > budget:
            return Refusal(BUDGET, wait, budget, self._retry(wait, budget))
        return None

    def timeout_s(self, remaining_s: float | None, service_s: float | None) -> tuple[float | None, bool]:
        """How long a queued request may wait, and whether that bound is the queue's (True) or its deadline's."""
        budget = self.budget_s(service_s)
        if budget is None:
            return remaining_s, False
        if remaining_s is None or budget < remaining_s:
            return budget, True
        return remaining_s, False

    def dequeued(self, sojourn_s: float, service_s: float | None) -> bool:
        """A waiter is granted its slot after ``sojourn_s``: True to serve it, False to drop it (standing queue)."""
        now = self._clock()
        target = self.target_s(service_s)
        if sojourn_s <= target:
            self._above_since = None
            self.standing = False
            return True
        if not self.policy.codel:
            return True
        if self._above_since is None:
            self._above_since = now
        elif now - self._above_since >= self.policy.interval_s:
            self.standing = True
        budget = self.budget_s(service_s)
        if self.standing and budget is not None and sojourn_s > budget:
            self.dropped += 1
            return False
        return True

    def drained(self) -> None:
        """The queue emptied: whatever stood is gone."""
        self._above_since = None
        self.standing = False

    def _retry(self, wait: float, budget: float) -> float:
        """Until the queue has drained to within budget (at least a millisecond)."""
        return max(MIN_RETRY_S, wait - max(0.0, budget))


@dataclass(frozen=True)
class LoopPolicy:
    """The process's own queue: the event loop. Its lag (how late a timer fires) is the time every
    request waits before the frontend even reads it, invisible to any model's queue."""

    target_s: float = 0.010  # a loop lagging more than this for a whole interval is standing
    interval_s: float = 0.100
    min_limit: int = 16  # never cut the in-flight limit below this
    decrease: float = 0.75  # on each standing interval the limit becomes this x what is in flight
    increase: float = 1.25  # on each sample below target it grows by this factor (lifted once far above in flight)
    ceiling: int | None = None  # the most requests in flight at once, lag or not (None: no bound of its own)
    rate_window_s: float = 0.1  # completions are counted over windows this long (the drain rate of the retry hint)


class LoopGate:
    """AIMD on the process's in-flight inference requests, driven by the event loop's lag (CoDel's
    standing-time test): no limit while the loop keeps up; once its lag stood above ``target`` for
    an ``interval`` the limit is cut to ``decrease x`` what is in flight, again every interval it
    still stands, and grows back (then lifts) while the lag is below target. ``ceiling`` bounds the
    in-flight requests whatever the lag (the process's admitted work: past it a request is refused,
    not queued behind the others). An arrival over either limit is refused before any work — before
    its body is decoded — with a retry hint: the time the measured completion rate needs to drain
    what is in flight (at least the loop's lag)."""

    def __init__(self, policy: LoopPolicy = LoopPolicy(), clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self.limit: int | None = None
        self.inflight = 0
        self.lag_s = 0.0
        self.refused = 0
        self._above_since: float | None = None
        self.rate = 0.0  # completions per second over the last whole window (0: none measured yet)
        self._window_start = clock()
        self._window_done = 0

    def sample(self, lag_s: float) -> None:
        """One reading of the loop's lag (a timer's lateness)."""
        p = self.policy
        self.lag_s = lag_s
        if lag_s <= p.target_s:
            self._above_since = None
            if self.limit is not None:
                grown = max(self.limit + 1, int(self.limit * p.increase))
                self.limit = None if grown > 4 * max(self.inflight, p.min_limit) else grown
            return
        now = self._clock()
        if self._above_since is None:
            self._above_since = now
        elif now - self._above_since >= p.interval_s:
            base = self.inflight if self.limit is None else min(self.limit, self.inflight)
            self.limit = max(p.min_limit, int(base * p.decrease))
            self._above_since = now  # one cut per interval

    def enter(self) -> float | None:
        """None: admitted (call :meth:`exit` when done). Otherwise refused: retry after this many seconds."""
        limit, ceiling = self.limit, self.policy.ceiling
        if (limit is not None and self.inflight >= limit) or (ceiling is not None and self.inflight >= ceiling):
            self.refused += 1
            return self.retry_after_s()
        if self.inflight == 0:  # idle until now: the completion count starts afresh (an idle gap is no slow drain)
            self._window_start, self._window_done = self._clock(), 0
        self.inflight += 1
        return None

    def exit(self) -> None:
        self.inflight -= 1
        self._window_done += 1
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed >= self.policy.rate_window_s:
            self.rate = self._window_done / elapsed
            self._window_start, self._window_done = now, 0

    def retry_after_s(self) -> float:
        """How long what is in flight takes to drain at the measured completion rate, at least the loop's lag."""
        drain = self.inflight / self.rate if self.rate > 0 else 0.0
        return max(MIN_RETRY_S, self.lag_s, drain)
