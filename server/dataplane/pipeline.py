"""The one admission pipeline every request goes through, whatever its transport or kind.

``async with pipeline.admitted(ctx, name, version, kind, validate=…) as call:`` runs, in this
order and nowhere else:

    authenticate -> grant -> route (traffic split or live version) -> resolve (the signature)
    -> quota -> validate -> safety (the endpoint's input filters, when it has a policy)
    -> deadline check -> circuit breaker -> fair queue

and on the way out, however the body ended (answer, error, cancellation, the caller gone):

    release the queue slot -> breaker outcome -> quota release (with the call's tokens)
    -> meter (only when the body computed something) -> metrics -> traffic observation

The body gets an :class:`AdmittedCall`: the resolved signature, the version that answers (and the
split's arm), the tenant, the deadline left after waiting, and fields it fills in for the exit —
tokens in/out, whether Triton worked on it, a copy for a shadow version. Output filters run where the
answer is made: ``screen_output`` on a unary answer's texts, ``output_stream`` on a generation's chunks. ModelInfer, REST infer,
embeddings, each ModelStreamInfer message, OpenAI chat/completions and gRPC Generate all enter
here; a stream message holds its call open until its final response arrives (``admitted(…).open()``
enters it, ``exit`` ends it: the two halves of the context manager, usable from different tasks).

The metrics label of a request is its model's name only once the model resolved; anything a
caller names that is not served folds into one ``_unknown`` label, so label sets stay bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from batching.fair_queue import BATCH, AdmissionPolicy, DeadlineUnmeetable, FairQueue, QueueFull
from batching.overload_policy import OverloadPolicy
from server.dataplane.circuit_breaker import BreakerSet, CircuitBreaker
from server.dataplane.metrics import UNKNOWN_MODEL_LABEL, Metrics
from server.dataplane.models import Asleep
from server.dataplane.routing import Router
from server.dataplane.signature import ModelSignature, is_llm
from server.errors import BackendError, Cancelled, DeadlineExceeded, InferplaneError, ModelNotFound, Overloaded
from server.tenancy.identity import CallContext, Gatekeeper, Principal, Tenant
from server.tenancy.monthly_quotas import QuotaTicket

log = logging.getLogger(__name__)

# kinds of work (a label on nothing yet; they decide the metering and the queue's slot sizing)
INFER, STREAM, GENERATE = "infer", "stream", "generate"
CANCELLED = Cancelled("").reason
BATCH_SCOPE = "#batch"  # appended to a tenant's name: the quota scope of its batch jobs' rows


class AdmittedCall:
    """One request inside the pipeline (what the body of ``admitted`` sees and fills in)."""

    __slots__ = (
        "ctx", "name", "version", "arm", "kind", "signature", "principal", "timeout", "started",
        "label", "ticket", "queue", "breaker", "admitted", "waited_at", "dispatched_at", "dispatch_timeout",
        "tokens_in", "tokens_out", "computed", "compute_s", "request", "shadow", "inflight", "latency", "code", "closed", "routed",
        "trace", "answer", "batch", "safety", "adapter", "port",
    )  # fmt: skip

    def __init__(
        self, ctx: CallContext | None, name: str, version: str = "", kind: str = INFER, *, timeout: float | None = None, adapter: str = "", port=None
    ):
        """Made by :meth:`Pipeline.admitted` from what it is given; the deadline is ``timeout``, else the context's."""
        if timeout is None and ctx is not None:
            timeout = ctx.timeout
        self.ctx = ctx
        self.name = name
        self.version = version  # as asked; after routing and resolving: the version that answers
        self.arm = ""
        self.routed = False  # the pipeline chose the version (the request named none): the body pins it
        self.kind = kind
        self.signature: ModelSignature | None = None
        self.principal: Principal | None = None
        self.timeout = timeout  # seconds left; after the queue: what is left after waiting
        self.started = time.perf_counter()
        self.label = UNKNOWN_MODEL_LABEL
        self.ticket = None
        self.queue: FairQueue | None = None
        self.breaker: CircuitBreaker | None = None
        self.admitted = False  # holds a queue slot
        self.waited_at = 0.0
        self.dispatched_at = 0.0
        self.dispatch_timeout: float | None = None
        self.tokens_in = 0  # prompt / input tokens the answer covered: metered, charged to the token quota
        self.tokens_out = 0  # generated tokens
        self.computed = False  # Triton worked on it (a replayed idempotent answer did not): metered
        self.compute_s: float | None = None  # how long Triton worked (default: from dispatch to exit)
        self.request = None  # the ModelInferRequest sent (its id names it in A/B feedback)
        self.shadow: tuple | None = None  # (bytes sent, answer) for a shadow copy
        self.inflight = self.latency = None
        self.code = "OK"
        self.closed = False
        self.trace = None  # server.dataplane.tracing.RequestTrace when this request is sampled
        self.answer = None  # the answer's bytes (the sampled copies of server.dataplane.observe read it)
        self.batch = ctx is not None and ctx.priority == BATCH  # a batch job's row: the queue's batch class
        self.safety = None  # the endpoint's server.dataplane.safety.SafetyPolicy, when it has one
        self.adapter = adapter  # a LoRA adapter of the model (model="base:adapter"): its own grant, quota and meter
        self.port = port  # the server.dataplane.port.ModelPort that admitted it: the safety classifier's calls go through it

    @property
    def endpoint(self) -> str:
        """What the caller named: the model, or ``model:adapter``."""
        return f"{self.name}:{self.adapter}" if self.adapter else self.name

    @property
    def tenant(self) -> Tenant:
        return self.principal.tenant


