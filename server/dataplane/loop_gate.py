"""The process's own admission: unary requests refused before decode while the event loop stands behind.

Past the frontend's CPU capacity the backlog is not in any model's queue but in the event loop —
requests read and waiting for their turn to run — so every request, answered or refused, waits
there first (issue 30: refusals at 148 ms, admitted requests at seconds). :func:`watch` samples the
loop's lag (how late a short timer fires) into a ``batching.overload_policy.LoopGate``; gRPC
ModelInfer and REST infer enter through :class:`UnaryAdmission` before they decode anything, and
an arrival over the gate's limit is RESOURCE_EXHAUSTED / 429 with the lag as its retry hint.
"""

from __future__ import annotations

import asyncio
import time

from batching.overload_policy import LoopGate
from server.errors import Overloaded

TICK_S = 0.005


class UnaryAdmission:
    """``with admission:`` around one unary request (a sync context manager: no await, no allocation)."""

    __slots__ = ("gate",)

    def __init__(self, gate: LoopGate):
        self.gate = gate

    def __enter__(self) -> None:
        retry = self.gate.enter()
        if retry is not None:
            raise Overloaded(
                f"the frontend is saturated: its event loop runs {self.gate.lag_s * 1000:.1f} ms behind "
                f"({self.gate.inflight} requests in flight, limit {self.gate.limit})",
                retry_after_s=retry,
            )

    def __exit__(self, exc_type, exc, tb) -> None:
        self.gate.exit()


async def watch(gate: LoopGate, tick_s: float = TICK_S) -> None:
    """Forever: sleep ``tick_s``, feed the gate how much later than asked the loop woke up."""
    clock = time.perf_counter
    sleep = asyncio.sleep
    while True:
        asked = clock()
        await sleep(tick_s)
        gate.sample(max(0.0, clock() - asked - tick_s))
