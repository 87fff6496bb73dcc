"""``inferplane.v1.Admin`` GetModelProto / RetireSchema over the typed APIs' schema catalog: the
:class:`SchemaAdmin` the composition root hands ``server.transports.grpc.admin.AdminService``."""

from __future__ import annotations

from server.control.typed import typed_proto
from server.control.typed.typed_catalog import SchemaCatalog, parse_major
from server.control.typed.typed_schema import TypedSchema
from server.protogen.inferplane.v1 import admin_pb2


def schema_info(schema: TypedSchema, state: str = "active") -> admin_pb2.TypedSchemaInfo:
    return admin_pb2.TypedSchemaInfo(
        major=schema.major, revision=schema.revision, model_version=schema.model_version,
        service=schema.service, file_name=schema.file_name, state=state,
    )  # fmt: skip


class SchemaAdmin:
    def __init__(self, catalog: SchemaCatalog):
        self.catalog = catalog

    async def get_model_proto(self, request: admin_pb2.GetModelProtoRequest) -> admin_pb2.GetModelProtoResponse:
        """The caller was checked for the model already (an ungranted one is NOT_FOUND)."""
        schema = await self.catalog.schema_for(request.name, request.version)
        majors = self.catalog.majors(request.name)
        state = "active" if schema.major in majors else "not served"
        served = [schema_info(s) for _, s in sorted(majors.items())]
        return admin_pb2.GetModelProtoResponse(proto=typed_proto.proto_text(schema), schema=schema_info(schema, state), served=served)

    async def retire_schema(self, request: admin_pb2.RetireSchemaRequest, actor: str) -> admin_pb2.RetireSchemaResponse:
        """The caller was checked for admin already."""
        kept = await self.catalog.retire(request.name, parse_major(request.major), actor)
        return admin_pb2.RetireSchemaResponse(served=[schema_info(s) for s in kept])
