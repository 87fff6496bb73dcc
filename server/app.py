"""Wiring: one process, one event loop — embedded Triton (or an external one), the data plane,
the gRPC frontend (OIP v2, admin, health, reflection) and the metrics endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from server.composition import create_app, row_runner
from server.control.monitoring.observability import Observability
from server.control.registry.audit_buffer import AuditBuffer, AuditWriter
from server.control.registry.envelope import EncryptionError, KeyRing
from server.control.rollout.shadow_records import ShadowRecords
from server.control.scaling.fleet import Fleet, PRIMARY
from server.control.service.leader import LeaderDirectory
from server.control.service.state_watch import follow
from server.dataplane.builder import build_dataplane
from server.dataplane.composite import read_plan_files
from server.dataplane.dataplane import DataPlane
from server.dataplane.fleet_hooks import FleetHooks
from server.dataplane.loop_gate import watch as watch_loop
from server.dataplane.metrics import Metrics
from server.dataplane.safety import PolicyError, policy_source
from server.dataplane.tracing import traces_url
from server.db import display_url, make_engine
from server.errors import BackendUnavailable, InferplaneError
from server.protogen import _pool
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.runtime import gc_pauses
from server.runtime.process import log_to_stderr, stop_on_signals
from server.runtime.supervisor import TritonSupervisor
from server.runtime.workers import READY_MARK, WorkerPool, worker_settings
from server.settings import Settings
from server.tenancy.builder import Tenancy, build_tenancy, open_tenancy
from server.tenancy.tls import CertificateFiles, FileStamp, TLSConfigError, channel_credentials, is_loopback, leader_credentials, triton_files
from server.transports.grpc.admin import AdminService
from server.transports.grpc.autoscale import AutoscaleService, add_to_server as add_autoscale
from server.transports.grpc.context import DomainErrorInterceptor
from server.transports.grpc.decoding import DecodeErrorsInterceptor
from server.transports.grpc.forward import LeaderForwarder
from server.transports.grpc.generation import add_to_server as add_generation
from server.transports.grpc.inference import InferenceService, SERVICE
from server.transports.grpc.tenancy import TenancyService, add_to_server as add_tenancy
from server.transports.grpc.traffic import TrafficService, add_to_server as add_traffic
from server.transports.openai.endpoints import SSEPolicy
from server.transports.rest.http_errors import json_parse_errors
from server.transports.rest.tls import peer_certificate
from server.transports.typed import add_typed_services

log = logging.getLogger("inferplane")


class StartupError(RuntimeError):
    """The platform cannot start as configured; the message says why in one line."""


class Frontend:
    """The running platform; ``start()`` then ``wait()``; ``stop()`` from a signal or a test."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics(multiprocess=settings.metrics_dir is not None)
        self.gc_watch = gc_pauses.PauseWatch(self.metrics.gc_pause)
        self.supervisor: TritonSupervisor | None = None
        self.tenancy: Tenancy | None = None
        self.dataplane: DataPlane | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None  # the plaintext health-only port (health_port)
        self.health_port = 0
        self.health = health_aio.HealthServicer()
        self.grpc_port = 0
        self.metrics_port = 0
        self.http_port = 0
        self.workers = None  # WorkerPool, in the parent of several workers
        self._runners: list[web.AppRunner] = []
        self.tls = None  # server.tenancy.tls.CertificateFiles when --tls-cert is given (issue 23)
        self.audit = None  # server.control.registry.audit_buffer.AuditBuffer: safety decisions, retention passes
        self.shadow_records = None  # server.control.rollout.shadow_records.ShadowRecords (the traffic controller's, or the desired-state watcher's)
        self.keys = None  # server.control.registry.envelope.KeyRing: encryption at rest, when a key is set
        self._tasks: list[asyncio.Task] = []
        self.registry = None  # server.control.registry.registry.Registry, with the deployer (issue 5)
        self.deployer = None
        self.traffic = None  # server.control.rollout.traffic.TrafficController, beside the deployer (issue 8)
        self.observability = None  # server.control.monitoring.observability.Observability (issue 19)
        self.batches = None  # server.control.batches.batches.BatchStore (issue 20), with the registry
        self.fleet: Fleet | None = None  # the replica set and its control plane (issue 17)
        self.control = None  # server.control.service.control_plane.ControlPlane: the writers behind the leader lease (issue 27)
        self._directory = None  # server.control.service.leader.LeaderDirectory: where control RPCs are carried
        self._engine = None  # the database a process without a control plane watches
        self._forwarder = None  # server.transports.grpc.forward.LeaderForwarder
        self._control_server: grpc.aio.Server | None = None  # the parent of --workers N: its control RPCs' port
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        s = self.settings
        self._check_security()
        if s.triton_url is None and not s.model_repository.is_dir():
            raise StartupError(
                f"model repository {s.model_repository} is not a directory: build the demo models with "
                f"`inferplane demo build --out {s.model_repository}`, or create an empty folder to deploy your own"
            )
        if s.triton_url:
            target = s.triton_url
        elif s.triton_mode == "in-process":
            target = "in-process"
        else:
            self.supervisor = TritonSupervisor(
                s.model_repository,
                s.workdir,
                on_restart=self._on_triton_restart,
                on_down=self._on_triton_down,
                startup_timeout=s.triton_startup_timeout_s,
                response_cache_bytes=s.response_cache_bytes,
                otlp_traces_url=_triton_traces_url(s),
            )
            await self.supervisor.start()
            target = self.supervisor.grpc_target
        inprocess = await self._inprocess() if target == "in-process" else None
        self._triton_tls()  # the remote replicas' TLS files load (server.control.scaling.fleet.client uses them)
        self.fleet = fleet = Fleet.build(s, self.supervisor, inprocess=inprocess)
        await fleet.start_replicas()
        self._watch_triton_tls(fleet.replicas)
        # the processes that serve get tenancy (keys, metering); a parent of workers serves nothing
        self.tenancy = await build_tenancy(s) if s.workers == 1 else open_tenancy(s)
        self._tasks.append(asyncio.create_task(self.tenancy.run(s), name="key-refresh"))
        self._tasks.append(asyncio.create_task(self.gc_watch.run(), name="gc-pauses"))
        hooks = FleetHooks()
        self.dataplane = build_dataplane(
            s, fleet.replicas, metrics=self.metrics, gate=self.tenancy.gate, meter=self.tenancy.meter, hooks=hooks, audit=self._audit_buffer(),
        )  # fmt: skip
        fleet.attach_dataplane(self.dataplane, hooks, self.metrics)
        if fleet.has_replicas():
            await self._load_models_or_say_why()
        else:  # model groups with no replica yet (scaled to zero): their models load when replicas appear
            log.warning("no Triton replica is up yet; requests for the model groups' models are held until one is%s", self._triton_hint())
        fleet.hold_group_models()
        if not s.worker and s.control_plane == "embedded":  # the control plane, behind the leader lease (issue 27)
            await self._start_control_plane()
        elif s.workers == 1:  # a serving process that never leads: it applies the leader's desired state
            self._watch_desired_state()
        await fleet.start()
        if self.control is not None:
            self.control.fleet_started = True
        self.metrics.triton_up.set(1)
        self._start_observability()
        if not s.worker:
            self._tasks.append(asyncio.create_task(self._poll_statistics(), name="triton-statistics"))
        if s.workers > 1:  # the parent: workers serve the ports, this process keeps Triton and /metrics
            if not s.redis_url:
                log.warning(
                    "quotas and idempotency keys are per worker process: each of the %d workers admits every "
                    "tenant's full quota (set INFERPLANE_REDIS_URL to share them)", s.workers,
                )  # fmt: skip
            await self._start_metrics()
            if self.control is not None:  # the workers carry control RPCs to this process's own loopback port
                self._control_server, port = await self._grpc_server("127.0.0.1:0", internal=True)
                await self.control.advertise(s.control_advertise or f"127.0.0.1:{port}")
            await self._start_workers(target)
            return
        if s.loop_admission:  # unary requests refused before decode while the loop stands behind
            self._tasks.append(asyncio.create_task(watch_loop(self.dataplane.loop_gate), name="loop-lag"))
        await self._start_grpc()
        if self.control is not None:
            await self.control.advertise(s.control_advertise or await self._leader_address())
        if not s.worker:
            await self._start_metrics()
        await self._start_http()
        if s.gc_freeze:
            gc_pauses.settle()
        await self._set_serving(True)

    async def _start_control_plane(self) -> None:
        """Registry, deployer, traffic, autoscaler, batches, retention (server.control.service.control_plane): their
        writers run while this process holds the leader lease; a standby watches the desired state."""
        from server.control.service.control_plane import ControlPlane

        s, dp = self.settings, self.dataplane
        self.control = control = await asyncio.to_thread(
            ControlPlane, s, dp, self.fleet, usage_store=self.tenancy.store, shadow_records=self._shadow_records(),
            row_runner=row_runner(dp), audit=self.audit.add if self.audit is not None else None,
        )  # fmt: skip
        self.registry, self.deployer, self.traffic, self.batches = control.registry, control.deployer, control.traffic, control.batches
        self._directory = control.directory
        await control.start()

    def _watch_desired_state(self) -> None:
        """A process that serves without a control plane: the desired state applied to its pipeline, control
        RPCs carried to the leader the lease row names."""
        s = self.settings
        self._engine = engine = make_engine(s.database_url)
        self._directory = LeaderDirectory(engine)
        watch = follow(self.dataplane, engine, s, sampler=self.fleet.sampler, wakers=self.fleet.hooks.wakers, shadow_records=self._shadow_records())
        self._tasks.append(asyncio.create_task(watch, name="desired-state-watch"))

    async def _inprocess(self):
        """Triton in this process through its C API (``--triton-mode in-process``): the fleet's one member."""
        from server.runtime.inprocess import InProcessTriton

        s = self.settings
        return await InProcessTriton.start(
            s.model_repository, s.workdir, response_cache_bytes=s.response_cache_bytes, startup_timeout=s.triton_startup_timeout_s
        )

    def _start_observability(self) -> None:
        """SLO budgets, the status page's history, drift, payload logs, device metrics (server.control.monitoring.observability)."""
        s = self.settings
        supervisor = self.supervisor

        def triton_metrics() -> str:
            if s.triton_metrics_url or supervisor is None:
                return s.triton_metrics_url
            return f"http://127.0.0.1:{supervisor.metrics_port}/metrics"

        self.observability = Observability(
            s, self.metrics, self.dataplane, serves_metrics=not s.worker, serves_requests=s.workers == 1 or s.worker,
            triton_metrics_url=triton_metrics, registry=self.registry,
        )  # fmt: skip
        self.observability.start()

    async def _start_workers(self, target: str) -> None:
        s = self.settings
        self.grpc_port, self.http_port = s.grpc_port, s.http_port
        self.workers = WorkerPool(worker_settings(s, target, s.grpc_port, s.http_port), s.workers)
        await self.workers.start()

    async def _load_models(self) -> None:
        names = self.settings.models
        index = await self.dataplane.repository_index()
        if names == ["*"]:
            names = sorted({m.name for m in index if not self.settings.worker or m.state == "READY"})
        if not self.settings.worker:  # failure domains: LLMs (or every model) on Tritons of their own (issue 29)
            await self.fleet.place_models(names)
        for name in names:
            if self.settings.worker:  # the parent loaded it; a worker only reads its signature
                await self.dataplane.adopt(name)
            else:
                await self.dataplane.load_model(name)
                log.info("model %s ready", name)

        for plan in read_plan_files(self.settings.model_repository):  # composite endpoints (their parts loaded above)
            try:
                self.dataplane.composites.install(plan)
                log.info("composite %s:%s ready (%s)", plan.name, plan.version, plan.mode)
            except InferplaneError as err:
                log.error("composite %s:%s not installed: %s", plan.name, plan.version, err.message)

    async def _start_grpc(self) -> None:
        s = self.settings
        self.grpc_server, self.grpc_port = await self._grpc_server(f"{s.host}:{s.grpc_port}")
        await self._start_health_port()

    async def _grpc_server(self, address: str, internal: bool = False) -> tuple[grpc.aio.Server, int]:
        """Every service on one server bound to ``address``; control RPCs this process cannot answer go to the leader.
        ``internal``: the loopback port of the parent of workers, where they carry control RPCs (plaintext)."""
        s = self.settings
        if self._directory is not None and self._forwarder is None:
            control = self.control
            self._forwarder = LeaderForwarder(
                lambda: control is not None and control.leading, self._directory,
                max_message_bytes=s.max_request_bytes + (1 << 20), tls=self._leader_tls(),
            )  # fmt: skip
        forward = (self._forwarder,) if self._forwarder is not None else ()  # innermost: control RPCs to the leader
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
        server.add_generic_rpc_handlers((InferenceService(self.dataplane).handler(),))
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self.dataplane, self.registry, self.deployer), server)
        tenancy_name = add_tenancy(TenancyService(self.dataplane, self.tenancy.store, s.key_pepper.get_secret_value().encode(), self.registry), server)
        generation_name = add_generation(self.dataplane.llm, server, self.dataplane.admission)
        traffic_name = add_traffic(TrafficService(self.dataplane, self.traffic), server)
        autoscale_name = add_autoscale(AutoscaleService(self.dataplane, self.fleet.autoscaler, self.fleet.sampler), server)
        typed = add_typed_services(server, self.dataplane, registry=self.registry, deployer=self.deployer, repository=s.model_repository)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        _add_to_pool(health_pb2.DESCRIPTOR)
        admin_name = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
        typed.enable_reflection(  # grpc_reflection's, plus the typed services that come and go at deploy
            (SERVICE, admin_name, generation_name, tenancy_name, traffic_name, autoscale_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
            pool=_pool.POOL,
        )
        port = server.add_insecure_port(address) if internal else self._bind_grpc(server, address)
        if not port:
            raise OSError(f"cannot bind gRPC to {address}")
        await server.start()
        return server, port

    async def _start_health_port(self) -> None:
        """``health_port``: grpc.health.v1 alone, in plaintext, for probes that speak no TLS (kubelet's
        gRPC probes); it answers what the main port's health service answers, and serves nothing else."""
        s = self.settings
        if s.health_port is None:
            return
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.health_port = server.add_insecure_port(f"{s.host}:{s.health_port}")
        if not self.health_port:
            raise OSError(f"cannot bind the health port to {s.host}:{s.health_port}")
        await server.start()
        self._health_server = server

    async def _start_metrics(self) -> None:
        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._require_client_certificate(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, self.settings.metrics_port, ssl_context=self._ssl_context())
        await site.start()
        self._runners.append(runner)
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - port 0 read back

    async def _start_http(self) -> None:
        """The REST bridge (KServe v2 + v1 predict), on the same event loop and data plane."""
        s = self.settings
        app = create_app(
            self.dataplane, self.metrics, max_body_bytes=s.max_request_bytes, sse=SSEPolicy(stall_s=s.sse_stall_s, heartbeat_s=s.sse_heartbeat_s),
            status=self.observability, batches=self.batches, provisioner=self.fleet.provisioner,
        )
        self._require_client_certificate(app)  # and the client certificate, for calls without an API key
        # handler_cancellation: a caller that disconnects cancels its request (and the Triton call)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=s.shutdown_grace_s, handler_cancellation=True)
        await runner.setup()
        json_parse_errors(runner)  # aiohttp's own 400s (bad request line, headers) in the JSON error shape
        self._runners.append(runner)
        site = web.TCPSite(runner, s.host, s.http_port, reuse_port=s.worker, ssl_context=self._ssl_context())
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - port 0 read back

    async def _load_models_or_say_why(self) -> None:
        """A remote Triton that refuses the first calls (a TLS mismatch, most often) stops the start in one line."""
        try:
            await self._load_models()
        except BackendUnavailable as err:
            if not self.settings.triton_url:
                raise
            raise StartupError(f"cannot load the models: {err}{self._triton_hint()}") from None

    def _triton_hint(self) -> str:
        """Why a remote Triton may be unreachable at start: most often a TLS mismatch."""
        s = self.settings
        if not s.triton_url:
            return ""
        if s.triton_tls:
            return f" (the Triton at {s.triton_url}: check triton_tls_ca, triton_tls_cert/key and triton_tls_server_name against its certificates)"
        return f" (the Triton at {s.triton_url}: if it serves TLS, set INFERPLANE_TRITON_TLS_CA, and _CERT/_KEY when it requires client certificates)"

    # ---- TLS (issue 23: server.tenancy.tls) ----------------------------------------------------

    def _check_security(self) -> None:
        """TLS files, encryption keys and safety policies are checked before anything starts."""
        s = self.settings
        try:
            self.keys = KeyRing.from_settings(s)
            policy_source(s.safety)
        except (EncryptionError, PolicyError) as err:
            raise StartupError(str(err)) from None
        self._start_tls()

    def _shadow_records(self):
        s = self.settings
        self.shadow_records = ShadowRecords(s.shadow_record_destination, self.keys, s.shadow_record_max)
        self.shadow_records.start()
        return self.shadow_records

    def _start_tls(self) -> None:
        """The certificate files every port serves, watched for changes; a file that cannot be used stops the start."""
        s = self.settings
        if s.triton_tls and s.triton_url is None and not s.worker:
            raise StartupError("triton_tls_* settings are for a remote Triton: give --triton-url (the embedded one listens on loopback only)")
        try:
            self.tls = CertificateFiles.from_settings(s)
        except TLSConfigError as err:
            raise StartupError(str(err)) from None
        if self.tls is not None:
            self._tasks.append(asyncio.create_task(self.tls.watch(s.tls_reload_s), name="tls-reload"))

    def _audit_buffer(self):
        """Safety-filter decisions go to the audit log in batches (``server.control.registry.audit_buffer``)."""
        self._audit_writer = AuditWriter(self.settings.database_url)
        self.audit = AuditBuffer(self._audit_writer.write_many, self.settings.safety_audit_flush_s)
        self.audit.start()
        return self.audit.add

    def _require_client_certificate(self, app: web.Application) -> None:
        """mTLS on an aiohttp port: a request whose connection presented no certificate is a 401."""
        if self.tls is not None and self.tls.mutual:
            app.middlewares.insert(0, peer_certificate)

    def _ssl_context(self):
        return self.tls.ssl_context() if self.tls is not None else None

    def _leader_tls(self) -> tuple | None:
        """The forwarded control RPCs' TLS (server.tenancy.tls.leader_credentials); its files must load."""
        try:
            return leader_credentials(self.settings)
        except TLSConfigError as err:
            raise StartupError(str(err)) from None

    async def _leader_address(self) -> str:
        """The address this process advertises in the lease row. Forwarders dial a loopback address in
        plaintext (server.transports.grpc.forward): a TLS process on loopback advertises a plaintext loopback
        control port of its own, as the parent of workers does."""
        address = f"{_reachable(self.settings.host)}:{self.grpc_port}"
        if self.tls is None or not is_loopback(address):
            return address
        self._control_server, port = await self._grpc_server("127.0.0.1:0", internal=True)
        return f"127.0.0.1:{port}"

    def _bind_grpc(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.grpc_credentials())

    def _triton_tls(self) -> None:
        """The remote Triton channel's TLS files load (``server.control.scaling.fleet.client`` reads them for each remote replica)."""
        if not self.settings.triton_tls:
            return
        try:
            channel_credentials(self.settings)
        except TLSConfigError as err:
            raise StartupError(str(err)) from None

    def _watch_triton_tls(self, replicas) -> None:
        """A renewed client certificate (or CA) for the remote Tritons: new channels to each remote replica, without a restart."""
        s = self.settings
        if not s.triton_tls:
            return
        stamp = FileStamp(triton_files(s))

        async def watch() -> None:
            while True:
                await asyncio.sleep(s.tls_reload_s)
                if await asyncio.to_thread(stamp.changed):
                    try:
                        credentials = channel_credentials(s)
                    except TLSConfigError as err:
                        log.warning("Triton channel TLS reload refused: %s", err)
                        continue
                    for member in replicas.members():
                        if not member.local and hasattr(member.client, "reconnect"):
                            await member.client.reconnect(credentials)
                    log.info("Triton channel TLS files reloaded")

        self._tasks.append(asyncio.create_task(watch(), name="triton-tls-reload"))

    async def _poll_statistics(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_poll_s)
            try:
                await self.dataplane.read_statistics()
            except Exception as err:  # Triton restarting: try again next time
                log.debug("reading Triton statistics failed: %s", err)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    def _on_triton_down(self) -> None:
        """The embedded Triton died: with other replicas up only it leaves the rotation; alone, the
        whole backend is down (callers get UNAVAILABLE with a retry hint until it is back)."""
        self.fleet.replicas.mark_down(PRIMARY)
        if self.fleet.others_up(PRIMARY):
            return
        self.dataplane.mark_backend_down()
        asyncio.get_running_loop().create_task(self._set_serving(False))

    async def _on_triton_restart(self) -> None:
        if self.dataplane.backend_up:  # other replicas kept serving: it rejoins with its models
            await self.fleet.replicas.rejoin(PRIMARY)
            return
        self.fleet.replicas.revive(PRIMARY)
        await self.dataplane.reload_all()
        await self._set_serving(True)

    def ready_line(self) -> str:
        s = self.settings
        if self.settings.triton_url:
            triton = self.settings.triton_url
        elif self.supervisor is None:
            triton = "in-process"
        else:
            triton = f"embedded@{self.supervisor.grpc_target}"
        return (
            f"inferplane ready grpc={s.host}:{self.grpc_port} metrics={s.host}:{self.metrics_port} "
            f"http={s.host}:{self.http_port} triton={triton} workers={s.workers} registry={display_url(s.database_url)}"
            + (f" tls={'mtls' if self.tls.mutual else 'on'}" if self.tls is not None else "")
            + (f" health={s.host}:{self.health_port}" if self._health_server is not None else "")
        )

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.control is not None:
            await self.control.stop()
        if self.shadow_records is not None:
            await self.shadow_records.stop()
        if self._forwarder is not None:
            await self._forwarder.close()
        if self._control_server is not None:
            await self._control_server.stop(0)
        if self._engine is not None:
            self._engine.dispose()
        if self.workers is not None:
            await self.workers.stop()
        if self.grpc_server is not None:
            await self._set_serving(False)
            await self.grpc_server.stop(self.settings.shutdown_grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        for runner in self._runners:
            await runner.cleanup()
        if self.observability is not None:
            await self.observability.stop()
        if self.audit is not None:
            await self.audit.stop()  # the last decisions written
            self._audit_writer.close()
        if self.dataplane is not None:
            await self.dataplane.close()  # the last usage records, Redis connections, Triton channels
        # the replicas' Tritons and the embedded one stop together (each takes seconds to unload its models)
        await asyncio.gather(
            *([self.fleet.stop_replicas()] if self.fleet is not None else []),
            *([self.supervisor.stop()] if self.supervisor is not None else []),
        )
        self.gc_watch.close()
        self._stopped.set()


def _reachable(host: str) -> str:
    """An address other processes can dial for a listening host (a wildcard listens on loopback too)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def _add_to_pool(file_descriptor) -> None:
    """Make a default-pool file (e.g. grpc health) visible to reflection over our private pool."""
    try:
        _pool.POOL.FindFileByName(file_descriptor.name)
    except KeyError:
        _pool.POOL.AddSerializedFile(file_descriptor.serialized_pb)


async def serve(settings: Settings) -> None:
    frontend = Frontend(settings)
    stop = stop_on_signals()
    try:
        await frontend.start()
    except BaseException:
        await frontend.stop()
        raise
    if settings.worker:
        print(f"{READY_MARK} pid={os.getpid()}", flush=True)
    else:
        print(frontend.ready_line(), flush=True)
    await stop.wait()
    log.info("shutting down")
    await frontend.stop()
    print("inferplane stopped", flush=True)


def run(settings: Settings) -> None:
    log_to_stderr(settings.log_level)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        asyncio.run(serve(settings))
    else:
        uvloop.run(serve(settings))


def _triton_traces_url(settings: Settings) -> str | None:
    """Where the embedded Triton's OpenTelemetry trace mode exports (the frontend's collector)."""
    if not settings.otlp_endpoint or not settings.triton_tracing:
        return None

    return traces_url(settings.otlp_endpoint)


def _worker_main() -> None:
    """A worker process of ``serve --workers N`` (``python -m server.app``): its settings come from the parent."""
    run(Settings.for_worker())


if __name__ == "__main__":
    _worker_main()
