"""The GRPCInferenceService unary methods the in-process Triton answers (``unary_raw``): each
takes the parsed request and returns the answer message or its bytes."""

from __future__ import annotations

from typing import Any, Protocol

from server.errors import Unimplemented
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime import capi_codec
from server.runtime.capi import ffi
from server.runtime.capi_codec import RequestPlan
from server.runtime.inprocess_call import InferResult


class Server(Protocol):
    """What the unary methods call on the in-process server (``server.runtime.inprocess.InProcessTriton``),
    declared here so that nothing names it back."""

    _lib: Any
    _server: Any

    def _check_running(self) -> None: ...

    def _ok(self, err) -> None: ...

    def _json(self, produce): ...

    def _model_config_bytes(self, name: str, version: str = "") -> bytes: ...

    def _repository_index(self, ready_only: bool = False) -> pb.RepositoryIndexResponse: ...

    async def _infer_plan(self, plan: RequestPlan, timeout: float | None) -> InferResult: ...

    async def server_live(self, timeout: float = 1.0) -> bool: ...

    async def server_ready(self, timeout: float = 1.0) -> bool: ...

    async def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse: ...

    def statistics(self, name: str = "", version: str = "") -> bytes: ...

    async def load_model(self, name: str, timeout: float = 300.0, *, config: dict | str | None = None) -> None: ...

    async def unload_model(self, name: str, timeout: float = 60.0) -> None: ...



async def _live(t: Server, _req, _timeout):
    return pb.ServerLiveResponse(live=await t.server_live())


async def _ready(t: Server, _req, _timeout):
    return pb.ServerReadyResponse(ready=await t.server_ready())


async def _model_ready(t: Server, req: pb.ModelReadyRequest, _timeout):
    t._check_running()
    flag = ffi.new("bool*")
    t._ok(t._lib.TRITONSERVER_ServerModelIsReady(t._server, req.name.encode(), capi_codec.parse_version(req.version), flag))
    return pb.ModelReadyResponse(ready=bool(flag[0]))


async def _server_metadata(t: Server, _req, _timeout):
    t._check_running()
    return capi_codec.server_metadata(t._json(lambda out: t._lib.TRITONSERVER_ServerMetadata(t._server, out)))


async def _model_metadata(t: Server, req: pb.ModelMetadataRequest, _timeout):
    return await t.model_metadata(req.name, req.version)


async def _model_config(t: Server, req: pb.ModelConfigRequest, _timeout):
    return t._model_config_bytes(req.name, req.version)


async def _statistics(t: Server, req: pb.ModelStatisticsRequest, _timeout):
    return t.statistics(req.name, req.version)


async def _index(t: Server, req: pb.RepositoryIndexRequest, _timeout):
    if req.repository_name:
        raise Unimplemented("'repository_name' specification is not supported")
    return t._repository_index(req.ready)


async def _load(t: Server, req: pb.RepositoryModelLoadRequest, timeout):
    config = req.parameters["config"].string_param if "config" in req.parameters else None
    if any(k != "config" for k in req.parameters):
        raise Unimplemented("only the 'config' load parameter is supported by the in-process Triton")
    await t.load_model(req.model_name, timeout or 300.0, config=config)
    return pb.RepositoryModelLoadResponse()


async def _unload(t: Server, req: pb.RepositoryModelUnloadRequest, timeout):
    await t.unload_model(req.model_name, timeout or 60.0)
    return pb.RepositoryModelUnloadResponse()


async def _infer(t: Server, req: pb.ModelInferRequest, timeout):
    return (await t._infer_plan(capi_codec.request_plan(req), timeout)).to_bytes()


UNARY = {
    "ServerLive": (pb.ServerLiveRequest, _live),
    "ServerReady": (pb.ServerReadyRequest, _ready),
    "ModelReady": (pb.ModelReadyRequest, _model_ready),
    "ServerMetadata": (pb.ServerMetadataRequest, _server_metadata),
    "ModelMetadata": (pb.ModelMetadataRequest, _model_metadata),
    "ModelConfig": (pb.ModelConfigRequest, _model_config),
    "ModelStatistics": (pb.ModelStatisticsRequest, _statistics),
    "RepositoryIndex": (pb.RepositoryIndexRequest, _index),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, _load),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, _unload),
    "ModelInfer": (pb.ModelInferRequest, _infer),
}
