"""Typed per-model gRPC APIs (issue 21): ``inferplane.models.<name>.v<major>.<Name>Service``.

``add_typed_services(server, dataplane, ...)`` is what the frontend calls while it assembles its
gRPC server: it builds the schema catalog (``server.control.typed.typed_catalog``), gives the deployer
its hook, registers the one generic handler of every typed service and returns a
:class:`TypedApi` whose ``enable_reflection`` replaces ``grpc_reflection``'s (the typed services
appear and disappear at deploy time). The admin API's ``GetModelProto`` and ``RetireSchema`` get the
catalog from the composition root (``server.transports.typed.admin.SchemaAdmin``); the REST route
``GET /v1/models/{name}/proto`` finds the catalog of its data plane with :func:`typed_api`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

from grpc_reflection.v1alpha import reflection_pb2_grpc

from server.control.typed.typed_catalog import SchemaCatalog
from server.errors import Unimplemented
from server.transports.typed.reflection import TypedReflection
from server.transports.typed.service import TypedServices

_APIS: "weakref.WeakKeyDictionary[object, TypedApi]" = weakref.WeakKeyDictionary()


@dataclass
class TypedApi:
    catalog: SchemaCatalog
    services: TypedServices

    def enable_reflection(self, service_names, server, pool) -> None:
        """Server reflection over the fixed ``service_names`` (found in ``pool``) and every typed service."""
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(TypedReflection(service_names, pool, self.services), server)


def add_typed_services(server, dataplane, *, registry=None, deployer=None, repository: Path | None = None) -> TypedApi:
    """Serve the typed API of every model ``dataplane`` serves on ``server`` (call before it starts).

    ``registry`` (with ``deployer``): deployed endpoints keep their schema majors in its database
    and the deployer checks each new version's schema against the live one. ``repository``: where
    a model's ``inferplane.json`` names its features."""
    catalog = SchemaCatalog(dataplane, registry, repository)
    catalog.load()  # a few rows, once, before the server starts
    catalog.sync()
    if deployer is not None:
        deployer.schemas = catalog
    services = TypedServices(dataplane, catalog)
    services.refresh()
    server.add_generic_rpc_handlers((services,))
    api = _APIS[dataplane] = TypedApi(catalog, services)
    return api


def typed_api(dataplane) -> TypedApi:
    api = _APIS.get(dataplane)
    if api is None:
        raise Unimplemented("this frontend serves no typed APIs")
    return api


__all__ = ["TypedApi", "add_typed_services", "typed_api"]
