"""``GET /v1/models/{name}/proto``: the .proto of a model's typed gRPC API (issue 21), as text.

``…/versions/{version}/proto`` names a schema major (``v2``) or a model version (``3``), like
``inferplane proto NAME --version V``. ``ROUTES`` is spliced into
``server.composition.ROUTES``.
"""

from __future__ import annotations

from aiohttp import web

from server.control.typed import typed_proto
from server.errors import Unimplemented
from server.tenancy.identity import CallContext
from server.transports.rest.appkeys import DATAPLANE, SCHEMAS
from server.transports.rest.openapi import TEXT, Body, Route, error_responses

SCHEMA_HEADER = "x-inferplane-schema"  # e.g. "inferplane.models.fraud_xgboost.v1.FraudXgboostService v1"


async def model_proto(request: web.Request) -> web.Response:
    dp = request.app[DATAPLANE]
    name = request.match_info["name"]
    dp.authorize(CallContext.from_headers(request.headers), name)  # an ungranted model is an unknown one
    catalog = request.app.get(SCHEMAS)
    if catalog is None:
        raise Unimplemented("this frontend serves no typed APIs")
    schema = await catalog.schema_for(name, request.match_info.get("version", ""))
    return web.Response(text=typed_proto.proto_text(schema), content_type="text/plain", charset="utf-8",
                        headers={SCHEMA_HEADER: f"{schema.service} {schema.label}"})  # fmt: skip


_PROTO = {200: Body("The .proto file of the model's typed gRPC API", {TEXT: {"schema": {"type": "string"}}},
                    {SCHEMA_HEADER: {"description": "service and schema version", "schema": {"type": "string"}}})}  # fmt: skip
ROUTES: list[Route] = [
    Route("GET", "/v1/models/{name}/proto", model_proto, "model_proto", "The .proto of the model's typed gRPC API",
          "metadata", _PROTO | error_responses(400, 404, 501, 503)),
    Route("GET", "/v1/models/{name}/versions/{version}/proto", model_proto, "model_proto_version",
          "The .proto of a schema major (v2) or of the schema a model version (3) is served under", "metadata",
          _PROTO | error_responses(400, 404, 501, 503)),
]  # fmt: skip
