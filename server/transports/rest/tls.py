"""mTLS on the REST ports: the connection's client certificate, for the call context.

Under mutual TLS every REST request runs with :data:`server.tenancy.tls.PEER_CERT` set to a getter
of its connection's client certificate (``transport.get_extra_info("ssl_object")``), which
``CallContext.from_headers`` picks up: a call without an API key is authenticated by the tenant its
certificate is bound to. The certificate is read only when that happens.
"""

from __future__ import annotations

import functools

from aiohttp import web

from server.tenancy.tls import PEER_CERT, transport_peer_cert


@web.middleware
async def peer_certificate(request: web.Request, handler):
    token = PEER_CERT.set(functools.partial(transport_peer_cert, request.transport))
    try:
        return await handler(request)
    finally:
        PEER_CERT.reset(token)
