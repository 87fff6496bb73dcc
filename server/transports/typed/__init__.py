"""Typed per-model gRPC APIs (issue 21): ``inferplane.models.<name>.v<major>.<Name>Service``.

``add_typed_services(server, dataplane, catalog)`` is what the frontend calls while it assembles a gRPC
server: it registers the one generic handler of every typed service over the process's schema catalog
(``server.control.typed.typed_catalog``, built once per process by ``server.composition.schema_catalog``)
and returns a :class:`TypedApi` whose ``enable_reflection`` replaces ``grpc_reflection``'s (the typed
services appear and disappear at deploy time). Every port of the process serves that one catalog: the
admin API's ``GetModelProto`` and ``RetireSchema`` (``server.transports.typed.admin.SchemaAdmin``) and the
REST route ``GET /v1/models/{name}/proto`` (the app's ``SCHEMAS`` key) get it from the composition root.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpc_reflection.v1alpha import reflection_pb2_grpc

from server.control.typed.typed_catalog import SchemaCatalog
from server.transports.typed.reflection import TypedReflection
from server.transports.typed.service import TypedServices


@dataclass
class TypedApi:
    services: TypedServices

    def enable_reflection(self, service_names, server, pool) -> None:
        """Server reflection over the fixed ``service_names`` (found in ``pool``) and every typed service."""
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(TypedReflection(service_names, pool, self.services), server)


def add_typed_services(server, dataplane, catalog: SchemaCatalog) -> TypedApi:
    """Serve the typed API of every schema in ``catalog`` (of the models ``dataplane`` serves) on ``server``
    (call before it starts)."""
    services = TypedServices(dataplane, catalog)
    services.refresh()
    server.add_generic_rpc_handlers((services,))
    return TypedApi(services)


__all__ = ["TypedApi", "add_typed_services"]
