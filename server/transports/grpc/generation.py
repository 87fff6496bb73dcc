"""``inferplane.v1.Generation/Generate``: server-streaming generation, a thin adapter over ``LLMService``.

Two-phase errors: before the first response the call ends with the error table's status; after
it the failure is the last message's ``error`` field. The call's deadline becomes the engine's
deadline; a cancelled call closes the generator, which cancels the Triton stream, and the engine
drops the sequence at its next decode step.

A generation takes a place in the process's in-flight bound (``server.dataplane.loop_gate``, the
one ``Admission`` of ModelInfer, REST and the OpenAI routes) before anything else — before its
metadata is read, its fields checked or its model looked up — and holds it until its last chunk is
sent, its call is cancelled or it fails: past the bound the call is RESOURCE_EXHAUSTED with the
platform's retry hint (``RetryInfo`` and ``retry-after``) and no work done.
"""

from __future__ import annotations

import grpc

from server.errors import InferplaneError, InvalidRequest, public_message
from server.dataplane.generation import LLMService
from server.dataplane.port import Chunk, GenerateParams
from server.dataplane.loop_gate import Admission
from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc
from server.transports import limits
from server.transports.grpc.context import call_context

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def _params(request: generate_pb2.GenerateRequest) -> GenerateParams:
    """The request's fields, each checked at the edge (``server.transports.limits``): a uint32
    ``max_tokens`` past the engine's limit or a NaN ``temperature`` is INVALID_ARGUMENT naming it."""
    if bool(request.messages) == bool(request.prompt):
        raise InvalidRequest("send exactly one of messages and prompt")

    def field(name: str, kind: type, low, high):
        return limits.number(getattr(request, name), name, kind, low, high) if request.HasField(name) else None

    params = GenerateParams(
        max_tokens=field("max_tokens", int, 1, limits.MAX_TOKENS),
        temperature=field("temperature", float, *limits.TEMPERATURE),
        top_p=field("top_p", float, *limits.TOP_P),
        seed=field("seed", int, *limits.SEED),
        stop=list(request.stop),
        ignore_eos=request.ignore_eos,
    )
    if request.messages:
        params.messages = [{"role": m.role, "content": m.content} for m in request.messages]
    else:
        params.prompt = request.prompt
    return params


def _response(chunk: Chunk) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(text=chunk.text)
    if chunk.finish_reason is not None:
        response.finish_reason = chunk.finish_reason
        response.usage.prompt_tokens = chunk.prompt_tokens
        response.usage.completion_tokens = chunk.completion_tokens
        response.usage.total_tokens = chunk.prompt_tokens + chunk.completion_tokens
        response.usage.cached_tokens = chunk.cached_tokens
    return response


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, service: LLMService, admission: Admission):
        self.llm = service
        self.admission = admission

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802 - the RPC's name
        admission = self.admission
        admission.enter()  # past the in-flight bound: Overloaded (RESOURCE_EXHAUSTED + retry hint), no work done
        started = False
        stream = None
        try:
            ctx = call_context(context)
            stream = self.llm.generate(request.model, _params(request), ctx=ctx)
            async for chunk in stream:
                started = True
                yield _response(chunk)
        except InferplaneError as err:
            if not started:  # phase one: the interceptor ends the call with the error's status
                raise
            yield generate_pb2.GenerateResponse(error=generate_pb2.StreamError(code=err.reason, message=public_message(err)))
        finally:
            try:
                if stream is not None:
                    await stream.aclose()
            finally:  # the place comes back once: last chunk sent, error, or the call cancelled
                admission.exit()


def add_to_server(service: LLMService, server: grpc.aio.Server, admission: Admission) -> str:
    """Register the servicer, its generations under ``admission`` (the process's in-flight bound);
    returns the service's full name (for reflection and health)."""
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(service, admission), server)
    return SERVICE
