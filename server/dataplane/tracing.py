"""OpenTelemetry traces of the request path: one span per request and one per hop, joined by Triton's own.

Off unless ``INFERPLANE_OTLP_ENDPOINT`` is set; then a request is traced when its W3C ``traceparent``
(gRPC metadata or HTTP header) says sampled, or — without one — with probability
``INFERPLANE_TRACE_SAMPLE_RATIO``. The decision is made first, from one header lookup and one random
number: an unsampled request never creates a span object, a context or a timestamp.

A sampled request gets (parent: the caller's span when it sent one)::

    inferplane <kind>                 SERVER  model, version, replica, tenant, arm, kind, code
      auth                            authenticate + grant
      route                           traffic split, resolve the signature
      quota
      validation
      admission                       deadline check, circuit breaker, fair-queue wait (admission.path)
      coalesce                        waiting for the batch it rode in (batch.id)
      triton infer                    CLIENT  the Triton call (batch.id, batch.rows, batch.requests):
                                      its context goes to Triton as ``traceparent``, so the spans of
                                      Triton's OpenTelemetry trace mode are its children

Hops are timestamps taken on the way and turned into spans when the request ends (spans with
explicit start and end times); only the Triton call span is live, because its id must travel to
Triton. A coalesced call that carries several sampled requests is a child of the first and linked
from the others (their ``coalesce`` spans carry the same ``batch.id``). The exporter is OTLP/HTTP
with a batch span processor (export happens on its own thread).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import random
import time

from server.dataplane.routing import header
from server.dataplane.replicas import SERVED_BY

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
# hops of ``Pipeline.enter``, in order (a refusal ends the hop that was running)
HOPS = ("auth", "route", "quota", "validation", "admission")
# the stages of a timed request (server.dataplane.stage_timing) that get a span of their own here
# (the others are the hops above, ``coalesce`` and the live ``triton infer`` span)
UNTRACED_STAGES = ("decode", "replica", "answer")

# gRPC metadata for the Triton call being made in this task (set only around a traced call)
_OUTGOING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("inferplane_triton_metadata", default=None)


def outgoing_metadata() -> tuple | None:
    """What the Triton client attaches to the call it is making now (None: nothing)."""
    return _OUTGOING.get()


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent; None when absent or malformed."""
    if not value or len(value) < 55:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(flags & 1)


def format_traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


