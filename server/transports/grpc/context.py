"""What every gRPC servicer shares: the call context read from metadata, and the one place a domain
error becomes a status (``DomainErrorInterceptor``, installed on the server; servicers just raise).
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from server.dataplane.stage_timing import TIMING_HEADER, StageTimer
from server.errors import InferplaneError, grpc_status
from server.tenancy.identity import CallContext, bearer_token, clamp_timeout
from server.tenancy.tls import grpc_peer_cert

log = logging.getLogger(__name__)


def call_context(context: grpc.aio.ServicerContext, timed: bool = False) -> CallContext:
    """The caller's key (``authorization: Bearer`` or ``x-api-key``), idempotency key and deadline;
    ``timed``: a call that offers a per-stage breakdown (``server.dataplane.stage_timing``) starts its
    timer here when the caller asked for it."""
    authorization = api_key = idempotency_key = timing = None
    metadata = context.invocation_metadata() or ()
    for key, value in metadata:
        if key == "authorization":
            authorization = value
        elif key == "x-api-key":
            api_key = value
        elif key == "idempotency-key":
            idempotency_key = value
        elif timed and key == TIMING_HEADER:
            timing = StageTimer()
    timeout = clamp_timeout(context.time_remaining())  # a deadline of years would overflow on the way to Triton
    # the client certificate is read only if the call authenticates by it (mTLS, no API key)
    peer = functools.partial(grpc_peer_cert, context)
    return CallContext(bearer_token(authorization, api_key), idempotency_key, timeout, headers=metadata, peer=peer, timing=timing)


async def abort(context: grpc.aio.ServicerContext, err: InferplaneError):
    status = grpc_status(err)
    await context.abort(status.code, status.details, status.trailing_metadata)


def _unexpected(context, err: Exception) -> InferplaneError:
    log.exception("unexpected error in %s", getattr(context, "_rpc_method", "a gRPC call"), exc_info=err)
    return InferplaneError(f"internal error ({type(err).__name__})")


def _unary(behaviour):
    async def wrapper(request, context):
        try:
            return await behaviour(request, context)
        except InferplaneError as err:
            await abort(context, err)
        except Exception as err:  # noqa: BLE001 - a bug: INTERNAL with the error table's details, logged
            if isinstance(err, grpc.aio.AbortError):
                raise
            await abort(context, _unexpected(context, err))

    return wrapper


def _streaming(behaviour):
    """Server-streaming handlers: a domain error before or between messages ends the call with its
    status (servicers that send errors inside the stream catch them themselves)."""

    async def wrapper(request, context):
        try:
            async for message in behaviour(request, context):
                yield message
        except InferplaneError as err:
            await abort(context, err)
        except Exception as err:  # noqa: BLE001
            if isinstance(err, grpc.aio.AbortError):
                raise
            await abort(context, _unexpected(context, err))

    return wrapper


# services whose handlers never change while the server runs (registered once, never forwarded to
# the leader): their wrapped handler is made once per method, not per call. The typed per-model
# services come and go at deploy, and the control RPCs may be forwarded: those are wrapped per call.
STATIC_SERVICES = ("/inference.GRPCInferenceService/",)


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps every ``InferplaneError`` a handler raises to the error table's status and details."""

    def __init__(self) -> None:
        self._static: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        wrapped = self._static.get(method)
        if wrapped is not None:  # the hot path: no inner interceptors, no new handler per call
            return wrapped
        wrapped = self._wrap(await continuation(handler_call_details))
        if wrapped is not None and method.startswith(STATIC_SERVICES):
            self._static[method] = wrapped
        return wrapped

    @staticmethod
    def _wrap(handler):
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_unary(handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_unary(handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
        return handler


def _wrap_stream(behaviour):
    # an async generator yields its messages; a coroutine (grpc health's Watch) writes them itself
    return _streaming(behaviour) if inspect.isasyncgenfunction(behaviour) else _unary(behaviour)
