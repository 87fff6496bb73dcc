"""Admission control in front of one model: a bounded queue, weighted fair across tenants.

``slots`` requests may be past the gate at once (in the coalescer or at Triton). A request that
finds a free slot and nobody waiting goes at once (no await, no allocation beyond a counter).
Otherwise it waits in the model's queue, and freed slots go to waiting requests in weighted fair
order across tenants (self-clocked fair queuing: each request gets the finish tag
``max(V, tenant's last tag) + 1/weight``; the smallest tag goes next; ``V`` is the tag last
served). A tenant offering ten times its share therefore waits behind itself, not in front of
the others. Weights come from plan tiers (``server.tenancy.identity.PLAN_WEIGHTS``).

The queue is bounded so that an admitted request waits at most about ``queue_rounds`` service
times: by default it holds ``queue_rounds x slots`` requests (two rounds: an admitted request's
latency stays within ~3x an unloaded one's, whatever the model's speed). With
``max_queue_delay_s`` set it holds instead what the model drains in that long at its measured
capacity (``slots`` / the EWMA of the time a request holds a slot), to absorb longer bursts at
the cost of latency. Either way the bound stays between ``min_queue`` and
``max_queue``. When it is full, an arriving tenant that holds less than its fair share of the
queue pushes out the newest request of the tenant holding the most (that one gets
``QueueFull``); otherwise the arrival is refused with ``QueueFull`` and a retry hint (the
queue's estimated drain time). A request whose deadline cannot be met — its estimated wait plus
service time exceeds what is left — is shed at admission with ``DeadlineUnmeetable``, never after
it waited; one whose deadline passes while queued leaves the queue then. Past that, overload is
``batching.overload_policy``'s: an arrival whose expected wait (Little's law) exceeds the model's queue
TTL is refused at once, a queued one leaves at its TTL with a retry hint, and a standing queue (CoDel)
drops the requests that already waited past its short budget instead of serving them late.

Two traffic classes. ``realtime`` (every caller's request) is everything above. ``batch`` (the
rows of a batch job) only takes capacity real-time traffic leaves: a batch request gets a slot
only while no real-time request is waiting for one, and batch requests hold at most
``batch_share`` of the slots at once, so a real-time arrival finds a free slot. Waiting batch
requests are granted after every waiting real-time one, in weighted fair order among batch
tenants; they are never counted in the real-time bound nor pushed out, and never shed for a
deadline they did not give.

Pure asyncio policy: an injectable clock, no I/O, nothing about transports.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batching.overload_policy import BUDGET, OverloadPolicy, QueueGovernor


class Refused(Exception):
    """Admission said no before any work; the data plane maps each kind to its domain error."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class QueueFull(Refused):
    """The model's queue is at its bound (or this request was pushed out): retry after ``retry_after_s``."""


class DeadlineUnmeetable(Refused):
    """The request's deadline cannot be met (estimated at admission), or passed while it waited."""


@dataclass(frozen=True)
class AdmissionPolicy:
    slots: int = 64
    max_queue_delay_s: float | None = None  # set: the queue holds what the model drains in this long
    queue_rounds: float = 2.0  # unset: the queue holds this many rounds of ``slots``
    min_queue: int = 4
    max_queue: int = 4096
    initial_service_s: float | None = None  # prior for the EWMA (None: no deadline shedding until measured)
    ewma_alpha: float = 0.05
    batch_share: float = 0.5  # of ``slots`` the batch class may hold at once (at least one slot)
    overload: OverloadPolicy = OverloadPolicy()  # queue TTL and standing-time drops (batching.overload_policy)

    @property
    def batch_slots(self) -> int:
        return max(1, int(self.slots * self.batch_share))


REALTIME, BATCH = "realtime", "batch"


@dataclass(eq=False)
class _Waiter:
    tag: float
    tenant: str
    deadline: float | None
    future: asyncio.Future
    done: bool = False
    enqueued: float = 0.0  # on the queue's clock


@dataclass(eq=False)
class _TenantState:
    weight: float
    last_tag: float = 0.0
    waiting: deque = field(default_factory=deque)  # this tenant's waiters, oldest first


