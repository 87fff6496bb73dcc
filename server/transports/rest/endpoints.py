"""The REST bridge: Open Inference Protocol v2 over HTTP (aiohttp), a thin adapter over the DataPlane.

The twin of ``server.transports.grpc.inference``: every request becomes the same ``ModelInferRequest`` a gRPC
caller would send (``server.transports.rest.codec``) and goes through ``DataPlane.infer``, so validation,
metrics and errors are the gRPC path's. One middleware turns every ``InferplaneError`` into the
error table's HTTP status and ``{"error": {code, message, details}}`` body; anything unexpected
becomes a 500 of the same shape. ``ROUTES`` is this module's table (inference, health, metadata,
metrics, the OpenAPI document); ``server.composition`` puts it beside the other transports' tables,
registers them all and builds ``/openapi.json`` (``server.transports.rest.openapi``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from server import __version__
from server.transports.rest import codec as rest_codec
from server.control.batches.batches import OIP_ENDPOINT
from server.dataplane.port import ModelPort
from server.errors import BackendUnavailable, InferplaneError, RequestTooLarge, error_body, http_error
from server.transports.rest.appkeys import DATAPLANE, METRICS, OPENAI_OPERATIONS, OPENAPI
from server.transports.rest.body import read_body, require_content_type
from server.transports.rest.openapi import BINARY, JSON, TEXT, Body, Route, error_responses, error_statuses, json_body
from server.transports.rest.openapi import error_body as documented_error
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext
from server.dataplane.routing import ARM_HEADER, VERSION_HEADER
from server.dataplane.stage_timing import TIMING_HEADER, StageTimer

log = logging.getLogger(__name__)


EXTENSIONS = ("binary_tensor_data", "model_configuration")
# bodies above this are decoded/encoded off the event loop (a thread), below it inline
_OFFLOAD_BYTES = 256 << 10
_HTTP_REASONS = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}


# ---- helpers --------------------------------------------------------------------------------


def _json(document: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=rest_codec.dumps(document), status=status, headers=headers, content_type=JSON)


def _error(err: InferplaneError, request: web.Request | None = None) -> web.Response:
    status, body, headers = http_error(err, openai=_is_openai(request))
    return _json(body, status, headers)


def _is_openai(request: web.Request | None) -> bool:
    """An OpenAI route answers errors in the OpenAI API's shape (``server.errors.error_body``)."""
    if request is None:
        return False
    route = request.match_info.route
    return getattr(route, "name", None) in request.app.get(OPENAI_OPERATIONS, ())


def _context(request: web.Request) -> CallContext:
    return CallContext.from_headers(request.headers)


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["name"], request.match_info.get("version", "")


async def _cpu(size: int, fn, *args):
    """Run a codec step inline when small, in a thread when the payload is big enough to stall the loop."""
    if size > _OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


# ---- health and metadata --------------------------------------------------------------------


async def server_live(request: web.Request) -> web.Response:
    return _json({"live": True})


async def server_ready(request: web.Request) -> web.Response:
    if not request.app[DATAPLANE].is_ready():
        raise BackendUnavailable("the server is not ready (Triton or a model is still loading)", retry_after_s=1.0)
    return _json({"ready": True})


async def server_metadata(request: web.Request) -> web.Response:
    return _json({"name": "inferplane", "version": __version__, "extensions": list(EXTENSIONS)})


async def model_ready(request: web.Request) -> web.Response:
    name, version = _model(request)
    request.app[DATAPLANE].resolve_for(_context(request), name, version)  # NOT_FOUND / MODEL_NOT_READY / UNAVAILABLE
    return _json({"name": name, "version": version, "ready": True})


async def model_metadata(request: web.Request) -> web.Response:
    name, version = _model(request)
    ask = pb.ModelMetadataRequest(name=name, version=version).SerializeToString()
    return _json(rest_codec.model_metadata_json(await request.app[DATAPLANE].describe(_context(request), "ModelMetadata", ask)))


async def model_config(request: web.Request) -> web.Response:
    name, version = _model(request)
    ask = pb.ModelConfigRequest(name=name, version=version).SerializeToString()
    return _json(rest_codec.model_config_json(await request.app[DATAPLANE].describe(_context(request), "ModelConfig", ask)))


# ---- inference ------------------------------------------------------------------------------


