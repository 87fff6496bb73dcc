"""Wiring: one process, one event loop — embedded Triton (or an external one), the data plane,
the gRPC frontend (OIP v2, admin, health, reflection) and the metrics endpoint.

``Frontend`` is one process: what every process has (``Backend``: Triton or the way to it, the fleet,
tenancy, the data plane, the audit buffer; the TLS files and keys; observability), and what its role
adds, chosen once from the settings (``server.roles``: the control role, ``Leader`` or ``Follower``, and
the ports, ``ServingPorts`` or ``WorkerParent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from grpc_health.v1.health import aio as health_aio

from server.composition import ControlParts, row_runner
from server.control.monitoring.observability import Observability
from server.control.registry.audit_buffer import AuditBuffer, AuditWriter
from server.control.registry.envelope import EncryptionError, KeyRing
from server.control.scaling.fleet import Fleet, PRIMARY
from server.dataplane.builder import build_dataplane
from server.dataplane.composite import read_plan_files
from server.dataplane.dataplane import DataPlane
from server.dataplane.fleet_hooks import FleetHooks
from server.dataplane.loop_gate import watch as watch_loop
from server.dataplane.metrics import Metrics
from server.dataplane.safety import PolicyError, policy_source
from server.dataplane.tracing import traces_url
from server.db import display_url
from server.errors import BackendUnavailable, InferplaneError
from server.roles import Follower, Leader, Listeners, ServingPorts, WorkerParent, leader_forwarder, set_serving, shadow_records, typed_schemas
from server.runtime import gc_pauses
from server.runtime.process import log_to_stderr, stop_on_signals
from server.runtime.supervisor import LOAD_CONCURRENCY, TritonSupervisor
from server.runtime.workers import READY_MARK, worker_settings
from server.settings import Settings
from server.tenancy.builder import Tenancy, build_tenancy, open_tenancy
from server.tenancy.tls import CertificateFiles, FileStamp, TLSConfigError, channel_credentials, leader_credentials, triton_files

log = logging.getLogger("inferplane")


class StartupError(RuntimeError):
    """The platform cannot start as configured; the message says why in one line."""


class Backend:
    """What every process has once its backend is up: Triton (``supervisor``: the embedded one, None with
    a remote or an in-process Triton), the fleet of replicas, tenancy, the data plane, and the audit buffer
    its safety decisions go to."""

    def __init__(self, supervisor: TritonSupervisor | None, fleet: Fleet, tenancy: Tenancy, dataplane: DataPlane, audit: AuditBuffer, audit_writer: AuditWriter):
        self.supervisor = supervisor
        self.fleet = fleet
        self.tenancy = tenancy
        self.dataplane = dataplane
        self.audit = audit
        self.audit_writer = audit_writer

    async def close(self) -> None:
        await self.audit.stop()  # the last decisions written
        self.audit_writer.close()
        await self.dataplane.close()  # the last usage records, Redis connections, Triton channels
        # the replicas' Tritons and the embedded one stop together (each takes seconds to unload its models)
        await asyncio.gather(self.fleet.stop_replicas(), *([self.supervisor.stop()] if self.supervisor is not None else []))


class Frontend:
    """The running platform; ``start()`` then ``wait()``; ``stop()`` from a signal or a test.

    Its parts come up in order (``backend``, ``control``, ``observability``, ``ports``); each is None only
    until it is up (``control`` stays None in the parent of workers with an external control plane)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics(multiprocess=settings.metrics_dir is not None)
        self.gc_watch = gc_pauses.PauseWatch(self.metrics.gc_pause)
        self.health = health_aio.HealthServicer()
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        # checked before anything starts: a file or key that cannot be used is a StartupError here
        self.keys: KeyRing | None = _keys(settings)  # encryption at rest, when a key is set
        self.tls: CertificateFiles | None = _certificates(settings)  # when --tls-cert is given (issue 23)
        self.backend: Backend | None = None
        self.control: Leader | Follower | None = None
        self.observability: Observability | None = None  # issue 19
        self.ports: ServingPorts | WorkerParent | None = None

    async def start(self) -> None:
        s = self.settings
        if self.tls is not None:  # the certificate files every port serves, watched for changes
            self._tasks.append(asyncio.create_task(self.tls.watch(s.tls_reload_s), name="tls-reload"))
        self.backend = backend = await self._start_backend()
        dp, fleet = backend.dataplane, backend.fleet
        if not s.worker and s.control_plane == "embedded":  # the control plane, behind the leader lease (issue 27)
            self.control = await self._start_leader()
        elif s.workers == 1:  # a serving process that never leads: it applies the leader's desired state
            self.control = follower = Follower(s, self.keys, self._leader_tls())
            self._tasks.append(asyncio.create_task(follower.watch(dp, fleet), name="desired-state-watch"))
        await fleet.start()
        if isinstance(self.control, Leader):
            self.control.fleet_started()
        self.metrics.triton_up.set(1)
        self._start_observability()
        if not s.worker:
            self._tasks.append(asyncio.create_task(self._poll_statistics(), name="triton-statistics"))
        control, leader = self.control, self.control if isinstance(self.control, Leader) else None
        schemas = typed_schemas(s, dp, control)  # one catalog for every port of this process
        if schemas.store is not None:  # what other processes' deploys and retirements write, read again
            self._tasks.append(asyncio.create_task(schemas.follow(s.desired_state_reconcile_s), name="typed-schemas-watch"))
        listeners = Listeners(
            s, self.tls, self.metrics, self.health, dp, fleet, backend.tenancy.store, control.parts if control is not None else ControlParts(),
            control.forwarder if control is not None else None, status=self.observability, schemas=schemas,
        )  # fmt: skip
        if s.workers > 1:  # the parent: workers serve the ports, this process keeps Triton and /metrics
            if not s.redis_url:
                log.warning(
                    "quotas and idempotency keys are per worker process: each of the %d workers admits every "
                    "tenant's full quota (set INFERPLANE_REDIS_URL to share them)", s.workers,
                )  # fmt: skip
            target = s.triton_url or ("in-process" if backend.supervisor is None else backend.supervisor.grpc_target)
            self.ports = await WorkerParent.start(listeners, leader, worker_settings(s, target, s.grpc_port, s.http_port), s.workers)
            return
        if s.loop_admission:  # unary requests refused before decode while the loop stands behind
            self._tasks.append(asyncio.create_task(watch_loop(dp.loop_gate), name="loop-lag"))
        self.ports = await ServingPorts.start(listeners, leader)
        if s.gc_freeze:
            gc_pauses.settle()
        await self._set_serving(True)

    async def _start_backend(self) -> Backend:
        """Triton (or the way to it), the fleet, tenancy, the data plane, the models; a failure part-way
        stops what had started before it raises."""
        s = self.settings
        if s.triton_url is None and not s.model_repository.is_dir():
            raise StartupError(
                f"model repository {s.model_repository} is not a directory: build the demo models with "
                f"`inferplane demo build --out {s.model_repository}`, or create an empty folder to deploy your own"
            )
        async with contextlib.AsyncExitStack() as undo:
            supervisor = None
            if s.triton_url:
                target = s.triton_url
            elif s.triton_mode == "in-process":
                target = "in-process"
            else:
                supervisor = TritonSupervisor(
                    s.model_repository,
                    s.workdir,
                    on_restart=self._on_triton_restart,
                    on_down=self._on_triton_down,
                    startup_timeout=s.triton_startup_timeout_s,
                    response_cache_bytes=s.response_cache_bytes,
                    otlp_traces_url=_triton_traces_url(s),
                )
                undo.push_async_callback(supervisor.stop)
                await supervisor.start()
                target = supervisor.grpc_target
            inprocess = await self._inprocess() if target == "in-process" else None
            self._triton_tls()  # the remote replicas' TLS files load (server.control.scaling.fleet.client uses them)
            fleet = Fleet.build(s, supervisor, inprocess=inprocess)
            undo.push_async_callback(fleet.stop_replicas)
            await fleet.start_replicas()
            self._watch_triton_tls(fleet.replicas)
            # the processes that serve get tenancy (keys, metering); a parent of workers serves nothing
            tenancy = await build_tenancy(s) if s.workers == 1 else open_tenancy(s)
            self._tasks.append(asyncio.create_task(tenancy.run(s), name="key-refresh"))
            self._tasks.append(asyncio.create_task(self.gc_watch.run(), name="gc-pauses"))
            hooks = FleetHooks()
            # safety-filter decisions go to the audit log in batches (``server.control.registry.audit_buffer``)
            audit_writer = AuditWriter(s.database_url)
            audit = AuditBuffer(audit_writer.write_many, s.safety_audit_flush_s)
            audit.start()
            undo.push_async_callback(_close_audit, audit, audit_writer)
            dp = build_dataplane(s, fleet.replicas, metrics=self.metrics, gate=tenancy.gate, meter=tenancy.meter, hooks=hooks, audit=audit.add)
            undo.push_async_callback(dp.close)
            fleet.attach_dataplane(dp, hooks, self.metrics)
            if fleet.has_replicas():
                await self._load_models_or_say_why(dp, fleet)
            else:  # model groups with no replica yet (scaled to zero): their models load when replicas appear
                log.warning("no Triton replica is up yet; requests for the model groups' models are held until one is%s", self._triton_hint())
            fleet.hold_group_models()
            undo.pop_all()
        return Backend(supervisor, fleet, tenancy, dp, audit, audit_writer)

    async def _start_leader(self) -> Leader:
        """Registry, deployer, traffic, autoscaler, batches, retention (server.control.service.control_plane): their
        writers run while this process holds the leader lease; a standby watches the desired state."""
        from server.control.service.control_plane import ControlPlane

        s, b = self.settings, self.backend
        async with contextlib.AsyncExitStack() as undo:  # a failure part-way stops what had started
            records = shadow_records(s, self.keys)
            undo.push_async_callback(records.stop)
            control = await asyncio.to_thread(
                ControlPlane, s, b.dataplane, b.fleet, usage_store=b.tenancy.store, shadow_records=records,
                row_runner=row_runner(b.dataplane), audit=b.audit.add,
            )  # fmt: skip
            undo.push_async_callback(control.stop)
            forwarder = leader_forwarder(s, control, self._leader_tls())
            undo.push_async_callback(forwarder.close)
            await control.start()
            undo.pop_all()
        return Leader(control, records, forwarder)

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
        supervisor = self.backend.supervisor

        def triton_metrics() -> str:
            if s.triton_metrics_url or supervisor is None:
                return s.triton_metrics_url
            return f"http://127.0.0.1:{supervisor.metrics_port}/metrics"

        registry = self.control.parts.registry if self.control is not None else None  # none in a worker
        self.observability = Observability(
            s, self.metrics, self.backend.dataplane, serves_metrics=not s.worker, serves_requests=s.workers == 1 or s.worker,
            triton_metrics_url=triton_metrics, registry=registry,
        )  # fmt: skip
        self.observability.start()

    async def _load_models(self, dp: DataPlane, fleet: Fleet) -> None:
        names = self.settings.models
        index = await dp.repository_index()
        if names == ["*"]:
            names = sorted({m.name for m in index if not self.settings.worker or m.state == "READY"})
        if self.settings.worker:  # the parent loaded them; a worker only reads their signatures
            for name in names:
                await dp.adopt(name)
        else:
            await fleet.place_models(names)  # failure domains: LLMs (or every model) on Tritons of their own (issue 29)
            gate = asyncio.Semaphore(self.settings.load_concurrency or LOAD_CONCURRENCY)  # as the reconciler loads a late Triton's set

            async def load(name: str) -> None:
                async with gate:
                    await dp.load_model(name)
                log.info("model %s ready", name)

            await asyncio.gather(*(load(name) for name in names))

        for plan in read_plan_files(self.settings.model_repository):  # composite endpoints (their parts loaded above)
            try:
                dp.install_composite(plan)
                log.info("composite %s:%s ready (%s)", plan.name, plan.version, plan.mode)
            except InferplaneError as err:
                log.error("composite %s:%s not installed: %s", plan.name, plan.version, err.message)

    async def _load_models_or_say_why(self, dp: DataPlane, fleet: Fleet) -> None:
        """A remote Triton that refuses the first calls (a TLS mismatch, most often) stops the start in one line."""
        try:
            await self._load_models(dp, fleet)
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

    def _leader_tls(self) -> tuple | None:
        """The forwarded control RPCs' TLS (server.tenancy.tls.leader_credentials); its files must load."""
        try:
            return leader_credentials(self.settings)
        except TLSConfigError as err:
            raise StartupError(str(err)) from None

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
                await self.backend.dataplane.read_statistics()
            except Exception as err:  # Triton restarting: try again next time
                log.debug("reading Triton statistics failed: %s", err)

    async def _set_serving(self, serving: bool) -> None:
        await set_serving(self.health, serving)

    def _on_triton_down(self) -> None:
        """The embedded Triton died: with other replicas up only it leaves the rotation; alone, the
        whole backend is down (callers get UNAVAILABLE with a retry hint until it is back)."""
        fleet = self.backend.fleet
        fleet.replicas.mark_down(PRIMARY)
        if fleet.others_up(PRIMARY):
            return
        self.backend.dataplane.mark_backend_down()
        asyncio.get_running_loop().create_task(self._set_serving(False))

    async def _on_triton_restart(self) -> None:
        fleet, dp = self.backend.fleet, self.backend.dataplane
        fleet.reconnect(PRIMARY, self.backend.supervisor.grpc_target)  # the restarted process: a new channel
        if dp.backend_up:  # other replicas kept serving: it rejoins with its models
            await fleet.replicas.rejoin(PRIMARY)
            return
        fleet.replicas.revive(PRIMARY)
        await dp.reload_all()
        await self._set_serving(True)

    def ready_line(self) -> str:
        s, ports = self.settings, self.ports
        if s.triton_url:
            triton = s.triton_url
        elif self.backend.supervisor is None:
            triton = "in-process"
        else:
            triton = f"embedded@{self.backend.supervisor.grpc_target}"
        return (
            f"inferplane ready grpc={s.host}:{ports.grpc_port} metrics={s.host}:{ports.metrics_port} "
            f"http={s.host}:{ports.http_port} triton={triton} workers={s.workers} registry={display_url(s.database_url)}"
            + (f" tls={'mtls' if self.tls.mutual else 'on'}" if self.tls is not None else "")
            + (f" health={s.host}:{ports.health_port}" if ports.health_port else "")
        )

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Everything that came up stops, in this order: the background tasks, the fleet's control loops, the
        control role, the ports (the gRPC port drains for shutdown_grace_s), observability, the backend."""
        for task in self._tasks:
            task.cancel()
        if self.backend is not None:
            await self.backend.fleet.stop()
        if self.control is not None:
            await self.control.stop()
        if self.ports is not None:
            await self.ports.stop()
        if self.observability is not None:
            await self.observability.stop()
        if self.backend is not None:
            await self.backend.close()
        self.gc_watch.close()
        self._stopped.set()


def _keys(settings: Settings) -> KeyRing | None:
    """The encryption keys, and the safety policies checked with them, before anything starts."""
    try:
        keys = KeyRing.from_settings(settings)
        policy_source(settings.safety)
    except (EncryptionError, PolicyError) as err:
        raise StartupError(str(err)) from None
    return keys


def _certificates(settings: Settings) -> CertificateFiles | None:
    """The certificate files every port serves; a file that cannot be used stops the start."""
    if settings.triton_tls and settings.triton_url is None and not settings.worker:
        raise StartupError("triton_tls_* settings are for a remote Triton: give --triton-url (the embedded one listens on loopback only)")
    try:
        return CertificateFiles.from_settings(settings)
    except TLSConfigError as err:
        raise StartupError(str(err)) from None


async def _close_audit(audit: AuditBuffer, writer: AuditWriter) -> None:
    await audit.stop()
    writer.close()


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
