"""The autoscaler's executors: how a replica count becomes real, behind one small interface.

``Executor``: ``replicas(endpoint)`` (what serves now), ``set_replicas(endpoint, n)`` (returns once
the change is in effect: loaded and in rotation, or patched), ``prepare(endpoint, n)`` (placement
only: the next load of the model lands there), ``describe()``.

* :class:`LocalExecutor` — replica *processes* on this machine (``server.runtime.local_replicas``)
  and the models placed on them (``server.control.scaling.placement``: first-fit decreasing on memory
  needs, sticky); a new copy is loaded on its replica and joins the rotation once Triton says ready;
  a removed copy is drained first (in-flight requests finish) and then unloaded; a replica left
  hosting nothing stops (not the embedded one). ``set_instances`` scales a model's Triton
  ``instance_group`` count instead, with Triton's load-with-config. The warm standbys asked for
  (``standby``) are placed too: the pool keeps those that fit a replica (``keep_standby``), and
  ``describe`` reports the refused ones and the memory the standbys hold.
* :class:`KubernetesGroupExecutor` — the replica count of the model group's Triton Deployment
  (``server.control.scaling.kubernetes_executor``: the scale subresource); a group serving several
  endpoints gets the largest count any of them asks for. Kubernetes places and restarts the pods;
  the frontends discover them through the group's headless Service. With a warm pool
  (``server.control.scaling.kube_warm_pool``) a group's replicas are its Deployment's plus the warm pods
  it adopted: a scale-up takes ready warm pods first (loaded, then relabelled into the group), the
  Deployment's count covers the rest; a scale-down deletes adopted pods first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from google.protobuf.json_format import MessageToJson

from server.control.scaling.placement import DEFAULT_MEMORY_BYTES, Demand, Plan, place, replica_order
from server.dataplane.capacity_policy import ON_DEMAND, SPOT, parse_capacity
from server.dataplane.replicas import DOWN, Member, ReplicaSet
from server.errors import InvalidRequest, ModelNotFound, PermissionDenied

log = logging.getLogger(__name__)


class Executor(Protocol):
    name: str

    def replicas(self, endpoint: str) -> int: ...

    async def set_replicas(self, endpoint: str, n: int) -> None: ...

    async def prepare(self, endpoint: str, n: int) -> None: ...

    def describe(self) -> dict: ...

    def standby_ready(self, endpoint: str) -> int: ...

    async def heal(self) -> bool: ...


class LocalExecutor:
    name = "local"

    def __init__(
        self,
        replicas: ReplicaSet,
        pool,  # server.runtime.local_replicas.LocalReplicaPool
        client_factory: Callable[[str], object],
        *,
        capacity_bytes: int = 4 << 30,
        memory_of: Callable[[str], int] = lambda model: DEFAULT_MEMORY_BYTES,
        primary: str = "local-0",
        refresh: Callable[[str], object] | None = None,  # re-read a model's signature (its capacity changed)
        default_copies: int = 1,  # copies of a model nobody autoscales
        group_of: Callable[[str], str] = lambda model: "",  # its isolation group (server.control.scaling.isolation)
        zones: tuple[str, ...] = (),  # the zones new replicas open in (placement spreads copies over them)
        standby: dict[str, int] | None = None,  # model -> warm standbys asked for (INFERPLANE_WARM_STANDBY)
        zone_down_grace_s: float = 10.0,  # a zone whose replicas are all down this long: its copies placed in the others
        clock: Callable[[], float] = time.monotonic,
    ):
        self.zone_down_grace_s = zone_down_grace_s
        self._clock = clock
        self._down_since: dict[str, float] = {}  # zone -> since when every local replica in it is down
        self.down_zones: frozenset[str] = frozenset()  # down past the grace: the plan places their copies elsewhere
        self._owed: dict[str, int] = {}  # while zones are down: the copies of models nobody autoscales, as before it
        self.standby = {m: n for m, n in (standby or {}).items() if n > 0}
        self._refused: dict[str, int] = {}  # the standbys last refused (logged once)
        self.default_copies = max(1, default_copies)
        self.group_of = group_of
        self.zones = tuple(zones)
        self.set = replicas
        self.pool = pool
        self.client_factory = client_factory
        self.capacity_bytes = capacity_bytes
        self.memory_of = memory_of
        self.primary = primary
        self.refresh = refresh
        self.copies: dict[str, int] = {}  # endpoints under autoscaling: copies asked for
        self._lock = asyncio.Lock()
        self.last_plan: Plan | None = None
        self.provision_s: dict[str, float] = {}  # endpoint -> seconds its last scale-up took
        self.instance_counts: dict[str, int] = {}  # model -> Triton instances per replica (set or read here)
        replicas.placer = self.place_one

    # ---- what exists -------------------------------------------------------------------------

    def _local(self) -> list[Member]:
        return [m for m in self.set.members() if m.local]

    def replicas(self, endpoint: str) -> int:
        return sum(1 for m in self._local() if endpoint in m.wanted)

    def standby_ready(self, endpoint: str) -> int:
        """The loaded standbys of ``endpoint`` a scale-up can take now (not one restarting)."""
        return sum(1 for pid in self.pool.standby_pids().get(endpoint, ()) if pid is not None)

    def _current(self) -> dict[str, set[str]]:
        members = sorted(self._local(), key=lambda m: (m.id != self.primary, replica_order(m.id)))  # local-2 before local-10
        return {m.id: set(m.wanted) for m in members}

    def _demands(self, overrides: dict[str, int] | None = None) -> dict[str, Demand]:
        """Every model some local replica hosts (one copy unless autoscaled) and every autoscaled one."""
        copies: dict[str, int] = {}
        for m in self._local():
            for model in m.wanted:
                copies[model] = max(copies.get(model, 0), 1)
        for model in list(copies):
            copies[model] = self._owed.get(model, self.replicas(model))  # not the stand-ins a down zone's copies have
        copies.update(self.copies)
        copies.update(overrides or {})
        models = [m for m in copies if copies[m] > 0] + [m for m in self.standby if copies.get(m, 0) <= 0]  # a standby's even at zero copies
        return {m: Demand(max(0, copies.get(m, 0)), self.memory_of(m), self.group_of(m), self.standby.get(m, 0)) for m in models}

    def plan(self, overrides: dict[str, int] | None = None) -> Plan:
        zone_of = {m.id: m.zone for m in self._local()}
        return place(
            self._demands(overrides), self._current(), self.capacity_bytes, new_id=lambda n: f"local-{n}", zone_of=zone_of, zones=self.zones,
            down=self.down_zones,
        )  # fmt: skip

    async def place_at_start(self, models: list[str]) -> None:
        """Place the models loaded at start all at once (each isolation group on replicas of its own,
        opened now), so the loads that follow land on them."""
        async with self._lock:
            plan = self.plan({m: max(self.default_copies, self.copies.get(m, 0)) for m in models})
            await self._open(plan)
            for model in models:
                self.set.placement[model] = plan.replicas_of(model)
            self.last_plan = plan
            await self._keep_standby(plan)

    def place_one(self, model: str) -> list[str] | None:
        """Where a model nobody scaled goes when it is loaded (the replica set asks): its copies'
        replicas in the plan, among the replicas that exist (new ones start only on scale-up)."""
        if model in self.copies:
            n = self.copies[model]
        else:
            n = max(self.default_copies, self.replicas(model))
        plan = self.plan({model: n})
        ids = [r for r in plan.replicas_of(model) if r in {m.id for m in self._local()}]
        if not ids:
            members = self._local()
            group = self.group_of(model)
            same = [m for m in members if all(self.group_of(w) == group for w in m.wanted)]  # its isolation group's (or empty)
            if members and not same:
                log.warning("no replica of isolation group %r for %s yet: it shares one until a scale-up opens its own", group, model)
            ids = [min(same or members, key=lambda m: len(m.wanted)).id] if members else []
        return ids or None

    # ---- changes --------------------------------------------------------------------------------

    async def prepare(self, endpoint: str, n: int) -> None:
        """Place ``n`` copies (starting replicas as needed) without loading: the next
        ``load_model`` of the endpoint (a wake, a deploy) loads them there."""
        async with self._lock:
            self.copies[endpoint] = n
            plan = self.plan()
            await self._open(plan)
            self.set.placement[endpoint] = plan.replicas_of(endpoint)
            self.last_plan = plan
            await self._keep_standby(plan)

    async def set_replicas(self, endpoint: str, n: int) -> None:
        if n < 0:
            raise InvalidRequest(f"replicas must be >= 0, got {n}")
        async with self._lock:
            self.copies[endpoint] = n
            changed = await self._replan(endpoint)
        for model in changed:
            await self._refresh(model)

    async def heal(self) -> bool:
        """A zone whose local replicas have all been down for ``zone_down_grace_s`` (their Tritons do
        not come back) is down for the plan: its copies are placed again in the zones that are up. A
        zone with a replica up again is not: the stand-ins are unloaded and stopped. The autoscaler's
        loop calls this each round; returns whether the placement was redone."""
        now = self._clock()
        for zone in self.zones:
            members = [m for m in self._local() if m.zone == zone]
            if members and all(m.state == DOWN for m in members):
                self._down_since.setdefault(zone, now)
            else:
                self._down_since.pop(zone, None)
        down = frozenset(z for z, since in self._down_since.items() if now - since >= self.zone_down_grace_s)
        if down == self.down_zones:
            return False
        log.warning("zones down for %gs or more: %s (were: %s); placing again", self.zone_down_grace_s, sorted(down) or "none",
                    sorted(self.down_zones) or "none")  # fmt: skip
        async with self._lock:
            if not self.down_zones:
                self._owed = {m: self.replicas(m) for member in self._local() for m in member.wanted if m not in self.copies}
            self.down_zones = down
            changed = await self._replan(None)
            if not down:
                self._owed = {}
        for model in changed:
            await self._refresh(model)
        return True

    async def _replan(self, endpoint: str | None) -> set[str]:
        """Apply the plan (with the lock held): new replicas, loads, then drains and unloads; returns the
        models whose replicas changed (``endpoint``: the one whose scale-up is timed)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        before = self._current()
        plan = self.plan()
        self.last_plan = plan
        held = await self._open(plan)
        # loads first (new copies join the rotation when ready; a standby's model is in it already), then drains and unloads
        loads = [(r, m) for r, models in plan.assignment.items() for m in sorted(models) if m not in before.get(r, set()) | held.get(r, set())]
        joined = [m for models in held.values() for m in models]
        unloads = [(r, m) for r, models in before.items() for m in sorted(models) if m not in plan.assignment.get(r, set())]
        if loads:
            results = await asyncio.gather(*(self.set.load_on(r, m) for r, m in loads), return_exceptions=True)
            for (r, m), result in zip(loads, results):
                if isinstance(result, BaseException):
                    log.error("loading %s on local replica %s failed: %s", m, r, result)
        changed = {m for _, m in loads + unloads} | set(joined)
        for model in changed:
            self.set.placement[model] = plan.replicas_of(model)
        await asyncio.gather(*(self.set.unload_from(r, m) for r, m in unloads), return_exceptions=True)
        await self._close_empty(plan)
        await self._keep_standby(plan)
        if endpoint is not None and (loads or joined):
            self.provision_s[endpoint] = loop.time() - began
        return changed

    async def keep_standby(self) -> None:
        """Place the standbys again (the models' memory needs changed: the registry was read)."""
        async with self._lock:
            self.last_plan = plan = self.plan()
            await self._keep_standby(plan)

    async def _keep_standby(self, plan: Plan) -> None:
        """The pool keeps the standbys the plan keeps; one whose model outgrows a replica is refused
        (stopped if it waits already) and reported."""
        if not self.standby:
            return
        for model, n in plan.refused_standby.items():
            if self._refused.get(model) != n:  # once, not at every scaling step
                log.warning("warm standby of %s refused (%d asked for): one copy needs %d MiB, a local replica offers %d MiB",
                            model, n, self.memory_of(model) >> 20, self.capacity_bytes >> 20)  # fmt: skip
        self._refused = dict(plan.refused_standby)
        await self.pool.keep_standby(plan.standby)

    async def _refresh(self, model: str) -> None:
        if self.refresh is None:
            return
        try:
            await self.refresh(model)
        except Exception as err:  # not loaded anywhere (scaled to zero): nothing to read
            log.debug("refreshing %s after scaling: %s", model, err)

    async def _open(self, plan: Plan) -> dict[str, set[str]]:
        """Start the plan's new replicas (or take warm members); returns, per new replica, the models
        its Triton holds already (a standby's): it joins the rotation with them, nothing to load."""
        have = {m.id for m in self.set.members()}
        missing = [r for r in plan.assignment if r not in have]
        targets = await asyncio.gather(*(self.pool.start(r, plan.assignment[r]) for r in missing))
        held = {}
        for replica_id, target in zip(missing, targets):
            member = Member(replica_id, self.client_factory(target), group="local", local=True, zone=plan.zones.get(replica_id, ""))
            held[replica_id] = self.pool.holds(replica_id) & plan.assignment[replica_id]
            member.models, member.wanted = set(held[replica_id]), set(held[replica_id])
            await self.set.add_member(member, probe=False)
        return held

    async def _close_empty(self, plan: Plan) -> None:
        for member in self._local():
            if member.id == self.primary or member.id in self.pool.adopted or plan.assignment.get(member.id):
                continue
            if member.wanted:
                continue
            await self.set.remove_member(member.id)
            await self.pool.stop(member.id)

    def instances(self, model: str) -> int:
        return self.instance_counts.get(model, 1)

    async def read_instances(self, model: str) -> int:
        """The model's instance count per replica, from a replica's Triton config."""
        hosts = [m for m in self._local() if model in m.wanted]
        if hosts:
            config = await hosts[0].client.model_config(model)
            self.instance_counts[model] = max(1, sum(max(1, g.count) for g in config.instance_group) or 1)
        return self.instances(model)

    async def set_instances(self, model: str, count: int) -> None:
        """Scale a model's Triton instances on every replica hosting it (load-with-config: the
        replica's config.pbtxt with another ``instance_group`` count; Triton swaps it in while the
        old instances keep serving)."""
        if count < 1:
            raise InvalidRequest(f"instances must be >= 1, got {count}")
        hosts = [m for m in self._local() if model in m.wanted]
        if not hosts:
            raise ModelNotFound(f"model '{model}' is not loaded on any local replica")
        for member in hosts:
            config = await member.client.model_config(model)
            if not config.instance_group:
                config.instance_group.add(count=count)
            for group in config.instance_group:
                group.count = count
            await self.set.load_on(member.id, model, config=MessageToJson(config))
        self.instance_counts[model] = count
        await self._refresh(model)

    def describe(self) -> dict:
        members = self._local()
        plan = self.last_plan
        memory = plan.memory(self._demands()) if plan is not None else {}
        return {
            "executor": "local",
            "replicas": [{"id": m.id, "target": m.target, "pid": self.pool.pid(m.id), "models": sorted(m.wanted), "zone": m.zone,
                          "capacity": m.capacity, "state": m.state, "reclaimed": m.reclaimed} for m in members],
            "warm": [pid for pid in self.pool.warm_pids() if pid is not None],  # the warm pool's idle Tritons
            "standby": {m: [p for p in pids if p is not None] for m, pids in sorted(self.pool.standby_pids().items())},  # loaded, out of rotation
            "from_warm": dict(sorted(self.pool.from_warm.items())),  # replica -> "empty" or the standby's model it took
            "taken_over": self.pool.taken_over,  # dead replicas a standby replaced
            "warm_failures": self.pool.warm_failures,  # warm starts (or standby loads) that failed: each is started again after a backoff
            "standby_refused": dict(sorted(plan.refused_standby.items())) if plan is not None else {},  # a copy outgrows a replica
            "memory_mb": {k: v >> 20 for k, v in memory.items()},  # placed: the replicas' copies, the standbys'
            "capacity_mb": self.capacity_bytes >> 20,
            "copies": dict(sorted(self.copies.items())),
            "down_zones": sorted(self.down_zones),  # zones down past INFERPLANE_ZONE_DOWN_GRACE_S: their copies placed elsewhere
        }


