"""OpenAI-compatible REST: chat completions, completions (stream or not), embeddings, models.

Thin handlers over ``server.dataplane.generation.LLMService``. Streams are Server-Sent Events in OpenAI's
shape: ``data: {chunk}`` lines, ``data: [DONE]`` at the end; an error after the first event
travels as ``data: {"error": {...}}`` then ``data: [DONE]``; one before it is the error table's
HTTP status. Extensions to OpenAI's request body: ``ignore_eos`` and ``deadline_ms``.

Flow control: a relay task reads the engine's stream as fast as it comes (so Triton never
waits on a slow client) into a bounded per-stream buffer; when the buffer is full its pending
text deltas are merged into one chunk, so memory stays bounded and other streams never block.
The writer sends what is pending, waiting for the socket to drain; a client that does not
read for ``SSEPolicy.stall_s`` (30 s) or disconnects cancels the generation (and its Triton stream;
the tokens generated so far are charged and metered). A stream with nothing to send for
``SSEPolicy.heartbeat_s`` (15 s) gets an SSE comment (``: heartbeat``), which clients ignore and which
keeps idle-timing proxies from closing a slow prefill or a long queue wait: when the first chunk is
that late the response's headers go out first (200), so an error after that travels in the stream.
Both come from ``Settings`` (``sse_stall_s``, ``sse_heartbeat_s``).

Chat completions, completions and embeddings take a place in the process's in-flight bound
(``server.dataplane.loop_gate``) before their body is read and hold it to the answer's last byte:
past the bound a 429 with ``Retry-After`` and the OpenAI error body, before any byte of a stream.

A request with an ``inferplane-timing`` header gets ``Server-Timing`` (``server.dataplane.stage_timing``):
``decode`` (the JSON body and its parameters), the pipeline's stages, ``encode`` (the JSON answer); a
stream's headers carry the stages until they are sent (its first token, or its first heartbeat).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from server.errors import Cancelled, InferplaneError, InvalidRequest, http_error
from server.settings import Settings
from server.dataplane.generation import LLMService
from server.dataplane.port import Chunk, GenerateParams
from server.dataplane.stage_timing import TIMING_HEADER, StageTimer
from server.tenancy.identity import CallContext
from server.transports import limits
from server.transports.openai.body import json_object
from server.transports.openai.batches import ROUTES as BATCH_ROUTES
from server.transports.rest.appkeys import DATAPLANE
from server.transports.rest.openapi import JSON, Body, Route, error_body, error_responses, error_statuses, json_body

log = logging.getLogger(__name__)

LLM: web.AppKey[LLMService] = web.AppKey("llm_service", LLMService)
SSE = "text/event-stream"
MAX_PENDING_CHUNKS = 64  # per stream, before pending deltas are merged
HEARTBEAT = b": heartbeat\n\n"


@dataclass(frozen=True)
class SSEPolicy:
    """The stream policy (defaults: the settings', their one source: sse_stall_s, sse_heartbeat_s)."""

    stall_s: float = Settings.model_fields["sse_stall_s"].default  # a client that takes no byte for this long is disconnected
    heartbeat_s: float = Settings.model_fields["sse_heartbeat_s"].default  # a comment after this long without an event (0: never)


SSE_POLICY: web.AppKey[SSEPolicy] = web.AppKey("sse_policy", SSEPolicy)
DISCONNECT_POLL_S = 0.05
_FINISH = {"stop": "stop", "length": "length"}


def _ctx(request: web.Request) -> CallContext:
    """The call's context, made once the body is parsed: a timed request's ``decode`` ends here."""
    ctx = CallContext.from_headers(request.headers)
    timer = request.get(_TIMER)
    if timer is not None:
        timer.mark("decode")
        ctx.timing = timer
    return ctx


# a request that sent inferplane-timing: its StageTimer (server.dataplane.stage_timing), from the handler's start
_TIMER = "inferplane.stage_timer"


def _start_timer(request: web.Request) -> None:
    if TIMING_HEADER in request.headers:
        request[_TIMER] = StageTimer()


def _server_timing(request: web.Request, response: web.StreamResponse, stage: str | None = None) -> web.StreamResponse:
    """``Server-Timing`` on a timed request's response (``stage``: the one that ends now); an SSE stream's
    headers carry the stages until they are sent."""
    timer = request.get(_TIMER)
    if timer is not None:
        if stage is not None:
            timer.mark(stage)
        response.headers["Server-Timing"] = timer.header()
    return response


def service(request: web.Request) -> LLMService:
    return request.app[LLM]  # set by server.composition.create_app


# ---- request parsing --------------------------------------------------------------------------


def _bad(field: str, description: str) -> InvalidRequest:
    return limits.bad(field, description)


def _number(doc: dict, key: str, kind=float, low=None, high=None):
    return limits.number(doc.get(key), key, kind, low, high)


def _model_name(doc: dict) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required (a model name from GET /v1/models)")
    return model


def _sampling(doc: dict) -> GenerateParams:
    if doc.get("n") is not None and _number(doc, "n", int) != 1:
        raise _bad("n", "only n=1 is supported")
    stop = doc.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "must be a non-empty string or a list of up to 4 non-empty strings")
    max_tokens = _number(doc, "max_completion_tokens", int, 1, limits.MAX_TOKENS)
    if max_tokens is None:
        max_tokens = _number(doc, "max_tokens", int, 1, limits.MAX_TOKENS)
    return GenerateParams(
        max_tokens=max_tokens,
        temperature=_number(doc, "temperature", float, *limits.TEMPERATURE),
        top_p=_number(doc, "top_p", float, *limits.TOP_P) or None,
        seed=_number(doc, "seed", int, *limits.SEED),
        stop=stop,
        ignore_eos=bool(doc.get("ignore_eos", False)),
        deadline_ms=_number(doc, "deadline_ms", float, *limits.DEADLINE_MS),
    )


