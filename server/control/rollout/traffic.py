"""The traffic controller: canary analysis and automatic rollback, blue-green, A/B, shadow.

It owns the router's splits and shadows (``DataPlane.traffic``, a :class:`server.dataplane.routing.Router`)
and moves versions through the deployer:

* **Stage** a version beside the live one: materialized, loaded into the endpoint's Triton model
  (``version_policy specific`` lists both) and warmed with its validation rows, under the
  deployer's per-endpoint lock. No traffic moves. The deployer's grace-period expiry is held
  while a policy needs the extra version.
* **Canary:** stage, then split ``stable``/``canary`` by percent. Every ``tick_s`` the analysis
  compares the arms' sliding windows (``server.dataplane.traffic_policy.canary_verdict``): a breach rolls
  back at once (the split is dropped: one assignment) with an audit record carrying the figures
  that triggered it; a step that passed for ``interval_s`` advances; after the last step the
  canary is promoted through ``Deployer.deploy`` (already loaded: only the route moves, the old
  version stays warm for the grace period).
* **Blue-green:** stage green; ``switch`` checks it is ready and answers its validation rows,
  then ``Deployer.deploy`` moves all traffic in one assignment.
* **A/B:** arms with weights, sticky on a caller key; outcomes arrive through :meth:`feedback`
  keyed by request id; :meth:`ab_report` runs the significance tests (``server.control.rollout.stats_tests``).
* **Shadow:** stage, then copy a share of the endpoint's requests to it asynchronously; answers
  are compared with the primary's and never returned. The shadow is in the desired state, so every
  frontend worker copies its share; :meth:`shadow_report` sums their comparisons
  (``server.control.rollout.shadow_reports``).

Policies persist in the registry database (``traffic_policies``, migration 0004); active ones are
installed again when the frontend starts. Every change is an audit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import JSON, Column, Engine, Float, Integer, MetaData, String, Table, insert, select, update

from server.control.rollout.arm_reports import after_reports
from server.errors import Conflict, InferplaneError, InvalidRequest, ModelNotFound
from server.control.rollout.shadow_reports import ShadowPeers, summed
from server.control.rollout.stats_tests import compare_outcomes, two_proportion_z
from server.dataplane.traffic_policy import (
    ADVANCE,
    PROMOTE,
    ROLLBACK,
    Arm,
    CanaryPlan,
    CanaryThresholds,
    Verdict,
    canary_action,
    canary_arms,
    canary_verdict,
    percentile,
)
from server.dataplane.routing import Shadow, Split

log = logging.getLogger(__name__)

SPLIT, SHADOW = "split", "shadow"
CONTROLLER = "traffic-controller"  # the audit actor of automatic decisions

metadata = MetaData()
policies_table = Table(
    "traffic_policies",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("endpoint", String(200), nullable=False, index=True),
    Column("slot", String(16), nullable=False),  # split | shadow
    Column("kind", String(16), nullable=False),  # canary | bluegreen | ab | shadow
    Column("spec", JSON, nullable=False),
    Column("state", JSON, nullable=False),
    Column("status", String(16), nullable=False),  # active | promoted | rolled_back | switched | ended | replaced
    Column("actor", String(200), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)


class TrafficStore:
    """The policies table (synchronous; the controller calls it off the event loop)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def insert(self, endpoint: str, slot: str, kind: str, spec: dict, state: dict, actor: str) -> int:
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(
                update(policies_table)
                .where(policies_table.c.endpoint == endpoint, policies_table.c.slot == slot, policies_table.c.status == "active")
                .values(status="replaced", updated_at=now)
            )
            result = conn.execute(
                insert(policies_table).values(
                    endpoint=endpoint, slot=slot, kind=kind, spec=spec, state=state, status="active",
                    actor=actor or "unknown", created_at=now, updated_at=now,
                )  # fmt: skip
            )
            return int(result.inserted_primary_key[0])

    def update(self, policy_id: int, *, state: dict | None = None, status: str | None = None) -> None:
        values: dict[str, Any] = {"updated_at": time.time()}
        if state is not None:
            values["state"] = state
        if status is not None:
            values["status"] = status
        with self.engine.begin() as conn:
            conn.execute(update(policies_table).where(policies_table.c.id == policy_id).values(**values))

    def active(self) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(policies_table).where(policies_table.c.status == "active").order_by(policies_table.c.id))
            return [dict(r._mapping) for r in rows]

    def history(self, endpoint: str, limit: int = 20) -> list[dict]:
        with self.engine.connect() as conn:
            query = select(policies_table).where(policies_table.c.endpoint == endpoint).order_by(policies_table.c.id.desc()).limit(limit)
            return [dict(r._mapping) for r in conn.execute(query)]