class Pipeline:
    """Built once from the settings' collaborators (``server.dataplane.builder``); never mutated after."""

    def __init__(
        self,
        *,
        gate: Gatekeeper,
        quotas,  # QuotaPolicy or RedisQuotaPolicy
        router: Router,
        metrics: Metrics,
        resolve: Callable[[str, str], ModelSignature],
        replica: str,
        breaker_policy=None,
        admission_policy: AdmissionPolicy = AdmissionPolicy(),
        admission_slots: int | None = None,
        meter=None,  # server.tenancy.metering.Meter
        observer=None,  # server.dataplane.observe.Observer: tenant metrics, traces, sampled copies
        safety=None,  # server.dataplane.safety.SafetyStage: input and output filters of endpoints with a policy
    ):
        self.gate = gate
        self.quotas = quotas
        self.router = router
        self.metrics = metrics
        self.meter = meter
        self._resolve = resolve
        self.replica = replica
        self.breakers = BreakerSet(breaker_policy) if breaker_policy is not None else BreakerSet()
        self.admission_policy = admission_policy
        self.admission_slots = admission_slots  # None: from each model's own capacity
        self.queues: dict[str, FairQueue] = {}
        self.observer = observer
        self.tracing = observer.tracing if observer is not None else None
        self.safety = safety
        self._sized: dict[str, ModelSignature] = {}  # the signature each queue was sized for

    # ---- the context manager ---------------------------------------------------------------

    def admitted(
        self,
        ctx: CallContext | None,
        name: str,
        version: str = "",
        kind: str = INFER,
        *,
        timeout: float | None = None,
        validate: Callable[[ModelSignature], None] | None = None,
        texts: Callable[[ModelSignature], object] | None = None,
        adapter: str = "",
        port=None,
    ) -> "Admission":
        """One call, made here and nowhere else: ``async with pipeline.admitted(…) as call`` enters it
        (:meth:`enter`) and exits it however the body ends (:meth:`exit`); ``await pipeline.admitted(…).open()``
        enters a call that another task will exit (a stream message).
        ``validate(signature)``: the request's own checks against the resolved signature.
        ``texts(signature)``: the request's texts (``server.dataplane.safety.TextSlots``) for the safety
        stage's input screen, when the endpoint has a policy. ``adapter``: a LoRA adapter of model
        ``name``, granted, quota'd and metered as ``name:adapter``. ``port``: the model port making the call
        (``server.dataplane.port``), through which the safety classifier's own calls go."""
        return Admission(self, AdmittedCall(ctx, name, version, kind, timeout=timeout, adapter=adapter, port=port), validate, texts)

    async def enter(self, call: AdmittedCall, validate: Callable[[ModelSignature], None] | None = None, texts=None) -> AdmittedCall:
        """Everything before the work. On a refusal it closes the call itself (counted, released) and raises."""
        trace = call.trace = self.tracing.begin(call) if self.tracing is not None else None  # None unless sampled
        ctx = call.ctx
        timer = ctx.timing if ctx is not None else None  # None unless the caller asked (server.dataplane.stage_timing)
        try:
            call.principal = principal = self.gate.authenticate(ctx)
            if not granted(principal, call.endpoint, ctx):
                raise ModelNotFound(f"unknown model '{call.endpoint}'")
            if trace is not None:
                trace.hop("auth")
            if timer is not None:
                timer.mark("auth")
            if not call.version:
                call.version, call.arm = self.router.choose(call.name, ctx)
                call.routed = bool(call.version)
            signature = call.signature = await self._resolve_held(call)
            call.label = call.name
            if not call.version:
                call.version = signature.latest_version
            tenant = principal.tenant
            if trace is not None:
                trace.hop("route")
            if timer is not None:
                timer.mark("route")
            # a batch job's rows have their own charge (the tenant's limits, a bucket of their own): a
            # batch never spends the quota the tenant's real-time callers need
            scope = tenant.name + BATCH_SCOPE if call.batch else tenant.name
            # an adapter with a quota of its own is charged there; otherwise to its model's (one bucket for both)
            quota_key = call.endpoint if call.adapter and tenant.model_quota(call.endpoint) else call.name
            call.ticket = await self.quotas.admit(scope, quota_key, self.gate.quota(tenant), tenant.model_quota(quota_key))
            if ctx is not None and isinstance(call.ticket, QuotaTicket):
                ctx.quota_headers = call.ticket.headers  # the monthly allowance left, for the transport
            if trace is not None:
                trace.hop("quota")
            if timer is not None:
                timer.mark("quota")
            if validate is not None:
                validate(signature)
            if self.safety is not None:
                await self._screen_input(call, texts)
            if trace is not None:
                trace.hop("validation")
            if timer is not None:
                timer.mark("validation")
            call.latency, call.inflight = self.metrics.model(call.name)
            call.inflight.inc()
            queue = call.queue = self._queue(call.name, signature)
            timeout = call.timeout
            if timeout is not None and timeout <= (queue.service_s or 0.0):
                raise DeadlineExceeded(
                    f"model '{call.name}' cannot answer within the deadline ({timeout * 1000:.3f} ms left, "
                    f"~{(queue.service_s or 0.0) * 1000:.3f} ms needed)"
                )
            breaker = call.breaker = self.breakers[f"{self.replica}/{call.name}/{call.version}"]
            breaker.before()  # an open circuit refuses before the request waits anywhere
            try:
                if call.batch:  # only capacity real-time traffic leaves (batching.fair_queue)
                    await self._wait_batch(call, queue, tenant)
                elif queue.try_acquire():
                    self.metrics.admitted(call.name, "direct")
                else:
                    await self._wait(call, queue, tenant, timeout)
            except BaseException:
                breaker.neutral()
                call.breaker = None
                raise
            call.admitted = True
            if trace is not None:
                trace.hop("admission")
            if timer is not None:
                timer.mark("admission")
            call.dispatched_at = time.perf_counter()
            call.dispatch_timeout = call.timeout
            return call
        except BaseException as err:
            await self.exit(call, err)
            raise

    async def exit(self, call: AdmittedCall, err: BaseException | None = None) -> None:
        """Everything after the work; safe to call once per call (later calls do nothing)."""
        if call.closed:
            return
        call.closed = True
        if err is not None:
            call.code = _code(err)
        try:
            now = time.perf_counter()
            if call.admitted:
                call.queue.release(now - call.dispatched_at, batch=call.batch)
            if call.breaker is not None:
                self._breaker_outcome(call, err)
            if call.inflight is not None:
                call.inflight.dec()
                call.latency.observe(now - call.started)
            if call.ticket is not None:
                await self.quotas.release(call.ticket, call.tokens_in + call.tokens_out)
            if call.computed and self.meter is not None:
                compute_s = call.compute_s if call.compute_s is not None else now - call.dispatched_at
                tenant = call.tenant
                self.meter.record(
                    tenant.name, tenant.team, call.endpoint, call.version,
                    input_tokens=call.tokens_in, output_tokens=call.tokens_out, compute_us=int(compute_s * 1e6),
                    **({"traffic_class": BATCH} if call.batch else {}),
                )  # fmt: skip
        finally:
            resolved = call.label != UNKNOWN_MODEL_LABEL
            self.metrics.count(call.label, call.version if resolved else "", call.code)
            if self.observer is not None:
                self._observe(call, err)
            if call.ctx is not None and call.ctx.timing is not None:
                call.ctx.timing.mark("exit")
            if resolved and (call.arm or self.router.shadows):
                try:
                    sent, answer = call.shadow or (None, None)
                    self.router.observe(call.name, call.arm, call.code, time.perf_counter() - call.started, call.request, sent, answer, call.ctx)
                except Exception:  # traffic bookkeeping must never change an answer
                    log.exception("traffic bookkeeping for %s failed", call.name)

    # ---- the safety stage (server.dataplane.safety) ------------------------------------------

    async def _screen_input(self, call: AdmittedCall, texts) -> None:
        policy = call.safety = self.safety.policy(call)
        if policy is not None and policy.input is not None and texts is not None:
            slots = texts(call.signature)
            if slots is not None:
                await self.safety.screen_input(call, slots)

    async def screen_output(self, call: AdmittedCall, slots) -> bool:
        """A unary answer's texts through the endpoint's output filters; True when they were rewritten."""
        if call.safety is None or call.safety.output is None:
            return False
        return await self.safety.screen_output(call, slots)

    def output_stream(self, call: AdmittedCall):
        """The endpoint's output filter for one generation stream (``OutputStream``), or None."""
        if call.safety is None or call.safety.output is None:
            return None
        return self.safety.stream(call)

    # ---- pieces ----------------------------------------------------------------------------

    def _observe(self, call: AdmittedCall, err: BaseException | None) -> None:
        """Tenant metrics, the trace's spans, sampled copies (``server.dataplane.observe``): never an answer's business."""
        try:
            self.observer.exit(call, err, time.perf_counter())
        except Exception:
            log.exception("observing a request to %s failed", call.name)
    async def _resolve_held(self, call: AdmittedCall) -> ModelSignature:
        """Resolve; a scaled-to-zero model is loaded while the request waits (every concurrent
        first request shares the one load), within its deadline and the endpoint's cold-start budget."""
        try:
            return self._resolve(call.name, call.version)
        except Asleep as asleep:
            held = time.perf_counter()
            await asleep.waker.wait(call.timeout)
            if call.timeout is not None:
                call.timeout = max(0.0, call.timeout - (time.perf_counter() - held))
            return self._resolve(call.name, call.version)

    async def _wait(self, call: AdmittedCall, queue: FairQueue, tenant: Tenant, timeout: float | None) -> None:
        """The slow path: no free slot, wait in the model's queue in weighted fair order."""
        depth = self.metrics.queue_depth.labels(call.name)
        waited = time.perf_counter()
        try:
            depth.inc()
            await queue.acquire(tenant.name, tenant.weight, timeout)
        except QueueFull as refused:
            self.metrics.admitted(call.name, "refused")
            raise Overloaded(refused.message, retry_after_s=refused.retry_after_s) from None
        except DeadlineUnmeetable as refused:
            self.metrics.admitted(call.name, "shed")
            raise DeadlineExceeded(refused.message) from None
        finally:
            depth.dec()
        self.metrics.admitted(call.name, "queued")
        self.metrics.waited(call.name, time.perf_counter() - waited)
        if timeout is not None:
            call.timeout = max(0.0, timeout - (time.perf_counter() - waited))

    async def _wait_batch(self, call: AdmittedCall, queue: FairQueue, tenant: Tenant) -> None:
        """A batch row: a slot no real-time request is waiting for, within the batch class's share."""
        if not queue.try_acquire_batch():
            try:
                await queue.acquire_batch(tenant.name, tenant.weight, call.timeout)
            except QueueFull as refused:
                raise Overloaded(refused.message, retry_after_s=refused.retry_after_s) from None
            except DeadlineUnmeetable as refused:
                raise DeadlineExceeded(refused.message) from None
        self.metrics.admitted(call.name, "batch")

    def _queue(self, name: str, signature: ModelSignature) -> FairQueue:
        queue = self.queues.get(name)
        if queue is None or self._sized.get(name) is not signature:
            queue = self._size_queue(name, signature, queue)
        return queue

    def _size_queue(self, name: str, signature: ModelSignature, queue: FairQueue | None) -> FairQueue:
        """The model's queue for this signature: made, or resized in place when the signature
        changed under load (its replicas or instances scaled), keeping whoever waits in it."""
        slots = max(1, self.admission_slots or model_slots(signature))
        self._sized[name] = signature
        overload = model_overload(signature, self.admission_policy.overload)
        if queue is None:
            policy = AdmissionPolicy(**{**self.admission_policy.__dict__, "slots": slots, "overload": overload})
            queue = self.queues[name] = FairQueue(name, policy)
        else:
            queue.governor.policy = overload  # a reload may bring another queue TTL
            if queue.policy.slots != slots:
                queue.resize(slots)
        return queue

    def forget(self, name: str) -> None:
        """The model left (unloaded or reloaded): its queue is sized again from its next signature."""
        queue = self.queues.get(name)
        if queue is not None and not queue.inflight and not queue.size:
            del self.queues[name]
            self._sized.pop(name, None)

    def _breaker_outcome(self, call: AdmittedCall, err: BaseException | None) -> None:
        """Only what says the backend is sick counts: unreachable, crashed, or timing out on work it
        had ample time for. A caller's bad input, a model's error on one input, a cancellation, a
        short deadline — none of these count (a tenant cannot open the circuit for everyone)."""
        breaker = call.breaker
        if err is None:
            if call.computed:
                breaker.success()
            else:
                breaker.neutral()
        elif isinstance(err, DeadlineExceeded):
            given = call.dispatch_timeout
            typical = call.queue.service_s or 0.0
            if given is not None and given >= max(1.0, 10.0 * typical) and call.computed:
                breaker.failure()
            else:
                breaker.neutral()
        elif isinstance(err, InferplaneError) and err.reason == "UNAVAILABLE":
            breaker.failure()
        else:
            breaker.neutral()


