"""Request coalescing: concurrent requests for one model version become one Triton request.

Requests that arrive while the model's in-flight slots are busy wait in a pending batch; the
batch goes to Triton as ONE request (inputs concatenated along the batch dimension, raw bytes
joined without decoding) when a slot frees, when it reaches the model's maximum batch, or when
its oldest member has waited ``window_s`` — whichever comes first. A request that finds a free
slot goes at once, untouched: a lone caller is never held. Triton's answer is split back into
one response per caller. A failure of the merged call fails every member with the same error.

Members are validated before they get here (an invalid request never joins a batch). The
module is transport-free and format-free: requests are opaque to it; a ``BatchCodec`` (the data
plane's protobuf one, ``server.dataplane.batch_codec``) says which requests may merge, how many
rows each carries, and how to merge them and split the answer; ``send`` is an async callable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from typing import Any, Protocol

Send = Callable[[bytes, "float | None"], Awaitable[bytes]]


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
    window_s: float = 0.0005  # the longest a request waits for company
    max_inflight: int = 2  # merged calls to Triton at once per model version
    max_batch: int = 64  # rows per merged call (the model's max_batch_size)

    @classmethod
    def from_parameters(cls, params: dict[str, str], max_batch_size: int) -> "CoalescePolicy":
        """Read ``inferplane.coalesce*`` parameters of a model config (strings)."""
        enabled = params.get("inferplane.coalesce", "true").lower() not in ("false", "0", "off", "no")
        return cls(
            enabled=enabled and max_batch_size > 0,
            window_s=float(params.get("inferplane.coalesce_window_us", "500")) / 1e6,
            max_inflight=max(1, int(params.get("inferplane.coalesce_max_inflight", "2"))),
            max_batch=max(1, int(params.get("inferplane.coalesce_max_batch", str(max(max_batch_size, 1))))),
        )


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
    pending: list[_Member] = field(default_factory=list)
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
    ):
        self._send = send
        self._codec = codec
        self._clock = clock
        self._sleep = sleep
        self._lanes: dict[tuple, _Lane] = {}
        self.merged_calls = 0
        self.merged_rows = 0

    async def submit(
        self, request: Any, raw: bytes, policy: CoalescePolicy, timeout: float | None = None
    ) -> bytes:
        """Serve one validated request; returns its own serialized ModelInferResponse."""
        key = self._codec.key(request) if policy.enabled else None
        if key is None:
            return await self._send(raw, timeout)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        rows = self._codec.rows(request)
        if lane.rows + rows > policy.max_batch and lane.pending:
            self._flush(key, lane, policy)
        now = self._clock()
        member = _Member(request, raw, rows, asyncio.get_running_loop().create_future(), None if timeout is None else now + timeout)
        lane.pending.append(member)
        lane.rows += rows
        if lane.rows >= policy.max_batch:
            self._flush(key, lane, policy)
        elif lane.inflight < policy.max_inflight:
            # a free slot: go at the end of this loop tick, with whoever else arrived in it
            if not lane.tick_scheduled:
                lane.tick_scheduled = True
                asyncio.get_running_loop().call_soon(self._tick, key, lane, policy)
        elif lane.timer is None:
            hold = policy.window_s if timeout is None else max(0.0, min(policy.window_s, timeout * 0.1))
            if hold == 0.0:
                self._flush(key, lane, policy)
            else:
                lane.timer = asyncio.create_task(self._expire(key, lane, policy, hold))
        return await member.future

    def _tick(self, key, lane: _Lane, policy: CoalescePolicy) -> None:
        lane.tick_scheduled = False
        if lane.pending and lane.inflight < policy.max_inflight:
            self._flush(key, lane, policy)

    def _on_slot_free(self, key, lane: _Lane, policy: CoalescePolicy) -> None:
        if lane.pending:
            self._flush(key, lane, policy)
        elif lane.inflight == 0 and lane.timer is None and not lane.tick_scheduled:
            self._lanes.pop(key, None)

    async def _expire(self, key, lane: _Lane, policy: CoalescePolicy, hold: float) -> None:
        await self._sleep(hold)
        lane.timer = None
        if lane.pending:
            self._flush(key, lane, policy)

    def _flush(self, key, lane: _Lane, policy: CoalescePolicy) -> None:
        members, lane.pending, lane.rows = lane.pending, [], 0
        if lane.timer is not None:
            lane.timer.cancel()
            lane.timer = None
        members = [m for m in members if not m.future.done()]  # cancelled callers drop out
        if not members:
            return
        lane.inflight += 1
        asyncio.create_task(self._run(key, lane, policy, members))

    async def _run(self, key, lane: _Lane, policy: CoalescePolicy, members: list[_Member]) -> None:
        try:
            if len(members) == 1:
                m = members[0]
                results = [await self._send(m.raw, _remaining(m.deadline, self._clock()))]
            else:
                requests = [m.request for m in members]
                timeout = _latest(members, self._clock())
                answer = await self._send(self._codec.merge(requests), timeout)
                results = self._codec.split(answer, requests, [m.rows for m in members])
                self.merged_calls += 1
                self.merged_rows += sum(m.rows for m in members)
        except asyncio.CancelledError:
            for m in members:
                m.future.cancel()
            raise
        except Exception as err:  # every member learns the outcome
            for m in members:
                if not m.future.done():
                    m.future.set_exception(err)
        else:
            for m, result in zip(members, results):
                if not m.future.done():
                    m.future.set_result(result)
        finally:
            lane.inflight -= 1
            self._on_slot_free(key, lane, policy)


def _remaining(deadline: float | None, now: float) -> float | None:
    return None if deadline is None else max(0.0, deadline - now)


def _latest(members: list[_Member], now: float) -> float | None:
    if any(m.deadline is None for m in members):
        return None
    return max(0.0, max(m.deadline for m in members) - now)