async def model_infer(request: web.Request) -> web.Response:
    """v2 infer: JSON tensors, or Triton's binary tensor extension (Inference-Header-Content-Length)."""
    dp = request.app[DATAPLANE]
    with dp.admission:  # refused before the body is read past the in-flight bound or while the loop stands behind
        timer = StageTimer() if TIMING_HEADER in request.headers else None  # the caller asked for Server-Timing
        name, version = _model(request)
        ctx = _context(request)
        ctx.timing = timer
        dp.authorize(ctx, name)  # an unknown key or ungranted model answers before the body is read
        require_content_type(request, (JSON, BINARY))
        body = await read_body(request)
        header_len = rest_codec.header_length(request.headers.get(rest_codec.HEADER_LENGTH), len(body))
        answer, plan = await _infer(dp, ctx, body, header_len, name, version)
    payload, header_len = await _encode(answer.raw, plan)
    answered = {VERSION_HEADER: answer.version, ARM_HEADER: answer.arm, **dict(ctx.quota_headers)}  # which version (and arm) answered; allowance left
    if timer is not None:
        timer.mark("encode")
        answered["Server-Timing"] = timer.header()
    if header_len is None:
        return web.Response(body=payload, content_type=JSON, headers=answered)
    return web.Response(body=payload, content_type=BINARY, headers={rest_codec.HEADER_LENGTH: str(header_len), **answered})


async def _infer(port: ModelPort, ctx: CallContext, body: bytes, header_len: int | None, name: str, version: str):
    """A v2 infer body (JSON, or the binary tensor extension's) decoded and sent through the port:
    (the answer, how to encode it)."""
    infer_request, plan = await _cpu(len(body), rest_codec.decode_infer_request, body, header_len, name, version)
    if ctx.timing is not None:
        ctx.timing.mark("decode")
    return await port.infer(infer_request, None, ctx.timeout, ctx), plan


async def _encode(raw: bytes, plan) -> tuple[bytes, int | None]:
    """The answer as the caller asked for it: (payload, binary header length or None)."""
    return await _cpu(len(raw), rest_codec.encode_infer_response, raw, plan)


def row_answers(port: ModelPort) -> list[tuple[re.Pattern, object]]:
    """A batch job's ``/v2/models/NAME[/versions/V]/infer`` rows (``server.transports.batch_rows.RowRunner``):
    the live handler's decode, infer and encode; the row's answer is the JSON part."""

    async def infer_row(match, doc: dict, ctx: CallContext) -> dict:
        answer, plan = await _infer(port, ctx, json.dumps(doc).encode(), None, match["name"], match["version"] or "")
        payload, header_len = await _encode(answer.raw, plan)
        return json.loads(payload if header_len is None else payload[:header_len])

    return [(OIP_ENDPOINT, infer_row)]


async def predict(request: web.Request) -> web.Response:
    """KServe v1 convenience form: ``{"instances": [...]}`` -> ``{"predictions": [...]}``."""
    dp = request.app[DATAPLANE]
    name, version = _model(request)
    ctx = _context(request)
    dp.authorize(ctx, name)
    require_content_type(request, (JSON,))
    body = await read_body(request)
    signature = dp.resolve(name, version)
    requests = await _cpu(len(body), rest_codec.decode_instances, body, signature, version)
    raws = [a.raw for a in await asyncio.gather(*(dp.infer(r, None, ctx.timeout, _instance(ctx, i)) for i, r in enumerate(requests)))]
    size = sum(len(r) for r in raws)
    predictions = await _cpu(size, rest_codec.encode_predictions, list(raws), signature.max_batch_size > 0)
    return web.Response(body=await _cpu(size, rest_codec.dumps, {"predictions": predictions}), content_type=JSON)


def _instance(ctx: CallContext, index: int) -> CallContext:
    """Each instance of a predict call is its own request: an idempotency key covers each by index."""
    return dataclasses.replace(ctx, idempotency_key=f"{ctx.idempotency_key}#{index}" if ctx.idempotency_key else None)


# ---- operations -----------------------------------------------------------------------------


async def metrics(request: web.Request) -> web.Response:
    """The metrics port's registry, for admin keys only: this port faces tenants, and the series
    name every model with its counts, also models a tenant may not see. (With auth off the open
    tenant is the admin; the metrics port itself stays open, on the operators' network.)"""
    request.app[DATAPLANE].gate.require_admin(_context(request), "GET /metrics on the REST port")
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type=JSON)


# ---- the route table ------------------------------------------------------------------------