def _messages(doc: dict) -> list[dict[str, str]]:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "needs a string role")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def _stream_options(doc: dict) -> bool:
    options = doc.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    return bool(options.get("include_usage", False))


def _usage(chunk: Chunk) -> dict[str, Any]:
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": chunk.cached_tokens},
    }


def _error_event(err: InferplaneError) -> dict[str, Any]:
    status, body, _headers = http_error(err, openai=True)
    body["error"]["status"] = status
    return body


# ---- SSE with flow control ------------------------------------------------------------------------


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _until_gone(request: web.Request) -> None:
    while not _client_gone(request):
        await asyncio.sleep(DISCONNECT_POLL_S)


class _Pending:
    """The bounded buffer between the engine's stream and one slow or fast client."""

    def __init__(self, limit: int = MAX_PENDING_CHUNKS):
        self.items: list[Any] = []  # event dicts, or Chunk to be rendered
        self.limit = limit
        self.ready = asyncio.Event()
        self.closed = False
        self.merged = 0

    def put(self, item: Any) -> None:
        if len(self.items) >= self.limit and isinstance(item, Chunk) and isinstance(self.items[-1], Chunk):
            last = self.items[-1]
            if last.finish_reason is None:  # merge the deltas: memory stays bounded
                item.text = last.text + item.text
                self.items[-1] = item
                self.merged += 1
                self.ready.set()
                return
        self.items.append(item)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def take(self) -> list[Any]:
        while not self.items and not self.closed:
            self.ready.clear()
            await self.ready.wait()
        items, self.items = self.items, []
        return items


def _policy(request: web.Request) -> SSEPolicy:
    return request.app.get(SSE_POLICY) or SSEPolicy()


async def _open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": SSE, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    _server_timing(request, response)
    await response.prepare(request)
    if request.transport is not None:
        request.transport.set_write_buffer_limits(high=64 << 10)
    return response


