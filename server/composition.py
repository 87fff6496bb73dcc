"""The composition root's tables (with ``server.app``, the wiring): the HTTP port's routes assembled
from each transport's own table, the REST application built on them, its OpenAPI document, the gRPC
port's services (``add_grpc_services``), the process's one typed-schema catalog (``schema_catalog``),
and the batch row runner over the data plane's port.
Transports define their routes; only this module puts them together, so no transport imports
another's table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy.exc import SQLAlchemyError

from server import __version__
from server.control.typed.typed_catalog import SchemaCatalog
from server.control.typed.typed_store import TypedSchemaStore
from server.dataplane.metrics import Metrics
from server.protogen import _pool
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.transports.batch_rows import RowRunner
from server.transports.grpc.admin import AdminService
from server.transports.grpc.autoscale import AutoscaleService, add_to_server as add_autoscale
from server.transports.grpc.generation import add_to_server as add_generation
from server.transports.grpc.inference import SERVICE, InferenceService
from server.transports.grpc.tenancy import TenancyService, add_to_server as add_tenancy
from server.transports.grpc.traffic import TrafficService, add_to_server as add_traffic
from server.transports.openai.batches import BATCHES
from server.transports.openai.endpoints import LLM, SSE_POLICY, SSEPolicy
from server.transports.openai.endpoints import ROUTES as OPENAI_ROUTES
from server.transports.openai.endpoints import row_answers as openai_rows
from server.transports.rest import codec as rest_codec
from server.transports.rest.appkeys import DATAPLANE, MAX_BODY, METRICS, OPENAI_OPERATIONS, OPENAPI, SCHEMAS
from server.transports.rest.deploy import PROVISIONER
from server.transports.rest.deploy import ROUTES as DEPLOY_ROUTES
from server.transports.rest.endpoints import ROUTES as INFERENCE_ROUTES
from server.transports.rest.endpoints import error_middleware
from server.transports.rest.endpoints import row_answers as inference_rows
from server.transports.rest.openapi import Route, document
from server.transports.rest.repository import ROUTES as REPOSITORY_ROUTES
from server.transports.rest.status_page import ROUTES as STATUS_ROUTES
from server.transports.rest.status_page import STATUS
from server.transports.rest.typed import ROUTES as TYPED_ROUTES
from server.transports.typed import add_typed_services
from server.transports.typed.admin import SchemaAdmin

log = logging.getLogger(__name__)

# every route of the HTTP port, in the order they are registered and documented
ROUTES: list[Route] = [*INFERENCE_ROUTES, *REPOSITORY_ROUTES, *OPENAI_ROUTES, *TYPED_ROUTES, *STATUS_ROUTES, *DEPLOY_ROUTES]
# the operations whose errors take the OpenAI API's shape (``server.errors.error_body``)
_OPENAI_OPERATIONS = frozenset(r.operation_id for r in OPENAI_ROUTES if r.tag == "openai")


def openapi_document() -> dict:
    return document(
        ROUTES,
        title="inferplane REST bridge",
        version=__version__,
        description="Open Inference Protocol v2 over HTTP (KServe v2, Triton binary tensor extension), "
        "a KServe v1 predict form, metrics. Errors: {\"error\": {code, message, details}} with the gRPC codes.",
    )


def create_app(
    dataplane, metrics: Metrics, *, max_body_bytes: int, sse: SSEPolicy | None = None, status=None, batches=None, provisioner=None,
    schemas: SchemaCatalog | None = None,
) -> web.Application:
    """The HTTP port's application: every route of ``ROUTES`` over ``dataplane`` (a DataPlane), one error
    middleware; ``status``: the status page's observability tasks, ``batches``: the batch store,
    ``provisioner``: deploys that answer at once, ``schemas``: the typed APIs' catalog (each route answers
    what it lacks when not given)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app[SSE_POLICY] = sse or SSEPolicy()
    app[DATAPLANE] = dataplane
    app[METRICS] = metrics
    app[MAX_BODY] = max_body_bytes
    app[OPENAI_OPERATIONS] = _OPENAI_OPERATIONS
    app[STATUS] = status
    if dataplane is not None:
        app[LLM] = dataplane.llm
    if batches is not None:
        app[BATCHES] = batches
    if provisioner is not None:
        app[PROVISIONER] = provisioner
    if schemas is not None:
        app[SCHEMAS] = schemas
    app[OPENAPI] = rest_codec.dumps(openapi_document())
    for route in ROUTES:
        app.router.add_route(route.method, route.path, route.handler, name=route.operation_id)
    return app