class Admission:
    """A call made by :meth:`Pipeline.admitted`, with its checks: ``async with`` over :meth:`Pipeline.enter` /
    :meth:`Pipeline.exit` (no generator frames), or :meth:`open` when another task exits it."""

    __slots__ = ("pipeline", "call", "validate", "texts")

    def __init__(self, pipeline: Pipeline, call: AdmittedCall, validate, texts=None):
        self.pipeline, self.call, self.validate, self.texts = pipeline, call, validate, texts

    async def open(self) -> AdmittedCall:
        """:meth:`Pipeline.enter` the call; :meth:`Pipeline.exit` ends it, from this task or another."""
        return await self.pipeline.enter(self.call, self.validate, self.texts)

    async def __aenter__(self) -> AdmittedCall:
        return await self.open()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc is None and exc_type is not None:
            exc = exc_type()
        await self.pipeline.exit(self.call, exc)


def granted(principal: Principal, name: str, ctx: CallContext | None) -> bool:
    """May this principal call ``name``? A delegated call may be covered beyond its own grants (a
    composite's node by the composite's grant, the platform's own call by none: ``Delegation``)."""
    tenant = principal.tenant
    return tenant.may_use(name) or (ctx is not None and ctx.delegation is not None and ctx.delegation.grants(tenant, name))


