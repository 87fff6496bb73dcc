"""The one data plane: what every transport (gRPC, REST, OpenAI, typed) calls.

It keeps the model table in step with Triton, sends every request through the one admission
pipeline (``server.dataplane.pipeline``), forwards it to Triton as the caller's bytes (through the
coalescer where requests can merge) and knows nothing of the caller-facing transports. The Triton
backend is private to it: transports and the control plane call the methods below, never Triton.
It is the model port (``server.dataplane.port``) its features are built with and call: the LLM
service, composite endpoints, the safety classifier. It is built once from the settings
(``server.dataplane.builder.build_dataplane``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError

from batching.coalescer import Coalescer
from batching.overload_policy import LoopGate
from server.dataplane import stage_timing, triton_stats
from server.dataplane.backend import Backend
from server.dataplane.capacity_policy import BATCH, TRAFFIC
from server.dataplane.engine_calls import EngineCalls
from server.dataplane.generation import LLMService
from server.dataplane.idempotency import body_digest, scoped
from server.dataplane.loop_gate import Admission
from server.dataplane.metrics import Metrics
from server.dataplane.models import ModelTable
from server.dataplane.composite import Composites, Plan
from server.dataplane.port import Answered, Chunk, GenerateParams
from server.dataplane.pipeline import INFER, STREAM, UNKNOWN_MODEL_LABEL, Pipeline, granted
from server.dataplane.routing import Router
from server.dataplane.safety import infer_texts, tensor_texts
from server.dataplane.signature import ModelSignature, is_llm
from server.dataplane.stream_ledger import StreamLedger
from server.dataplane.validation import validate_infer_request
from server.dataplane.wire import pin_version
from server.errors import BackendError, BackendUnavailable, InferplaneError, InvalidRequest, ModelNotFound, public_message
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext, Gatekeeper, Principal

log = logging.getLogger(__name__)

__all__ = ["DataPlane", "UNKNOWN_MODEL_LABEL", "parse_infer_request", "parse_message"]


def parse_message(message_type, raw: bytes):
    """Parse a protobuf request body; garbage is an InvalidRequest naming the expected message."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise InvalidRequest(f"the request body is not a valid {message_type.DESCRIPTOR.full_name} protobuf") from None


def parse_infer_request(raw: bytes) -> pb.ModelInferRequest:
    return parse_message(pb.ModelInferRequest, raw)


