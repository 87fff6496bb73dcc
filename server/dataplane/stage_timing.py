"""Per-stage timing of one request, on the caller's request: ``Server-Timing`` on REST (the OIP
routes and the OpenAI ones), trailing metadata on gRPC (ModelInfer and the typed API's Predict /
PredictBatch).

A caller that sends ``inferplane-timing`` (HTTP header or gRPC metadata, any value) gets the time its
request spent in each stage, in order, and the total::

    server-timing: decode;dur=0.012, auth;dur=0.004, route;dur=0.003, quota;dur=0.002,
                   validation;dur=0.006, admission;dur=0.003, coalesce;dur=0.041, replica;dur=0.002,
                   triton;dur=0.612, answer;dur=0.019, exit;dur=0.011, encode;dur=0.003, total;dur=0.731

(milliseconds, to the microsecond). Stages are contiguous: each one started when the previous one
ended, the first when the transport received the request, and ``total`` is taken last, so the stages
sum to at most ``total`` (each is floored to the microsecond). The stages:

- ``decode``: the request parsed (protobuf, JSON or the binary tensor extension)
- ``auth`` ``route`` ``quota`` ``validation`` ``admission``: the pipeline's hops (the trace's spans
  of the same names, ``server.dataplane.tracing``); ``admission`` includes a fair-queue wait
- ``coalesce``: from admission until the Triton call it rode in started (the coalescer's wait)
- ``replica``: choosing the replica set's member (absent with one Triton)
- ``triton``: the Triton call (the hop, or the in-process call), as the batch saw it
- ``answer``: the batch's answer split and handed back to this request's task (the loop's wake-up)
- ``exit``: output filters (an endpoint with a safety policy), the pipeline's bookkeeping (queue
  release, metrics, metering, traffic observation)
- ``encode``: the answer encoded for the caller (REST JSON / binary, the typed API's message; nothing
  on OIP gRPC)

The typed API adds an ``auth`` before ``decode`` (the model's visibility, checked before its fields
are decoded; :func:`parse` sums it with the pipeline's). An OpenAI stream's ``Server-Timing`` header
is sent with its first event, so it holds the stages until then and the total so far.

A timed request that is also sampled for tracing (``server.dataplane.tracing``) gets its ``decode``,
``replica`` and ``answer`` stages as spans beside the hops' (the other stages have spans already).

Nothing is made for a request that does not ask: the context's ``timing`` stays None, and each hook
is one ``is not None`` test. The coalescer's batch finds its members' timers through ``PENDING``
(keyed by the request object's id while it waits there), which is empty unless a timed request waits.
"""

from __future__ import annotations

import contextvars
from time import perf_counter_ns

# what the caller sends to ask (HTTP header, gRPC metadata key) and the key of the answer
TIMING_HEADER = "inferplane-timing"
SERVER_TIMING = "server-timing"

# id(request) -> its timer while it waits at the coalescer (only timed requests are ever here)
PENDING: dict[int, "StageTimer"] = {}

# the timers of the Triton call being made in this task (set only around a call carrying a timed request)
_BATCH: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("inferplane_batch_timers", default=None)


class StageTimer:
    """The stages of one request, as (name, nanoseconds) in order."""

    __slots__ = ("started", "last", "stages")

    def __init__(self):
        self.started = self.last = perf_counter_ns()
        self.stages: list[tuple[str, int]] = []

    def mark(self, name: str) -> None:
        """The stage ``name`` ended now (it started when the previous one ended)."""
        now = perf_counter_ns()
        self.stages.append((name, now - self.last))
        self.last = now

    def spans(self, now_epoch_ns: int):
        """The stages so far as (name, start, end) in epoch nanoseconds (for trace spans), ``now_epoch_ns``
        being the wall clock now."""
        offset = now_epoch_ns - perf_counter_ns()
        at = self.started + offset
        for name, ns in self.stages:
            yield name, at, at + ns
            at += ns

    def header(self) -> str:
        """The ``Server-Timing`` value: each stage and the total, in milliseconds (floored to the µs)."""
        total = perf_counter_ns() - self.started
        parts = [f"{name};dur={ns // 1000 / 1000:.3f}" for name, ns in self.stages]
        parts.append(f"total;dur={total // 1000 / 1000:.3f}")
        return ", ".join(parts)


def parse(value: str) -> dict[str, float]:
    """A ``Server-Timing`` value -> {stage: milliseconds}; a stage named twice (a retry) is summed."""
    stages: dict[str, float] = {}
    for entry in value.split(","):
        name, _, rest = entry.strip().partition(";")
        for param in rest.split(";"):
            key, _, number = param.strip().partition("=")
            if key == "dur":
                stages[name] = stages.get(name, 0.0) + float(number)
    return stages


# ---- the coalescer's batch (server.dataplane.observe's on_call) --------------------------------


def batch_started(requests: list):
    """A Triton call is about to be made for ``requests``: each timed one's ``coalesce`` ends; the
    finisher to call after it (None: none of them is timed)."""
    timers = tuple(t for t in (PENDING.get(id(r)) for r in requests) if t is not None)
    if not timers:
        return None
    for timer in timers:
        timer.mark("coalesce")
    token = _BATCH.set(timers)

    def done() -> None:
        _BATCH.reset(token)
        for timer in timers:
            timer.mark("triton")

    return done


def replica_chosen() -> None:
    """The replica set chose the member for the call being made in this task."""
    timers = _BATCH.get()
    if timers is not None:
        for timer in timers:
            timer.mark("replica")
