"""The platform's own admin API (``inferplane.v1.Admin``): a thin adapter over the DataPlane."""

from __future__ import annotations

from server.dataplane import DataPlane
from server.errors import InferplaneError
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.servicer import abort
from server.signature import ModelSignature, version_key


def model_status(dp: DataPlane, name: str) -> admin_pb2.ModelStatus:
    signature: ModelSignature | None = dp.models.get(name)
    if signature is None:
        return admin_pb2.ModelStatus(name=name, state="UNAVAILABLE", reason="not loaded or failed to load")
    status = admin_pb2.ModelStatus(
        name=name,
        versions=sorted(signature.versions, key=version_key),
        state="READY" if dp.backend_up else "UNAVAILABLE",
        backend=signature.backend,
        max_batch_size=signature.max_batch_size,
    )
    for spec in signature.inputs.values():
        status.inputs.add(name=spec.name, datatype=spec.datatype, dims=spec.dims)
    for spec in signature.outputs.values():
        status.outputs.add(name=spec.name, datatype=spec.datatype, dims=spec.dims)
    return status


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, dataplane: DataPlane):
        self.dp = dataplane

    async def ListModels(self, request, context):
        names = sorted(set(self.dp.models) | self.dp.loaded)
        return admin_pb2.ListModelsResponse(models=[model_status(self.dp, n) for n in names])

    async def LoadModel(self, request, context):
        try:
            await self.dp.load_model(request.name)
        except InferplaneError as err:
            await abort(context, err)
        return admin_pb2.LoadModelResponse(model=model_status(self.dp, request.name))

    async def UnloadModel(self, request, context):
        try:
            await self.dp.unload_model(request.name)
        except InferplaneError as err:
            await abort(context, err)
        return admin_pb2.UnloadModelResponse()
