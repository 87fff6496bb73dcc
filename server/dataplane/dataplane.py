"""The one data plane: what every transport (gRPC servicer, REST bridge) calls.

It knows the models Triton serves (their signatures and ready versions), validates each request
against its model's signature, forwards it to Triton as the caller's bytes, and records metrics.
It knows nothing of the caller-facing transports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from google.protobuf.message import DecodeError

from batching.coalescer import Coalescer
from batching.fair_queue import AdmissionPolicy, DeadlineUnmeetable, FairQueue, QueueFull
from server.dataplane.batch_codec import CODEC
from server.dataplane.circuit_breaker import CircuitBreaker
from server.errors import (
    BackendError,
    BackendUnavailable,
    DeadlineExceeded,
    InferplaneError,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
)
from server.dataplane.idempotency import MemoryIdempotency, body_digest, scoped
from server.dataplane.metrics import Metrics
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.quota_policy import QuotaPolicy
from server.dataplane.signature import ModelSignature, version_key
from server.dataplane.stream_ledger import StreamLedger
from server.tenancy.identity import CallContext, Gatekeeper, Principal, Tenant
from server.dataplane.routing import Router
from server.dataplane.triton_client import TritonClient
from server.dataplane.validation import validate_infer_request

log = logging.getLogger(__name__)

UNKNOWN_MODEL_LABEL = "_unknown"


def parse_message(message_type, raw: bytes):
    """Parse a protobuf request body; garbage is an InvalidRequest naming the expected message."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise InvalidRequest(f"the request body is not a valid {message_type.DESCRIPTOR.full_name} protobuf") from None


def parse_infer_request(raw: bytes) -> pb.ModelInferRequest:
    return parse_message(pb.ModelInferRequest, raw)