def model_slots(signature: ModelSignature) -> int:
    """How many requests a model works on at once: the rest waits in the frontend's fair queue,
    where a caller can leave. Coalesced: merged calls in flight x their rows; an LLM engine: its
    concurrent sequences; otherwise Triton's instances x max batch size."""
    c = signature.coalesce
    if c.enabled:
        return c.max_inflight * c.max_batch
    if is_llm(signature):
        return signature.instances * max(1, signature.max_running)
    return signature.instances * max(1, signature.max_batch_size)


QUEUE_TTL_PARAMETER = "inferplane.queue_ttl_ms"


def model_overload(signature: ModelSignature, default: OverloadPolicy) -> OverloadPolicy:
    """The model's overload policy: its config's queue TTL (``inferplane.queue_ttl_ms``) over the default."""
    raw = signature.params.get(QUEUE_TTL_PARAMETER)
    if not raw:
        return default
    try:
        ttl_ms = float(raw)
    except ValueError:
        log.warning("model %s: %s=%r is not a number; the default queue TTL applies", signature.name, QUEUE_TTL_PARAMETER, raw)
        return default
    return replace(default, queue_ttl_s=ttl_ms / 1000.0) if ttl_ms > 0 else default


def _code(err: BaseException) -> str:
    if isinstance(err, InferplaneError):
        return err.reason
    if isinstance(err, (asyncio.CancelledError, GeneratorExit)):
        return CANCELLED
    return BackendError("").reason