class Tracing:
    """The sampling decision and the spans; built once (``from_settings``) when an endpoint is set."""

    def __init__(self, tracer, ratio: float, *, provider=None, metrics=None, rand=random.random):
        from opentelemetry import trace

        self._trace = trace
        self.tracer = tracer
        self.ratio = ratio
        self.provider = provider
        self.metrics = metrics
        self._random = rand
        self.pending: dict[int, "RequestTrace"] = {}  # id(request) -> its trace while it is at the coalescer
        self._batch_ids = itertools.count(1)
        self._prefix = f"{random.getrandbits(32):08x}"

    @classmethod
    def from_settings(cls, settings, metrics=None) -> "Tracing | None":
        if not settings.otlp_endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        provider = TracerProvider(resource=Resource.create({"service.name": settings.trace_service_name}), sampler=ALWAYS_ON)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(settings.otlp_endpoint)), schedule_delay_millis=500))
        return cls(provider.get_tracer("inferplane"), settings.trace_sample_ratio, provider=provider, metrics=metrics)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # flushes what is queued

    # ---- the decision ------------------------------------------------------------------------

    def begin(self, call) -> "RequestTrace | None":
        """A trace for this request, or None (the common case: nothing made)."""
        value = header(call.ctx, TRACEPARENT) if call.ctx is not None else None
        if value is not None:
            parsed = parse_traceparent(value)
            if parsed is not None:
                if not parsed[2]:
                    return None  # the caller decided: not sampled
                return RequestTrace(self, call.kind, self._remote(parsed))
        if self.ratio <= 0 or self._random() >= self.ratio:
            return None
        return RequestTrace(self, call.kind, None)

    def _remote(self, parsed):
        trace = self._trace
        context = trace.SpanContext(parsed[0], parsed[1], is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
        return trace.set_span_in_context(trace.NonRecordingSpan(context))

    # ---- Triton calls --------------------------------------------------------------------------

    def on_batch(self, requests: list, rows: int, replica: str):
        """A Triton call is about to be made for ``requests``: a span for it when any is traced, its
        traceparent for the call, and the finisher the coalescer calls after it (None: none traced)."""
        pending = self.pending
        members = [t for t in (pending.get(id(r)) for r in requests) if t is not None]
        if not members:
            return None
        now = time.time_ns()
        batch_id = f"{self._prefix}-{next(self._batch_ids)}"
        first = members[0]
        trace = self._trace
        links = [trace.Link(m.span.get_span_context()) for m in members[1:]]
        request = requests[0]
        span = self.tracer.start_span(
            "triton infer",
            context=first.context,
            kind=trace.SpanKind.CLIENT,
            start_time=now,
            links=links,
            attributes={
                "inferplane.model": request.model_name, "inferplane.version": request.model_version,
                "inferplane.replica": replica, "inferplane.batch.id": batch_id,
                "inferplane.batch.rows": rows, "inferplane.batch.requests": len(requests),
            },
        )  # fmt: skip
        context = span.get_span_context()
        for m in members:
            m.batched(batch_id, now, context if m is not first else None)
        token = _OUTGOING.set(((TRACEPARENT, format_traceparent(context.trace_id, context.span_id)),))

        def done(err: BaseException | None = None) -> None:
            _OUTGOING.reset(token)
            served = served_by()  # the call ran in this task: the member the replica set chose
            if served:
                span.set_attribute("inferplane.replica", served)
                for m in members:
                    m.replica = served
            if err is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(err).__name__}: {err}"))
            span.end()

        return done

    def start_call(self, call, name: str, replica: str):
        """A live span for a Triton call made outside the coalescer (an LLM generation's stream):
        (span, metadata carrying its traceparent)."""
        trace = self._trace
        span = self.tracer.start_span(
            name, context=call.trace.context, kind=trace.SpanKind.CLIENT,
            attributes={"inferplane.model": call.name, "inferplane.version": call.version, "inferplane.replica": replica},
        )  # fmt: skip
        context = span.get_span_context()
        return span, ((TRACEPARENT, format_traceparent(context.trace_id, context.span_id)),)

    def end_call(self, span, err: BaseException | None = None) -> None:
        if err is not None and not isinstance(err, GeneratorExit):
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, type(err).__name__))
        span.end()


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base URL (``http://host:4318``) or a full traces URL -> the traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class RequestTrace:
    """One sampled request: its live root span and the hops' timestamps (spans made at the end)."""

    __slots__ = ("tracing", "span", "context", "last_ns", "hops", "submitted_ns", "batch", "replica")

    def __init__(self, tracing: Tracing, kind: str, parent_context):
        trace = tracing._trace
        now = time.time_ns()
        self.tracing = tracing
        self.span = tracing.tracer.start_span(f"inferplane {kind}", context=parent_context, kind=trace.SpanKind.SERVER, start_time=now)
        self.context = trace.set_span_in_context(self.span)
        self.last_ns = now
        self.hops: list[tuple[str, int, int]] = []
        self.submitted_ns = 0
        self.batch: tuple | None = None  # (batch id, when the call started, the call span's context for a link)
        self.replica = ""  # the Triton that answered the call it rode in (a replica set's member)

    def hop(self, name: str) -> None:
        """The hop ``name`` ended now (it started when the previous one ended)."""
        now = time.time_ns()
        self.hops.append((name, self.last_ns, now))
        self.last_ns = now

    # ---- at the coalescer ----------------------------------------------------------------------

    def submitting(self, request) -> None:
        self.submitted_ns = time.time_ns()
        self.tracing.pending[id(request)] = self

    def submitted(self, request) -> None:
        self.tracing.pending.pop(id(request), None)
        if self.submitted_ns and self.batch is None:  # never batched (refused, cancelled): the wait still shows
            self.batch = ("", time.time_ns(), None)

    def batched(self, batch_id: str, started_ns: int, call_context) -> None:
        self.batch = (batch_id, started_ns, call_context)

    # ---- the end ---------------------------------------------------------------------------

    def finish(self, call, err: BaseException | None, replica: str = "") -> None:
        tracing = self.tracing
        trace = tracing._trace
        tracer = tracing.tracer
        now = time.time_ns()
        for name, start, end in self.hops:
            tracer.start_span(name, context=self.context, start_time=start).end(end)
        if not call.admitted and len(self.hops) < len(HOPS):  # refused in this hop
            failed = tracer.start_span(HOPS[len(self.hops)], context=self.context, start_time=self.last_ns)
            failed.set_status(trace.Status(trace.StatusCode.ERROR, call.code))
            failed.end(now)
        timer = call.ctx.timing if call.ctx is not None else None
        if timer is not None:  # the stages the hops above do not cover (server.dataplane.stage_timing)
            for name, start, end in timer.spans(now):
                if name in UNTRACED_STAGES:
                    tracer.start_span(name, context=self.context, start_time=start).end(end)
        if self.batch is not None:
            batch_id, started, linked = self.batch
            links = [trace.Link(linked)] if linked is not None else None
            attributes = {"inferplane.batch.id": batch_id} if batch_id else None
            tracer.start_span("coalesce", context=self.context, start_time=self.submitted_ns, links=links, attributes=attributes).end(started)
        span = self.span
        principal = call.principal
        span.set_attributes({
            "inferplane.model": call.name, "inferplane.version": call.version or "", "inferplane.arm": call.arm,
            "inferplane.kind": call.kind, "inferplane.code": call.code,
            "inferplane.tenant": principal.tenant.name if principal is not None else "",
            "inferplane.replica": self.replica or replica,
        })  # fmt: skip
        if call.code != "OK":
            span.set_status(trace.Status(trace.StatusCode.ERROR, call.code))
        span.end(now)
        if tracing.metrics is not None:
            tracing.metrics.traces_sampled.labels(call.kind).inc()


def served_by() -> str:
    """The Triton that answered this task's last call (a replica set's member), or ""."""
    return SERVED_BY.get()
