"""The control plane as one unit (issue 27): every writer behind one leader lease.

The writers — the deployer (routes restored from the registry, retired versions unloaded after their
grace period), the traffic controller (canary steps, automatic rollback), the autoscaler (on the load
every serving process reports: server.control.scaling.signal_reports; it exists where an executor does — the
embedded Triton's replicas, or Kubernetes), the batch
runner, retention, and the publisher of the desired state — run only in the process that holds the
lease (server.control.service.leader). Every other replica stands by: it keeps the registry open for reads,
watches the desired state like any frontend (server.control.service.state_watch.StateWatcher), and takes
over when the lease lapses. ``writers`` is the list more writers join (objects with async
``start()``/``stop()``, started after the built-in ones when this process leads, stopped when it
loses the lease): the Triton reconciler is one.

The same unit runs in ``inferplane serve`` (the embedded default: the one process, or the parent of
``--workers N``) and in ``inferplane control run`` (a replica of its own beside stateless frontends).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from server.control.rollout.arm_reports import ArmCollector
from server.control.batches.batches import BatchStore, BatchWorker, file_store
from server.control.rollout.deployer import build_control_plane
from server.control.service.desired_state import DesiredStateStore
from server.control.service.leader import LeaderDirectory, Leadership, holder_id, lease_for
from server.runtime.kube_api import ClusterAccess, KubeAPI
from server.control.scaling.placement_store import PlacementStore
from server.control.service.reconciler import converger
from server.control.service.reconciler import from_settings as reconcilers
from server.control.planning.replica_ledger import fleet_ledger
from server.control.registry.retention import RetentionJob
from server.control.scaling.signal_reports import SignalPeers
from server.control.service.state_watch import StatePublisher, follow, stop_task
from server.control.rollout.traffic import TrafficController

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, settings, dataplane, fleet, *, usage_store=None, shadow_records=None, row_runner: Callable | None = None, audit=None):
        self.settings = settings
        self.dp = dataplane
        self.fleet = fleet
        self.usage_store = usage_store
        self.row_runner = row_runner  # server.transports.batch_rows.RowRunner: how a batch row runs
        self.audit = audit
        self.registry, self.deployer = build_control_plane(settings, dataplane)
        self.deployer.targets = fleet.triton_targets  # which backends and GPUs each replica has (issue 31)
        self.traffic = TrafficController(dataplane, self.registry, self.deployer, shadow_records=shadow_records)
        self.batches = BatchStore(self.registry.engine, file_store(settings))
        self.desired = DesiredStateStore(self.registry.engine)
        self.directory = LeaderDirectory(self.registry.engine)
        self.reporter = holder_id()  # this process's rows in arm_reports / signal_reports while it stands by
        kube = KubeAPI(ClusterAccess.from_dir(settings.kubernetes_token_dir, settings.kubernetes_namespace)) if settings.control_lease == "kubernetes" else None
        self.lease = lease_for(self.registry.engine, self.registry.url, holder_id(), "", ttl_s=settings.control_lease_ttl_s, kubernetes=kube)
        self.leadership = Leadership(self.lease, self._lead, self._lost)
        self.writers: list = []  # more writers: async start()/stop(), run while this process leads
        # the versions the deployer loads are every Triton's placements; the reconciler loads them on Tritons that
        # join late, restart or were down during a change (none for the embedded Triton: it is the deployer's own)
        self.deployer.placements = placements = PlacementStore(self.registry.engine)
        self.reconcilers = reconcilers(settings, placements)
        self.writers += [_Loop(r.run, settings.reconcile_interval_s) for r in self.reconcilers]
        self.publisher: StatePublisher | None = None  # while this process leads
        self.ledger = None  # server.control.planning.replica_ledger.ReplicaLedger: what the replicas reserve (the owner view of cost)
        self.retention: RetentionJob | None = None
        self.fleet_started = False  # set by the wiring once the fleet runs: a late leader starts the autoscaler itself
        self._tasks: list[asyncio.Task] = []
        self._watcher: asyncio.Task | None = None
        self._run: asyncio.Task | None = None

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    async def start(self) -> bool:
        """Lead now if the lease is free (the routes are restored before this returns), else stand by."""
        led = await self.leadership.try_once()
        if not led:
            log.info("another process leads the control plane: this one stands by")
            self._watch()
        self._run = asyncio.get_running_loop().create_task(self.leadership.run(), name="control-lease")
        return led

    async def advertise(self, address: str) -> None:
        """Where frontends reach this process's control RPCs (known once its port is bound)."""
        self.lease.address = address
        if self.leading:
            await self.lease.renew()

    def _watch(self) -> None:
        fleet = self.fleet
        watch = follow(self.dp, self.registry.engine, self.settings, sampler=fleet.sampler, wakers=fleet.hooks.wakers if fleet.hooks is not None else None,
                       reporter=self.reporter, shadow_records=self.traffic.shadow_records)  # fmt: skip
        self._watcher = asyncio.get_running_loop().create_task(watch, name="desired-state-watch")

    async def _lead(self) -> None:
        s = self.settings
        await stop_task(self._watcher)
        self._watcher = None
        await self.deployer.start()
        await self.traffic.start()
        await self.fleet.read_memory_needs(self.registry)
        if self.fleet.sampler is not None:  # the load of every other frontend and worker, added to this process's own
            self.fleet.sampler.peers = SignalPeers(self.registry.engine, self.reporter)
        if self.fleet.autoscaler is None:
            self.fleet.start_control(registry=self.registry, deployer=self.deployer, usage_store=self.usage_store,
                                     placements=self.deployer.placements, reconcile=self._reconcile_now,
                                     converge=converger(self.reconcilers))  # fmt: skip
        if self.fleet.autoscaler is not None:
            self.fleet.autoscaler.announce = self._announce_sleep
        if self.fleet_started and self.fleet.autoscaler is not None:
            await self.fleet.autoscaler.start()
        loop = asyncio.get_running_loop()
        if self.row_runner is not None:
            worker = BatchWorker(self.batches, self.row_runner, lease_s=s.batch_lease_s, concurrency=s.batch_concurrency,
                                 row_batch=s.batch_row_batch, poll_s=s.batch_poll_s)  # fmt: skip
            self._tasks.append(loop.create_task(worker.run(), name="batch-worker"))
        self.retention = RetentionJob(s, self.audit)
        self.retention.start()
        self.publisher = publisher = StatePublisher(self.dp.router, self.desired, s.desired_state_poll_s, asleep=self._asleep)
        self._tasks.append(loop.create_task(publisher.run(), name="desired-state-publish"))
        collector = ArmCollector(self.dp.router, self.registry.engine)  # canary verdicts on every frontend's outcomes
        self.traffic.arm_reports = collector  # and A/B feedback for the requests of every frontend
        self._tasks.append(loop.create_task(collector.run(), name="arm-reports"))
        self.ledger = fleet_ledger(s, self.fleet, self.registry)
        self.ledger.start()
        for writer in self.writers:
            await writer.start()

    async def _reconcile_now(self) -> None:
        """A reconciler round on every Triton now (the remote executor's scale-up; the loop's rounds wait their turn)."""
        await asyncio.gather(*(r.reconcile_once() for r in self.reconcilers))

    def _asleep(self) -> dict[str, float]:
        """The endpoints the autoscaler scaled to zero -> their cold-start budget (held on every frontend); a model
        group's models waiting for their first pod are each frontend's own business (Fleet.hold_group_models)."""
        autoscaler = self.fleet.autoscaler
        if autoscaler is None:
            return {}
        return {name: ep.waker.budget_s for name, ep in list(autoscaler.endpoints.items()) if ep.waker is not None}

    async def _announce_sleep(self, name: str, timeout_s: float = 3.0) -> None:
        """Before the autoscaler unloads ``name`` (scaled to zero): its sleep published, and every serving process
        that reports (signal_reports) has applied it — its requests are held there, none reaches the unloading
        Triton. A process that does not answer within ``timeout_s`` (the reports' staleness) is not waited for."""
        if self.publisher is None:
            return
        await self.publisher.publish_once()
        generation = await asyncio.to_thread(self.desired.generation)
        peers = SignalPeers(self.registry.engine, self.reporter)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while lagging := await asyncio.to_thread(peers.lagging, generation):
            if loop.time() >= deadline:
                log.warning("endpoint %s: unloading while %d process(es) have not applied its sleep: %s", name, len(lagging), ", ".join(lagging))
                return
            await asyncio.sleep(0.05)

    async def _stop_writers(self) -> None:
        for writer in reversed(self.writers):
            try:
                await writer.stop()
            except Exception:
                log.exception("stopping writer %r failed", writer)
        for task in self._tasks:
            await stop_task(task)
        self._tasks.clear()
        if self.retention is not None:
            await self.retention.stop()
            self.retention = None
        if self.ledger is not None:
            await self.ledger.stop()
            self.ledger = None
        if self.fleet.autoscaler is not None:
            await self.fleet.autoscaler.stop()
        if self.fleet.sampler is not None:
            self.fleet.sampler.peers = None
        await self.traffic.stop()
        await self.deployer.stop()

    async def _lost(self) -> None:
        """Another replica may lead now: stop writing, watch the desired state like a frontend."""
        await self._stop_writers()
        self._watch()

    async def stop(self) -> None:
        await stop_task(self._run)
        await stop_task(self._watcher)
        if self.leading:
            await self._stop_writers()
            await self.leadership.release()
        self.registry.close()


class _Loop:
    """A writer made of a loop ``run(stop_event, interval_s)`` (the Triton reconciler's)."""

    def __init__(self, run: Callable, interval_s: float):
        self._run, self.interval_s = run, interval_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.get_running_loop().create_task(self._run(self._stop, self.interval_s), name="triton-reconciler")

    async def stop(self) -> None:
        self._stop.set()
        await stop_task(self._task)
        self._task = None
