"""A request body that does not parse is the caller's mistake: INVALID_ARGUMENT, on every typed RPC.

grpc runs a typed handler's ``request_deserializer`` before the servicer; when it raises (bytes
that are not the message, a string field that is not UTF-8 — protobuf refuses those) grpc
answers UNKNOWN "Unexpected DecodeError", which reads as a server fault. This interceptor gives
each typed unary handler a raw-bytes front that parses the body itself and answers
INVALID_ARGUMENT naming the expected message through the error table. The raw-bytes handlers
(``ModelInfer``, ``ModelStreamInfer``, the metadata passthroughs) already parse inside the data
plane and are returned untouched; so are client-streaming handlers and the server-streaming ones
that are not async generators (grpc health's ``Watch`` writes through its context).
"""

from __future__ import annotations

import inspect

import grpc

from server.errors import InvalidRequest, grpc_status


def _message_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request")


async def _parse(deserializer, raw: bytes, context: grpc.aio.ServicerContext):
    try:
        return deserializer(raw)
    except Exception:  # noqa: BLE001 - DecodeError, and whatever a custom deserializer raises
        status = grpc_status(
            InvalidRequest(
                f"the request body is not a valid {_message_name(deserializer)} protobuf "
                "(not that message, or a string field that is not UTF-8)"
            )
        )
        await context.abort(status.code, status.details, status.trailing_metadata)


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary_unary(raw, context):
            request = await _parse(deserialize, raw, context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=handler.response_serializer)
    behavior = handler.unary_stream
    if not inspect.isasyncgenfunction(behavior):
        return handler

    async def unary_stream(raw, context):
        request = await _parse(deserialize, raw, context)
        async for response in behavior(request, context):
            yield response

    return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=handler.response_serializer)


class DecodeErrorsInterceptor(grpc.aio.ServerInterceptor):
    """Install with ``grpc.aio.server(interceptors=[DecodeErrorsInterceptor()])``."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method in self._wrapped:
            wrapped = self._wrapped[method]
            if wrapped is not None:
                return wrapped
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method (never cached: its name is the caller's)
            return None
        if handler.request_streaming or handler.request_deserializer is None:
            self._wrapped[method] = None  # raw bytes or client streaming: as registered
            return handler
        wrapped = _wrap(handler)
        self._wrapped[method] = wrapped
        return wrapped