async def _stream_sse(request: web.Request, stream, render, include_usage: bool) -> web.StreamResponse:
    """The engine's stream as SSE. The first chunk is awaited before any byte is sent (an error
    there is the error table's HTTP status) for up to ``heartbeat_s``; past that the headers go out,
    heartbeats keep the connection busy and an error comes as an in-stream event."""
    policy = _policy(request)
    first = asyncio.ensure_future(_first(stream))
    if policy.heartbeat_s <= 0:
        await first
    else:
        await asyncio.wait({first}, timeout=policy.heartbeat_s)
    if first.done():
        first.result()  # an error before the first event: an HTTP status
        return await _stream(request, first, stream, render, include_usage, policy)
    try:
        response = await _open_stream(request)
        await response.write(HEARTBEAT)
    except BaseException:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        with contextlib.suppress(Exception):
            await stream.aclose()
        raise
    return await _stream(request, first, stream, render, include_usage, policy, response)


async def _stream(
    request: web.Request, first: asyncio.Future, rest, render, include_usage: bool, policy: SSEPolicy,
    response: web.StreamResponse | None = None,
) -> web.StreamResponse:
    """Send the chunk ``first`` resolves to and the rest of the engine's chunks as SSE; ``render(chunk)``
    -> list of events."""
    if response is None:
        response = await _open_stream(request)
    pending = _Pending()

    async def relay() -> None:
        try:
            head = await first
            pending.put(head)
            if head.finish_reason is None:
                async for chunk in rest:
                    pending.put(chunk)
        except InferplaneError as err:
            pending.items.append(_error_event(err))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - mid-stream: the error goes in the stream
            log.exception("stream failed")
            pending.items.append(_error_event(InferplaneError(f"internal error ({type(err).__name__})")))
        finally:
            pending.close()

    async def write() -> None:
        last: Chunk | None = None
        while True:
            if policy.heartbeat_s > 0:
                try:
                    items = await asyncio.wait_for(pending.take(), policy.heartbeat_s)
                except asyncio.TimeoutError:
                    await asyncio.wait_for(response.write(HEARTBEAT), policy.stall_s)
                    continue
            else:
                items = await pending.take()
            if not items and pending.closed:
                break
            parts = []
            for item in items:
                if isinstance(item, Chunk):
                    last = item
                    parts.extend(render(item))
                else:
                    parts.append(item)
            data = b"".join(b"data: " + json.dumps(p, separators=(",", ":")).encode() + b"\n\n" for p in parts)
            await asyncio.wait_for(response.write(data), policy.stall_s)
        if include_usage and last is not None and last.finish_reason is not None:
            await response.write(b"data: " + json.dumps(render.usage(last)).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")

    relay_task = asyncio.create_task(relay())
    write_task = asyncio.create_task(write())
    watch_task = asyncio.create_task(_until_gone(request))
    try:
        done, _ = await asyncio.wait({write_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if write_task in done:
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                write_task.result()
    finally:
        for task in (relay_task, write_task, watch_task, first):
            task.cancel()
        await asyncio.gather(relay_task, write_task, watch_task, first, return_exceptions=True)
        with contextlib.suppress(Exception):
            await rest.aclose()
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


async def _first(stream):
    """The first chunk, before any byte is sent (errors here become HTTP statuses)."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise InferplaneError("the model sent no response") from None


async def _whole(request: web.Request, answer) -> Chunk:
    """A non-streaming answer (``LLMService.complete``), cancelled if the client goes away."""
    task = asyncio.create_task(answer)
    watch = asyncio.create_task(_until_gone(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise Cancelled("the client closed the connection")  # nobody reads the answer
        return task.result()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task  # a cancelled generation closes its stream (the Triton call) before the answer leaves


# ---- handlers ---------------------------------------------------------------------------------


class _ChatRender:
    def __init__(self, cid: str, model: str, created: int, include_usage: bool):
        self.base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        self.include_usage = include_usage
        self.sent_role = False

    def _chunk(self, delta: dict, finish: str | None) -> dict:
        doc = {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            doc["usage"] = None
        return doc

    def __call__(self, chunk: Chunk) -> list[dict]:
        events = []
        if not self.sent_role:
            events.append(self._chunk({"role": "assistant", "content": ""}, None))
            self.sent_role = True
        if chunk.text:
            events.append(self._chunk({"content": chunk.text}, None))
        if chunk.finish_reason is not None:
            events.append(self._chunk({}, _FINISH.get(chunk.finish_reason, chunk.finish_reason)))
        return events

    def usage(self, chunk: Chunk) -> dict:
        return {**self.base, "choices": [], "usage": _usage(chunk)}


class _CompletionRender(_ChatRender):
    def __init__(self, cid: str, model: str, created: int, include_usage: bool):
        super().__init__(cid, model, created, include_usage)
        self.base["object"] = "text_completion"

    def __call__(self, chunk: Chunk) -> list[dict]:
        finish = None if chunk.finish_reason is None else _FINISH.get(chunk.finish_reason, chunk.finish_reason)
        if not chunk.text and finish is None:
            return []
        doc = {**self.base, "choices": [{"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish}]}
        if self.include_usage:
            doc["usage"] = None
        return [doc]


def _admission(request: web.Request):
    """The process's in-flight bound (``server.dataplane.loop_gate``), entered before the body is read:
    past it a 429 with ``Retry-After`` and the OpenAI error body, before any byte of a stream."""
    return request.app[DATAPLANE].admission


async def chat_completions(request: web.Request) -> web.StreamResponse:
    with _admission(request):  # held until the answer's last byte (a stream's too)
        _start_timer(request)
        doc = await json_object(request)
        model, params = parse_generation(doc, chat=True)
        return await _generate(request, doc, model, params, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    with _admission(request):
        _start_timer(request)
        doc = await json_object(request)
        model, params = parse_generation(doc, chat=False)
        return await _generate(request, doc, model, params, chat=False)


async def _generate(request: web.Request, doc: dict, model: str, params: GenerateParams, chat: bool) -> web.StreamResponse:
    stream_mode = bool(doc.get("stream", False))
    include_usage = _stream_options(doc) if stream_mode else False
    svc = service(request)
    ctx = _ctx(request)
    created = int(time.time())
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if stream_mode:
        render_cls = _ChatRender if chat else _CompletionRender
        return await _stream_sse(request, svc.generate(model, params, ctx=ctx), render_cls(cid, model, created, include_usage), include_usage)
    last = await _whole(request, svc.complete(model, params, ctx=ctx))
    return _server_timing(request, web.json_response(_completion_doc(cid, model, created, chat, last)), "encode")


def parse_generation(doc: dict, chat: bool) -> tuple[str, GenerateParams]:
    """A chat completion's or completion's body as (model, parameters), as the handlers read it."""
    model = _model_name(doc)
    params = _sampling(doc)
    if chat:
        params.messages = _messages(doc)
        return model, params
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("prompt", "must be a string (or a list of one string)")
    params.prompt = prompt
    return model, params


async def completion_answer(svc: LLMService, doc: dict, ctx: CallContext, chat: bool) -> dict:
    """The non-streaming answer of a chat completion or completion (a batch job's row)."""
    if doc.get("stream"):
        raise _bad("stream", "a batch request cannot stream")
    model, params = parse_generation(doc, chat)
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    return _completion_doc(cid, model, int(time.time()), chat, await svc.complete(model, params, ctx=ctx))


def _completion_doc(cid: str, model: str, created: int, chat: bool, last: Chunk) -> dict:
    """The answer of a whole generation (``LLMService.complete``)."""
    text = last.text
    finish = _FINISH.get(last.finish_reason, last.finish_reason)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        body = {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    body["usage"] = _usage(last)
    return body


async def embeddings(request: web.Request) -> web.Response:
    with _admission(request):
        _start_timer(request)
        doc = await json_object(request)
        return _server_timing(request, web.json_response(await embeddings_answer(service(request), doc, _ctx(request))), "encode")


async def embeddings_answer(svc: LLMService, doc: dict, ctx: CallContext) -> dict:
    """An embeddings request's answer (the handler's and a batch job's row)."""
    model = _model_name(doc)
    texts = doc.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _bad("input", "must be a string or a non-empty list of strings (token arrays are not supported)")
    if len(texts) > 2048:
        raise _bad("input", "at most 2048 inputs per request")
    encoding = doc.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _bad("encoding_format", "must be float or base64")
    dimensions = _number(doc, "dimensions", int, *limits.DIMENSIONS)
    vectors, tokens = await svc.embed(model, texts, ctx=ctx)
    if dimensions is not None and dimensions != vectors.shape[1]:
        raise _bad("dimensions", f"model '{model}' produces {vectors.shape[1]} dimensions")
    data = []
    for i, vector in enumerate(vectors):
        value = base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def row_answers(svc: LLMService) -> list[tuple[re.Pattern, object]]:
    """A batch job's rows of the OpenAI endpoints (``server.transports.batch_rows.RowRunner``): the same
    answers as the live handlers'."""

    async def embeddings(_match, doc: dict, ctx: CallContext) -> dict:
        return await embeddings_answer(svc, doc, ctx)

    async def completion(match, doc: dict, ctx: CallContext) -> dict:
        return await completion_answer(svc, doc, ctx, chat=match[0] == "/v1/chat/completions")

    return [(re.compile(r"/v1/embeddings"), embeddings), (re.compile(r"/v1/(chat/)?completions"), completion)]


async def list_models(request: web.Request) -> web.Response:
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "inferplane", "kind": kind, **({"parent": parent} if parent else {})}
        for name, kind, parent in await service(request).listed(_ctx(request))
    ]
    return web.json_response({"object": "list", "data": data})


async def engine_stats(request: web.Request) -> web.Response:
    return web.json_response(await service(request).engine_stats(request.match_info["name"], _ctx(request)))


# ---- routes (mounted into server.composition.ROUTES) ------------------------------------------------------------

_ANY_ERROR = {status: error_body(f"Error ({status}); see the error code", "OpenAIError") for status in error_statuses()}
_OBJ = {"type": "object", "additionalProperties": True}
_SSE_BODY = {SSE: {"schema": {"type": "string", "description": "data: {chunk} events, then data: [DONE]"}}}


def _openai_body(description: str, required: list[str], properties: dict) -> Body:
    return json_body(description, {"type": "object", "required": required, "properties": properties, "additionalProperties": True})


_SAMPLING_PROPS = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean", "description": "extension: generate up to max_tokens even past end-of-sequence"},
    "deadline_ms": {"type": "number", "minimum": 1, "description": "extension: abort the generation after this long"},
}

ROUTES: list[Route] = [
    Route("POST", "/v1/chat/completions", chat_completions, "chat_completions",
          "OpenAI chat completions (stream: Server-Sent Events)", "openai",
          {200: Body("A chat.completion, or with stream=true chat.completion.chunk events",
                     {JSON: {"schema": _OBJ}, **_SSE_BODY})} | _ANY_ERROR,
          request=_openai_body("OpenAI chat completion request", ["model", "messages"],
                               {**_SAMPLING_PROPS, "messages": {"type": "array", "items": _OBJ}})),
    Route("POST", "/v1/completions", completions, "completions", "OpenAI text completions (stream: SSE)", "openai",
          {200: Body("A text_completion, or with stream=true text_completion events",
                     {JSON: {"schema": _OBJ}, **_SSE_BODY})} | _ANY_ERROR,
          request=_openai_body("OpenAI completion request", ["model", "prompt"],
                               {**_SAMPLING_PROPS, "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}})),
    Route("POST", "/v1/embeddings", embeddings, "embeddings", "OpenAI embeddings (L2-normalized)", "openai",
          {200: json_body("A list of embeddings", _OBJ)} | _ANY_ERROR,
          request=_openai_body("OpenAI embeddings request", ["model", "input"], {
              "model": {"type": "string"},
              "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
              "encoding_format": {"type": "string", "enum": ["float", "base64"]},
              "dimensions": {"type": "integer", "minimum": 1},
          })),
    *BATCH_ROUTES,
    Route("GET", "/v1/models", list_models, "openai_models", "Served LLM and embedding models (OpenAI list shape)", "openai",
          {200: json_body("Model list", _OBJ)} | error_responses(schema="OpenAIError")),
    Route("GET", "/v2/models/{name}/engine_stats", engine_stats, "llm_engine_stats",
          "LLM engine counters: decode steps, queue, KV reservations, prefix-cache hits, recent sequences", "llm",
          {200: json_body("Engine counters", _OBJ)} | error_responses(400, 404, 503)),
]  # fmt: skip