def row_runner(dataplane) -> RowRunner:
    """A batch job's rows answered as the live OpenAI and inference handlers answer them, through the port."""
    return RowRunner(dataplane.gate.principal_of, [*openai_rows(dataplane.llm), *inference_rows(dataplane)])


class ControlParts(NamedTuple):
    """What the control plane lends the ports: its registry, deployer, traffic controller and batch store
    (all None in a process without one: a worker of --workers N, a serving process that never leads)."""

    registry: object = None
    deployer: object = None
    traffic: object = None
    batches: object = None


def control_parts(control) -> ControlParts:
    """``control``: a ``server.control.service.control_plane.ControlPlane``."""
    return ControlParts(control.registry, control.deployer, control.traffic, control.batches)


def schema_catalog(dataplane, parts: ControlParts, repository: Path | None, store: TypedSchemaStore | None = None) -> SchemaCatalog:
    """The typed APIs' schema catalog of this process, which every one of its ports serves: the persisted
    schemas read (``parts.registry``'s database, or ``store``: a process that never leads reads the leader's),
    the loaded models' derived, and the deployer's hook when ``parts`` has one. Its ``follow`` task keeps it
    up to date with what other processes write."""
    catalog = SchemaCatalog(dataplane, parts.registry, repository, store)
    try:
        catalog.load()  # a few rows, once, before the ports open
    except SQLAlchemyError as err:  # a follower before the leader's first migration: ``follow`` reads them later
        if parts.registry is not None:
            raise
        log.warning("the typed schemas cannot be read yet: %s", err)
    catalog.sync()
    if parts.deployer is not None:
        parts.deployer.schemas = catalog
    return catalog


def add_grpc_services(server, dataplane, fleet, health, parts: ControlParts, *, tenancy_store, key_pepper: bytes, schemas: SchemaCatalog) -> None:
    """Every service of the gRPC port on ``server`` (OIP v2, admin, tenancy, generation, traffic, autoscale,
    the typed services over ``schemas``, health) and reflection over them; ``parts``: what the control plane lends them."""
    server.add_generic_rpc_handlers((InferenceService(dataplane).handler(),))
    typed = add_typed_services(server, dataplane, schemas)
    admin = AdminService(dataplane, parts.registry, parts.deployer, schemas=SchemaAdmin(schemas))
    admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
    tenancy_name = add_tenancy(TenancyService(dataplane, tenancy_store, key_pepper, parts.registry), server)
    generation_name = add_generation(dataplane.llm, server, dataplane.admission)
    traffic_name = add_traffic(TrafficService(dataplane, parts.traffic), server)
    autoscale_name = add_autoscale(AutoscaleService(dataplane, lambda: fleet.autoscaler, fleet.sampler), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _add_to_pool(health_pb2.DESCRIPTOR)
    admin_name = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
    typed.enable_reflection(  # grpc_reflection's, plus the typed services that come and go at deploy
        (SERVICE, admin_name, generation_name, tenancy_name, traffic_name, autoscale_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
        pool=_pool.POOL,
    )


def _add_to_pool(file_descriptor) -> None:
    """Make a default-pool file (e.g. grpc health) visible to reflection over our private pool."""
    try:
        _pool.POOL.FindFileByName(file_descriptor.name)
    except KeyError:
        _pool.POOL.AddSerializedFile(file_descriptor.serialized_pb)
