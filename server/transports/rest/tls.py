"""mTLS on the REST and metrics ports: the connection's client certificate, for the call context.

The TLS layer asks every client for a certificate and refuses, in the handshake, one the client CA
did not sign or that is expired (``ssl.CERT_OPTIONAL``: a presented certificate is verified). A
client that presents none completes the handshake and every request it sends is answered 401 with a
JSON body saying a client certificate is required — a clear error where a refused handshake would
only show the client a closed connection (asyncio's TLS transport closes without sending OpenSSL's
alert). Nothing is served without a verified certificate.

Every request that has one runs with :data:`server.tenancy.tls.PEER_CERT` set to a getter of it,
which ``CallContext.from_headers`` picks up: a call without an API key is authenticated by the
tenant its certificate is bound to. The certificate is parsed only when that happens.
"""

from __future__ import annotations

import functools

from aiohttp import web

from server.errors import Unauthenticated, http_error
from server.tenancy.tls import PEER_CERT, transport_peer_cert

MISSING = (
    "mutual TLS: this port requires a client certificate signed by the frontend's client CA "
    "(--tls-client-ca); the connection presented none"
)


@web.middleware
async def peer_certificate(request: web.Request, handler):
    if transport_peer_cert(request.transport) is None:
        status, body, headers = http_error(Unauthenticated(MISSING), openai=request.path.startswith("/v1/"))
        return web.json_response(body, status=status, headers=headers)
    token = PEER_CERT.set(functools.partial(transport_peer_cert, request.transport))
    try:
        return await handler(request)
    finally:
        PEER_CERT.reset(token)
