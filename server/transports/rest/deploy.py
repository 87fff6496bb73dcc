"""REST deploys for callers that deploy programmatically (spliced into
``server.composition.ROUTES``):

* ``POST /v1/models/deploy`` ``{"model": NAME, "version"?: N, "serving"?: {instances, max_batch,
  queue_delay_us, cache}, "autoscaling"?: {min_replicas, max_replicas, target_inflight | target +
  signal, scale_to_zero_after_s, cold_start_budget_s, ...}}`` -> **202** ``{"endpoint_id",
  "status": "provisioning", "estimated_ready_seconds", ...}`` and ``Location``;
* ``GET /v1/models/deploy/{endpoint_id}`` -> the operation: ``provisioning``, ``ready`` (with the
  deploy's result) or ``failed`` (with the error), plus the endpoint's replicas.

Both need an admin key with ``--auth on``; a frontend without the control plane (a worker of
``--workers N``) answers 501. A thin adapter over :class:`server.control.rollout.provisioning.Provisioner`.
"""

from __future__ import annotations

from aiohttp import web

from server.control.rollout.provisioning import Provisioner
from server.errors import InvalidRequest, Unimplemented
from server.tenancy.identity import CallContext
from server.transports.rest import codec as rest_codec
from server.transports.rest.appkeys import DATAPLANE
from server.transports.rest.body import read_body, require_content_type
from server.transports.rest.openapi import JSON, Route, error_responses, json_body

PROVISIONER: web.AppKey[Provisioner] = web.AppKey("provisioner", Provisioner)

SIGNAL_TARGETS = {"target_inflight": "inflight", "target_queue": "queue", "target_qps": "qps", "target_tokens_per_s": "tokens_per_s"}
_SERVING = ("instances", "max_batch", "queue_delay_us", "cache")


def autoscaling_fields(raw: object) -> dict:
    """The request's autoscaling object as config fields (``target_inflight: 8`` is ``target: 8``
    on the ``inflight`` signal)."""
    if not isinstance(raw, dict):
        raise InvalidRequest("'autoscaling' must be an object")
    out = dict(raw)
    for alias, signal in SIGNAL_TARGETS.items():
        if alias in out:
            if "target" in out:
                raise InvalidRequest(f"give either 'target' or '{alias}', not both")
            out["target"] = out.pop(alias)
            out.setdefault("signal", signal)
    for key, value in out.items():
        if key in ("signal",):
            if not isinstance(value, str):
                raise InvalidRequest(f"autoscaling.{key} must be a string")
        elif key == "predictive":
            if not isinstance(value, bool):
                raise InvalidRequest("autoscaling.predictive must be true or false")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidRequest(f"autoscaling.{key} must be a number")
    return out


def _provisioner(request: web.Request) -> Provisioner:
    provisioner = request.app.get(PROVISIONER)
    if provisioner is None:
        raise Unimplemented("deploys run in the frontend process that owns the registry and deployer")
    return provisioner


def _admin(request: web.Request, what: str) -> str:
    gate = request.app[DATAPLANE].gate
    principal = gate.require_admin(CallContext.from_headers(request.headers), what)
    return f"{principal.name}/{principal.key_id}" if gate.enabled else request.headers.get("x-inferplane-actor", "rest")[:200]


async def deploy(request: web.Request) -> web.Response:
    actor = _admin(request, "deploying a model")
    provisioner = _provisioner(request)
    require_content_type(request, (JSON,))
    body = rest_codec.loads(await read_body(request))
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with 'model'")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' (the registered model's name) is required")
    version = body.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise InvalidRequest("'version' must be a positive integer")
    serving = body.get("serving") or {}
    if not isinstance(serving, dict) or set(serving) - set(_SERVING):
        raise InvalidRequest(f"'serving' must be an object with some of {', '.join(_SERVING)}")
    autoscaling = autoscaling_fields(body["autoscaling"]) if body.get("autoscaling") is not None else None
    op = await provisioner.submit(f"{model}:{version}" if version else model, serving, autoscaling, actor)
    location = f"/v1/models/deploy/{op['endpoint_id']}"
    return web.Response(body=rest_codec.dumps(op), status=202, content_type=JSON, headers={"Location": location})


async def deploy_status(request: web.Request) -> web.Response:
    _admin(request, "reading a deploy")
    op = _provisioner(request).get(request.match_info["endpoint_id"])
    return web.Response(body=rest_codec.dumps(op), content_type=JSON)


_OBJ = {"type": "object", "additionalProperties": True}
_OPERATION = {
    "type": "object",
    "required": ["endpoint_id", "endpoint", "status", "estimated_ready_seconds"],
    "properties": {
        "endpoint_id": {"type": "string"},
        "endpoint": {"type": "string"},
        "version": {"type": "integer"},
        "status": {"type": "string", "enum": ["provisioning", "ready", "failed"]},
        "estimated_ready_seconds": {"type": "number"},
    },
    "additionalProperties": True,
}
_REQUEST = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string"},
        "version": {"type": "integer", "minimum": 1},
        "serving": {"type": "object", "properties": {"instances": {"type": "integer"}, "max_batch": {"type": "integer"},
                                                     "queue_delay_us": {"type": "integer"}, "cache": {"type": "boolean"}},
                    "additionalProperties": False},
        "autoscaling": {"type": "object", "properties": {
            "min_replicas": {"type": "integer", "minimum": 0}, "max_replicas": {"type": "integer", "minimum": 1},
            "target_inflight": {"type": "number", "minimum": 0, "exclusiveMinimum": True}, "target": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
            "signal": {"type": "string", "enum": ["inflight", "queue", "qps", "tokens_per_s", "triton_queue_ms"]},
            "scale_to_zero_after_s": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
            "cold_start_budget_s": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        }, "additionalProperties": True},
    },
    "additionalProperties": False,
}  # fmt: skip



ROUTES: list[Route] = [
    Route("POST", "/v1/models/deploy", deploy, "deploy_model",
          "Deploy a registered model version (202: provisioning in the background; poll the Location)", "deploy",
          {202: json_body("The deploy operation, provisioning", _OPERATION)} | error_responses(400, 401, 403, 404, 409, 413, 415, 501, 503),
          request=json_body("What to deploy and how to scale it", _REQUEST)),
    Route("GET", "/v1/models/deploy/{endpoint_id}", deploy_status, "deploy_status",
          "A deploy operation: provisioning, ready (with the result) or failed (with the error)", "deploy",
          {200: json_body("The deploy operation", _OPERATION)} | error_responses(401, 403, 404, 501)),
]  # fmt: skip