class KubernetesGroupExecutor:
    """Endpoints to their model group's Deployment; the group's count is the largest any of its
    endpoints asks for."""

    name = "kubernetes"

    def __init__(self, kubernetes, groups: "ModelGroups", warm=None):
        self.k8s = kubernetes  # server.control.scaling.kubernetes_executor.KubernetesExecutor
        self.groups = groups
        self.warm = warm  # server.control.scaling.kube_warm_pool.KubeWarmPool, or None: the scale subresource alone
        self.wanted: dict[str, int] = {}
        self.counts: dict[str, int] = {}  # deployment -> last count read or set (its replicas plus the pods it adopted)

    def deployment(self, endpoint: str) -> str:
        group = self.groups.group_of(endpoint)
        if group is None:
            raise ModelNotFound(f"no model group serves '{endpoint}' (see INFERPLANE_MODEL_GROUPS_FILE)")
        return self.groups.groups[group]["service"]

    def replicas(self, endpoint: str) -> int:
        return self.counts.get(self.deployment(endpoint), 0)

    def standby_ready(self, endpoint: str) -> int:
        """None here: a scale-up starts a pod or loads a warm one, which holds no model yet (the policy keeps
        its full scale-down window)."""
        return 0

    async def heal(self) -> bool:
        """Nothing to do: Kubernetes reschedules the pods of a zone that is lost (topologySpreadConstraints)."""
        return False

    async def read(self, endpoint: str) -> int:
        deployment = self.deployment(endpoint)
        adopted = await self._adopted(self.groups.group_of(endpoint))
        n = self.counts[deployment] = await self.k8s.get_replicas(deployment) + len(adopted or ())
        return n

    async def _adopted(self, group: str) -> list | None:
        """The group's adopted pods; None without a pool, or where the Role does not grant pods (the
        manifests' older Role: the Deployment alone, as before)."""
        if self.warm is None:
            return None
        try:
            return await self.warm.adopted(group)
        except PermissionDenied as err:
            log.warning("group %s: no warm pool (%s): the Deployment's scale alone", group, err.message)
            return None

    async def set_replicas(self, endpoint: str, n: int) -> None:
        self.wanted[endpoint] = n
        deployment = self.deployment(endpoint)
        group = self.groups.group_of(endpoint)
        count = max(v for e, v in self.wanted.items() if self.groups.group_of(e) == group)
        if self.counts.get(deployment) != count:
            adopted = await self._adopted(group)
            if adopted is None:
                await self.k8s.set_replicas(deployment, count)
            else:
                await self._scale_with_pool(group, deployment, count, adopted)
            self.counts[deployment] = count

    async def _scale_with_pool(self, group: str, deployment: str, count: int, adopted: list) -> None:
        """``count`` replicas of ``group``: its Deployment's plus its adopted pods. Up: ready warm pods first,
        the Deployment for the rest; down: adopted pods deleted first, then the Deployment lowered."""
        replicas = await self.k8s.get_replicas(deployment)
        have = replicas + len(adopted)
        if count > have:
            kept = len(adopted) + await self.warm.take(group, count - have, self.groups.groups[group]["grpc_port"])
        else:
            kept = len(adopted) - await self.warm.release(group, adopted, have - count)
        if max(0, count - kept) != replicas:
            await self.k8s.set_replicas(deployment, max(0, count - kept))

    async def prepare(self, endpoint: str, n: int) -> None:
        await self.set_replicas(endpoint, n)

    def describe(self) -> dict:
        out = {**self.k8s.describe(), "deployments": dict(sorted(self.counts.items())), "wanted": dict(sorted(self.wanted.items()))}
        if self.warm is not None:  # per group: the ready warm pods and the adopted ones last listed, taken and failed counts
            out["warm_pools"] = self.warm.describe()
        return out