class DataPlane:
    def __init__(
        self,
        backend: Backend,
        *,
        metrics: Metrics,
        pipeline: Pipeline,
        table: ModelTable,
        router: Router,
        coalescer: Coalescer,
        idempotency,  # MemoryIdempotency or RedisIdempotency
        prefix_chars: int,  # an LLM generation's routing key: its prompt's leading characters (batching.route_policy)
        stall_s: float,  # no token for this long: a generation is cancelled (engine_calls.GenerationStalled)
    ):
        self._backend = backend
        self.metrics = metrics
        self._pipeline = pipeline
        self._table = table
        self._router = router
        self._coalescer = coalescer
        self._idempotency = idempotency
        self._reloading = asyncio.Lock()
        self._queue_readings: dict[tuple[str, str], tuple[int, int]] = {}
        self._stat_readings: dict = {}
        self._engine = EngineCalls(self, pipeline, backend, idempotency, prefix_chars=prefix_chars, stall_s=stall_s)
        # the features, each built with this data plane as its model port (server.dataplane.port)
        self.llm = LLMService(self)
        self.loop_gate = LoopGate()  # fed by server.dataplane.loop_gate.watch (started with the servers)
        self.admission = Admission(self.loop_gate)
        self.composites = Composites(self, self.llm, metrics)  # composite endpoints (server.dataplane.composite)
        self.features = None  # server.dataplane.feature_store.FeatureFetcher, with INFERPLANE_FEATURE_STORE_URL

    # ---- collaborators others may read ----------------------------------------------------

    @property
    def gate(self) -> Gatekeeper:
        return self._pipeline.gate

    @property
    def router(self) -> Router:
        return self._router

    @property
    def observer(self):
        """server.dataplane.observe.Observer: the sampled copies the drift monitor and payload log read."""
        return self._pipeline.observer

    @property
    def backend_target(self) -> str:
        return self._backend.target

    async def close(self) -> None:
        """Flush the last usage records and close shared connections (Redis, Triton channels)."""
        if self._pipeline.meter is not None:
            await self._pipeline.meter.stop()
        if self._pipeline.tracing is not None:
            await asyncio.to_thread(self._pipeline.tracing.shutdown)  # the last spans go out
        for shared in (self._idempotency, self._pipeline.quotas, self.features):
            close = getattr(shared, "close", None)
            if close is not None:
                await close()
        await self._backend.close()

    # ---- the model table ------------------------------------------------------------------

    def signature(self, name: str) -> ModelSignature | None:
        return self._table.signatures.get(name)

    def ready_versions(self, name: str) -> frozenset[str]:
        signature = self._table.signatures.get(name)
        return signature.versions if signature is not None else frozenset()

    def is_loaded(self, name: str) -> bool:
        """Asked to be loaded (ready or not)."""
        return name in self._table.loaded

    def names(self) -> list[str]:
        return self._table.names()

    @property
    def backend_up(self) -> bool:
        return self._table.backend_up

    def is_ready(self) -> bool:
        t = self._table
        return t.backend_up and all(name in t.signatures for name in t.loaded)

    def resolve(self, name: str, version: str = "") -> ModelSignature:
        return self._table.resolve(name, version)

    # ---- composite endpoints (server.dataplane.composite) ------------------------------------

    def install_composite(self, plan: Plan) -> ModelSignature:
        """A composite's version: served under the composite's name (its signature in the model table)."""
        t = self._table
        if plan.name in t.loaded or (plan.name in t.signatures and not self.composites.serves(plan.name)):
            raise InvalidRequest(f"'{plan.name}' is a model served by Triton; a composite needs a name of its own")
        signature = t.signatures[plan.name] = self.composites.add(plan)
        self._pipeline.forget(plan.name)
        return signature

    def remove_composite(self, name: str, version: str) -> None:
        """A composite's version leaves; with its last one, the composite."""
        signature = self.composites.drop(name, version)
        if signature is not None:
            self._table.signatures[name] = signature
        else:
            self._table.signatures.pop(name, None)
        self._pipeline.forget(name)

    # ---- routes (the deployer's switch) ---------------------------------------------------

    def live_version(self, name: str) -> str | None:
        """The version answering requests that name none (None: Triton's latest)."""
        return self._router.routes.get(name)

    def set_live(self, name: str, version: str) -> None:
        """The deploy / rollback switch: one assignment on the event loop."""
        self._router.routes[name] = version

    # ---- control --------------------------------------------------------------------------

    async def load_model(self, name: str) -> ModelSignature:
        if name not in {m.name for m in await self._backend.repository_index()}:
            raise ModelNotFound(f"no model '{name}' in the model repository")
        await self._backend.load_model(name)
        self._table.loaded.add(name)
        return await self.refresh(name)

    async def unload_model(self, name: str, *, missing_ok: bool = False) -> None:
        t = self._table
        if self.composites.serves(name):
            raise InvalidRequest(f"'{name}' is a composite endpoint: its versions come and go with deploy and rollback")
        if name not in t.signatures and name not in t.loaded and not missing_ok:
            raise ModelNotFound(f"model '{name}' is not loaded")
        self.release(name)
        try:
            await self._backend.unload_model(name)
        except InferplaneError:
            if not missing_ok:
                raise

    def release(self, name: str) -> None:
        """The model leaves this process's table, Triton untouched (the leader scaled it to zero and unloads it)."""
        t = self._table
        t.loaded.discard(name)
        t.signatures.pop(name, None)
        self._pipeline.forget(name)

    async def adopt(self, name: str) -> ModelSignature:
        """A model another process loaded into the same Triton (a worker of ``--workers N``)."""
        self._table.loaded.add(name)
        return await self.refresh(name)

    async def refresh(self, name: str) -> ModelSignature:
        """Read the model's config and ready versions from Triton into the model table."""
        config = await self._backend.model_config(name)
        index = await self._backend.repository_index()
        versions = [m.version for m in index if m.name == name and m.state == "READY"]
        signature = ModelSignature.from_config(config, versions)
        self._table.signatures[name] = signature
        self._pipeline.forget(name)
        return signature

    async def repository_index(self) -> list:
        """Triton's repository index (every model in the repository, loaded or not)."""
        return await self._backend.repository_index()

    async def read_statistics(self) -> None:
        """Triton's per-model statistics into metrics: response-cache hits and queue time."""
        response = await self._backend.model_statistics()
        previous = self._queue_readings
        self._queue_readings = {}
        self._stat_readings = triton_stats.export_statistics(self.metrics, response, set(self._table.signatures), self._stat_readings)
        for stats in response.model_stats:
            if stats.name not in self._table.signatures:
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
        self._table.backend_up = False
        self.metrics.triton_up.set(0)
        self.metrics.triton_restarts.inc()

    async def reload_all(self) -> None:
        """After Triton restarted: load again every model that was loaded, then serve."""
        async with self._reloading:
            for name in sorted(self._table.loaded):
                try:
                    await self.load_model(name)
                except InferplaneError as err:
                    log.error("reloading model %s failed: %s", name, err.message)
                    self._table.signatures.pop(name, None)
            self._table.backend_up = True
            self.metrics.triton_up.set(1)

    async def backend_infer(self, raw: bytes, timeout: float | None = None) -> bytes:
        """A call to Triton that is nobody's request — a deploy's warm-up, a shadow copy: outside the
        pipeline, so it is neither charged, metered, counted nor queued."""
        return await self._backend.infer_raw(raw, timeout)

    async def backend_generate(self, name: str, version: str, prompt: str, max_tokens: int, timeout: float | None = None) -> str:
        """A generation that is nobody's request (an LLM deploy's warm-up), pinned to ``version``:
        outside the pipeline like ``backend_infer``; the engine's text."""
        return await self._engine.warm_up(name, version, prompt, max_tokens, timeout)

    # ---- who may see what -----------------------------------------------------------------

    def authenticate(self, ctx: CallContext | None) -> Principal:
        return self.gate.authenticate(ctx)

    def authorize(self, ctx: CallContext | None, name: str) -> Principal:
        """Who is calling, and may they see ``name``? An ungranted model is an unknown one."""
        principal = self.gate.authenticate(ctx)
        if not granted(principal, name, ctx):
            raise ModelNotFound(f"unknown model '{name}'")
        return principal

    def resolve_for(self, ctx: CallContext | None, name: str, version: str = "") -> ModelSignature:
        """:meth:`resolve` as the caller sees it: authenticated, and only models granted to them."""
        self.authorize(ctx, name)
        return self._table.resolve(name, version)

    def visible(self, ctx: CallContext | None, names):
        """The names among ``names`` the caller may see."""
        tenant = self.gate.authenticate(ctx).tenant
        return [n for n in names if tenant.may_use(n)]

    # ---- metadata ---------------------------------------------------------------------------

    async def describe(self, ctx: CallContext | None, method: str, raw: bytes, timeout: float | None = 30.0) -> bytes:
        """ModelMetadata / ModelConfig / ModelStatistics for the caller: Triton's answer for a model
        they may see; statistics of every model filtered to those they may see."""
        request = parse_message(_DESCRIBE[method], raw)
        if self.composites.serves(request.name):
            self.resolve_for(ctx, request.name, request.version)
            if method == "ModelStatistics":  # Triton counts the composite's parts, under their own names
                return pb.ModelStatisticsResponse().SerializeToString()
            return self.composites.describe(method, request)
        if request.name or method != "ModelStatistics":
            self.resolve_for(ctx, request.name, request.version)
            return await self._backend.unary_raw(method, raw, timeout=timeout)
        answer = pb.ModelStatisticsResponse.FromString(await self._backend.unary_raw(method, raw, timeout=timeout))
        visible = set(self.visible(ctx, [m.name for m in answer.model_stats]))
        kept = [m for m in answer.model_stats if m.name in visible]
        del answer.model_stats[:]
        answer.model_stats.extend(kept)
        return answer.SerializeToString()

    # ---- inference --------------------------------------------------------------------------

    async def _fetch_features(self, request: pb.ModelInferRequest, timeout: float | None, ctx: CallContext | None) -> bool:
        """The feature-store stage (before validation): True when it rewrote ``request``."""
        signature = self._table.signatures.get(request.model_name)
        mapping = self.features.mapping(request.model_name, signature.params) if signature is not None else None
        if mapping is None:
            return False
        self.authorize(ctx, request.model_name)  # nothing is fetched for a caller who may not call the model
        await self.features.enrich(request, mapping, timeout if timeout is not None else (ctx.timeout if ctx is not None else None))
        return True

    async def infer(
        self,
        request: pb.ModelInferRequest,
        raw: bytes | None = None,
        timeout: float | None = None,
        ctx: CallContext | None = None,
        count_tokens: Callable[[bytes], int] | None = None,
    ) -> Answered:
        """One request through the pipeline to Triton; returns Triton's ModelInferResponse bytes and
        the version (and arm) that answered.

        ``raw`` is the request exactly as the caller sent it; when given it travels to Triton
        untouched (no re-serialization; a routed version is appended as a field). ``timeout`` is
        the caller's remaining deadline (or ``ctx.timeout``). ``ctx`` carries the caller's key and
        idempotency key. ``count_tokens`` reads from Triton's answer how many input tokens it
        covered (embedding models report them): metered and charged to the token quota.
        """
        if self.composites.serves(request.model_name):
            return await self._infer_composite(request, raw, timeout, ctx)
        if self.features is not None and await self._fetch_features(request, timeout, ctx):
            raw = None  # the entity keys became the feature tensor: serialized again

        def validate(signature: ModelSignature) -> None:
            if signature.decoupled:  # Triton answers UNIMPLEMENTED; it is the caller's choice of call
                raise InvalidRequest(
                    f"model '{signature.name}' streams its answers (decoupled): call ModelStreamInfer"
                    + (", /v1/chat/completions or Generate" if is_llm(signature) else "")
                )
            validate_infer_request(request, signature)

        rewritten: list = []  # the safety stage redacted an input: the request is serialized again
        texts = _screened_texts(request, rewritten) if self._pipeline.safety is not None else None
        async with self._pipeline.admitted(ctx, request.model_name, request.model_version, INFER, timeout=timeout, validate=validate, texts=texts, port=self) as call:
            try:
                caller_bytes = raw if raw is not None and not rewritten else request.SerializeToString()
                data = caller_bytes
                if call.routed:
                    request.model_version = call.version
                    data = pin_version(caller_bytes, call.version)
                signature = call.signature
                call.request = request

                async def forward() -> bytes:
                    call.computed = True
                    answer = await self.submit(call, request, data, signature)
                    if count_tokens is not None:
                        call.tokens_in = count_tokens(answer)
                    return answer

                if ctx is not None and ctx.idempotency_key:
                    key = scoped(call.tenant.name, ctx.idempotency_key)  # the caller's bytes: a retry across a deploy matches
                    answer = await self._idempotency.run(key, body_digest(caller_bytes), forward, call.timeout)
                else:
                    answer = await forward()
                if call.safety is not None and call.safety.output is not None:
                    answer = await self._screen_answer(call, answer)
                if self._router.shadows:
                    call.shadow = (data, answer)
                call.answer = answer
                return Answered(answer, call.version, call.arm)
            except InferplaneError:
                raise
            except Exception as err:  # a bug or a malformed Triton answer: a status, never a crash
                log.exception("inference on %s failed", request.model_name)
                raise BackendError(f"inference failed: {err}") from None

    async def _infer_composite(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None, ctx: CallContext | None) -> Answered:
        """A composite endpoint's request: admitted as any model's, answered by its plan."""
        validate = functools.partial(validate_infer_request, request)
        async with self._pipeline.admitted(ctx, request.model_name, request.model_version, INFER, timeout=timeout, validate=validate) as call:
            return await self.composites.run(call, request, raw, ctx)

    def generate(
        self, model: str, params: GenerateParams, timeout: float | None = None, ctx: CallContext | None = None
    ) -> AsyncIterator[Chunk]:
        """One generation through the pipeline to the LLM engine (``server.dataplane.engine_calls``):
        its chunks, the last with ``finish_reason``."""
        return self._engine.generate(model, params, timeout, ctx)

    async def engine_stats(self, model: str) -> dict[str, Any]:
        """The LLM engine's counters, outside the pipeline (an operator's read, a listing's adapters)."""
        return await self._engine.stats(model)

    async def _screen_answer(self, call, answer: bytes) -> bytes:
        """The endpoint's output filters over the answer's text (BYTES) outputs (``server.dataplane.safety``)."""
        response = pb.ModelInferResponse.FromString(answer)
        names = {o.name for o in response.outputs if o.datatype == "BYTES"}
        if not names:
            return answer
        if await self._pipeline.screen_output(call, tensor_texts(response.outputs, response.raw_output_contents, names)):
            return response.SerializeToString()
        return answer

    async def submit(self, call, request: pb.ModelInferRequest, data: bytes, signature: ModelSignature) -> bytes:
        """The coalescer's call; a traced or timed request is registered there so its batch finds it."""
        trace = call.trace
        if call.batch:  # a batch job's row: merged with rows only, sent at the batch class (spot replicas first)
            token = TRAFFIC.set(BATCH)
            try:
                return await self._coalescer.submit(request, data, signature.coalesce, call.timeout, traffic=BATCH)
            finally:
                TRAFFIC.reset(token)
        timer = call.ctx.timing if call.ctx is not None else None
        if trace is None and timer is None:
            return await self._coalescer.submit(request, data, signature.coalesce, call.timeout)
        if trace is not None:
            trace.submitting(request)
        if timer is not None:
            stage_timing.PENDING[id(request)] = timer
        try:
            return await self._coalescer.submit(request, data, signature.coalesce, call.timeout)
        finally:
            if trace is not None:
                trace.submitted(request)
            if timer is not None:
                stage_timing.PENDING.pop(id(request), None)
                timer.mark("answer")

    async def _refuse_unscreened_stream(self, call) -> None:
        """Triton's stream answers pass through as bytes: an endpoint with output filters is not served here."""
        err = InvalidRequest(
            f"model '{call.name}' filters its outputs (safety policy): ModelStreamInfer passes answers through unscreened; "
            + ("call Generate or /v1/chat/completions" if is_llm(call.signature) else "call ModelInfer")
        )
        await self._pipeline.exit(call, err)
        raise err

    async def stream_infer(
        self, raw_requests: AsyncIterator[bytes], timeout: float | None = None, ctx: CallContext | None = None
    ) -> AsyncIterator[bytes]:
        """ModelStreamInfer: each message enters the pipeline; refused ones get an in-stream error.

        Yields serialized ModelStreamInferResponse messages, Triton's and the frontend's own, until
        the caller has finished writing and Triton has sent its last response. Each message written
        to Triton holds its pipeline call (quota ticket, queue slot) open until its final response
        (or the end of the stream) and is metered then, with an LLM's tokens (``StreamLedger``).

        Each model the caller's stream names gets a Triton stream of its own: Triton 2.51 crashes
        (SIGSEGV/abort in its stream writer) when one ModelStreamInfer stream carries requests of a
        decoupled model and of a non-decoupled one (``tests/integration/test_hardening_streams.py``),
        so one tenant's mixed stream would take every model down. Per model, that cannot happen.
        """
        self.gate.authenticate(ctx)  # before the first message: the call is refused
        out: asyncio.Queue = asyncio.Queue()
        streams: dict[str, object] = {}  # model -> its Triton stream
        relays: list[asyncio.Task] = []
        admission = self.admission
        ledger = StreamLedger(self._pipeline, release=admission.exit)  # gives a message's place back when it ends
        relay_done, pump_done = object(), object()

        async def relay(stream) -> None:
            try:
                async for response in stream:
                    try:
                        response = await ledger.answered(response)  # before the caller sees it: its tokens are charged
                    except Exception:  # bookkeeping must never change or stop an answer
                        log.exception("stream bookkeeping failed")
                    await out.put(response)
            except Exception as err:  # the stream failed after it started: tell the caller in-stream
                await out.put(_stream_error(BackendUnavailable(f"Triton stream failed: {err}"), None))
            finally:
                await out.put(relay_done)

        def stream_for(model: str):
            stream = streams.get(model)
            if stream is None:
                stream = streams[model] = self._backend.stream_raw(timeout=timeout, model=model)
                relays.append(asyncio.create_task(relay(stream)))
            return stream

        async def pump() -> None:
            try:
                async for raw in raw_requests:
                    request = None
                    try:
                        request = parse_infer_request(raw)
                        admission.enter()  # a place per message (server.dataplane.loop_gate), refused in-stream past the bound
                        try:
                            validate = lambda signature, r=request: validate_infer_request(r, signature)  # noqa: E731
                            rewritten: list = []
                            texts = _screened_texts(request, rewritten) if self._pipeline.safety is not None else None
                            call = await self._pipeline.admitted(ctx, request.model_name, request.model_version, STREAM, timeout=timeout, validate=validate, texts=texts, port=self).open()
                            if call.safety is not None and call.safety.output is not None:
                                await self._refuse_unscreened_stream(call)
                            if rewritten:
                                raw = request.SerializeToString()
                        except BaseException:
                            admission.exit()  # refused or gone before the ledger holds it
                            raise
                    except InferplaneError as err:
                        await out.put(_stream_error(err, request))
                        continue
                    if call.routed:
                        request.model_version = call.version
                        raw = pin_version(raw, call.version)
                    stream = stream_for(request.model_name)
                    ledger.sent(request, call)
                    await stream.write(raw)
            finally:
                for stream in streams.values():
                    with contextlib.suppress(Exception):  # a stream that failed says so through its relay
                        await stream.done_writing()
                await out.put(pump_done)

        pumping = asyncio.create_task(pump())
        try:
            finished, pumped = 0, False
            while not (pumped and finished == len(relays)):
                item = await out.get()
                if item is pump_done:
                    pumped = True
                elif item is relay_done:
                    finished += 1
                else:
                    yield item
            await pumping
        finally:
            for task in (pumping, *relays):
                task.cancel()
            for stream in streams.values():
                stream.cancel()
            await ledger.close()


