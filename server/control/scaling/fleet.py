"""The fleet, assembled from the settings: the replica set the data plane sends requests through, its
members' sources, and (in the process that owns the control plane) the executor, signals, autoscaler
and REST provisioner around it.

Members, by how the frontend runs:

* embedded (no ``--triton-url``): the supervised ``tritonserver`` is replica ``local-0``;
  ``INFERPLANE_LOCAL_REPLICAS`` > 1 starts more at once; the local executor starts and stops more as
  endpoints scale (placement: ``server.control.scaling.placement``);
* ``--triton-url a:8001,b:8001``: one member per URL (``remote-0``, ``remote-1``, ...);
* ``INFERPLANE_MODEL_GROUPS_FILE``: each group's headless Service, resolved again every
  ``discovery_interval_s`` (one member per address; a group with no address has no member, and its
  requests are held for one — KEDA sees them in ``inferplane_group_queue_depth``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from batching.route_policy import RouteBounds
from server.control.scaling import isolation
from server.control.registry.backend_configs import TritonTarget, observe_backends, observe_gpus
from server.control.scaling.executors import KubernetesGroupExecutor, LocalExecutor, ModelGroups
from server.control.scaling.remote_executor import RemoteExecutor
from server.control.scaling.placement import memory_need
from server.dataplane.capacity_policy import parse_capacity, spot_opt_in
from server.dataplane.replicas import DnsSource, Member, ReplicaPolicy, ReplicaSet
from server.dataplane.triton_client import TritonClient
from server.runtime.kube_api import ClusterAccess, EndpointSliceSource, KubeAPI
from server.runtime.triton_install import TritonInstallation, TritonNotInstalled
from server.settings import Settings
from server.runtime.local_replicas import LocalReplicaPool, parse_standby
from server.control.scaling.autoscaler import Waker
from server.control.scaling.signals import SignalSampler
from server.control.scaling.autoscaler import Autoscaler
from server.control.rollout.provisioning import Provisioner
from server.control.scaling.scaling_store import ScalingStore
from server.control.scaling.weight_cache import WeightCache
from server.control.scaling.kubernetes_executor import KubernetesExecutor
from server.control.scaling.kube_warm_pool import KubeWarmPool
from server.tenancy.tls import channel_credentials

log = logging.getLogger(__name__)

PRIMARY = "local-0"
ROUTING_PARAMETER = "inferplane.routing"  # an LLM endpoint's own routing policy (batching.route_policy)


class Fleet:
    def __init__(self, settings: Settings, replicas: ReplicaSet, *, pool=None, groups: ModelGroups | None = None):
        self.settings = settings
        self.replicas = replicas
        self.pool = pool  # server.runtime.local_replicas.LocalReplicaPool (embedded Triton only)
        self.groups = groups
        self.executor = None
        self.sampler = None
        self.autoscaler = None
        self.provisioner = None
        self.dataplane = None
        self._refreshing: set[str] = set()
        self._memory: dict[str, int] = {}
        self._group_wakers: set[str] = set()
        self._streams: dict[str, bool] = {}  # model -> decoupled (its config), read once
        self._ensemble_bound: set[str] | None = None  # ensembles and their steps (one Triton holds them)
        self.hooks = None
        self._local_hardware: tuple[frozenset[str], int] | None = None

    # ---- the replica set (before the data plane) ---------------------------------------------

    @classmethod
    def build(cls, settings: Settings, supervisor=None, inprocess=None) -> "Fleet":
        """``inprocess``: Triton in this process (``server.runtime.inprocess``), the one member."""
        s = settings
        policy = ReplicaPolicy(
            health_interval_s=s.replica_health_interval_s, eject_failures=s.replica_eject_failures, eject_s=s.replica_eject_s,
            wait_for_member_s=s.replica_wait_s, retry_lost=s.replica_retry_lost, discovery_interval_s=s.discovery_interval_s,
            llm_routing=s.llm_routing, zone=s.zone, zone_spill_outstanding=s.zone_spill_outstanding,
            route_bounds=RouteBounds(load_factor=s.llm_route_load_factor, load_slack=s.llm_route_load_slack, kv_high=s.llm_route_kv_high),
        )  # fmt: skip
        codec = inprocess.batch_codec() if inprocess is not None else None
        replicas = ReplicaSet(name="triton", policy=policy, client_factory=lambda target: client(s, target, remote=True), codec=codec)
        if inprocess is not None:
            replicas._add(Member("in-process", inprocess, group="local"))
        pool = None
        groups = ModelGroups.load(s.model_groups_file) if s.model_groups_file else None
        if supervisor is not None:

            pool = LocalReplicaPool(
                s.model_repository, s.workdir, install=supervisor.install, startup_timeout=s.triton_startup_timeout_s,
                response_cache_bytes=s.response_cache_bytes, otlp_traces_url=supervisor.otlp_traces_url, warm_pool=s.warm_pool,
                standby=parse_standby(s.warm_standby), load=lambda target, model: _load_at(s, target, model),
            )  # fmt: skip
            pool.adopt(PRIMARY, supervisor)
            primary = Member(PRIMARY, client(s, supervisor.grpc_target), group="local", local=True, zone=(s.zones or ("",))[0], capacity=_capacity_of(s, 0))
            replicas._add(primary)
        for i, url in enumerate(s.triton_urls if not groups else []):
            replicas._add(Member(f"remote-{i}", client(s, url, remote=True), group="remote"))
        if groups is not None:
            for name, spec in groups.groups.items():
                replicas.add_source(_source(s, name, spec))
        fleet = cls(s, replicas, pool=pool, groups=groups)
        if pool is not None:
            pool.on_down = fleet._local_down
            pool.on_restart = fleet._local_restarted
        return fleet

    async def start_replicas(self) -> None:
        """Discovery's first round and the extra local replicas asked for at start; then health checks."""
        for source in self.replicas._sources:
            await self.replicas.discover(source)
        if self.pool is not None:
            s = self.settings
            extra = [f"local-{i}" for i in range(1, s.local_replicas)]
            targets = await asyncio.gather(*(self.pool.start(r) for r in extra))
            for i, (replica_id, target) in enumerate(zip(extra, targets), start=1):
                zone = s.zones[i % len(s.zones)] if s.zones else ""
                member = Member(replica_id, client(s, target), group="local", local=True, zone=zone, capacity=_capacity_of(s, i))
                await self.replicas.add_member(member, probe=False)
            await self.pool.fill_warm()
        self.replicas.start()

    def _local_down(self, replica_id: str) -> None:
        """A local replica's Triton died: a standby holding its models takes its place at once (the
        dead one restarts as the standby); with none, no traffic to it until it rejoins."""
        member = next((m for m in self.replicas.members() if m.id == replica_id), None)
        target = self.pool.take_over(replica_id, set(member.wanted)) if member is not None else None
        if target is None:
            self.replicas.mark_down(replica_id)
            return
        self.reconnect(replica_id, target)
        self.replicas.revive(replica_id)  # its models stay: the standby holds them, ready

    async def _local_restarted(self, replica_id: str, target: str) -> None:
        self.reconnect(replica_id, target)
        await self.replicas.rejoin(replica_id)

    def reconnect(self, replica_id: str, target: str) -> None:
        """A new channel to a local replica's Triton, live at ``target``: a standby that took its place,
        or its restarted process (its ports, or new ones after a failed try). The dead process's
        channel waits out its reconnect backoff (up to 1 s) and fails every call meanwhile, so a
        rejoin's probe on it missed the live Triton and the replica waited for a later health round."""
        self.replicas.replace_client(replica_id, client(self.settings, target))

    def triton_targets(self) -> list[TritonTarget]:
        """Each replica's Triton backends and GPUs, for the deployer's backend choice. A local Triton's
        are observed (the installation's backend directory, this machine's GPUs) and recorded on its
        member; a remote one keeps what its member records (the Python backend unless told)."""
        if self._local_hardware is None:
            self._local_hardware = (observe_backends(_installed_backends()) or frozenset({"python"}), observe_gpus())
        targets = []
        for member in self.replicas.members():
            if member.local or member.group == "local":
                member.backends, member.gpus = self._local_hardware
            targets.append(TritonTarget(member.id, member.backends, member.gpus))
        return targets

    def group_of(self, model: str) -> str:
        if self.groups is not None:
            return self.groups.group_of(model) or "default"
        return "local" if self.pool is not None else "remote"

    def has_replicas(self) -> bool:
        return any(m.state == "up" for m in self.replicas.members())

    def hold_group_models(self) -> None:
        """Models a group names that no replica serves yet (the group is at zero replicas, or its pods
        are starting): the table knows them as asleep, so their requests are held — counted in the
        group's queue gauge, which brings KEDA's first replica — until a replica serves them."""
        if self.groups is None or self.dataplane is None:
            return
        for spec in self.groups.groups.values():
            for model in spec["models"]:
                if model != "*" and self.dataplane.signature(model) is None and model not in self.hooks.wakers:
                    self.hooks.wakers[model] = Waker(model, lambda m=model: self._adopt_when_served(m), self.settings.replica_wait_s)
                    self._group_wakers.add(model)

    async def _adopt_when_served(self, model: str) -> None:
        await self.replicas.wait_for(model)
        await self.dataplane.adopt(model)
        self.hooks.wakers.pop(model, None)
        self._group_wakers.discard(model)

    def others_up(self, member_id: str) -> bool:
        return any(m.state == "up" for m in self.replicas.members() if m.id != member_id)

    # ---- the control plane (after the data plane) ----------------------------------------------

    def attach_dataplane(self, dataplane, hooks, metrics) -> None:
        """Executor and signals: every serving process needs the signals (KEDA reads them)."""
        self.dataplane = dataplane
        self.hooks = hooks
        self.replicas.on_change = self._hosting_changed
        self.replicas.routing_of = self._routing_of
        self.replicas.spot_ok = self._spot_ok
        self.sampler = SignalSampler(hooks, self.replicas, registry=metrics.registry, group_of=self.group_of)
        s = self.settings
        if self.pool is not None and s.autoscale_executor == "local" and not s.worker:
            self.executor = LocalExecutor(
                self.replicas, self.pool, lambda target: client(s, target),
                capacity_bytes=s.replica_memory_mb << 20, memory_of=self.memory_of, primary=PRIMARY, refresh=dataplane.refresh,
                default_copies=s.local_replicas, group_of=self.isolation_of, zones=s.zones, standby=parse_standby(s.warm_standby),
                zone_down_grace_s=s.zone_down_grace_s,
            )  # fmt: skip

    def isolation_of(self, model: str) -> str:
        """The model's isolation group: its tier (its autoscaling config), the settings' mode, whether
        it streams (its config), and whether a warm standby of it is asked for (a group of its own)."""
        if model not in self._streams:
            self._streams[model] = isolation.streams(self.settings.model_repository, model)
        if self._ensemble_bound is None:
            self._ensemble_bound = isolation.ensemble_bound(self.settings.model_repository)
        scaler = self.autoscaler.endpoints.get(model) if self.autoscaler is not None else None
        tier = scaler.config.tier if scaler is not None else isolation.DEFAULT_TIER
        return isolation.isolation_group(
            model, streams=self._streams[model], mode=self._isolation_mode(), tier=tier, ensemble=model in self._ensemble_bound,
            standby=model in parse_standby(self.settings.warm_standby),
        )  # fmt: skip

    def _isolation_mode(self) -> str:
        """The settings' mode; none with several workers (they reach the embedded Triton only)."""
        return self.settings.isolation if self.settings.workers == 1 else "none"

    async def place_models(self, models: list[str]) -> None:
        """Before the models of the start load: each isolation group on local replicas of its own."""
        if self.settings.isolation != "none" and self._isolation_mode() == "none":
            log.warning("isolation %s needs --workers 1 (workers reach the embedded Triton only): every model shares it", self.settings.isolation)
        if isinstance(self.executor, LocalExecutor) and models:
            await self.executor.place_at_start(models)

    def _routing_of(self, model: str) -> str | None:
        """An LLM endpoint's own routing policy (its config's ``inferplane.routing``), if it names one."""
        signature = self.dataplane.signature(model) if self.dataplane is not None else None
        return signature.params.get(ROUTING_PARAMETER) if signature is not None else None

    def _spot_ok(self, model: str) -> bool:
        """Whether the endpoint lets its real-time traffic use spot replicas (its config's ``inferplane.spot``)."""
        signature = self.dataplane.signature(model) if self.dataplane is not None else None
        return signature is not None and spot_opt_in(signature.params)

    def memory_of(self, model: str) -> int:
        return self._memory.get(model, self.settings.default_model_memory_mb << 20)

    async def read_memory_needs(self, registry) -> None:
        """Memory per copy from the registry's hardware metadata of each registered model's latest version."""
        default = self.settings.default_model_memory_mb << 20

        def read() -> dict[str, int]:
            out = {}
            for summary in registry.list_models():
                try:
                    out[summary.name] = memory_need(registry.get(summary.name).hardware, default)
                except Exception:  # a model without versions
                    continue
            return out

        try:
            self._memory.update(await asyncio.to_thread(read))
        except Exception as err:  # an unreachable registry: defaults
            log.warning("reading memory needs from the registry failed: %s", err)
        if isinstance(self.executor, LocalExecutor):  # a standby holds its model's memory: placed again with the needs read
            await self.executor.keep_standby()

    def start_control(self, *, registry=None, deployer=None, usage_store=None, placements=None, reconcile=None, converge=None) -> None:
        """The autoscaler, on the executor this process has: its own Triton processes (local), the Tritons
        it reaches by address (remote: ``placements``, the desired state, and ``reconcile``, one reconciler
        round now), or Kubernetes Deployments (with ``converge(group, target)``, a reconciler round on one
        Triton, a scale-up takes the group's warm pods first: server.control.scaling.kube_warm_pool)."""
        s = self.settings
        executor = self.executor
        if executor is None and s.autoscale_executor == "kubernetes" and self.groups is not None:
            k8s = KubernetesExecutor.from_settings(s)
            warm = KubeWarmPool(k8s, converge) if converge is not None else None
            executor = self.executor = KubernetesGroupExecutor(k8s, self.groups, warm)
        remote = self.pool is None and self.groups is None and bool(s.triton_urls) and placements is not None and reconcile is not None
        if executor is None and s.autoscale_executor == "local" and remote:
            executor = self.executor = RemoteExecutor(self.replicas, placements, reconcile)
        if s.autoscale and executor is not None:
            cache = WeightCache(s.weight_cache_dir or (s.workdir / "weight-cache"), s.weight_cache_bytes)
            self.autoscaler = Autoscaler(
                self.dataplane, self.hooks, self.sampler, executor,
                store=ScalingStore(registry) if registry is not None else None, usage_store=usage_store, usage_flush_s=s.usage_flush_s,
                weight_cache=cache, artifact_store=registry.store if registry is not None else None,
                repository=Path(s.model_repository), evict_on_zero=s.scale_to_zero_evict, interval_s=s.autoscale_interval_s,
                profile_period_s=s.autoscale_profile_period_s, profile_slot_s=s.autoscale_profile_slot_s, lead_s=s.autoscale_lead_s,
                replicas=self.replicas,
            )  # fmt: skip
        if deployer is not None and registry is not None:
            self.provisioner = Provisioner(deployer, registry, self.autoscaler, self.replicas)

    async def start(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.start()
        elif self.sampler is not None:
            self._sampling = asyncio.create_task(self._sample_forever(), name="signals")

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.autoscale_interval_s)
            try:
                await self.sampler.sample()
            except Exception:  # keep sampling
                log.exception("sampling load signals failed")

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.provisioner is not None:
            await self.provisioner.stop()
        task = getattr(self, "_sampling", None)
        if task is not None:
            task.cancel()

    async def stop_replicas(self) -> None:
        if self.pool is not None:
            await self.pool.stop_all()

    def _hosting_changed(self, models: set[str]) -> None:
        """A model's replicas changed: read its signature again (its capacity is the replicas')."""
        dp = self.dataplane
        if dp is None:
            return
        for model in models:
            if model in self._group_wakers and self.replicas.hosting_count(model):
                self.hooks.wakers[model].start()  # a replica serves it now: into the table
                continue
            if model in self._refreshing or dp.signature(model) is None:
                continue
            self._refreshing.add(model)
            asyncio.get_running_loop().call_later(0.05, lambda m=model: asyncio.ensure_future(self._refresh(m)))

    async def _refresh(self, model: str) -> None:
        try:
            if self.dataplane.signature(model) is not None and self.replicas.hosting_count(model):
                await self.dataplane.refresh(model)
        except Exception as err:  # unloaded meanwhile
            log.debug("refreshing %s: %s", model, err)
        finally:
            self._refreshing.discard(model)


