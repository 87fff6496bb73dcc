"""The Open Inference Protocol v2 gRPC service: a thin adapter over the DataPlane.

ModelInfer and the metadata RPCs are registered as generic handlers on raw bytes, so a request
is parsed once (for validation) and forwarded as the bytes that arrived; Triton's answer goes
back to the caller the same way. Every domain error becomes a status through ``server.errors``.
"""

from __future__ import annotations

import functools

import grpc

from server import __version__
from server.dataplane.dataplane import DataPlane, parse_infer_request, parse_message
from server.errors import InferplaneError, PermissionDenied, grpc_status
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext, bearer_token, clamp_timeout
from server.dataplane.routing import ARM_HEADER, VERSION_HEADER

SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = ("model_repository", "statistics", "model_configuration", "binary_tensor_data")


async def abort(context: grpc.aio.ServicerContext, err: InferplaneError):
    status = grpc_status(err)
    await context.abort(status.code, status.details, status.trailing_metadata)


def _guarded(handler):
    """Turn domain errors into statuses (phase one: before any response was sent)."""

    @functools.wraps(handler)
    async def wrapper(request, context):
        try:
            return await handler(request, context)
        except InferplaneError as err:
            await abort(context, err)

    return wrapper


def call_context(context: grpc.aio.ServicerContext) -> CallContext:
    """The caller's key (``authorization: Bearer`` or ``x-api-key``), idempotency key and deadline."""
    authorization = api_key = idempotency_key = None
    metadata = context.invocation_metadata() or ()
    for key, value in metadata:
        if key == "authorization":
            authorization = value
        elif key == "x-api-key":
            api_key = value
        elif key == "idempotency-key":
            idempotency_key = value
    timeout = clamp_timeout(context.time_remaining())  # a deadline of years would overflow on the way to Triton
    return CallContext(bearer_token(authorization, api_key), idempotency_key, timeout, headers=metadata)


def _passthrough(method: str, request_type):
    """A raw-bytes RPC about one model: check the caller may see it and it is served here, forward to Triton."""

    async def handler(self, raw: bytes, context):
        request = parse_message(request_type, raw)
        ctx = call_context(context)
        if request.name or method != "ModelStatistics":
            self.dp.resolve_for(ctx, request.name, request.version)
            return await self.dp.triton.unary_raw(method, raw, timeout=ctx.timeout)
        # statistics of every model: only those the caller may see
        answer = pb.ModelStatisticsResponse.FromString(await self.dp.triton.unary_raw(method, raw, timeout=ctx.timeout))
        visible = set(self.dp.visible(ctx, [m.name for m in answer.model_stats]))
        kept = [m for m in answer.model_stats if m.name in visible]
        del answer.model_stats[:]
        answer.model_stats.extend(kept)
        return answer.SerializeToString()

    return handler


class InferenceService:
    def __init__(self, dataplane: DataPlane):
        self.dp = dataplane

    # ---- health and metadata --------------------------------------------------------------

    async def server_live(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, context):
        return pb.ServerReadyResponse(ready=self.dp.is_ready())

    async def model_ready(self, request, context):
        ctx = call_context(context)
        self.dp.gate.authenticate(ctx)  # an unknown key is UNAUTHENTICATED, not "not ready"
        try:
            self.dp.resolve_for(ctx, request.name, request.version)
            return pb.ModelReadyResponse(ready=True)
        except InferplaneError:
            return pb.ModelReadyResponse(ready=False)

    async def server_metadata(self, request, context):
        return pb.ServerMetadataResponse(name="inferplane", version=__version__, extensions=EXTENSIONS)

    model_metadata = _passthrough("ModelMetadata", pb.ModelMetadataRequest)
    model_config = _passthrough("ModelConfig", pb.ModelConfigRequest)
    model_statistics = _passthrough("ModelStatistics", pb.ModelStatisticsRequest)

    async def repository_index(self, request, context):
        response = pb.RepositoryIndexResponse()
        for name in self.dp.visible(call_context(context), sorted(set(self.dp.models) | self.dp.loaded)):
            signature = self.dp.models.get(name)
            versions = sorted(signature.versions) if signature else [""]
            for version in versions:
                response.models.add(name=name, version=version, state="READY" if signature else "UNAVAILABLE")
        return response

    def _operator(self, context) -> None:
        """Loading and unloading models is for admin tenants when auth is on."""
        principal = self.dp.gate.authenticate(call_context(context))
        if self.dp.gate.enabled and not principal.tenant.admin:
            raise PermissionDenied("loading and unloading models needs an admin key")

    async def repository_model_load(self, request, context):
        self._operator(context)
        await self.dp.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request, context):
        self._operator(context)
        await self.dp.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- inference ------------------------------------------------------------------------

    async def model_infer(self, raw: bytes, context):
        ctx = call_context(context)
        answer = await self.dp.infer(parse_infer_request(raw), raw, ctx.timeout, ctx)
        context.set_trailing_metadata(((VERSION_HEADER, ctx.version), (ARM_HEADER, ctx.arm)))  # who answered
        return answer

    async def model_stream_infer(self, request_iterator, context):
        ctx = call_context(context)
        try:
            stream = self.dp.stream_infer(request_iterator, ctx.timeout, ctx)
            first = await anext(stream, None)
        except InferplaneError as err:  # phase one: refused before any response
            await abort(context, err)
            return
        if first is None:
            return
        yield first
        async for response in stream:
            yield response

    # ---- registration ---------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def typed(fn, request_type):
            return grpc.unary_unary_rpc_method_handler(
                _guarded(fn),
                request_deserializer=request_type.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )

        def raw(fn):
            return grpc.unary_unary_rpc_method_handler(_guarded(fn))

        methods = {
            "ServerLive": typed(self.server_live, pb.ServerLiveRequest),
            "ServerReady": typed(self.server_ready, pb.ServerReadyRequest),
            "ModelReady": typed(self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": typed(self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": raw(self.model_metadata),
            "ModelConfig": raw(self.model_config),
            "ModelStatistics": raw(self.model_statistics),
            "ModelInfer": raw(self.model_infer),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.model_stream_infer),
            "RepositoryIndex": typed(self.repository_index, pb.RepositoryIndexRequest),
            "RepositoryModelLoad": typed(self.repository_model_load, pb.RepositoryModelLoadRequest),
            "RepositoryModelUnload": typed(self.repository_model_unload, pb.RepositoryModelUnloadRequest),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)
