"""The process's own admission: inference requests refused before decode past the process's
in-flight bound, or while the event loop stands behind.

Past the frontend's CPU capacity the backlog is not in any model's queue but ahead of the pipeline —
requests accepted and waiting for their turn to run — so every request, answered or refused, waits
there first (issue 30: refusals at 148 ms, admitted requests at seconds). Every inference request
enters through the one :class:`Admission` before it decodes anything, into a
``batching.overload_policy.LoopGate``:

- gRPC ModelInfer, REST infer, the typed API's Predict/PredictBatch and the OpenAI routes
  (chat/completions, completions, embeddings): ``with admission:`` around the handler, before the
  body is read. A generation holds its place until its last byte is written (a streaming one
  too: it is frontend work all along), so a refused stream is refused before its first byte.
- ``inferplane.v1.Generation/Generate``: :meth:`Admission.enter` first thing in the streaming
  handler (before its metadata, fields or model are read), :meth:`Admission.exit` once when the
  generation ends — its last chunk, its error or its cancellation.
- ModelStreamInfer: **per message**, not per stream. One stream carries any number of pipelined
  requests, so a place per stream would bound nothing (one caller could hold thousands of requests
  behind one place) and would refuse an idle open stream that costs nothing. Each message takes a
  place once it is parsed (:meth:`Admission.enter`) — after the protobuf parse, so the in-stream
  refusal names the request's ``id`` and model like every other in-stream error (a stream has no
  per-message status to correlate by) — and gives it back when its final response arrives or the
  stream ends (``server.dataplane.stream_ledger``, :meth:`Admission.exit`).

Past its ``ceiling`` (``INFERPLANE_MAX_INFLIGHT``, on by default) or, opt-in
(``INFERPLANE_LOOP_ADMISSION``), over the limit :func:`watch` sets from the loop's lag (how late a short timer fires), an arrival is
RESOURCE_EXHAUSTED / 429 with the time to drain what is in flight as its retry hint. A refusal costs
no decode, no task and no pipeline stage, so the frontend keeps pace with arrivals it cannot serve.
"""

from __future__ import annotations

import asyncio
import time

from batching.overload_policy import LoopGate
from server.errors import Overloaded

TICK_S = 0.005


class Admission:
    """``with admission:`` around one request (a sync context manager: no await, no allocation), or
    :meth:`enter` / :meth:`exit` from different places (a stream message)."""

    __slots__ = ("gate",)

    def __init__(self, gate: LoopGate):
        self.gate = gate

    def enter(self) -> None:
        """Take a place, or raise ``Overloaded`` with the retry hint."""
        gate = self.gate
        retry = gate.enter()
        if retry is not None:
            ceiling = gate.policy.ceiling
            if gate.limit is None or (ceiling is not None and ceiling <= gate.limit):
                why = f"{gate.inflight} requests in flight, its bound is {ceiling}"
            else:
                why = f"its event loop runs {gate.lag_s * 1000:.1f} ms behind ({gate.inflight} requests in flight, limit {gate.limit})"
            raise Overloaded(f"the frontend is saturated: {why}", retry_after_s=retry)

    def exit(self) -> None:
        """Give the place back (once per :meth:`enter` that returned)."""
        self.gate.exit()

    __enter__ = enter

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
