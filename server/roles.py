"""The parts of a frontend process that depend on its role, one object each (``server.app`` chooses them
from the settings, once, in ``Frontend.start``):

| process                                           | control role | ports role     |
|---------------------------------------------------|--------------|----------------|
| ``--workers 1``, control plane embedded           | ``Leader``   | ``ServingPorts`` (and /metrics) |
| ``--workers 1``, control plane external           | ``Follower`` | ``ServingPorts`` (and /metrics) |
| a worker of ``--workers N``                       | ``Follower`` | ``ServingPorts`` |
| the parent of ``--workers N``, embedded           | ``Leader``   | ``WorkerParent`` |
| the parent of ``--workers N``, external           | none         | ``WorkerParent`` |

``Leader``: what only a leader-capable process builds (the registry, deployer, traffic controller, the
batch store and its row runner: ``ControlPlane``, writing while it holds the lease). ``Follower``: a
serving process that never leads (the desired state applied, control RPCs carried to the leader).
``ServingPorts``: the data plane's ports. ``WorkerParent``: Triton's owner that serves only /metrics and
runs the workers. Each object holds every attribute from its construction on: a start that fails
part-way stops what it had started before it raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.composition import ControlParts, add_grpc_services, control_parts, create_app, schema_catalog
from server.control.rollout.shadow_records import ShadowRecords
from server.control.service.leader import LeaderDirectory
from server.control.service.state_watch import follow
from server.control.typed.typed_catalog import SchemaCatalog
from server.control.typed.typed_store import TypedSchemaStore
from server.db import make_engine
from server.runtime.workers import WorkerPool
from server.settings import Settings
from server.tenancy.tls import CertificateFiles, is_loopback
from server.transports.grpc.context import DomainErrorInterceptor
from server.transports.grpc.decoding import DecodeErrorsInterceptor
from server.transports.grpc.forward import LeaderForwarder
from server.transports.grpc.inference import SERVICE
from server.transports.openai.endpoints import SSEPolicy
from server.transports.rest.http_errors import json_parse_errors
from server.transports.rest.tls import peer_certificate


def shadow_records(settings: Settings, keys) -> ShadowRecords:
    """Where this process's shadow copies' disagreements are kept (the traffic controller's, or the watcher's)."""
    records = ShadowRecords(settings.shadow_record_destination, keys, settings.shadow_record_max)
    records.start()
    return records


def _forwarder(settings: Settings, leading, directory, leader_tls: tuple | None) -> LeaderForwarder:
    """Control RPCs this process cannot answer, carried to the leader the lease row names."""
    return LeaderForwarder(leading, directory, max_message_bytes=settings.max_request_bytes + (1 << 20), tls=leader_tls)


# ---- control roles -----------------------------------------------------------------------------


class Leader:
    """The control plane in a process that may lead (``server.control.service.control_plane``): registry,
    deployer, traffic controller, autoscaler's writer, batch store and row runner, behind the leader lease;
    a standby forwards control RPCs to the leader."""

    def __init__(self, control, records: ShadowRecords, forwarder: LeaderForwarder):
        self.control = control  # server.control.service.control_plane.ControlPlane
        self.shadow_records = records
        self.forwarder = forwarder

    @property
    def parts(self) -> ControlParts:
        return control_parts(self.control)

    async def advertise(self, address: str) -> None:
        await self.control.advertise(address)

    def fleet_started(self) -> None:
        self.control.fleet_started = True  # a late leader starts the autoscaler itself

    async def stop(self) -> None:
        await self.control.stop()
        await self.shadow_records.stop()
        await self.forwarder.close()


class Follower:
    """A serving process that never leads: the desired state applied to its pipeline (``watch()``, one
    of the process's tasks), control RPCs carried to the leader the lease row names."""

    parts = ControlParts()  # no registry, deployer, traffic controller or batch store here

    def __init__(self, settings: Settings, keys, leader_tls: tuple | None):
        self.settings = settings
        self.engine = make_engine(settings.database_url)  # the database it watches
        self.schema_store = TypedSchemaStore(self.engine)  # the typed schemas the leader's deploys write
        self.directory = LeaderDirectory(self.engine)
        self.shadow_records = shadow_records(settings, keys)
        self.forwarder = _forwarder(settings, lambda: False, self.directory, leader_tls)

    def watch(self, dataplane, fleet):
        """The desired-state watch (a coroutine the process runs as a task)."""
        return follow(dataplane, self.engine, self.settings, sampler=fleet.sampler, wakers=fleet.hooks.wakers, shadow_records=self.shadow_records)

    async def stop(self) -> None:
        await self.shadow_records.stop()
        await self.forwarder.close()
        self.engine.dispose()


def typed_schemas(settings: Settings, dataplane, control: "Leader | Follower | None") -> SchemaCatalog:
    """The process's one typed-schema catalog: a leader-capable process's over its registry (its deployer
    writes it), a follower's over the leader's database; its ``follow`` keeps either up to date."""
    if isinstance(control, Follower):
        return schema_catalog(dataplane, ControlParts(), settings.model_repository, control.schema_store)
    return schema_catalog(dataplane, control.parts if control is not None else ControlParts(), settings.model_repository)


def leader_forwarder(settings: Settings, control, leader_tls: tuple | None) -> LeaderForwarder:
    """The forwarder of a process that may lead: it forwards only while another process holds the lease."""
    return _forwarder(settings, lambda: control.leading, control.directory, leader_tls)


# ---- ports roles -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listeners:
    """What every port of this process is built from (the data plane, the control role's parts, TLS)."""

    settings: Settings
    tls: CertificateFiles | None
    metrics: object  # server.dataplane.metrics.Metrics
    health: object  # grpc_health's HealthServicer: the gRPC port's and the health port's
    dataplane: object
    fleet: object
    tenancy_store: object
    parts: ControlParts
    forwarder: LeaderForwarder | None
    status: object  # the status page's observability tasks
    schemas: object  # server.control.typed.typed_catalog.SchemaCatalog: the typed APIs every port serves

    async def grpc_server(self, address: str, internal: bool = False) -> tuple[grpc.aio.Server, int]:
        """Every service on one server bound to ``address``; control RPCs this process cannot answer go to the leader.
        ``internal``: the loopback port of the parent of workers, where they carry control RPCs (plaintext)."""
        s = self.settings
        forward = (self.forwarder,) if self.forwarder is not None else ()  # innermost: control RPCs to the leader
        server = grpc.aio.server(
            # domain errors -> statuses; an unparsable typed request body -> INVALID_ARGUMENT, not UNKNOWN
            interceptors=(DomainErrorInterceptor(), DecodeErrorsInterceptor(), *forward),
            options=[
                ("grpc.max_receive_message_length", s.max_request_bytes),
                ("grpc.max_send_message_length", s.max_request_bytes + (1 << 20)),
                ("grpc.so_reuseport", 1 if s.worker else 0),
                *((("grpc.max_concurrent_streams", s.grpc_max_streams_per_connection),) if s.grpc_max_streams_per_connection else ()),
            ],
        )
        add_grpc_services(
            server, self.dataplane, self.fleet, self.health, self.parts, tenancy_store=self.tenancy_store,
            key_pepper=s.key_pepper.get_secret_value().encode(), schemas=self.schemas,
        )  # fmt: skip
        port = server.add_insecure_port(address) if internal else self._bind_grpc(server, address)
        if not port:
            raise OSError(f"cannot bind gRPC to {address}")
        await server.start()
        return server, port

    async def health_server(self) -> tuple[grpc.aio.Server | None, int]:
        """``health_port``: grpc.health.v1 alone, in plaintext, for probes that speak no TLS (kubelet's
        gRPC probes); it answers what the main port's health service answers, and serves nothing else."""
        s = self.settings
        if s.health_port is None:
            return None, 0
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = server.add_insecure_port(f"{s.host}:{s.health_port}")
        if not port:
            raise OSError(f"cannot bind the health port to {s.host}:{s.health_port}")
        await server.start()
        return server, port

    async def metrics_site(self) -> tuple[web.AppRunner, int]:
        metrics = self.metrics

        async def render(_request: web.Request) -> web.Response:
            return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", render)
        self._require_client_certificate(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        return runner, await _listen(runner, self.settings.host, self.settings.metrics_port, ssl_context=self._ssl_context())

    async def http_site(self) -> tuple[web.AppRunner, int]:
        """The REST bridge (KServe v2 + v1 predict), on the same event loop and data plane."""
        s = self.settings
        app = create_app(
            self.dataplane, self.metrics, max_body_bytes=s.max_request_bytes, sse=SSEPolicy(stall_s=s.sse_stall_s, heartbeat_s=s.sse_heartbeat_s),
            status=self.status, batches=self.parts.batches, provisioner=self.fleet.provisioner, schemas=self.schemas,
        )
        self._require_client_certificate(app)  # and the client certificate, for calls without an API key
        # handler_cancellation: a caller that disconnects cancels its request (and the Triton call)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=s.shutdown_grace_s, handler_cancellation=True)
        await runner.setup()
        json_parse_errors(runner)  # aiohttp's own 400s (bad request line, headers) in the JSON error shape
        return runner, await _listen(runner, s.host, s.http_port, reuse_port=s.worker, ssl_context=self._ssl_context())

    def _require_client_certificate(self, app: web.Application) -> None:
        """mTLS on an aiohttp port: a request whose connection presented no certificate is a 401."""
        if self.tls is not None and self.tls.mutual:
            app.middlewares.insert(0, peer_certificate)

    def _ssl_context(self):
        return self.tls.ssl_context() if self.tls is not None else None

    def _bind_grpc(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.grpc_credentials())


async def _listen(runner: web.AppRunner, host: str, port: int, **site) -> int:
    """``runner``'s site on ``host:port``; the port it bound (port 0 read back). A site that cannot bind
    cleans its runner up before it raises."""
    tcp = web.TCPSite(runner, host, port, **site)
    try:
        await tcp.start()
    except BaseException:
        await runner.cleanup()
        raise
    return tcp._server.sockets[0].getsockname()[1]  # noqa: SLF001 - port 0 read back


class ServingPorts:
    """The data plane's ports in a process that serves (``--workers 1``, or a worker of ``--workers N``):
    gRPC with every service, the plaintext health port when set, REST and OpenAI, and /metrics unless
    this is a worker (its parent serves them); a leader with TLS on a loopback address, a plaintext
    loopback control port of its own."""

    def __init__(
        self, listeners: Listeners, grpc_at: tuple[grpc.aio.Server, int], health_at: tuple[grpc.aio.Server | None, int],
        control_server: grpc.aio.Server | None, runners: list[web.AppRunner], http_port: int, metrics_port: int,
    ):  # fmt: skip
        self.health = listeners.health
        self.grace_s = listeners.settings.shutdown_grace_s
        self.grpc_server, self.grpc_port = grpc_at
        self.health_server, self.health_port = health_at  # a server only with health_port
        self.control_server = control_server  # only a leader with TLS on a loopback address
        self.runners = runners  # /metrics (not in a worker), then the HTTP port
        self.http_port, self.metrics_port = http_port, metrics_port

    @classmethod
    async def start(cls, listeners: Listeners, leader: Leader | None) -> "ServingPorts":
        """The ports, in the order they come up: gRPC (and the health port), the leader's advertised
        address, /metrics, HTTP; a failure part-way stops the ports already up before it raises."""
        s = listeners.settings
        async with contextlib.AsyncExitStack() as undo:
            grpc_server, grpc_port = await listeners.grpc_server(f"{s.host}:{s.grpc_port}")
            undo.push_async_callback(grpc_server.stop, 0)
            health_server, health_port = await listeners.health_server()
            if health_server is not None:
                undo.push_async_callback(health_server.stop, 0)
            control_server = None
            if leader is not None:
                address = s.control_advertise
                if not address:
                    address, control_server = await _leader_address(listeners, grpc_port)
                    if control_server is not None:
                        undo.push_async_callback(control_server.stop, 0)
                await leader.advertise(address)
            runners, metrics_port = [], 0
            if not s.worker:
                runner, metrics_port = await listeners.metrics_site()
                undo.push_async_callback(runner.cleanup)
                runners.append(runner)
            runner, http_port = await listeners.http_site()
            runners.append(runner)
            undo.pop_all()
        return cls(listeners, (grpc_server, grpc_port), (health_server, health_port), control_server, runners, http_port, metrics_port)

    async def stop(self) -> None:
        if self.control_server is not None:
            await self.control_server.stop(0)
        await set_serving(self.health, False)
        await self.grpc_server.stop(self.grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        for runner in self.runners:
            await runner.cleanup()


class WorkerParent:
    """The parent of ``--workers N``: it keeps Triton and serves the aggregated /metrics; the workers
    serve the ports (SO_REUSEPORT); a leader's control RPCs come in on a loopback port of its own."""

    def __init__(self, runner: web.AppRunner, metrics_port: int, control_server: grpc.aio.Server | None, workers: WorkerPool, settings: Settings):
        self.runner, self.metrics_port = runner, metrics_port
        self.control_server = control_server  # only with the control plane here (a Leader)
        self.workers = workers
        self.grpc_port, self.http_port = settings.grpc_port, settings.http_port  # the workers'
        self.health_port = 0

    @classmethod
    async def start(cls, listeners: Listeners, leader: Leader | None, worker_settings: Settings, count: int) -> "WorkerParent":
        s = listeners.settings
        async with contextlib.AsyncExitStack() as undo:
            runner, metrics_port = await listeners.metrics_site()
            undo.push_async_callback(runner.cleanup)
            control_server = None
            if leader is not None:  # the workers carry control RPCs to this process's own loopback port
                control_server, port = await listeners.grpc_server("127.0.0.1:0", internal=True)
                undo.push_async_callback(control_server.stop, 0)
                await leader.advertise(s.control_advertise or f"127.0.0.1:{port}")
            workers = WorkerPool(worker_settings, count)
            undo.push_async_callback(workers.stop)
            await workers.start()
            undo.pop_all()
        return cls(runner, metrics_port, control_server, workers, s)

    async def stop(self) -> None:
        if self.control_server is not None:
            await self.control_server.stop(0)
        await self.workers.stop()
        await self.runner.cleanup()


async def _leader_address(listeners: Listeners, grpc_port: int) -> tuple[str, grpc.aio.Server | None]:
    """The address this process advertises in the lease row. Forwarders dial a loopback address in
    plaintext (server.transports.grpc.forward): a TLS process on loopback advertises a plaintext loopback
    control port of its own (returned with it), as the parent of workers does."""
    address = f"{_reachable(listeners.settings.host)}:{grpc_port}"
    if listeners.tls is None or not is_loopback(address):
        return address, None
    server, port = await listeners.grpc_server("127.0.0.1:0", internal=True)
    return f"127.0.0.1:{port}", server


def _reachable(host: str) -> str:
    """An address other processes can dial for a listening host (a wildcard listens on loopback too)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


async def set_serving(health, serving: bool) -> None:
    """The health service's answer for the whole server and for OIP v2."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await health.set(name, status)
