"""The body of a REST request, read the one way every REST route reads it: its Content-Type one
of those the route accepts (none is fine: tritonclient.http sends none), within the app's body limit."""

from __future__ import annotations

from aiohttp import web

from server.errors import RequestTooLarge, UnsupportedMediaType
from server.transports.rest.appkeys import MAX_BODY


def require_content_type(request: web.Request, accepted: tuple[str, ...]) -> None:
    """No Content-Type is fine (tritonclient.http sends none); any other than ``accepted`` is a 415.

    ``curl -d`` sends application/x-www-form-urlencoded: a 415 that says what to send instead.
    """
    header = request.headers.get("Content-Type")
    if header is None:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media not in accepted:
        raise UnsupportedMediaType(f"Content-Type {media or '(empty)'!r} is not accepted here; send {' or '.join(accepted)}")


async def read_body(request: web.Request) -> bytes:
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise RequestTooLarge(f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes") from None
