"""The REST bridge's route table type and the OpenAPI 3 document built from it.

``server.composition.ROUTES`` is a list of :class:`Route`; ``create_app`` registers each one with
aiohttp and :func:`document` describes the very same list, so the served ``/openapi.json``
cannot drift from the handlers.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from server.errors import InferplaneError, entry

JSON = "application/json"
BINARY = "application/octet-stream"
TEXT = "text/plain"

_PATH_PARAM = re.compile(r"\{(\w+)\}")


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


@dataclass(frozen=True)
class Body:
    """A response (or request) body: description and media type -> schema."""

    description: str
    content: dict[str, dict] = field(default_factory=dict)
    headers: dict[str, dict] = field(default_factory=dict)


def json_body(description: str, schema: str | dict) -> Body:
    return Body(description, {JSON: {"schema": _ref(schema) if isinstance(schema, str) else schema}})


def error_body(description: str, schema: str = "Error") -> Body:
    return Body(
        description,
        {JSON: {"schema": _ref(schema)}},
        # only sent with 429/503 (a retry hint); declared optional
        {"Retry-After": {"schema": {"type": "string"}, "required": False, "description": "seconds to wait before retrying"}},
    )


@dataclass(frozen=True)
class Route:
    """One REST operation: what aiohttp registers and what the OpenAPI document describes."""

    method: str
    path: str
    handler: Callable[..., Awaitable]
    operation_id: str
    summary: str
    tag: str
    responses: dict[int, Body]
    request: Body | None = None
    headers: tuple[dict, ...] = ()  # OpenAPI header parameter objects

    def path_parameters(self) -> list[str]:
        return _PATH_PARAM.findall(self.path)


# Statuses every operation may answer, whatever it does (from the one error table).
COMMON_ERRORS = (500,)
_ERROR_TEXT = {
    400: "Invalid request (malformed body, or it does not match the model's signature)",
    401: "Missing, unknown or expired API key",
    403: "The key may not do this (an admin key is needed)",
    404: "Unknown model, version or path",
    409: "In conflict with the current state (a different signature, another change in progress)",
    413: "Request body larger than the configured limit",
    415: "Unsupported Content-Type",
    429: "Overloaded; retry after Retry-After",
    499: "The caller went away",
    500: "Internal error",
    501: "Not implemented",
    503: "Triton or the model is not ready; retry",
    504: "Deadline exceeded",
}


def error_responses(*statuses: int, schema: str = "Error") -> dict[int, Body]:
    """Error responses (all of the same JSON shape) for the given statuses plus the common ones."""
    return {status: error_body(_ERROR_TEXT[status], schema) for status in sorted({*statuses, *COMMON_ERRORS})}


def error_statuses() -> list[int]:
    """Every HTTP status the error table can produce (a model call may answer any of them)."""
    classes, stack = set(), [InferplaneError]
    while stack:
        cls = stack.pop()
        classes.add(cls)
        stack.extend(cls.__subclasses__())
    return sorted({entry(cls("")).http_status for cls in classes})


# ---- schemas ---------------------------------------------------------------------------------

_PARAMETERS = {
    "type": "object",
    "additionalProperties": {"oneOf": [{"type": "boolean"}, {"type": "integer"}, {"type": "number"}, {"type": "string"}]},
}
_TENSOR_META = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}


def _tensors(dimension: dict, data: dict) -> dict:
    """The tensors of an infer request (its inputs) or response (its outputs): the v2 protocol gives both
    the same fields; ``dimension`` is the schema of one shape entry, ``data`` that of the values."""
    return {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "shape", "datatype"],
            "properties": {
                "name": {"type": "string"},
                "shape": {"type": "array", "items": dimension},
                "datatype": {"type": "string"},
                "parameters": _PARAMETERS,
                "data": data,
            },
        },
    }


_DETAILS = {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["field", "description"],
            "properties": {"field": {"type": "string"}, "description": {"type": "string"}},
        },
    }
SCHEMAS: dict[str, dict] = {
    "Error": {
        "type": "object",
        "required": ["error", "code", "details"],
        "description": "Triton's HTTP error shape (a string error) with the machine reason and field violations beside it",
        "properties": {
            "error": {"type": "string"},
            "code": {"type": "string", "description": "stable machine-readable reason, as in gRPC ErrorInfo.reason"},
            "details": _DETAILS,
        },
    },
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "description": "The OpenAI API's error shape",
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code", "details"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "details": _DETAILS,
                },
            }
        },
    },
    "Live": {"type": "object", "required": ["live"], "properties": {"live": {"type": "boolean"}}},
    "Ready": {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}},
    "ModelReady": {
        "type": "object",
        "required": ["name", "ready"],
        "properties": {"name": {"type": "string"}, "version": {"type": "string"}, "ready": {"type": "boolean"}},
    },
    "ServerMetadata": {
        "type": "object",
        "required": ["name", "version", "extensions"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": _TENSOR_META},
            "outputs": {"type": "array", "items": _TENSOR_META},
        },
    },
    "ModelConfig": {"type": "object", "description": "Triton's model configuration (model_config.proto field names)"},
    "InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": _PARAMETERS,
            "inputs": _tensors({"type": "integer", "minimum": 0}, {"type": "array", "description": "row-major tensor data, flat or nested"}),
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "parameters": _PARAMETERS},
                },
            },
        },
    },
    "InferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": _PARAMETERS,
            "outputs": _tensors({"type": "integer"}, {"type": "array"}),
        },
    },
    "PredictRequest": {
        "type": "object",
        "required": ["instances"],
        "properties": {
            "instances": {
                "type": "array",
                "minItems": 1,
                "description": "one row per instance (single-input models) or an object input name -> row",
                "items": {},
            }
        },
    },
    "PredictResponse": {
        "type": "object",
        "required": ["predictions"],
        "properties": {"predictions": {"type": "array", "items": {}}},
    },
    "OpenAPI": {"type": "object", "required": ["openapi", "paths"]},
}


# ---- the document ----------------------------------------------------------------------------


def _body_json(body: Body) -> dict:
    out: dict = {"description": body.description}
    if body.content:
        out["content"] = body.content
    if body.headers:
        out["headers"] = body.headers
    return out


def document(routes: list[Route], *, title: str, version: str, description: str = "") -> dict:
    """The OpenAPI 3.0 document for ``routes``."""
    paths: dict[str, dict] = {}
    for route in routes:
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for name in route.path_parameters()
        ]
        parameters += [dict(h, **{"in": "header"}) for h in route.headers]
        operation: dict = {
            "operationId": route.operation_id,
            "summary": route.summary,
            "tags": [route.tag],
            "responses": {str(status): _body_json(body) for status, body in sorted(route.responses.items())},
        }
        if parameters:
            operation["parameters"] = parameters
        if route.request is not None:
            operation["requestBody"] = {
                "description": route.request.description,
                "required": True,
                "content": route.request.content,
            }
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": SCHEMAS},
    }
