"""The JSON object body of an OpenAI-style request, read the one way both the generation and the
batch endpoints read it: ``application/json`` (or no Content-Type), valid UTF-8 JSON, an object,
within the document limits (``server.transports.limits``)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from server.errors import InvalidRequest, UnsupportedMediaType
from server.transports import limits
from server.transports.rest.openapi import JSON


async def json_object(request: web.Request) -> dict[str, Any]:
    header = request.headers.get("Content-Type", JSON).split(";", 1)[0].strip().lower()
    if header not in (JSON, ""):
        raise UnsupportedMediaType(f"Content-Type {header!r} is not accepted here; send {JSON}")
    raw = await request.read()
    try:
        doc = json.loads(raw or b"null")
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; nesting too deep is not
        raise InvalidRequest("the request body is not valid JSON (UTF-8)") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("the request body must be a JSON object")
    limits.check_json(raw, doc)  # a lone surrogate ("\ud800") anywhere is the caller's mistake, named here
    return doc
