"""Triton's model-repository and statistics extensions over REST, as ``tritonclient.http`` calls them:
``POST /v2/repository/index``, ``POST /v2/repository/models/{name}/load|unload``,
``GET /v2/models/stats`` and ``GET /v2/models/{name}[/versions/{v}]/stats``. The same data plane
calls as the gRPC service's RepositoryIndex / RepositoryModelLoad / RepositoryModelUnload /
ModelStatistics: a tenant sees only its models; loading and unloading need an admin key.
"""

from __future__ import annotations

import json

from aiohttp import web

from server.errors import InvalidRequest, Violation
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext
from server.transports.rest import codec as rest_codec
from server.transports.rest.appkeys import DATAPLANE
from server.transports.rest.openapi import JSON, Route, error_responses, json_body

def _dp(request: web.Request):
    return request.app[DATAPLANE]


def _json(doc, status: int = 200) -> web.Response:
    return web.Response(body=rest_codec.dumps(doc), status=status, content_type=JSON)


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return doc


async def repository_index(request: web.Request) -> web.Response:
    dp = _dp(request)
    doc = await _body(request)
    ready_only = bool(doc.get("ready", False))
    out = []
    for name in dp.visible(CallContext.from_headers(request.headers), dp.names()):
        signature = dp.signature(name)
        if signature is None:
            if not ready_only:
                out.append({"name": name, "state": "UNAVAILABLE", "reason": "loading or failed to load"})
            continue
        out.extend({"name": name, "version": v, "state": "READY"} for v in sorted(signature.versions))
    return _json(out)


def _no_overrides(doc: dict) -> None:
    """A load with a config or files override is a deploy: it goes through the registry."""
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidRequest("parameters must be an object", [Violation("parameters", "must be an object")])
    unsupported = sorted(k for k in parameters if k == "config" or k.startswith("file:"))
    if unsupported:
        raise InvalidRequest(
            f"loading with {', '.join(unsupported)} is not offered here: register the model and `inferplane deploy` it",
            [Violation(f"parameters.{k}", "not supported: deploy through the registry") for k in unsupported],
        )


async def load(request: web.Request) -> web.Response:
    dp = _dp(request)
    dp.gate.require_admin(CallContext.from_headers(request.headers), "loading a model")
    _no_overrides(await _body(request))
    await dp.load_model(request.match_info["name"])
    return _json({})


async def unload(request: web.Request) -> web.Response:
    dp = _dp(request)
    dp.gate.require_admin(CallContext.from_headers(request.headers), "unloading a model")
    await _body(request)
    await dp.unload_model(request.match_info["name"])
    return _json({})


async def statistics(request: web.Request) -> web.Response:
    ask = pb.ModelStatisticsRequest(name=request.match_info.get("name", ""), version=request.match_info.get("version", ""))
    raw = await _dp(request).describe(CallContext.from_headers(request.headers), "ModelStatistics", ask.SerializeToString())
    return _json(rest_codec.statistics_json(raw))


_OBJ = {"type": "object", "additionalProperties": True}
_LIST = {"type": "array", "items": _OBJ}
ROUTES: list[Route] = [
    Route("POST", "/v2/repository/index", repository_index, "repository_index", "Models in the repository and their state",
          "repository", {200: json_body("Index", _LIST)} | error_responses(400, 401)),
    Route("POST", "/v2/repository/models/{name}/load", load, "repository_model_load", "Load a model (admin)",
          "repository", {200: json_body("Loaded", _OBJ)} | error_responses(400, 401, 403, 404, 503)),
    Route("POST", "/v2/repository/models/{name}/unload", unload, "repository_model_unload", "Unload a model (admin)",
          "repository", {200: json_body("Unloaded", _OBJ)} | error_responses(400, 401, 403, 404)),
    Route("GET", "/v2/models/stats", statistics, "model_statistics_all", "Statistics of every model the caller may see",
          "statistics", {200: json_body("Statistics", _OBJ)} | error_responses(401, 503)),
    Route("GET", "/v2/models/{name}/stats", statistics, "model_statistics", "A model's statistics",
          "statistics", {200: json_body("Statistics", _OBJ)} | error_responses(401, 404, 503)),
    Route("GET", "/v2/models/{name}/versions/{version}/stats", statistics, "model_statistics_version",
          "A model version's statistics", "statistics", {200: json_body("Statistics", _OBJ)} | error_responses(401, 404, 503)),
]  # fmt: skip