@dataclass
class Policy:
    id: int
    endpoint: str
    slot: str
    kind: str
    spec: dict
    state: dict = field(default_factory=dict)
    status: str = "active"
    step_started: float = 0.0  # clock() when the canary's current step began (not persisted)


def _invalid(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        raise InvalidRequest(str(err)) from None


class TrafficController:
    def __init__(self, dataplane, registry, deployer, *, tick_s: float = 0.5, shadow_workers: int = 2, clock=time.monotonic, shadow_records=None):
        self.dp = dataplane
        self.shadow_records = shadow_records  # server.control.rollout.shadow_records.ShadowRecords: disagreements kept
        self.router = dataplane.router
        self.registry = registry
        self.deployer = deployer
        self.store = TrafficStore(registry.engine)
        self.shadow_peers = ShadowPeers(registry.engine)  # every serving process's shadow comparisons
        # server.control.rollout.arm_reports.ArmCollector (the control plane's): a feedback waits on its reads for the
        # id of a request another process answered; None: only this process's requests are known
        self.arm_reports = None
        self.tick_s = tick_s
        self.shadow_workers = shadow_workers
        self.clock = clock
        self.policies: dict[tuple[str, str], Policy] = {}
        self.verdicts: dict[str, Verdict] = {}
        self.ended: dict[str, tuple[Policy, Split]] = {}  # the last split of each endpoint (reports after the end)
        self.ended_shadows: dict[str, Shadow] = {}
        self.last: dict[str, Policy] = {}  # the last ended split policy of each endpoint (status)
        self._locks: dict[str, asyncio.Lock] = {}
        self._task: asyncio.Task | None = None

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Install the active policies again (their versions must still be loaded), start the analysis."""
        for row in await asyncio.to_thread(self.store.active):
            policy = Policy(row["id"], row["endpoint"], row["slot"], row["kind"], dict(row["spec"]), dict(row["state"]))
            try:
                self._install(policy)
            except InferplaneError as err:
                log.error("traffic policy %s of %s not restored: %s", policy.kind, policy.endpoint, err.message)
                await asyncio.to_thread(self.store.update, policy.id, status="ended")
        self._task = asyncio.get_running_loop().create_task(self._analysis_loop(), name="traffic-analysis")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for shadow in list(self.router.shadows.values()):
            await shadow.stop()

    def _install(self, policy: Policy) -> None:
        name, spec = policy.endpoint, policy.spec
        ready = self.dp.ready_versions(name)
        needed = [v for v in _versions_of(policy) if v not in ready]
        if needed:
            raise Conflict(f"versions {needed} of '{name}' are not loaded")
        if policy.kind == "canary":
            if self.dp.live_version(name) != spec["stable"]:
                raise Conflict(f"'{name}' no longer routes to the canary's stable version {spec['stable']}")
            plan = CanaryPlan(tuple(spec["steps"]), spec["interval_s"])
            step = int(policy.state.get("step", 0))
            self.router.splits[name] = Split(
                "canary", canary_arms(spec["stable"], spec["canary"], plan.steps[step]), spec.get("key_header", ""),
                f"canary:{name}:{spec['canary']}", spec["window_s"], self.router.clock,
            )  # fmt: skip
            policy.step_started = self.clock()
        elif policy.kind == "ab":
            arms = [Arm(a["name"], a["version"], a["weight"]) for a in spec["arms"]]
            self.router.splits[name] = Split("ab", arms, spec.get("key_header", ""), spec.get("experiment") or name, 60.0, self.router.clock)
        elif policy.kind == SHADOW:
            record = self.shadow_records.recorder(name, spec["version"]) if self.shadow_records is not None else None
            shadow = Shadow(spec["version"], spec["percent"], record=record, key=f"shadow:{name}:{policy.id}")
            shadow.start(self.dp.backend_infer, self.shadow_workers)
            self.router.shadows[name] = shadow
        self.policies[(name, policy.slot)] = policy
        self.deployer.hold(name)

    def _settle(self, name: str) -> None:
        """No policy of ``name`` needs extra versions any more: the deployer's grace period unloads them."""
        if any(ep == name for ep, _ in self.policies):
            self.deployer.hold(name)
        elif self.dp.live_version(name):
            self.deployer.schedule_expiry(name)

    # ---- bookkeeping --------------------------------------------------------------------

    async def _audit(self, actor: str, action: str, target: str, outcome: str, detail: str) -> None:
        try:
            await asyncio.to_thread(self.registry.audit, actor, action, target, outcome, detail)
        except Exception as err:  # the audit table is away: keep the record in the log
            log.warning("audit %s %s %s failed: %s (%s)", action, target, outcome, err, detail)

    async def _new_policy(self, name: str, slot: str, kind: str, spec: dict, state: dict, actor: str) -> Policy:
        policy_id = await asyncio.to_thread(self.store.insert, name, slot, kind, spec, state, actor)
        return Policy(policy_id, name, slot, kind, spec, state)

    async def _finish(self, policy: Policy, status: str) -> None:
        policy.status = status
        self.policies.pop((policy.endpoint, policy.slot), None)
        if policy.slot == SPLIT:
            self.last[policy.endpoint] = policy
        await asyncio.to_thread(self.store.update, policy.id, state=policy.state, status=status)

    def _split_policy(self, name: str, kinds: tuple[str, ...] | None = None) -> Policy:
        policy = self.policies.get((name, SPLIT))
        if policy is None or (kinds and policy.kind not in kinds):
            what = " or ".join(kinds) if kinds else "traffic split"
            raise Conflict(f"endpoint '{name}' has no {what} running")
        return policy

    def _no_split(self, name: str) -> None:
        policy = self.policies.get((name, SPLIT))
        if policy is not None:
            raise Conflict(f"endpoint '{name}' already has a {policy.kind} running; promote or roll it back first")

    def _live(self, name: str) -> str:
        live = self.dp.live_version(name)
        if not live:
            raise Conflict(f"endpoint '{name}' has no live version on this frontend; deploy one first")
        return live

    # ---- canary -------------------------------------------------------------------------

    async def set_canary(
        self,
        name: str,
        version: int,
        percent: float = 0.0,
        steps: list[float] | None = None,
        interval_s: float = 60.0,
        window_s: float = 60.0,
        thresholds: dict | None = None,
        key_header: str = "",
        actor: str = "",
    ) -> Policy:
        steps = [float(s) for s in (steps or [])]
        if percent and (not steps or percent < steps[0]):
            steps = [float(percent), *steps]
        plan = _invalid(CanaryPlan, tuple(steps), float(interval_s or 60.0))
        limits = _invalid(CanaryThresholds, **(thresholds or {}))
        if not (window_s or 60.0) > 0:
            raise InvalidRequest("window_s must be > 0")
        async with self._lock(name):
            self._no_split(name)
            if str(version) == self._live(name):
                raise Conflict(f"{name}:{version} is already live")
            stable = await self.deployer.stage(name, version)
            spec = {
                "stable": stable, "canary": str(version), "steps": list(plan.steps), "interval_s": plan.interval_s,
                "window_s": float(window_s or 60.0), "thresholds": asdict(limits), "key_header": key_header,
            }  # fmt: skip
            policy = await self._new_policy(name, SPLIT, "canary", spec, {"step": 0}, actor)
            self._install(policy)
        await self._audit(actor, "canary.start", f"{name}:{version}", "ok", f"stable={stable} steps={list(plan.steps)} interval_s={plan.interval_s:g} thresholds={asdict(limits)}")
        return policy

    async def _analysis_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.analyze()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad tick must not stop the analysis
                log.exception("traffic analysis failed")

    async def analyze(self) -> None:
        """One analysis tick over every running canary."""
        for (name, slot), policy in list(self.policies.items()):
            if slot != SPLIT or policy.kind != "canary" or self._lock(name).locked():
                continue
            async with self._lock(name):
                if self.policies.get((name, slot)) is policy:
                    await self._analyze_canary(policy)

    async def _analyze_canary(self, policy: Policy) -> None:
        name, spec = policy.endpoint, policy.spec
        split = self.router.splits.get(name)
        if split is None or split.kind != "canary":
            await self._finish(policy, "ended")
            return
        if self.dp.live_version(name) != spec["stable"]:  # someone deployed or rolled back meanwhile
            self.router.splits.pop(name, None)
            await self._finish(policy, "ended")
            await self._audit(CONTROLLER, "canary.end", f"{name}:{spec['canary']}", "superseded", f"the endpoint now routes to {self.dp.live_version(name)}")
            self._settle(name)
            return
        limits = CanaryThresholds(**spec["thresholds"])
        verdict = canary_verdict(split.window("canary"), split.window("stable"), limits)
        self.verdicts[name] = verdict
        plan = CanaryPlan(tuple(spec["steps"]), spec["interval_s"])
        step = int(policy.state.get("step", 0))
        action = canary_action(plan, step, policy.step_started, self.clock(), verdict)
        if action == ROLLBACK:
            await self._end_split(policy, "rolled_back", CONTROLLER, verdict)
        elif action == ADVANCE:
            step += 1
            percent = plan.steps[step]
            self.router.splits[name] = split.reweighted({"stable": 100.0 - percent, "canary": percent})
            policy.state["step"] = step
            policy.step_started = self.clock()
            await asyncio.to_thread(self.store.update, policy.id, state=policy.state)
            await self._audit(CONTROLLER, "canary.step", f"{name}:{spec['canary']}", "ok", f"now {percent:g}%; {verdict.describe()}")
        elif action == PROMOTE:
            await self._promote(policy, CONTROLLER, verdict)

    async def promote(self, name: str, actor: str = "") -> Policy:
        async with self._lock(name):
            policy = self._split_policy(name, ("canary", "bluegreen"))
            await self._promote(policy, actor, self.verdicts.get(name))
            return policy

    async def _promote(self, policy: Policy, actor: str, verdict: Verdict | None) -> None:
        name, spec = policy.endpoint, policy.spec
        target = spec["canary"] if policy.kind == "canary" else spec["green"]
        split = self.router.splits.get(name)
        if split is not None and policy.kind == "canary":
            self.router.splits[name] = split.reweighted({"stable": 0.0, "canary": 100.0})  # no stable answers while the route moves
        try:
            await self.deployer.deploy(f"{name}:{target}", None, actor=actor or CONTROLLER)
        except InferplaneError as err:
            await self._end_split(policy, "rolled_back", actor, verdict, why=f"promotion failed: {err.reason}: {err.message}")
            raise
        self._retire_split(name)
        await self._finish(policy, "promoted" if policy.kind == "canary" else "switched")
        detail = verdict.describe() if verdict is not None else "manual"
        await self._audit(actor or CONTROLLER, f"{policy.kind}.promote", f"{name}:{target}", "ok", detail)
        self._settle(name)

    def _retire_split(self, name: str) -> None:
        split = self.router.splits.pop(name, None)
        policy = self.policies.get((name, SPLIT))
        if split is not None and policy is not None:
            self.ended[name] = (policy, split)

    async def rollback(self, name: str, actor: str = "") -> Policy:
        """End the endpoint's split at once: every request back to the live version."""
        async with self._lock(name):
            policy = self._split_policy(name)
            await self._end_split(policy, "rolled_back" if policy.kind == "canary" else "ended", actor, self.verdicts.get(name), why="manual")
            return policy

    async def _end_split(self, policy: Policy, status: str, actor: str, verdict: Verdict | None, why: str = "") -> None:
        name, spec = policy.endpoint, policy.spec
        self._retire_split(name)  # the switch back: one assignment
        await self._finish(policy, status)
        target = spec.get("canary") or spec.get("green") or spec.get("experiment") or name
        detail = "; ".join(x for x in (why, verdict.describe() if verdict is not None else "") if x)
        outcome = "rolled_back" if status == "rolled_back" else "ok"
        await self._audit(actor or CONTROLLER, f"{policy.kind}.rollback" if policy.kind != "ab" else "ab.end", f"{name}:{target}", outcome, detail)
        if status == "rolled_back" and actor == CONTROLLER:
            log.warning("canary %s:%s rolled back automatically: %s", name, target, detail)
        self._settle(name)

    # ---- blue-green ---------------------------------------------------------------------

    async def set_bluegreen(self, name: str, version: int, actor: str = "") -> Policy:
        async with self._lock(name):
            self._no_split(name)
            if str(version) == self._live(name):
                raise Conflict(f"{name}:{version} is already live")
            blue = await self.deployer.stage(name, version)
            policy = await self._new_policy(name, SPLIT, "bluegreen", {"blue": blue, "green": str(version)}, {"staged": True}, actor)
            self._install(policy)
        await self._audit(actor, "bluegreen.stage", f"{name}:{version}", "ok", f"blue={blue}; green loaded and warm, no traffic")
        return policy

    async def switch(self, name: str, actor: str = "") -> Policy:
        async with self._lock(name):
            policy = self._split_policy(name, ("bluegreen",))
            green = policy.spec["green"]
            with contextlib.suppress(InferplaneError):
                await self.dp.refresh(name)  # Triton's word on readiness
            if green not in self.dp.ready_versions(name):
                raise Conflict(f"green {name}:{green} is not ready; blue keeps serving")
            # Deployer.deploy checks it once more (warm-up rows against the validation set), then switches
            await self._promote(policy, actor, None)
            return policy

    # ---- A/B ----------------------------------------------------------------------------

    async def set_experiment(self, name: str, arms: list[tuple[str, int, float]], key_header: str = "", experiment: str = "", actor: str = "") -> Policy:
        if len(arms) < 2:
            raise InvalidRequest("an experiment needs two or more arms")
        built = [Arm(arm_name, str(version), float(weight)) for arm_name, version, weight in arms]
        _invalid(lambda: Split("ab", built))
        async with self._lock(name):
            self._no_split(name)
            live = self._live(name)
            for version in sorted({a.version for a in built if a.version != live}):
                await self.deployer.stage(name, int(version))
            spec = {"experiment": experiment or name, "arms": [asdict(a) for a in built], "key_header": key_header}
            policy = await self._new_policy(name, SPLIT, "ab", spec, {}, actor)
            self._install(policy)
        arms_text = ", ".join(f"{a.name}={name}:{a.version}@{a.weight:g}" for a in built)
        await self._audit(actor, "ab.start", f"{name}:{experiment or name}", "ok", f"{arms_text}; key header {key_header or '-'}")
        return policy

    async def feedback(self, name: str, request_id: str, value: float) -> str:
        """The outcome of one request, returning its arm. The request may have been answered by another serving
        process, whose report brings its id here up to a report interval after the answer: waited for (bounded)."""
        if not request_id:
            raise InvalidRequest("feedback needs the request id")
        return await after_reports(lambda: self.router.feedback(name, request_id, value), self.arm_reports)

    def _report_split(self, name: str) -> tuple[Policy, Split]:
        policy = self.policies.get((name, SPLIT))
        split = self.router.splits.get(name)
        if policy is not None and split is not None:
            return policy, split
        if name in self.ended:
            return self.ended[name]
        raise ModelNotFound(f"endpoint '{name}' has no experiment to report on")

    def ab_report(self, name: str, alpha: float = 0.05) -> dict[str, Any]:
        if not (0 < alpha < 1):
            raise InvalidRequest(f"alpha must be in (0, 1), got {alpha}")
        policy, split = self._report_split(name)
        arms = []
        for arm in split.arms:
            t = split.totals[arm.name]
            arms.append({
                "name": arm.name, "version": arm.version, "weight": arm.weight, "requests": t.requests, "errors": t.errors,
                "error_rate": t.errors / t.requests if t.requests else 0.0,
                "latency_mean_ms": t.latency_sum_s / t.requests * 1000.0 if t.requests else 0.0,
                "latency_p50_ms": percentile(t.latencies, 50.0) * 1000.0, "latency_p99_ms": percentile(t.latencies, 99.0) * 1000.0,
                "outcomes": len(t.outcomes), "outcome_mean": sum(t.outcomes) / len(t.outcomes) if t.outcomes else 0.0,
            })  # fmt: skip
        comparisons = []
        control = split.arms[0]
        c = split.totals[control.name]
        for arm in split.arms[1:]:
            t = split.totals[arm.name]
            if c.outcomes and t.outcomes:
                for result in compare_outcomes(c.outcomes, t.outcomes, alpha):
                    comparisons.append({"arm": arm.name, "control": control.name, "metric": "outcome", **result.as_dict()})
            if c.requests and t.requests:
                result = two_proportion_z(c.errors, c.requests, t.errors, t.requests, alpha)
                comparisons.append({"arm": arm.name, "control": control.name, "metric": "error_rate", **result.as_dict()})
        return {"name": name, "experiment": policy.spec.get("experiment", policy.kind), "arms": arms, "comparisons": comparisons}

    # ---- shadow -------------------------------------------------------------------------

    async def set_shadow(self, name: str, version: int, percent: float, actor: str = "") -> Policy | None:
        if percent == 0:
            await self.stop_shadow(name, actor)
            return None
        if not (0 < percent <= 100):
            raise InvalidRequest(f"shadow percent must be in (0, 100], got {percent}")
        async with self._lock(name):
            await self.deployer.stage(name, version)
            old = self.router.shadows.pop(name, None)
            if old is not None:
                await old.stop()
            old_policy = self.policies.pop((name, SHADOW), None)
            if old_policy is not None:
                old_policy.status = "replaced"
            policy = await self._new_policy(name, SHADOW, SHADOW, {"version": str(version), "percent": float(percent)}, {}, actor)
            self._install(policy)
        await self._audit(actor, "shadow.start", f"{name}:{version}", "ok", f"{percent:g}% of requests copied")
        return policy

    async def stop_shadow(self, name: str, actor: str = "") -> None:
        async with self._lock(name):
            policy = self.policies.get((name, SHADOW))
            if policy is None:
                raise Conflict(f"endpoint '{name}' has no shadow")
            shadow = self.router.shadows.pop(name, None)
            if shadow is not None:
                await shadow.stop()
                policy.state = {"report": shadow.stats.as_dict()}
                self.ended_shadows[name] = shadow
            await self._finish(policy, "ended")
            await self._audit(actor, "shadow.stop", f"{name}:{policy.spec['version']}", "ok", str(policy.state.get("report", "")))
            self._settle(name)

    async def shadow_report(self, name: str) -> dict[str, Any]:
        """The shadow's comparisons on this process and on every frontend worker that reported them."""
        shadow = self.router.shadows.get(name)
        if shadow is None:
            shadow = self.ended_shadows.get(name)
            if shadow is None:
                raise ModelNotFound(f"endpoint '{name}' has no shadow")
        reported = await asyncio.to_thread(self.shadow_peers.reported, name, shadow.key) if shadow.key else []
        return {"name": name, "version": shadow.version, "percent": shadow.percent, **summed(shadow.stats, reported).as_dict()}

    # ---- status -------------------------------------------------------------------------

    def get_policy(self, name: str) -> dict[str, Any]:
        policy = self.policies.get((name, SPLIT))
        split = self.router.splits.get(name)
        shadow = self.router.shadows.get(name)
        out: dict[str, Any] = {"name": name, "live": self.dp.live_version(name) or "", "kind": "none", "status": "", "arms": []}
        if policy is None:
            policy = self.last.get(name)
        if policy is not None:
            out["kind"], out["status"] = policy.kind, policy.status
            out["key_header"] = policy.spec.get("key_header", "")
            if policy.kind == "canary":
                out["step"] = int(policy.state.get("step", 0))
                out["steps"] = list(policy.spec["steps"])
                out["interval_s"] = float(policy.spec["interval_s"])
            if policy.kind == "bluegreen":
                out["green"] = policy.spec["green"]
        if split is not None:
            for arm in split.arms:
                w = split.window(arm.name)
                out["arms"].append({"name": arm.name, "version": arm.version, "weight": arm.weight,
                                    "window_requests": w.requests, "window_errors": w.errors, "window_p99_ms": w.p99_s * 1000.0})  # fmt: skip
        if name in self.verdicts:
            out["verdict"] = self.verdicts[name].describe()
        if shadow is not None:
            out["shadow_version"], out["shadow_percent"] = shadow.version, shadow.percent
        return out


def _versions_of(policy: Policy) -> list[str]:
    spec = policy.spec
    if policy.kind == "canary":
        return [spec["stable"], spec["canary"]]
    if policy.kind == "bluegreen":
        return [spec["blue"], spec["green"]]
    if policy.kind == "ab":
        return sorted({a["version"] for a in spec["arms"]})
    return [spec["version"]]