def _screened_texts(request: pb.ModelInferRequest, rewritten: list):
    """The safety stage's view of a request's declared text inputs; a redaction marks it ``rewritten``."""

    def texts(signature: ModelSignature):
        if not signature.text_inputs:
            return None
        slots = infer_texts(request, signature.text_inputs)
        put = slots.put

        def put_and_mark(values) -> None:
            put(values)
            rewritten.append(True)

        slots.put = put_and_mark
        return slots

    return texts


RETRY_AFTER_PARAMETER = "retry-after"

_DESCRIBE = {
    "ModelMetadata": pb.ModelMetadataRequest,
    "ModelConfig": pb.ModelConfigRequest,
    "ModelStatistics": pb.ModelStatisticsRequest,
}


def _stream_error(err: InferplaneError, request) -> bytes:
    """An in-stream error: ``REASON: message``; a refusal's retry hint as the ``retry-after`` parameter
    (seconds, as the unary trailer names it)."""
    response = pb.ModelStreamInferResponse(error_message=f"{err.reason}: {public_message(err)}")
    if err.retry_after_s is not None:
        response.infer_response.parameters[RETRY_AFTER_PARAMETER].double_param = err.retry_after_s
    if request is not None:
        response.infer_response.model_name = request.model_name
        response.infer_response.id = request.id
    return response.SerializeToString()
