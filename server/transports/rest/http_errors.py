"""Malformed HTTP (a bad request line, bad or oversize headers) answered in the JSON error shape.

aiohttp's parser answers these itself, before any route or middleware runs, with a plain-text
400 from ``RequestHandler.handle_error``. aiohttp 3.x has no hook for that response: parser
errors bypass middleware and ``on_response_prepare`` (aio-libs/aiohttp#3287; its master branch
routes them through the middleware chain for the next major release, which will make this
module unnecessary). The narrowest override is that public method: :func:`json_parse_errors`
makes a runner's server build protocols whose ``handle_error`` writes
``{"error": "<message>", "code", "details"}`` through the error table, like every other error
of the REST bridge. ``tests/integration/test_hardening.py`` sends raw malformed HTTP to the real
server, so an aiohttp upgrade that changes this path fails there, not in production.
"""

from __future__ import annotations

import logging

from aiohttp import web, web_protocol

from server.errors import BackendError, DeadlineExceeded, InferplaneError, InvalidRequest, RequestTooLarge, http_error
from server.transports.rest import codec as rest_codec

log = logging.getLogger(__name__)


def _domain_error(status: int, exc: BaseException | None, message: str | None) -> InferplaneError:
    detail = str(message or getattr(exc, "message", "") or (exc and type(exc).__name__) or "").strip()
    if status == 413 or status == 431:
        return RequestTooLarge(f"request line or headers too large: {detail}")
    if status == 504:
        return DeadlineExceeded("the request handler timed out")
    if 400 <= status < 500:
        return InvalidRequest(f"malformed HTTP request: {detail or 'could not be parsed'}")
    return BackendError(f"internal error ({type(exc).__name__ if exc else status})")


class JsonErrorRequestHandler(web_protocol.RequestHandler):
    """aiohttp's protocol, with its own error responses in the JSON error shape."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:  # a caller's malformed request: not the server's error
            log.debug("malformed HTTP request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:  # bytes already went out: the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        code, body, headers = http_error(_domain_error(status, exc, message))
        response = web.Response(status=code, body=rest_codec.dumps(body), headers=headers, content_type="application/json")
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


def json_parse_errors(runner: web.BaseRunner) -> None:
    """After ``runner.setup()``: the connections its sites accept answer malformed HTTP in JSON."""
    server = runner.server
    if server is None:
        raise RuntimeError("call json_parse_errors after runner.setup()")
    if type(server) is web.Server:
        server.__class__ = _JsonErrorServer
