"""The data plane's calls to an LLM engine model: a caller's generation (``DataPlane.generate``, the
model port's), a deploy's warm-up and an operator's read of the engine's counters.

Generation is one ``ModelStreamInfer`` call per request to a decoupled LLM model
(``model_repository/adapters/llm_engine.py``): BYTES inputs ``messages`` | ``text_input`` and
``parameters`` (JSON), streamed BYTES outputs ``text_output`` and ``info`` (JSON). Leaving the
iterator early (the caller went away, a deadline, an exception) cancels the Triton stream,
which the engine sees at its next decode step.

Every generation goes through the one admission pipeline (``server.dataplane.pipeline``):
authentication, grants, traffic splits, quotas, the fair queue and the circuit breaker apply as they
do to ModelInfer. Errors follow the two-phase rule: ``generate`` raises a domain error; a transport
that has not sent anything yet turns it into a status, one that has streamed sends it inside the
stream. The warm-up and the counters' read are nobody's request: outside the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from batching.route_policy import prefix_key
from server.dataplane import codecs
from server.dataplane.backend import Backend
from server.dataplane.backend_errors import stream_error
from server.dataplane.idempotency import body_digest, scoped
from server.dataplane.observe import token_clock
from server.dataplane.pipeline import GENERATE, Pipeline
from server.dataplane.port import Chunk, GenerateParams, ModelPort
from server.dataplane.routing import REQUEST_ID_HEADER, header
from server.dataplane.safety import TextSlots
from server.dataplane.signature import ModelSignature, require_llm
from server.dataplane.validation import ADAPTER_PARAMETER, PRIORITY_PARAMETER
from server.errors import BackendError, Cancelled, DeadlineExceeded, InferplaneError, InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext, plan_priority

log = logging.getLogger(__name__)

# model="base:adapter" names a LoRA adapter of an LLM (model_repository/adapters/_lora.py's names)
_ADAPTER_REF = re.compile(r"^(?P<model>[^:]+):(?P<adapter>[a-z][a-z0-9_-]{0,62})$")


def split_adapter(model: str) -> tuple[str, str]:
    """(model, adapter) of a generation's model name; adapter '' for the base model."""
    found = _ADAPTER_REF.match(model)
    return (found["model"], found["adapter"]) if found else (model, "")


def _bytes_input(request: pb.ModelInferRequest, name: str, value: str) -> None:
    request.inputs.add(name=name, datatype="BYTES", shape=[1])
    request.raw_input_contents.append(codecs.serialize_bytes([value.encode("utf-8")]))


async def _stream_outputs(call, request: pb.ModelInferRequest) -> AsyncIterator[dict]:
    """Send one request on a ModelStreamInfer call; yield each response's outputs (an in-stream
    error raises)."""
    await call.write(request.SerializeToString())
    await call.done_writing()
    async for raw in call:
        response = pb.ModelStreamInferResponse.FromString(raw)
        if response.error_message:
            raise stream_error(response.error_message)
        yield codecs.output_arrays(response.infer_response)


class GenerationStalled(BackendError):
    """The engine sent nothing for the stall limit: the generation was cancelled (its sequence freed)."""


async def within_stall(source, stall_s: float, describe) -> AsyncIterator:
    """``source``'s items, each due within ``stall_s`` seconds of the one before (0: no limit); a
    longer silence raises GenerationStalled (``describe()`` says where). Only the wait on the engine
    is timed, never the time the consumer takes between items."""
    iterator = source.__aiter__()
    while True:
        try:
            if stall_s > 0:
                async with asyncio.timeout(stall_s):
                    item = await anext(iterator)
            else:
                item = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise GenerationStalled(f"the engine sent nothing for {stall_s:g}s {describe()}; the generation was cancelled") from None
        yield item