def client(settings: Settings, target: str, remote: bool = False) -> TritonClient:
    """A channel to one Triton; a remote one (``--triton-url``, a model group's pods) over TLS when the
    settings' ``triton_tls_*`` say so (``server.tenancy.tls``: CA, client certificate, server name)."""
    tls = {}
    if remote and settings.triton_tls:

        tls = {"credentials": channel_credentials(settings), "server_name": settings.triton_tls_server_name or None}
    c = TritonClient(target, channels=settings.triton_channels, max_message_bytes=settings.max_request_bytes + (1 << 20), **tls)
    c.connect()
    return c


async def _load_at(settings: Settings, target: str, model: str) -> None:
    """Load ``model`` on the Triton at ``target`` (a warm standby's), outside the replica set."""
    c = client(settings, target)
    try:
        await c.load_model(model)
    finally:
        await c.close()


def _source(settings: Settings, name: str, spec: dict):
    """A model group's discovery: its headless Service's DNS, or its EndpointSlices (each pod's zone too)."""
    dns = DnsSource(spec["service"], spec["grpc_port"], group=name, capacity=spec["capacity"])
    if settings.replica_discovery == "endpointslices":
        api = KubeAPI(ClusterAccess.from_dir(settings.kubernetes_token_dir, settings.kubernetes_namespace))
        return EndpointSliceSource(spec["service"], spec["grpc_port"], name, spec["capacity"], api, fallback=dns)
    return dns


def _capacity_of(settings: Settings, i: int) -> str:
    """The capacity of local replica ``i`` of those started at once (``local_capacity`` in turn)."""
    capacities = [c for c in settings.local_capacity.split(",") if c.strip()]
    return parse_capacity(capacities[i % len(capacities)])


def _installed_backends() -> Path:
    """The backend directory of the Triton installation local replicas run (the pytriton wheel's)."""
    try:
        return TritonInstallation.find().root / "backends"
    except TritonNotInstalled:
        return Path("/opt/tritonserver/backends")  # the NVIDIA container's
