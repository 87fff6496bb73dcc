"""The remote executor: an endpoint's replicas are the Tritons it is placed on, among Tritons that run
already (``--triton-url a,b,c``: the local cluster's, a fixed pool of pods), so the autoscaler of a
control-plane replica (``inferplane control run``) scales by placement instead of starting processes: the
idle Tritons of the pool are its warm members.

A scale to ``n`` writes the desired state first — the endpoint's versions placed by name on ``n`` Tritons
and removed from every other one (``PlacementStore.set_hosts``) — then asks the Triton reconciler for a
round, which loads them where they are missing (load-with-config, exactly those versions), and unloads
the endpoint from the Tritons it left (Triton finishes what it started; a request arriving there later is
refused before any work and every frontend's replica set sends it to another member). A leader killed
part-way leaves the placements behind: its successor's reconciler finishes the loads, and its
autoscaler, reading the stored config and counting what serves, decides again (level-triggered: nothing
of the interrupted decision is needed).

Which Tritons: those hosting the endpoint now stay (while up); then the up Tritons hosting the fewest
models, in the zone with the fewest of its copies first; a scale-down lets the most loaded go first. At
most as many replicas as Tritons are up: a larger ask is placed on all of them and ``describe`` says so.
A model the store has no versions of (a repository model the frontends loaded at start) is placed with
the versions its Tritons have ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from server.control.scaling.placement import replica_order
from server.dataplane.replicas import DOWN, Member, ReplicaSet
from server.errors import InvalidRequest

log = logging.getLogger(__name__)

SETTLE_S = 10.0  # after a change, how long the set's view of the Tritons may take to show it


class RemoteExecutor:
    name = "remote"

    def __init__(self, replicas: ReplicaSet, store, reconcile: Callable[[], Awaitable[object]]):
        self.set = replicas
        self.store = store  # server.control.scaling.placement_store.PlacementStore: the desired state
        self.reconcile = reconcile  # one reconciler round now (server.control.service.reconciler)
        self.copies: dict[str, int] = {}  # endpoint -> replicas asked for
        self.capped: dict[str, int] = {}  # endpoint -> replicas asked for beyond the Tritons up
        self.hosts: dict[str, list[str]] = {}  # endpoint -> the Tritons (targets) it was placed on here
        self.settle_s = SETTLE_S
        self._lock = asyncio.Lock()
        replicas.placer = self.place_one

    # ---- what exists -------------------------------------------------------------------------

    def _pool(self) -> list[Member]:
        return [m for m in self.set.members() if not m.local]

    def replicas(self, endpoint: str) -> int:
        """The Tritons up with the endpoint ready (not being drained from them)."""
        return sum(1 for m in self._pool() if m.state != DOWN and endpoint in m.models and endpoint not in m.draining_models)

    def standby_ready(self, endpoint: str) -> int:
        """None: a scale-up loads the model on an idle Triton (the policy keeps its full scale-down window)."""
        return 0

    def place_one(self, model: str) -> list[str] | None:
        """Where a load of ``model`` goes (the replica set asks: a deploy, a wake): the Tritons it was placed
        on here, else every Triton (a new leader learns the hosts at its first scaling step; the
        reconciler unloads the model again where its placements say it is not wanted)."""
        targets = self.hosts.get(model)
        if not targets:
            return None
        return [m.id for m in self._pool() if m.target in targets] or None

    async def heal(self) -> bool:
        """Nothing to do: a Triton that is down is not counted, so the policy places the copy elsewhere."""
        return False

    # ---- changes -------------------------------------------------------------------------------

    async def prepare(self, endpoint: str, n: int) -> None:
        """Choose the Tritons (placed, nothing loaded): the next load of the endpoint lands there."""
        async with self._lock:
            await self._place(endpoint, n)

    async def set_replicas(self, endpoint: str, n: int) -> None:
        if n < 0:
            raise InvalidRequest(f"replicas must be >= 0, got {n}")
        async with self._lock:
            chosen, versions = await self._place(endpoint, n)
            missing = [m for m in chosen if endpoint not in m.models]
            if missing and versions:
                await self.reconcile()  # the placements loaded where they are missing
            elif missing:  # never placed, nothing ready anywhere: the repository's own config
                await asyncio.gather(*(self.set.load_on(m.id, endpoint) for m in missing))
            left = [m for m in self._pool() if m not in chosen and (endpoint in m.models or endpoint in m.wanted)]
            results = await asyncio.gather(*(self.set.unload_from(m.id, endpoint) for m in left), return_exceptions=True)
            for member, result in zip(left, results):
                if isinstance(result, BaseException):  # the placement is removed: the reconciler unloads it later
                    log.warning("unloading %s from %s failed: %s", endpoint, member.target, result)
            await self._settle(endpoint, chosen, placed=bool(versions))

    async def _settle(self, endpoint: str, chosen: list[Member], *, placed: bool) -> None:
        """Read the Tritons again until the set sees the endpoint ready where it is placed and nowhere else
        (or ``settle_s`` passed): the autoscaler's next count is the new one, not a stale probe's. A chosen
        Triton still without it (the round found it busy: still unloading it after a scale-down) gets
        another round at once, not the loop's next one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_s
        while True:
            await self.set.check_health()
            up = [m for m in chosen if m.state != DOWN]
            serving = {m.id for m in self._pool() if m.state != DOWN and endpoint in m.models}
            if serving == {m.id for m in up} or loop.time() >= deadline:
                return
            await asyncio.sleep(0.05)
            if placed and any(endpoint not in m.models for m in up):
                await self.reconcile()

    async def _place(self, endpoint: str, n: int) -> tuple[list[Member], list[int]]:
        """Choose ``n`` Tritons and write them as the endpoint's placements; returns them and the versions."""
        chosen = self._choose(endpoint, n)
        self.copies[endpoint] = n
        if n > len(chosen):
            self.capped[endpoint] = n
            log.warning("endpoint %s: %d replica(s) asked for, %d Triton(s) up: placed on all of them", endpoint, n, len(chosen))
        else:
            self.capped.pop(endpoint, None)
        versions = await self._versions(endpoint)
        if versions:
            await asyncio.to_thread(self.store.set_hosts, endpoint, versions, [m.target for m in chosen], [m.target for m in self._pool()])
        self.hosts[endpoint] = [m.target for m in chosen]
        self.set.placement[endpoint] = [m.id for m in chosen]
        self.set.everywhere.discard(endpoint)  # a Triton that rejoins gets it only where it is placed
        return chosen, versions

    def _choose(self, endpoint: str, n: int) -> list[Member]:
        up = [m for m in self._pool() if m.state != DOWN]
        load = {m.id: len(m.models | m.wanted) for m in up}
        hosting = sorted((m for m in up if endpoint in m.models or endpoint in m.wanted), key=lambda m: (load[m.id], replica_order(m.id)))
        if n <= len(hosting):
            return hosting[:n]  # the least loaded stay
        chosen = list(hosting)
        others = [m for m in up if m not in chosen]
        while len(chosen) < n and others:
            copies_in = {z: sum(1 for c in chosen if c.zone == z) for z in {m.zone for m in others}}
            pick = min(others, key=lambda m: (copies_in[m.zone], load[m.id], replica_order(m.id)))
            chosen.append(pick)
            others.remove(pick)
        return chosen

    async def _versions(self, endpoint: str) -> list[int]:
        """The endpoint's placed versions, else those its Tritons have ready, else those it was last placed with."""
        placements = [p for p in await asyncio.to_thread(self.store.all) if p.model == endpoint]
        live = {p.version for p in placements if p.removed_at is None}
        if live:
            return sorted(live)
        index = await self.set.repository_index()
        ready = {int(e.version) for e in index if e.name == endpoint and e.state == "READY" and e.version.isdigit()}
        if ready:
            return sorted(ready)
        removed = [p for p in placements if p.removed_at is not None]
        last = max((p.removed_at for p in removed), default=None)
        return sorted({p.version for p in removed if p.removed_at == last})

    def describe(self) -> dict:
        return {
            "executor": "remote",
            "tritons": [{"id": m.id, "target": m.target, "zone": m.zone, "state": m.state, "models": sorted(m.models)} for m in self._pool()],
            "copies": dict(sorted(self.copies.items())),
            "hosts": {e: sorted(t) for e, t in sorted(self.hosts.items())},
            "capped": dict(sorted(self.capped.items())),  # asked for more replicas than Tritons are up
        }
