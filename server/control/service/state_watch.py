"""Desired state moving between processes (issue 27): the leader publishes, every serving process applies.

``StatePublisher`` runs beside the leader's writers: it reads the leader's router (live versions,
splits and shadows, which the deployer and the traffic controller switch) every ``interval_s`` and writes what
changed to ``desired_state`` (server.control.service.desired_state) — level-triggered, so a switch made by any
writer is published without a hook in each of them.

``StateWatcher`` runs in every process that serves requests without leading (each worker of
``--workers N``, each frontend of a cluster): it applies the rows newer than the last generation it
applied to its own pipeline — the model's ready versions read again from Triton when a new one is
named, then the live version, then the split, then the shadow (this process copies its share of the
requests to the shadow version; its comparisons reach the leader's shadow report through
server.control.rollout.shadow_reports). It wakes on ``NOTIFY`` (PostgreSQL; a reconcile every
``reconcile_s`` is the safety net for a lost connection) or when SQLite's ``PRAGMA data_version``
moves (another connection committed). A row naming a version this process's Triton does not have
ready yet stays pending and is tried again at each wake-up; nothing older is ever applied over it.
A row with ``wake_budget_s`` (the leader scaled the endpoint to zero) takes the model out of this
process's table, Triton untouched, behind a ``Waker``: a request for it is held, ``on_held`` reports
the demand to the leader at once, and the held requests go on when a later row (the leader loaded it
again) brings the model back — or get MODEL_NOT_READY past the budget. ``on_held`` also reports at once
that such a row is applied (``applied_generation``): the leader unloads the endpoint only then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable, Mapping

import psycopg
from sqlalchemy.engine import make_url

from server.control.rollout.arm_reports import ArmReporter
from server.control.rollout.shadow_reports import ShadowReporter
from server.control.scaling.autoscaler import Waker
from server.control.scaling.signal_reports import SignalReporter
from server.control.service.desired_state import CHANNEL, DesiredStateStore, changes, route_snapshot
from server.control.service.leader import holder_id
from server.dataplane.routing import Shadow, Split
from server.dataplane.traffic_policy import Arm
from server.db import libpq_url
from server.errors import InferplaneError

log = logging.getLogger(__name__)

SHADOW_WORKERS = 2  # concurrent shadow copies per shadow in a process (the traffic controller's default)


class StatePublisher:
    def __init__(self, router, store: DesiredStateStore, interval_s: float = 0.02, asleep: Callable[[], Mapping[str, float]] | None = None):
        self.router = router
        self.store = store
        self.asleep = asleep  # endpoints scaled to zero -> their cold-start budget (the leader's wakers)
        self.interval_s = interval_s
        self._published: dict[str, dict] = {}
        self._seen: set[str] = set()  # endpoints this leader's router held: only those may be published as gone

    async def publish_once(self) -> int:
        now = route_snapshot(self.router, self.asleep() if self.asleep is not None else None)
        self._seen |= set(now)
        mine = {name: state for name, state in self._published.items() if name in self._seen or name in now}
        todo = changes(mine, now)
        if not todo:
            return 0
        await asyncio.to_thread(self.store.publish, todo)
        self._published.update(todo)
        return len(todo)

    async def run(self) -> None:
        self._published = await asyncio.to_thread(self.store.all)
        while True:
            try:
                await self.publish_once()
            except Exception as err:  # the database is away: the next pass publishes the same difference
                log.warning("publishing the desired state failed: %s", err)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.interval_s)


class StateWatcher:
    def __init__(self, dataplane, store: DesiredStateStore, database_url: str, *, poll_s: float = 0.02, reconcile_s: float = 1.0,
                 wakers: dict | None = None, on_held: Callable[[], None] = lambda: None, shadow_records=None):  # fmt: skip
        self.dp = dataplane
        self.shadow_records = shadow_records  # server.control.rollout.shadow_records.ShadowRecords: this process's disagreements kept
        self.wakers = wakers if wakers is not None else {}  # the model table's (FleetHooks.wakers)
        self.on_held = on_held
        self.held: set[str] = set()  # endpoints asleep behind a waker of this watcher
        self.wanted: set[str] = set()  # endpoints a request here asked to wake (demand until the leader has loaded them)
        self.store = store
        self.database_url = database_url
        self.poll_s = poll_s
        self.reconcile_s = reconcile_s
        self.generation = 0  # the newest row read
        self.applied_generation = 0  # every row up to this one applied (reported to the leader: signal_reports)
        self.pending: dict[str, dict] = {}  # endpoint -> the newest row not applicable yet
        self.applied = asyncio.Event()  # set after each pass (tests and benchmarks wait on it)

    async def sync(self) -> int:
        """Apply what is newer than the last applied generation; returns how many rows were applied."""
        rows = await asyncio.to_thread(self.store.since, self.generation)
        for row in rows:
            self.pending[row["endpoint"]] = row
            self.generation = max(self.generation, row["generation"])
        done, slept = 0, False
        for name, row in list(self.pending.items()):
            if await self._apply(row):
                self.pending.pop(name, None)
                done += 1
                slept = slept or row.get("wake_budget_s") is not None
        waiting = [row["generation"] for row in self.pending.values()]
        self.applied_generation = min(waiting) - 1 if waiting else self.generation
        if slept:  # the leader waits for every process to hold the endpoint's requests before it unloads it
            self.on_held()
        self.applied.set()
        return done

    async def _apply(self, row: dict) -> bool:
        name, live, split = row["endpoint"], row["live"], row["split"]
        if row.get("wake_budget_s") is not None:
            self._sleep(name, float(row["wake_budget_s"]))
        elif name in self.held and not self.dp.is_loaded(name):  # awake again: back into the table before the routes
            try:
                await self.dp.adopt(name)
            except InferplaneError as err:
                log.info("endpoint %s: generation %d waits for Triton to serve it again (%s)", name, row["generation"], err.message)
                return False
        shadow = row.get("shadow")
        needed = {v for v in ([live] if live else []) + [a[1] for a in (split or {}).get("arms", [])] + ([shadow["version"]] if shadow else [])}
        if row.get("wake_budget_s") is None and needed - self.dp.ready_versions(name):
            try:
                await (self.dp.refresh(name) if self.dp.is_loaded(name) else self.dp.adopt(name))
            except InferplaneError as err:
                log.info("endpoint %s: generation %d waits for Triton (%s)", name, row["generation"], err.message)
                return False
            if needed - self.dp.ready_versions(name):
                return False
        router = self.dp.router
        if live:
            self.dp.set_live(name, live)
        else:
            router.routes.pop(name, None)
        if split is None:
            router.splits.pop(name, None)
        else:
            router.splits[name] = _split(router, split, router.splits.get(name))
        await self._shadow(name, shadow)
        if row.get("wake_budget_s") is None and name in self.held:
            self.held.discard(name)
            self.wakers.pop(name, None)
            log.info("endpoint %s serves again (generation %d)", name, row["generation"])
        return True

    async def _shadow(self, name: str, state: dict | None) -> None:
        """The row's shadow in this process's router: the same shadow (its key) keeps its counts, another one
        starts from none, none stops the copies."""
        router = self.dp.router
        current = router.shadows.get(name)
        if current is not None and state is not None and current.key == state["key"] and current.version == state["version"]:
            current.percent = float(state["percent"])
            return
        if current is not None:
            await router.shadows.pop(name).stop()
        if state is not None:
            version = str(state["version"])
            record = self.shadow_records.recorder(name, version) if self.shadow_records is not None else None
            shadow = Shadow(version, float(state["percent"]), key=str(state["key"]), record=record)
            shadow.start(self.dp.backend_infer, SHADOW_WORKERS)
            router.shadows[name] = shadow

    async def stop_shadows(self) -> None:
        """The copies this watcher started, stopped (the process leads now, or stops)."""
        for name in list(self.dp.router.shadows):
            await self.dp.router.shadows.pop(name).stop()

    def _sleep(self, name: str, budget_s: float) -> None:
        """The leader scaled ``name`` to zero: requests for it are held here from now."""
        if name in self.wakers and name not in self.held:
            return  # this process's own waker (a model group's): it knows when its model is served
        waker = self.wakers.get(name)
        if waker is None:
            self.wakers[name] = Waker(name, lambda: self._until_served(name), budget_s)
            self.held.add(name)
            log.info("endpoint %s is scaled to zero: its requests are held here until the leader has loaded it", name)
        else:
            waker.budget_s = budget_s
        self.dp.release(name)

    async def _until_served(self, name: str) -> None:
        """A held request's load: ask the leader (by reporting the demand now), wait for the model back in the table."""
        self.wanted.add(name)  # demand even after the request that asked gave up (past its budget, cancelled)
        self.on_held()
        try:
            while self.dp.signature(name) is None:
                await asyncio.sleep(self.poll_s)
        finally:
            self.wanted.discard(name)

    async def run(self) -> None:
        postgres = self.store.postgres
        while True:
            try:
                await self.sync()
                await (self._listen() if postgres else self._poll())
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the database is away: reconcile again shortly
                log.warning("watching the desired state failed: %s", err)
                await asyncio.sleep(self.reconcile_s)

    async def _listen(self) -> None:
        async with await psycopg.AsyncConnection.connect(libpq_url(self.database_url), autocommit=True) as conn:
            await conn.execute(f"LISTEN {CHANNEL}")
            await self.sync()  # what was published before the LISTEN took effect
            while True:
                async for _note in conn.notifies(timeout=self.reconcile_s, stop_after=1):
                    break
                await self.sync()  # a notification, or the periodic reconcile

    async def _poll(self) -> None:
        path = make_url(self.database_url).database
        conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
        try:
            last = conn.execute("PRAGMA data_version").fetchone()[0]
            quiet = 0.0
            while True:
                await asyncio.sleep(self.poll_s)
                quiet += self.poll_s
                version = conn.execute("PRAGMA data_version").fetchone()[0]
                if version != last or self.pending or quiet >= self.reconcile_s:
                    last, quiet = version, 0.0
                    await self.sync()
        finally:
            conn.close()


