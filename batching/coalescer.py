"""Group commit for model calls: requests present at the same time become one Triton request.

Per lane (model, version and request shape), at most ``max_inflight`` merged calls are at Triton
at once (by default one per Triton instance of the model). A request that finds a free slot goes
at the end of the current event-loop tick together with whatever else arrived in that tick — a
lone caller is never held (and, still alone at the tick's end, makes its call in its own task:
no task or future per request at c=1). While every slot is busy, arrivals wait in the lane's pending batch;
the moment a call returns, the pending batch (up to ``max_batch`` rows) goes as the next call.
Merging therefore engages by itself under load, without a timer: the longer a call takes, the
more requests ride the next one. ``window_s`` (default 0: off) additionally caps how long a
pending request waits for a slot before it goes in a call of its own.

Inputs are concatenated along the batch dimension as raw bytes (never decoded) and Triton's
answer is cut back into one response per caller by rows. When a merged call fails because the
backend is away (unavailable, cancelled) every member gets that error; any other failure (a model
error on one row, an answer that cannot be split) is retried member by member, so one bad member
never poisons the others.

Members are validated before they get here (an invalid request never joins a batch). The module
is transport-free and format-free: requests are opaque to it; a ``BatchCodec`` (the data plane's
protobuf one, ``server.dataplane.batch_codec``) says which requests may merge, how many rows each
carries, and how to merge them and split the answer; ``send(raw, timeout, request)`` is an async
callable (``request``: the call's first member, for routing).

``on_call(requests, rows)`` (optional) hears of every call before it is sent — the members' requests
and their rows — and may return a finisher, called with the call's error (or None) when it returns:
batch-size metrics and trace spans hang there (``server.dataplane.observe``). It runs in the task
that makes the call, so a context variable it sets is seen by ``send``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from collections import deque
from dataclasses import dataclass, field

from typing import Any, Protocol

Send = Callable[[bytes, "float | None", Any], Awaitable[bytes]]
OnCall = Callable[[list, int], "Callable[[BaseException | None], None] | None"]


class BatchCodec(Protocol):
    def key(self, request: Any) -> tuple | None:
        """Requests with equal keys can be merged; None: this request is never merged."""

    def rows(self, request: Any) -> int:
        """The request's batch size (its first dimension)."""

    def merge(self, requests: list[Any]) -> bytes:
        """One serialized request whose inputs are the members' concatenated along dimension 0."""

    def split(self, response: bytes, requests: list[Any], rows: list[int]) -> list[bytes]:
        """The merged answer cut back into one serialized response per member."""


@dataclass(frozen=True)
class CoalescePolicy:
    enabled: bool = True
    window_s: float = 0.0  # > 0: the longest a pending request waits for a free slot (0: until one frees)
    max_inflight: int = 1  # merged calls to Triton at once per lane
    max_batch: int = 64  # rows per merged call (the model's max_batch_size)

    @classmethod
    def from_parameters(cls, params: dict[str, str], max_batch_size: int, instances: int = 1) -> "CoalescePolicy":
        """Read ``inferplane.coalesce*`` parameters of a model config (strings); in-flight calls
        default to the model's Triton instances (each works on one merged call)."""
        enabled = params.get("inferplane.coalesce", "true").lower() not in ("false", "0", "off", "no")
        return cls(
            enabled=enabled and max_batch_size > 0,
            window_s=_number(params, "inferplane.coalesce_window_us", 0.0) / 1e6,
            max_inflight=max(1, int(_number(params, "inferplane.coalesce_max_inflight", max(1, instances)))),
            max_batch=max(1, int(_number(params, "inferplane.coalesce_max_batch", max(max_batch_size, 1)))),
        )


def _number(params: dict[str, str], key: str, default: float) -> float:
    try:
        return float(params[key]) if params.get(key) else float(default)
    except ValueError:
        return float(default)


@dataclass
class _Member:
    request: Any
    raw: bytes
    rows: int
    future: asyncio.Future
    deadline: float | None  # absolute, on the coalescer's clock


