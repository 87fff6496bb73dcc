"""``inferplane.v1.Admin`` GetModelProto / RetireSchema: what ``server.transports.grpc.admin`` calls."""

from __future__ import annotations

from server.control.typed.typed_catalog import parse_major
from server.control.typed.typed_schema import TypedSchema
from server.protogen.inferplane.v1 import admin_pb2
from server.transports.typed import typed_api
from server.control.typed import typed_proto


def schema_info(schema: TypedSchema, state: str = "active") -> admin_pb2.TypedSchemaInfo:
    return admin_pb2.TypedSchemaInfo(
        major=schema.major, revision=schema.revision, model_version=schema.model_version,
        service=schema.service, file_name=schema.file_name, state=state,
    )  # fmt: skip


async def get_model_proto(dataplane, request: admin_pb2.GetModelProtoRequest) -> admin_pb2.GetModelProtoResponse:
    """The caller was checked for the model already (an ungranted one is NOT_FOUND)."""
    catalog = typed_api(dataplane).catalog
    schema = await catalog.schema_for(request.name, request.version)
    majors = catalog.majors(request.name)
    state = "active" if schema.major in majors else "not served"
    served = [schema_info(s) for _, s in sorted(majors.items())]
    return admin_pb2.GetModelProtoResponse(proto=typed_proto.proto_text(schema), schema=schema_info(schema, state), served=served)


async def retire_schema(dataplane, request: admin_pb2.RetireSchemaRequest, actor: str) -> admin_pb2.RetireSchemaResponse:
    """The caller was checked for admin already."""
    kept = await typed_api(dataplane).catalog.retire(request.name, parse_major(request.major), actor)
    return admin_pb2.RetireSchemaResponse(served=[schema_info(s) for s in kept])