_BINARY_SCHEMA = {"schema": {"type": "string", "format": "binary"}}
_OK_INFER = Body(
    "Inference result: JSON, or with binary outputs a JSON header of Inference-Header-Content-Length bytes "
    "followed by each binary output's bytes",
    {JSON: {"schema": {"$ref": "#/components/schemas/InferResponse"}}, BINARY: _BINARY_SCHEMA},
    {rest_codec.HEADER_LENGTH: {"schema": {"type": "integer", "minimum": 0}, "required": False}},
)
_INFER_BODY = Body(
    "JSON tensors, or (binary tensor extension) a JSON header of Inference-Header-Content-Length bytes followed by "
    "each input's binary_data_size bytes in order",
    {JSON: {"schema": {"$ref": "#/components/schemas/InferRequest"}}, BINARY: _BINARY_SCHEMA},
)
_HEADER_LENGTH_PARAM = {
    "name": rest_codec.HEADER_LENGTH,
    "required": False,
    "schema": {"type": "integer", "minimum": 0},
    "description": "binary tensor extension: length of the JSON header at the start of the body",
}
_MODEL_ERRORS = error_responses(404, 503)
_INFER_ERRORS = {status: documented_error(f"Error ({status}); see the error code") for status in error_statuses()}


def _versioned(method: str, path: str, handler, operation_id: str, summary: str, tag: str, responses, **kw):
    """Two routes: the model's latest version (``{name}``) and a named one (``{name}/versions/{version}``)."""
    versioned = path.replace("{name}", "{name}/versions/{version}", 1)
    return [
        Route(method, path, handler, operation_id, summary, tag, responses, **kw),
        Route(method, versioned, handler, operation_id + "_version", summary + " (a given version)", tag, responses, **kw),
    ]


_BASIC = error_responses()
ROUTES: list[Route] = [
    Route("GET", "/v2/health/live", server_live, "server_live", "The process is up", "health",
          {200: json_body("Live", "Live")} | _BASIC),
    Route("GET", "/v2/health/ready", server_ready, "server_ready", "Triton is up and every loaded model is ready", "health",
          {200: json_body("Ready", "Ready")} | error_responses(503)),
    Route("GET", "/v2", server_metadata, "server_metadata", "Server name, version and extensions", "metadata",
          {200: json_body("Server metadata", "ServerMetadata")} | _BASIC),
    *_versioned("GET", "/v2/models/{name}", model_metadata, "model_metadata", "Model metadata (inputs, outputs)",
                "metadata", {200: json_body("Model metadata", "ModelMetadata")} | _MODEL_ERRORS),
    *_versioned("GET", "/v2/models/{name}/ready", model_ready, "model_ready", "Model readiness (200 when ready)",
                "health", {200: json_body("Model ready", "ModelReady")} | _MODEL_ERRORS),
    *_versioned("GET", "/v2/models/{name}/config", model_config, "model_config", "Triton model configuration",
                "metadata", {200: json_body("Model configuration", "ModelConfig")} | _MODEL_ERRORS),
    *_versioned("POST", "/v2/models/{name}/infer", model_infer, "model_infer",
                "Inference (KServe v2 JSON, Triton binary tensor extension)", "inference",
                {200: _OK_INFER} | _INFER_ERRORS, request=_INFER_BODY, headers=(_HEADER_LENGTH_PARAM,)),
    Route("POST", "/v1/models/{name}:predict", predict, "predict", "KServe v1 convenience form: instances -> predictions",
          "inference", {200: json_body("Predictions, one per instance", "PredictResponse")} | _INFER_ERRORS,
          request=json_body("One row per instance, or an object input name -> row per instance", "PredictRequest")),
    Route("GET", "/metrics", metrics, "metrics",
          "Prometheus metrics (same registry as the metrics port); needs an admin key when auth is on", "operations",
          {200: Body("Prometheus text exposition", {TEXT: {"schema": {"type": "string"}}})} | _BASIC
          | {401: documented_error("No API key, or an unknown one"), 403: documented_error("The key is not an admin key")}),
    Route("GET", "/openapi.json", openapi, "openapi", "This document", "operations",
          {200: json_body("OpenAPI 3 document", "OpenAPI")} | _BASIC),
]  # fmt: skip


# ---- middleware -----------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as the error table's status and JSON shape; nothing escapes as a crash."""
    try:
        return await handler(request)
    except InferplaneError as err:
        return _error(err, request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return _error(RequestTooLarge(exc.text or "request body too large"), request)
        code = _HTTP_REASONS.get(exc.status, f"HTTP_{exc.status}")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        message = f"{exc.reason}: {request.method} {request.path}"
        return _json(error_body(code, message, [], openai=_is_openai(request)), exc.status, headers)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug, not the caller's fault: log it, answer 500, keep serving
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _error(InferplaneError(f"internal error ({type(exc).__name__})"), request)
