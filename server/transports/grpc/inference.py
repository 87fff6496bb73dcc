"""The Open Inference Protocol v2 gRPC service: a thin adapter over the DataPlane.

ModelInfer and the metadata RPCs are registered as generic handlers on raw bytes, so a request
is parsed once (for validation) and forwarded as the bytes that arrived; Triton's answer goes
back to the caller the same way. Handlers raise domain errors; the server's
``DomainErrorInterceptor`` turns them into statuses.
"""

from __future__ import annotations

import grpc

from server import __version__
from server.dataplane.dataplane import DataPlane, parse_infer_request
from server.dataplane.routing import ARM_HEADER, VERSION_HEADER
from server.dataplane.stage_timing import SERVER_TIMING
from server.errors import InferplaneError, InvalidRequest, Violation
from server.protogen.inference import grpc_service_pb2 as pb
from server.transports.grpc.context import call_context

SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = ("model_repository", "statistics", "model_configuration", "binary_tensor_data")


def _describe(method: str):
    async def handler(self, raw: bytes, context):
        ctx = call_context(context)
        return await self.dp.describe(ctx, method, raw, timeout=ctx.timeout)

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
        self.dp.authenticate(ctx)  # an unknown key is UNAUTHENTICATED, not "not ready"
        try:
            self.dp.resolve_for(ctx, request.name, request.version)
            return pb.ModelReadyResponse(ready=True)
        except InferplaneError:
            return pb.ModelReadyResponse(ready=False)

    async def server_metadata(self, request, context):
        return pb.ServerMetadataResponse(name="inferplane", version=__version__, extensions=EXTENSIONS)

    model_metadata = _describe("ModelMetadata")
    model_config = _describe("ModelConfig")
    model_statistics = _describe("ModelStatistics")

    async def repository_index(self, request, context):
        response = pb.RepositoryIndexResponse()
        for name in self.dp.visible(call_context(context), self.dp.names()):
            signature = self.dp.signature(name)
            versions = sorted(signature.versions) if signature else [""]
            for version in versions:
                response.models.add(name=name, version=version, state="READY" if signature else "UNAVAILABLE")
        return response

    async def repository_model_load(self, request, context):
        self.dp.gate.require_admin(call_context(context), "loading a model")
        overrides = sorted(k for k in request.parameters if k == "config" or k.startswith("file:"))
        if overrides:  # a load with a new config or files is a deploy: through the registry
            raise InvalidRequest(
                f"loading with {', '.join(overrides)} is not offered here: register the model and `inferplane deploy` it",
                [Violation(f"parameters.{k}", "not supported: deploy through the registry") for k in overrides],
            )
        await self.dp.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request, context):
        self.dp.gate.require_admin(call_context(context), "unloading a model")
        await self.dp.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- inference ------------------------------------------------------------------------

    async def model_infer(self, raw: bytes, context):
        with self.dp.admission:  # refused before decode past the in-flight bound or while the loop stands behind
            ctx = call_context(context, timed=True)
            request = parse_infer_request(raw)
            timer = ctx.timing
            if timer is not None:
                timer.mark("decode")
            answer, version, arm = await self.dp.infer(request, raw, ctx.timeout, ctx)
        answered = ((VERSION_HEADER, version), (ARM_HEADER, arm), *ctx.quota_headers)  # who answered; allowance left
        if timer is not None:
            timer.mark("encode")
            answered = (*answered, (SERVER_TIMING, timer.header()))
        context.set_trailing_metadata(answered)
        return answer

    async def model_stream_infer(self, request_iterator, context):
        """Phase one (refused before any response, e.g. a bad key) raises: the interceptor's status.
        After that every error travels in the stream as ``error_message``."""
        ctx = call_context(context)
        async for response in self.dp.stream_infer(request_iterator, ctx.timeout, ctx):
            yield response

    # ---- registration ---------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def typed(fn, request_type):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=request_type.FromString, response_serializer=lambda m: m.SerializeToString()
            )

        raw = grpc.unary_unary_rpc_method_handler
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