class EngineCalls:
    """What the data plane sends an LLM engine; built by the data plane it belongs to, which is the
    port a call is admitted through (the safety classifier's calls go through it too)."""

    def __init__(self, port: ModelPort, pipeline: Pipeline, backend: Backend, idempotency, *, prefix_chars: int, stall_s: float):
        self._port = port
        self._pipeline = pipeline
        self._backend = backend
        self._idempotency = idempotency  # MemoryIdempotency or RedisIdempotency: a keyed generation runs once
        self.prefix_chars = prefix_chars  # the routing key's leading characters (batching.route_policy.prefix_key)
        self.stall_s = stall_s  # how long without engine output a generation is cancelled and reported

    async def generate(
        self, model: str, params: GenerateParams, timeout: float | None = None, ctx: CallContext | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream the engine's chunks; the last has ``finish_reason``. Raises domain errors.

        However it ends — answered, failed, the caller gone, the deadline passed — the prompt +
        completion tokens the engine last reported are charged to the token quota, and a generation
        sent to the engine is metered (those tokens and the engine's wall time): a caller that
        leaves mid-stream still pays for what was generated.

        With an idempotency key (``server.dataplane.idempotency``, scoped by tenant) the same key and
        body answer once: the first generation runs to its end and its chunks are kept; a repeat
        (or a duplicate arriving meanwhile) gets those chunks without a second generation, a repeat
        with another body is refused. A keyed stream's chunks arrive when the generation is done.
        """
        ctx = ctx if ctx is not None else CallContext()
        model, adapter = split_adapter(model)

        def validate(signature: ModelSignature) -> None:
            require_llm(model, signature)
            if (params.messages is None) == (params.prompt is None):
                raise InvalidRequest("send exactly one of messages and prompt")

        texts = _prompt_texts(params) if self._pipeline.safety is not None else None
        body = _body(model, adapter, params)  # the caller's request, before the deadline is filled in
        admitted = self._pipeline.admitted(ctx, model, "", GENERATE, timeout=timeout, validate=validate, texts=texts, adapter=adapter, port=self._port)
        async with admitted as call:
            if not ctx.idempotency_key:
                async with contextlib.aclosing(self._generate(call, ctx, model, adapter, params)) as chunks:  # a caller gone: the engine stops now
                    async for chunk in chunks:
                        yield chunk
                return

            async def run() -> bytes:
                chunks = [asdict(chunk) async for chunk in self._generate(call, ctx, model, adapter, params)]
                return json.dumps(chunks).encode()

            answer = await self._idempotency.run(scoped(call.tenant.name, ctx.idempotency_key), body_digest(body), run, call.timeout)
            for chunk in json.loads(answer):
                yield Chunk(**chunk)

    async def _generate(self, call, ctx: CallContext, model: str, adapter: str, params: GenerateParams) -> AsyncIterator[Chunk]:
        """The admitted ``call``'s generation: the engine's chunks, through the endpoint's output filters."""
        stream = span = screen = None
        try:
            screen = self._pipeline.output_stream(call)  # the endpoint's output filters (server.dataplane.safety)
            timeout = call.timeout
            if timeout is not None and params.deadline_ms is None:
                params.deadline_ms = max(1.0, timeout * 1000.0)
            request_id = header(ctx, REQUEST_ID_HEADER) or uuid.uuid4().hex  # the caller's id names it in A/B feedback
            request = pb.ModelInferRequest(model_name=model, model_version=call.version if call.routed else "", id=request_id)
            if params.messages is not None:
                _bytes_input(request, "messages", json.dumps(params.messages))
            else:
                _bytes_input(request, "text_input", params.prompt)
            _bytes_input(request, "parameters", json.dumps(params.engine_parameters()))
            principal = call.principal  # the plan orders the engine's queue (paid first)
            request.parameters[PRIORITY_PARAMETER].int64_param = plan_priority(principal.tenant.plan if principal else "")
            if adapter:  # granted above as model:adapter; the engine applies it to this sequence only
                request.parameters[ADAPTER_PARAMETER].string_param = adapter
            call.request = request
            # a little slack past the engine's own deadline, so the engine reports it
            span, metadata = self._trace_call(call)
            stream_timeout = None if timeout is None else timeout + 5.0
            affinity = prefix_key(params.messages, params.prompt, self.prefix_chars)  # replicas route by it
            if affinity and adapter:  # an adapter's KV is its own: its prefix cache is apart from the base model's
                affinity = f"{adapter}/{affinity}"
            stream = self._backend.stream_raw(timeout=stream_timeout, metadata=metadata, model=request.model_name, affinity=affinity)
            call.computed = True
            call.dispatched_at = time.perf_counter()
            clock = token_clock(self._pipeline.observer, call)  # TTFT, inter-token latency, tokens/s
            def where() -> str:  # read only when it stalls
                return f"after {call.tokens_out} tokens of {model}"

            async for outputs in within_stall(_stream_outputs(stream, request), self.stall_s, where):
                if "info" not in outputs:
                    continue  # an empty final flag
                text = bytes(outputs["text_output"].reshape(-1)[0]).decode("utf-8")
                info = json.loads(bytes(outputs["info"].reshape(-1)[0]))
                call.tokens_in = int(info.get("prompt_tokens", call.tokens_in))
                call.tokens_out = int(info.get("completion_tokens", call.tokens_out))
                clock.tokens(call.tokens_out, time.perf_counter())
                reason = info.get("finish_reason")
                if "kv_utilization" in info:  # a replica set scores its members by it
                    stream.report_kv(info["kv_utilization"])
                if reason is not None:
                    call.compute_s = time.perf_counter() - call.dispatched_at
                    clock.finish()
                if reason == "deadline":
                    raise DeadlineExceeded(f"the request's deadline passed after {call.tokens_out} tokens")
                if reason == "cancelled":
                    raise Cancelled("the generation was cancelled")
                if reason == "error":
                    raise stream_error(info.get("error", "engine error"))
                chunk = Chunk(text, reason, call.tokens_in, call.tokens_out, info.get("cached_tokens", 0), info.get("step", 0), call.version, call.arm)
                if screen is not None:
                    chunk = await screen.chunk(chunk)  # held back, redacted, or ended with finish_reason content_filter
                yield chunk
                if chunk.finish_reason is not None:
                    return
            raise BackendError("the model ended the stream without a final response")
        except GenerationStalled:
            self._pipeline.metrics.generation_stalls.labels(model).inc()
            log.warning("generation of %s stalled after %d tokens (no output for %gs): cancelled", model, call.tokens_out, self.stall_s)
            raise
        except (InferplaneError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as err:
            raise BackendError(f"generation failed: {type(err).__name__}: {err}") from None
        finally:
            if screen is not None:
                screen.close()
            if stream is not None:
                stream.cancel()
                if span is not None:
                    self._pipeline.tracing.end_call(span)

    async def warm_up(self, model: str, version: str, prompt: str, max_tokens: int, timeout: float | None = None) -> str:
        """Generate from ``model:version`` outside the pipeline (``DataPlane.backend_generate``); its text."""
        request = pb.ModelInferRequest(model_name=model, model_version=version, id="inferplane-warmup")
        _bytes_input(request, "text_input", prompt)
        _bytes_input(request, "parameters", json.dumps({"max_tokens": int(max_tokens), "temperature": 0.0}))
        stream = self._backend.stream_raw(timeout=timeout, model=model)
        parts = []
        try:
            async for outputs in _stream_outputs(stream, request):
                if "info" not in outputs:
                    continue
                parts.append(bytes(outputs["text_output"].reshape(-1)[0]).decode("utf-8"))
                info = json.loads(bytes(outputs["info"].reshape(-1)[0]))
                if info.get("finish_reason") == "error":
                    raise stream_error(info.get("error", "engine error"))
                if info.get("finish_reason") is not None:
                    return "".join(parts)
        finally:
            stream.cancel()
        raise BackendError("the model ended the stream without a final response")

    def _trace_call(self, call):
        """(span, metadata) of a traced generation's Triton stream; (None, None) untraced."""
        if call.trace is None:
            return None, None
        return self._pipeline.tracing.start_call(call, "triton generate", self._backend.target)

    async def stats(self, model: str) -> dict[str, Any]:
        """The engine's counters (``DataPlane.engine_stats``): outside the pipeline."""
        request = pb.ModelInferRequest(model_name=model, id="stats")
        _bytes_input(request, "parameters", json.dumps({"command": "stats"}))
        stream = self._backend.stream_raw(timeout=10.0, model=model)
        try:
            async for outputs in _stream_outputs(stream, request):
                if "info" in outputs:
                    return json.loads(bytes(outputs["info"].reshape(-1)[0]))
        finally:
            stream.cancel()
        raise BackendError("no stats from the engine")


def _body(model: str, adapter: str, params: GenerateParams) -> bytes:
    """What an idempotency key covers: the model, the prompt and the sampling parameters."""
    doc = {"model": model, "adapter": adapter, "messages": params.messages, "prompt": params.prompt, "parameters": params.engine_parameters()}
    return json.dumps(doc, sort_keys=True).encode()


def _prompt_texts(params: GenerateParams):
    """A generation's prompt or message contents, for the safety stage's input screen (and its redactions)."""
    def texts(_signature: ModelSignature):
        if params.messages is not None:
            def put(values: list[str]) -> None:
                for message, value in zip(params.messages, values):
                    message["content"] = value

            return TextSlots(lambda: [m.get("content", "") for m in params.messages], put)
        if params.prompt is not None:
            return TextSlots(lambda: [params.prompt], lambda values: setattr(params, "prompt", values[0]))
        return None

    return texts