def _split(router, state: dict, current: Split | None) -> Split:
    """The Split a row describes; the same arms with new weights keep their measured windows."""
    arms = [Arm(str(n), str(v), float(w)) for n, v, w in state["arms"]]
    if current is not None and current.kind == state["kind"] and [(a.name, a.version) for a in current.arms] == [(a.name, a.version) for a in arms]:
        return current if current.arms == arms else current.reweighted({a.name: a.weight for a in arms})
    return Split(state["kind"], arms, state.get("key_header", ""), state.get("salt", ""), float(state.get("window_s", 60.0)), router.clock)


async def follow(dataplane, engine, settings, *, sampler=None, wakers: dict | None = None, reporter: str | None = None, shadow_records=None) -> None:
    """What a serving process that does not lead runs: the desired state applied, its arms' outcomes, shadow
    comparisons and load signals (``sampler``: server.control.scaling.signals.SignalSampler) reported; ``wakers``: the
    model table's; ``shadow_records``: where its shadow copies' disagreements are kept."""
    reporter = holder_id() if reporter is None else reporter
    watcher = StateWatcher(dataplane, DesiredStateStore(engine), settings.database_url, poll_s=settings.desired_state_poll_s,
                           reconcile_s=settings.desired_state_reconcile_s, wakers=wakers, shadow_records=shadow_records)  # fmt: skip
    loads = SignalReporter(sampler, engine, reporter, wanted=watcher.wanted, applied=lambda: watcher.applied_generation) if sampler is not None else None
    if loads is not None:
        watcher.on_held = loads.nudge
    arms = ArmReporter(dataplane.router, engine, reporter)
    shadows = ShadowReporter(dataplane.router, engine, reporter)
    try:
        await asyncio.gather(watcher.run(), arms.run(), shadows.run(), *((loads.run(),) if loads is not None else ()))
    finally:
        await watcher.stop_shadows()


async def stop_task(task: asyncio.Task | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
