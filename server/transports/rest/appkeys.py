"""The REST app's keys (what ``create_app`` puts on the aiohttp application), shared by its route modules."""

from __future__ import annotations

from aiohttp import web

DATAPLANE: web.AppKey = web.AppKey("dataplane")  # server.dataplane.dataplane.DataPlane
METRICS: web.AppKey = web.AppKey("metrics")  # server.dataplane.metrics.Metrics
MAX_BODY: web.AppKey[int] = web.AppKey("max_body_bytes", int)
OPENAPI: web.AppKey[bytes] = web.AppKey("openapi", bytes)