class DataPlane:
    def __init__(self, triton: TritonClient, metrics: Metrics | None = None):
        self.triton = triton
        self.metrics = metrics or Metrics()
        self.models: dict[str, ModelSignature] = {}
        self.loaded: set[str] = set()  # what the operator asked for; reloaded after a Triton restart
        # endpoint -> the version that answers requests naming no version (unset: Triton's latest)
        self.routes: dict[str, str] = {}
        # canary / blue-green / A/B splits and shadow copies over the routes (server.control.traffic)
        self.traffic = Router(self.routes)
        self.backend_up = True
        self._reloading: asyncio.Lock = asyncio.Lock()
        self.coalescer = Coalescer(self.triton.infer_raw, CODEC)
        # tenancy and overload (server.app replaces these with the configured ones)
        self.gate = Gatekeeper()
        self.quotas = QuotaPolicy()
        self.idempotency = MemoryIdempotency()
        self.breaker = CircuitBreaker(triton.target)
        self.meter = None  # server.tenancy.metering.Meter
        self.admission_policy = AdmissionPolicy()
        self.admission_slots: int | None = None  # None: from each model's coalescing policy
        self.admission: dict[str, FairQueue] = {}
        self._queue_readings: dict[tuple[str, str], tuple[int, int]] = {}

    # ---- control ------------------------------------------------------------------------

    async def load_model(self, name: str) -> ModelSignature:
        await self.triton.load_model(name)
        self.loaded.add(name)
        return await self.refresh(name)

    async def unload_model(self, name: str) -> None:
        if name not in self.models and name not in self.loaded:
            raise ModelNotFound(f"model '{name}' is not loaded")
        self.loaded.discard(name)
        self.models.pop(name, None)
        await self.triton.unload_model(name)

    async def refresh(self, name: str) -> ModelSignature:
        """Read the model's config and ready versions from Triton into the model table."""
        config = await self.triton.model_config(name)
        index = await self.triton.repository_index()
        versions = [m.version for m in index if m.name == name and m.state == "READY"]
        signature = ModelSignature.from_config(config, versions)
        self.models[name] = signature
        return signature

    async def read_statistics(self) -> None:
        """Triton's per-model statistics into metrics: response-cache hits and queue time."""
        raw = await self.triton.unary_raw("ModelStatistics", pb.ModelStatisticsRequest().SerializeToString(), timeout=5)
        previous = self._queue_readings
        self._queue_readings = {}
        for stats in pb.ModelStatisticsResponse.FromString(raw).model_stats:
            if stats.name not in self.models:
                continue
            inference = stats.inference_stats
            hits, misses = inference.cache_hit.count, inference.cache_miss.count
            self.metrics.cache_hits.labels(stats.name).set(hits)
            self.metrics.cache_misses.labels(stats.name).set(misses)
            if hits + misses:
                self.metrics.cache_hit_ratio.labels(stats.name).set(hits / (hits + misses))
            key = (stats.name, stats.version)
            self._queue_readings[key] = (inference.queue.count, inference.queue.ns)
            count0, ns0 = previous.get(key, (0, 0))
            if inference.queue.count > count0:
                mean = (inference.queue.ns - ns0) / (inference.queue.count - count0) / 1e9
                self.metrics.triton_queue_seconds.labels(stats.name).set(mean)

    def mark_backend_down(self) -> None:
        self.backend_up = False
        self.metrics.triton_up.set(0)
        self.metrics.triton_restarts.inc()

    async def reload_all(self) -> None:
        """After Triton restarted: load again every model that was loaded, then serve."""
        async with self._reloading:
            for name in sorted(self.loaded):
                try:
                    await self.load_model(name)
                except InferplaneError as err:
                    log.error("reloading model %s failed: %s", name, err.message)
                    self.models.pop(name, None)
            self.backend_up = True
            self.metrics.triton_up.set(1)

    def is_ready(self) -> bool:
        return self.backend_up and all(name in self.models for name in self.loaded)

    # ---- lookups ------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> ModelSignature:
        """The signature serving (name, version); NOT_FOUND / UNAVAILABLE otherwise."""
        if not self.backend_up:
            raise BackendUnavailable("Triton is restarting; retry shortly", retry_after_s=1.0)
        signature = self.models.get(name)
        if signature is None:
            if name in self.loaded:
                raise ModelNotReady(f"model '{name}' is loading or failed to load")
            raise ModelNotFound(f"unknown model '{name}'")
        if version and version not in signature.versions:
            raise ModelNotFound(
                f"unknown version '{version}' of model '{name}' (ready versions: {sorted(signature.versions, key=version_key)})"
            )
        return signature

    def authorize(self, ctx: CallContext | None, name: str) -> Principal:
        """Who is calling, and may they see ``name``? An ungranted model is an unknown one."""
        principal = self.gate.authenticate(ctx)
        if not principal.tenant.may_use(name):
            raise ModelNotFound(f"unknown model '{name}'")
        return principal

    def resolve_for(self, ctx: CallContext | None, name: str, version: str = "") -> ModelSignature:
        """:meth:`resolve` as the caller sees it: authenticated, and only models granted to them."""
        self.authorize(ctx, name)
        return self.resolve(name, version)

    def visible(self, ctx: CallContext | None, names):
        """The names among ``names`` the caller may see."""
        tenant = self.gate.authenticate(ctx).tenant
        return [n for n in names if tenant.may_use(n)]

    async def admit(self, tenant: Tenant, name: str):
        """Charge one request to the tenant's and the tenant x model quotas before any work
        (``Overloaded`` with a retry hint when over); hand the ticket to ``quotas.release``.
        The in-process policy answers without suspending; the Redis one in one round trip."""
        return await self.quotas.admit(tenant.name, name, self.gate.quota(tenant), tenant.model_quota(name))

    def _queue(self, name: str, signature: ModelSignature) -> FairQueue:
        queue = self.admission.get(name)
        if queue is None:
            slots = self.admission_slots
            if slots is None:  # what the model runs at once; the rest waits here, where a caller can leave
                c = signature.coalesce
                slots = c.max_inflight * c.max_batch if c.enabled else signature.instances * max(1, signature.max_batch_size)
            policy = AdmissionPolicy(**{**self.admission_policy.__dict__, "slots": max(1, slots)})
            queue = self.admission[name] = FairQueue(name, policy)
        return queue

    # ---- inference ----------------------------------------------------------------------

    def _route(self, request: pb.ModelInferRequest, raw: bytes | None, ctx: CallContext | None) -> tuple[bytes | None, str]:
        """A request naming no version: pin the live version or a traffic split's arm into it (and
        into its bytes). Returns (bytes to forward, the arm or "")."""
        version, arm = self.traffic.choose(request.model_name, ctx)
        if version:
            request.model_version = version
            raw = pin_version(raw if raw is not None else request.SerializeToString(), version)
        return raw, arm

    async def infer(
        self,
        request: pb.ModelInferRequest,
        raw: bytes | None = None,
        timeout: float | None = None,
        ctx: CallContext | None = None,
        count_tokens: Callable[[bytes], int] | None = None,
    ) -> bytes:
        """Authorize, admit, validate and forward one request; returns Triton's ModelInferResponse bytes.

        ``raw`` is the request exactly as the caller sent it; when given it travels to Triton
        untouched (no re-serialization). ``timeout`` is the caller's remaining deadline (or
        ``ctx.timeout``); it becomes Triton's. ``ctx`` carries the caller's key and idempotency key.
        ``count_tokens`` reads from Triton's answer how many input tokens it covered (embedding
        models report them): they are metered and charged to the tenant's token quota, which only
        the answer can tell.
        Order: key -> grant -> model -> quota -> validation -> idempotency -> admission queue -> Triton.
        """
        started = time.perf_counter()
        name = request.model_name
        label = UNKNOWN_MODEL_LABEL
        version = request.model_version
        code = "OK"
        arm = ""
        data = answer = None
        if ctx is not None:
            ctx.tokens = 0  # this call's, set from its answer (a context may serve several calls)
            if timeout is None:
                timeout = ctx.timeout
        try:
            tenant = self.authorize(ctx, name).tenant
            if not version:
                raw, arm = self._route(request, raw, ctx)
                version = request.model_version
            signature = self.resolve(name, version)
            label = name
            if not version:
                version = signature.latest_version
            ticket = await self.admit(tenant, name)
            try:
                validate_infer_request(request, signature)
                latency, inflight = self.metrics.model(name)
                inflight.inc()
                try:
                    data = raw if raw is not None else request.SerializeToString()

                    def forward():
                        return self._forward(request, data, signature, tenant, version, timeout, ctx, count_tokens)

                    if ctx is not None and ctx.idempotency_key:
                        key = scoped(tenant.name, ctx.idempotency_key)
                        answer = await self.idempotency.run(key, body_digest(data), forward, timeout)
                        return answer
                    answer = await forward()
                    return answer
                except InferplaneError:
                    raise
                except Exception as err:  # a bug or a malformed Triton answer: a status, never a crash
                    log.exception("inference on %s failed", name)
                    raise BackendError(f"inference failed: {err}") from None
                finally:
                    inflight.dec()
                    latency.observe(time.perf_counter() - started)
            finally:
                await self.quotas.release(ticket, ctx.tokens if ctx is not None else 0)
        except InferplaneError as err:
            code = err.reason
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.metrics.count(label, version if label != UNKNOWN_MODEL_LABEL else "", code)
            if ctx is not None:
                ctx.version, ctx.arm = version, arm
            if arm or self.traffic.shadows:
                try:
                    self.traffic.observe(name, arm, code, time.perf_counter() - started, request, data, answer, ctx)
                except Exception:  # traffic bookkeeping must never change an answer
                    log.exception("traffic bookkeeping for %s failed", name)

    async def _forward(
        self,
        request: pb.ModelInferRequest,
        data: bytes,
        signature: ModelSignature,
        tenant: Tenant,
        version: str,
        timeout: float | None,
        ctx: CallContext | None,
        count_tokens: Callable[[bytes], int] | None,
    ) -> bytes:
        """Through the model's admission queue and the replica's circuit breaker to Triton.

        Only an answer Triton computed is metered (an idempotent replay never comes here)."""
        queue = self._queue(request.model_name, signature)
        if timeout is not None and timeout <= (queue.service_s or 0.0):
            raise DeadlineExceeded(
                f"model '{request.model_name}' cannot answer within the deadline ({timeout * 1000:.3f} ms left, "
                f"~{(queue.service_s or 0.0) * 1000:.3f} ms needed)"
            )
        self.breaker.before()  # an open circuit refuses before the request waits anywhere
        admitted = False
        err: BaseException | None = None
        try:
            if not queue.try_acquire():
                waited = time.perf_counter()
                try:
                    await queue.acquire(tenant.name, tenant.weight, timeout)
                except QueueFull as refused:
                    raise Overloaded(refused.message, retry_after_s=refused.retry_after_s) from None
                except DeadlineUnmeetable as refused:
                    raise DeadlineExceeded(refused.message) from None
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.perf_counter() - waited))
            admitted = True
            t0 = time.perf_counter()
            try:
                answer = await self.coalescer.submit(request, data, signature.coalesce, timeout)
            finally:
                service_s = time.perf_counter() - t0
                queue.release(service_s)
            tokens = 0
            if count_tokens is not None:
                tokens = count_tokens(answer)
                if ctx is not None:
                    ctx.tokens = tokens  # charged to the token quota when the ticket is released
            if self.meter is not None:
                self.meter.record(tenant.name, tenant.team, request.model_name, version, input_tokens=tokens, compute_us=int(service_s * 1e6))
            return answer
        except BaseException as e:
            err = e
            raise
        finally:
            if admitted:
                self.breaker.record(err)
            else:
                self.breaker.neutral()

    async def stream_infer(
        self, raw_requests: AsyncIterator[bytes], timeout: float | None = None, ctx: CallContext | None = None
    ) -> AsyncIterator[bytes]:
        """ModelStreamInfer: each request is admitted and validated; refused ones get an in-stream error.

        Yields serialized ModelStreamInferResponse messages, Triton's and the frontend's own,
        until the caller has finished writing and Triton has sent its last response. Each
        request written to Triton holds its quota ticket until its final response (or the end of
        the stream) and is metered then, with the LLM's tokens (server.dataplane.stream_ledger).
        """
        tenant = self.gate.authenticate(ctx).tenant  # before the first message: the call is refused
        out: asyncio.Queue = asyncio.Queue()
        call = self.triton.stream_raw(timeout=timeout)
        done = object()

        def on_end(model: str, version: str, code: str, seconds: float, request_id: str, arm: str) -> None:
            self.metrics.count(model, version, code)
            if arm:  # the split's windows (canary analysis, A/B); streams make no shadow copies
                self.traffic.observe(model, arm, code, seconds, pb.ModelInferRequest(id=request_id), None, None, ctx)

        ledger = StreamLedger(tenant, self.quotas, self.meter, on_end)

        async def pump() -> None:
            try:
                async for raw in raw_requests:
                    request = None
                    try:
                        request = parse_infer_request(raw)
                        if not tenant.may_use(request.model_name):
                            raise ModelNotFound(f"unknown model '{request.model_name}'")
                        arm = ""
                        if not request.model_version:
                            raw, arm = self._route(request, raw, ctx)
                        signature = self.resolve(request.model_name, request.model_version)
                        ticket = await self.admit(tenant, request.model_name)
                        try:
                            validate_infer_request(request, signature)
                        except InferplaneError:
                            await self.quotas.release(ticket)
                            raise
                    except InferplaneError as err:
                        self.metrics.count(UNKNOWN_MODEL_LABEL if request is None else request.model_name, "", err.reason)
                        await out.put(_stream_error(err, request))
                        continue
                    ledger.sent(request, signature, ticket, arm)
                    await call.write(raw)
            finally:
                await call.done_writing()

        async def relay() -> None:
            try:
                async for response in call:
                    try:
                        await ledger.answered(response)  # before the caller sees it: its tokens are charged
                    except Exception:  # bookkeeping must never change or stop an answer
                        log.exception("stream bookkeeping failed")
                    await out.put(response)
            except Exception as err:  # the stream failed after it started: tell the caller in-stream
                await out.put(_stream_error(BackendUnavailable(f"Triton stream failed: {err}"), None))
            finally:
                await out.put(done)

        tasks = [asyncio.create_task(pump()), asyncio.create_task(relay())]
        try:
            while (item := await out.get()) is not done:
                yield item
            await tasks[0]
        finally:
            for task in tasks:
                task.cancel()
            call.cancel()
            await ledger.close()


def pin_version(raw: bytes, version: str) -> bytes:
    """The same request with ``model_version`` set, without re-serializing it.

    A protobuf parser keeps the last occurrence of a scalar field, so appending field 2
    (``model_version``) to the caller's bytes overrides whatever they carried.
    """
    data = version.encode()
    return raw + b"\x12" + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _stream_error(err: InferplaneError, request) -> bytes:
    response = pb.ModelStreamInferResponse(error_message=f"{err.reason}: {err.message}")
    if request is not None:
        response.infer_response.model_name = request.model_name
        response.infer_response.id = request.id
    return response.SerializeToString()