class FairQueue:
    def __init__(self, name: str, policy: AdmissionPolicy = AdmissionPolicy(), clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.policy = policy
        self._clock = clock
        self.inflight = 0
        self.size = 0  # waiting requests
        self._heap: list[tuple[float, int, int, _Waiter]] = []
        self._seq = itertools.count()
        self._tenants: dict[str, _TenantState] = {}
        self._vtime = 0.0
        self.service_s: float | None = policy.initial_service_s
        self.governor = QueueGovernor(policy.overload, clock)
        self.admitted = 0
        self.queued = 0
        self.rejected = 0
        self.shed = 0
        self.pushed_out = 0
        # the batch class: its own waiters, tags and virtual time (granted only when no real-time request waits)
        self.batch_inflight = 0
        self.batch_size = 0
        self._batch_heap: list[tuple[float, int, _Waiter]] = []
        self._batch_tags: dict[str, float] = {}
        self._batch_vtime = 0.0
        self.batch_admitted = 0

    # ---- measured capacity ----------------------------------------------------------------

    @property
    def capacity_rps(self) -> float | None:
        return None if not self.service_s else self.policy.slots / self.service_s

    @property
    def bound(self) -> int:
        p = self.policy
        if p.max_queue_delay_s is None:
            n = p.queue_rounds * p.slots
        elif (cap := self.capacity_rps) is None:
            return p.max_queue
        else:
            n = cap * p.max_queue_delay_s
        return int(min(p.max_queue, max(p.min_queue, n)))

    def _drain_s(self, ahead: float) -> float:
        return 0.0 if not self.service_s else ahead * self.service_s / self.policy.slots

    # ---- admission ------------------------------------------------------------------------

    def try_acquire(self) -> bool:
        """The fast path: a free slot and nobody waiting."""
        if self.inflight < self.policy.slots and not self.size:
            self.inflight += 1
            self.admitted += 1
            return True
        return False

    def try_acquire_batch(self) -> bool:
        """The batch class's fast path: a free slot, no request of either class waiting, batch under its share."""
        if self.inflight < self.policy.slots and not self.size and not self.batch_size and self.batch_inflight < self.policy.batch_slots:
            self.inflight += 1
            self.batch_inflight += 1
            self.batch_admitted += 1
            return True
        return False

    async def acquire_batch(self, tenant: str, weight: float = 1.0, timeout: float | None = None) -> None:
        """Wait for a slot real-time traffic leaves; ``release(batch=True)`` it when done."""
        if self.try_acquire_batch():
            return
        if self.batch_size >= self.policy.max_queue:
            raise QueueFull(f"model '{self.name}' has {self.batch_size} batch requests waiting", retry_after_s=max(0.001, self._drain_s(self.size + self.batch_size)))
        tag = max(self._batch_vtime, self._batch_tags.get(tenant, 0.0)) + 1.0 / weight
        self._batch_tags[tenant] = tag
        waiter = _Waiter(tag, tenant, None, asyncio.get_running_loop().create_future())
        heapq.heappush(self._batch_heap, (tag, next(self._seq), waiter))
        self.batch_size += 1
        await self._wait(waiter, timeout, batch=True)

    def _forget_batch(self, waiter: _Waiter) -> None:
        if not waiter.done:
            waiter.done = True
            self.batch_size -= 1

    def _grant_batch(self) -> None:
        p = self.policy
        while self._batch_heap and not self.size and self.inflight < p.slots and self.batch_inflight < p.batch_slots:
            tag, _, waiter = heapq.heappop(self._batch_heap)
            if waiter.done or waiter.future.done():
                continue
            self._batch_vtime = tag
            self._forget_batch(waiter)
            self.inflight += 1
            self.batch_inflight += 1
            self.batch_admitted += 1
            waiter.future.set_result(None)
        if not self._batch_heap:
            self._batch_tags = {t: tag for t, tag in self._batch_tags.items() if tag > self._batch_vtime}

    async def acquire(self, tenant: str, weight: float = 1.0, timeout: float | None = None) -> None:
        """Wait for a slot (weighted fair across tenants); ``release()`` it when done."""
        if self.try_acquire():
            return
        now = self._clock()
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState(weight)
        state.weight = weight
        tag = max(self._vtime, state.last_tag) + 1.0 / weight
        refusal = self.governor.admit(self._ahead(tag), self.policy.slots, self.service_s, timeout)
        if refusal is not None:
            if refusal.verdict == BUDGET:
                self.rejected += 1
                raise QueueFull(
                    f"model '{self.name}' is saturated: ~{refusal.expected_s * 1000:.1f} ms expected in its queue, "
                    f"{refusal.budget_s * 1000:.1f} ms allowed",
                    retry_after_s=refusal.retry_after_s,
                )
            self.shed += 1
            raise DeadlineUnmeetable(
                f"model '{self.name}' cannot answer within the deadline: ~{(refusal.expected_s + self.service_s) * 1000:.1f} ms "
                f"expected, {timeout * 1000:.1f} ms left"
            )
        if self.size >= self.bound and not self._push_out(tenant, state):
            self.rejected += 1
            raise QueueFull(
                f"model '{self.name}' is saturated ({self.size} requests waiting)",
                retry_after_s=max(0.001, self._drain_s(self.size)),
            )
        waiter = _Waiter(tag, tenant, None if timeout is None else now + timeout, asyncio.get_running_loop().create_future(), enqueued=now)
        state.last_tag = tag
        state.waiting.append(waiter)
        # equal tags: the request that found its tenant's queue shorter goes first (a tenant
        # arriving idle gets the turn a backlogged one would otherwise win by arriving earlier)
        heapq.heappush(self._heap, (tag, len(state.waiting), next(self._seq), waiter))
        self.size += 1
        self.queued += 1
        limit, by_queue = self.governor.timeout_s(timeout, self.service_s)
        await self._wait(waiter, limit, batch=False, by_queue=by_queue)

    async def _wait(self, waiter: _Waiter, timeout: float | None, batch: bool, by_queue: bool = False) -> None:
        """Until ``waiter`` is granted its slot. One that times out (DeadlineUnmeetable; QueueFull when the
        bound was the queue's TTL, ``by_queue``) or is cancelled leaves its queue; a grant that raced the
        cancellation is given back."""
        forget = self._forget_batch if batch else self._forget
        try:
            if timeout is None:
                await waiter.future
            else:
                await asyncio.wait_for(waiter.future, timeout)
        except asyncio.TimeoutError:
            forget(waiter)
            if by_queue:
                self.rejected += 1
                raise QueueFull(
                    f"model '{self.name}' is saturated: waited {timeout * 1000:.1f} ms, its queue budget",
                    retry_after_s=max(0.001, self._drain_s(self.size)),
                ) from None
            if not batch:
                self.shed += 1
            raise DeadlineUnmeetable(f"deadline exceeded waiting for model '{self.name}'{' (batch)' if batch else ''}") from None
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(None, batch=batch)  # granted a slot in the same tick it was cancelled: give it back
            forget(waiter)
            raise

    def release(self, service_s: float | None = None, batch: bool = False) -> None:
        """A request past the gate finished; ``service_s``: how long it held its slot; ``batch``:
        it was admitted by :meth:`acquire_batch` / :meth:`try_acquire_batch`."""
        self.inflight -= 1
        if batch:
            self.batch_inflight -= 1
        if service_s is not None:
            a = self.policy.ewma_alpha
            self.service_s = service_s if self.service_s is None else (1 - a) * self.service_s + a * service_s
        now = self._clock() if self._heap else 0.0
        while self._heap and self.inflight < self.policy.slots:
            tag, _, _, waiter = heapq.heappop(self._heap)
            if waiter.done or waiter.future.done():
                continue
            self._vtime = tag
            self._forget(waiter)
            if not self.governor.dequeued(now - waiter.enqueued, self.service_s):
                self.rejected += 1  # stood in a standing queue past its budget: refused, not served late
                waiter.future.set_exception(
                    QueueFull(f"model '{self.name}' is saturated (a standing queue)", retry_after_s=max(0.001, self._drain_s(self.size)))
                )
                continue
            self.inflight += 1
            self.admitted += 1
            waiter.future.set_result(None)
        if not self.size:
            self.governor.drained()
        if self._batch_heap:
            self._grant_batch()  # only what real-time traffic left

    def resize(self, slots: int) -> None:
        """Another slot count (the model's replicas or instances changed); more slots admit
        waiting requests at once, fewer let the ones past the gate finish."""
        self.policy = replace(self.policy, slots=max(1, slots))
        self.inflight += 1  # grant through release()'s loop, which hands free slots to waiters in fair order
        self.release(None)

    # ---- internals ------------------------------------------------------------------------

    def _ahead(self, tag: float) -> float:
        """Waiting requests served before a new one with finish tag ``tag`` (an estimate)."""
        span = tag - self._vtime
        return sum(min(len(s.waiting), span * s.weight) for s in self._tenants.values() if s.waiting)

    def _push_out(self, tenant: str, state: _TenantState) -> bool:
        """Full queue: evict the newest waiter of the tenant most over its share, if not this one."""
        victim_name, victim = None, None
        worst = (len(state.waiting) + 1) / state.weight
        for name, s in self._tenants.items():
            if name != tenant and s.waiting and len(s.waiting) / s.weight > worst:
                victim_name, victim, worst = name, s, len(s.waiting) / s.weight
        if victim is None:
            return False
        waiter = victim.waiting.pop()
        waiter.done = True
        self.size -= 1
        self.pushed_out += 1
        if not waiter.future.done():
            waiter.future.set_exception(
                QueueFull(f"model '{self.name}' is saturated; tenant '{victim_name}' is over its share", retry_after_s=max(0.001, self._drain_s(self.size)))
            )
        return True

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        self.size -= 1
        state = self._tenants.get(waiter.tenant)
        if state is None:
            return
        if state.waiting and state.waiting[0] is waiter:
            state.waiting.popleft()
        else:
            try:
                state.waiting.remove(waiter)
            except ValueError:
                pass
        if not state.waiting and state.last_tag <= self._vtime:
            del self._tenants[waiter.tenant]

    def snapshot(self) -> dict:
        return {
            "inflight": self.inflight,
            "waiting": self.size,
            "bound": self.bound,
            "service_ms": None if self.service_s is None else self.service_s * 1000,
            "admitted": self.admitted,
            "queued": self.queued,
            "rejected": self.rejected,
            "shed": self.shed,
            "pushed_out": self.pushed_out,
            "standing": self.governor.standing,
            "dropped": self.governor.dropped,
            "batch_inflight": self.batch_inflight,
            "batch_waiting": self.batch_size,
            "batch_admitted": self.batch_admitted,
        }