class ModelGroups:
    """The frontends' model-group table (``INFERPLANE_MODEL_GROUPS_FILE``, the ConfigMap's
    ``model-groups.json``): ``{group: {"service": NAME, "grpc_port": 8001, "models": [...]}}``; a
    group listing ``"*"`` serves every model no other group names. ``"capacity": "spot"`` marks a
    group whose pods run on the spot node pool (``server.dataplane.capacity_policy``)."""

    def __init__(self, groups: dict):
        if not isinstance(groups, dict) or not groups:
            raise InvalidRequest("the model groups file must be a non-empty JSON object {group: {service, grpc_port, models}}")
        for name, spec in groups.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("service"), str) or not spec["service"]:
                raise InvalidRequest(f"model group '{name}' needs a 'service' (the headless Service's name)")
            port = spec.get("grpc_port", 8001)
            if not isinstance(port, int) or not 0 < port < 65536:
                raise InvalidRequest(f"model group '{name}': grpc_port must be a port number, got {port!r}")
            models = spec.get("models", [])
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise InvalidRequest(f"model group '{name}': models must be a list of names (or '*')")
        for name, spec in groups.items():
            try:
                parse_capacity(spec.get("capacity", ON_DEMAND))
            except ValueError as err:
                raise InvalidRequest(f"model group '{name}': {err}") from None
        defaults = []  # the on-demand group serving '*' first (requests with no group of their own go there), then a spot one
        for spot in (False, True):
            star = [n for n, s in groups.items() if "*" in s.get("models", []) and (parse_capacity(s.get("capacity", ON_DEMAND)) == SPOT) == spot]
            if len(star) > 1:
                raise InvalidRequest(f"only one model group may serve '*' per capacity ({'spot' if spot else 'on demand'}: got {', '.join(star)})")
            defaults += star
        self.groups = {
            n: {"service": s["service"], "grpc_port": int(s.get("grpc_port", 8001)), "models": list(s.get("models", [])),
                "capacity": parse_capacity(s.get("capacity", ON_DEMAND))}
            for n, s in groups.items()
        }  # fmt: skip
        self.default = defaults[0] if defaults else None
        # a model an on-demand group and a spot group both name is the on-demand group's (its KEDA queue, its scaling)
        self._by_model = {m: n for n, s in self.groups.items() if s["capacity"] == SPOT for m in s["models"] if m != "*"}
        self._by_model.update({m: n for n, s in self.groups.items() if s["capacity"] != SPOT for m in s["models"] if m != "*"})

    @classmethod
    def load(cls, path: Path) -> "ModelGroups":
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as err:
            raise InvalidRequest(f"cannot read the model groups file {path}: {err}") from None

    def group_of(self, model: str) -> str | None:
        return self._by_model.get(model, self.default)

    def serves(self, group: str, model: str) -> bool:
        """Whether ``group``'s Tritons load ``model``: the model's own group, and a spot group naming it
        (by name, or by ``*`` when it is the on-demand default group's) — a spot pool mirrors its models."""
        if self.group_of(model) == group:
            return True
        spec = self.groups.get(group)
        if spec is None or spec["capacity"] != SPOT:
            return False
        owner = self.group_of(model)
        return model in spec["models"] or ("*" in spec["models"] and owner is not None and "*" in self.groups[owner]["models"])
