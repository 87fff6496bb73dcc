"""The Open Inference Protocol v2 gRPC service: a thin adapter over the DataPlane.

ModelInfer and the metadata RPCs are registered as generic handlers on raw bytes, so a request
is parsed once (for validation) and forwarded as the bytes that arrived; Triton's answer goes
back to the caller the same way. Every domain error becomes a status through ``server.errors``.
"""

from __future__ import annotations

import functools

import grpc

from server import __version__
from server.dataplane import DataPlane, parse_infer_request, parse_message
from server.errors import InferplaneError, grpc_status
from server.protogen.inference import grpc_service_pb2 as pb

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


def _passthrough(method: str, request_type):
    """A raw-bytes RPC about one model: check the model is served here, forward to Triton."""

    async def handler(self, raw: bytes, context):
        request = parse_message(request_type, raw)
        if request.name or method != "ModelStatistics":
            self.dp.resolve(request.name, request.version)
        return await self.dp.triton.unary_raw(method, raw, timeout=context.time_remaining())

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
        try:
            self.dp.resolve(request.name, request.version)
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
        for name in sorted(set(self.dp.models) | self.dp.loaded):
            signature = self.dp.models.get(name)
            versions = sorted(signature.versions) if signature else [""]
            for version in versions:
                response.models.add(name=name, version=version, state="READY" if signature else "UNAVAILABLE")
        return response

    async def repository_model_load(self, request, context):
        await self.dp.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request, context):
        await self.dp.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- inference ------------------------------------------------------------------------

    async def model_infer(self, raw: bytes, context):
        return await self.dp.infer(parse_infer_request(raw), raw, timeout=context.time_remaining())

    async def model_stream_infer(self, request_iterator, context):
        async for response in self.dp.stream_infer(request_iterator, timeout=context.time_remaining()):
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