@dataclass
class _Lane:
    """Pending members and in-flight count of one (model, version, request shape) key."""

    inflight: int = 0
    pending: deque = field(default_factory=deque)  # _Member, oldest first
    rows: int = 0
    timer: asyncio.Task | None = None
    tick_scheduled: bool = False


class Coalescer:
    def __init__(
        self,
        send: Send,
        codec: BatchCodec,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_call: OnCall | None = None,
    ):
        self._send = send
        self._on_call = on_call
        self._codec = codec
        self._clock = clock
        self._sleep = sleep
        self._lanes: dict[tuple, _Lane] = {}
        self.calls = 0  # calls sent (merged or alone)
        self.merged_calls = 0
        self.merged_rows = 0
        self.retried_alone = 0  # members re-sent one by one after a merged call failed

    async def submit(self, request: Any, raw: bytes, policy: CoalescePolicy, timeout: float | None = None, *, traffic: str = "") -> bytes:
        """Serve one validated request; returns its own serialized answer. ``traffic``: requests merge
        only with requests of the same traffic class (a batch job's rows apart from real-time callers:
        their merged call goes where the batch traffic class goes)."""
        key = self._codec.key(request) if policy.enabled else None
        if key is not None and traffic:
            key = (traffic, key)
        if key is None:
            self.calls += 1
            if self._on_call is None:
                return await self._send(raw, timeout, request)
            return await self._observed_send(raw, timeout, request, policy)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        rows = self._codec.rows(request)
        member = _Member(request, raw, rows, asyncio.get_running_loop().create_future(), None if timeout is None else self._clock() + timeout)
        lane.pending.append(member)
        lane.rows += rows
        if lane.inflight < policy.max_inflight:
            if lane.rows >= policy.max_batch:
                self._flush(key, lane, policy)
            elif not lane.tick_scheduled:
                # a free slot: go at the end of this loop tick, with whoever else arrives in it
                lane.tick_scheduled = True
                return await self._lead(key, lane, policy, member)
        elif policy.window_s > 0 and lane.timer is None:
            hold = policy.window_s if timeout is None else max(0.0, min(policy.window_s, timeout * 0.1))
            lane.timer = asyncio.create_task(self._expire(key, lane, policy, hold))
        return await member.future

    async def _lead(self, key, lane: _Lane, policy: CoalescePolicy, member: _Member) -> bytes:
        """The member that found a free slot waits out this loop tick (the same turn ``call_soon``
        would give the lane's tick) for others to join. Still alone then, it makes the call in its
        own task — no task, future or wake-up of the loop per request for a lone caller; joined, the
        batch goes as any other (its own task: no member's cancellation cancels the others' call)."""
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            member.future.cancel()  # drops out of the batch; the others still go at this tick's end
            asyncio.get_running_loop().call_soon(self._tick, key, lane, policy)
            raise
        lane.tick_scheduled = False
        if len(lane.pending) == 1 and lane.pending[0] is member and lane.inflight < policy.max_inflight:
            lane.pending.popleft()
            lane.rows -= member.rows
            lane.inflight += 1
            try:
                return (await self._observed([member.request], member.rows, lambda: self._call([member])))[0]
            finally:
                lane.inflight -= 1
                self._on_slot_free(key, lane, policy)
        self._tick(key, lane, policy)  # joined (or already sent with a full batch): as every batch
        return await member.future

    async def _observed_send(self, raw: bytes, timeout: float | None, request: Any, policy: CoalescePolicy) -> bytes:
        """A call of one unmerged request, with ``on_call`` told before and after."""
        return await self._observed([request], self._codec.rows(request) if policy.enabled else 1, lambda: self._send(raw, timeout, request))

    async def _observed(self, requests: list, rows: int, call: Callable[[], Awaitable]):
        """``await call()`` in this task, with ``on_call`` (when set) told before and after."""
        done = self._on_call(requests, rows) if self._on_call is not None else None
        failure = None
        try:
            return await call()
        except BaseException as err:
            failure = err
            raise
        finally:
            if done is not None:
                done(failure)

    def _tick(self, key, lane: _Lane, policy: CoalescePolicy) -> None:
        lane.tick_scheduled = False
        while lane.pending and lane.inflight < policy.max_inflight:
            self._flush(key, lane, policy)

    def _on_slot_free(self, key, lane: _Lane, policy: CoalescePolicy) -> None:
        while lane.pending and lane.inflight < policy.max_inflight:
            self._flush(key, lane, policy)
        if not lane.pending and lane.inflight == 0 and lane.timer is None and not lane.tick_scheduled:
            self._lanes.pop(key, None)

    async def _expire(self, key, lane: _Lane, policy: CoalescePolicy, hold: float) -> None:
        await self._sleep(hold)
        lane.timer = None
        if lane.pending:  # waited long enough for a slot: go now, over the in-flight limit
            self._flush(key, lane, policy)

    def _flush(self, key, lane: _Lane, policy: CoalescePolicy) -> None:
        """Send the oldest pending members, up to ``max_batch`` rows (at least one member), as one call."""
        if lane.timer is not None:
            lane.timer.cancel()
            lane.timer = None
        members, rows = [], 0
        while lane.pending and (not members or rows + lane.pending[0].rows <= policy.max_batch):
            m = lane.pending.popleft()
            lane.rows -= m.rows
            if not m.future.done():  # cancelled callers drop out
                members.append(m)
                rows += m.rows
        if not members:
            return
        lane.inflight += 1
        asyncio.create_task(self._run(key, lane, policy, members))

    async def _run(self, key, lane: _Lane, policy: CoalescePolicy, members: list[_Member]) -> None:
        done = self._on_call([m.request for m in members], sum(m.rows for m in members)) if self._on_call is not None else None
        failure = None
        try:
            results = await self._call(members)
        except asyncio.CancelledError as err:
            failure = err
            for m in members:
                m.future.cancel()
            raise
        except Exception as err:  # every member learns the outcome
            failure = err
            for m in members:
                if not m.future.done():
                    m.future.set_exception(err)
        else:
            for m, result in zip(members, results):
                if m.future.done():
                    continue
                if isinstance(result, BaseException):
                    m.future.set_exception(result)
                else:
                    m.future.set_result(result)
        finally:
            if done is not None:
                done(failure)  # first: the next call's task must not inherit this call's context
            lane.inflight -= 1
            self._on_slot_free(key, lane, policy)

    async def _call(self, members: list[_Member]) -> list:
        now = self._clock()
        self.calls += 1
        if len(members) == 1:
            m = members[0]
            return [await self._send(m.raw, _remaining(m.deadline, now), m.request)]
        requests = [m.request for m in members]
        try:
            answer = await self._send(self._codec.merge(requests), _latest(members, now), requests[0])
            results = self._codec.split(answer, requests, [m.rows for m in members])
        except Exception as err:
            if _backend_away(err):
                raise
            # a model error on some row, or an answer that does not split: each member on its own
            self.retried_alone += len(members)
            return await asyncio.gather(
                *(self._send(m.raw, _remaining(m.deadline, self._clock()), m.request) for m in members), return_exceptions=True
            )
        self.merged_calls += 1
        self.merged_rows += sum(m.rows for m in members)
        return results


def _backend_away(err: Exception) -> bool:
    """Errors that say nothing about any member: every member shares them (no retry one by one)."""
    reason = getattr(err, "reason", "")
    return reason in ("UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "MODEL_NOT_READY")


def _remaining(deadline: float | None, now: float) -> float | None:
    return None if deadline is None else max(0.0, deadline - now)


def _latest(members: list[_Member], now: float) -> float | None:
    if any(m.deadline is None for m in members):
        return None
    return max(0.0, max(m.deadline for m in members) - now)
