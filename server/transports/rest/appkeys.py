"""The REST app's keys (what ``server.composition.create_app`` puts on the aiohttp application), shared by its route modules."""

from __future__ import annotations

from aiohttp import web

DATAPLANE: web.AppKey = web.AppKey("dataplane")  # server.dataplane.dataplane.DataPlane
METRICS: web.AppKey = web.AppKey("metrics")  # server.dataplane.metrics.Metrics
MAX_BODY: web.AppKey[int] = web.AppKey("max_body_bytes", int)
OPENAPI: web.AppKey[bytes] = web.AppKey("openapi", bytes)
# the operations whose errors take the OpenAI API's shape (server.errors.error_body)
OPENAI_OPERATIONS: web.AppKey[frozenset] = web.AppKey("openai_operations", frozenset)
SCHEMAS: web.AppKey = web.AppKey("schemas")  # server.control.typed.typed_catalog.SchemaCatalog (absent: no typed APIs)
