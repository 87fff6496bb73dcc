"""The autoscaler: per endpoint, every ``interval_s``: signals -> forecast -> policy -> executor.

* **Signals** come from :class:`server.control.scaling.signals.SignalSampler` (in flight, queue, QPS,
  tokens/s, Triton queue/compute time per model), summed over every frontend and worker process that
  reports (:mod:`server.control.scaling.signal_reports`): the autoscaler runs in the leader, the traffic
  reaches the others.
* **Forecast**: an hour-of-week profile of the endpoint's request rate
  (:class:`batching.autoscale_policy.SeasonalProfile`, exponentially weighted), seeded from the
  metered history (the tenancy store's usage rows) and fed every tick; the rate predicted for
  ``lead_s`` ahead (the time a new replica takes to be warm, measured) times the current load per
  request/s (Little's law for the in-flight signal) is the policy's ``forecast``.
* **Policy**: :func:`batching.autoscale_policy.decide` (pure: windows, steps, cooldowns, bounds).
* **Executor**: :mod:`server.control.scaling.executors` (local processes / Kubernetes Deployments); one
  action at a time per endpoint, in its own task so a slow load never stalls the others.
* **Scale to zero**: the decision ``zero`` puts a :class:`Waker` in the model table (the pipeline
  holds the next request in its resolve step), unloads the model everywhere (drained first), stops
  replicas left empty and moves the artifacts of registry-deployed versions into the weight cache.
  The first request (or the policy seeing demand) starts the one load every waiting request
  shares: artifacts back from the weight cache (or the store), placement, ``load_model``; a request
  waiting past the endpoint's ``cold_start_budget_s`` gets ``MODEL_NOT_READY`` / 503 with a retry
  hint.
* **Config** (min/max replicas, target, signal, idle time, cold-start budget, windows) is stored
  with the endpoint (``server.control.scaling.scaling_store``: the registry database, audited) and read
  again at start, so it survives a restart. An endpoint configured before it is deployed waits
  ("pending"); its deploy loads the configured number of copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batching.autoscale_policy import HOLD, UP, WAKE, ZERO, Observation, PolicyState, ScalingConfig, SeasonalProfile, decide
from server.errors import DeadlineExceeded, InferplaneError, InvalidRequest, ModelNotFound, ModelNotReady
from server.tenancy.store import UsageRow

log = logging.getLogger(__name__)

DEFAULT_READY_S = 5.0  # a cold start's estimate before one was measured


class Waker:
    """One load for a scaled-to-zero model, however many requests wait for it."""

    def __init__(self, name: str, load: Callable[[], Awaitable[None]], budget_s: float, clock: Callable[[], float] = time.monotonic, estimate_s: float = DEFAULT_READY_S):
        self.name = name
        self._load = load
        self.budget_s = budget_s
        self._clock = clock
        self.estimate_s = estimate_s
        self.task: asyncio.Task | None = None
        self.waiting = 0
        self.loads = 0
        self.started_at: float | None = None

    def start(self) -> asyncio.Task:
        if self.task is None:
            self.loads += 1
            self.started_at = self._clock()
            self.task = asyncio.get_running_loop().create_task(self._load(), name=f"wake-{self.name}")
            self.task.add_done_callback(self._done)
        return self.task

    def _done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            self.task = None  # the next request tries again

    def retry_after_s(self) -> float:
        if self.started_at is None:
            return max(1.0, self.estimate_s)
        return max(1.0, self.estimate_s - (self._clock() - self.started_at))

    async def wait(self, timeout: float | None) -> None:
        task = self.start()
        limit = self.budget_s if timeout is None else min(self.budget_s, timeout)
        self.waiting += 1
        try:
            await asyncio.wait_for(asyncio.shield(task), limit)
        except asyncio.TimeoutError:
            if timeout is not None and timeout < self.budget_s:
                raise DeadlineExceeded(f"model '{self.name}' was still loading from zero replicas when the deadline passed") from None
            raise ModelNotReady(
                f"model '{self.name}' is scaled to zero and did not load within its cold-start budget of {self.budget_s:g}s; retry",
                retry_after_s=self.retry_after_s(),
            ) from None
        except InferplaneError as err:
            raise ModelNotReady(f"model '{self.name}' could not be loaded from zero replicas: {err.message}", retry_after_s=self.retry_after_s()) from None
        finally:
            self.waiting -= 1


class EndpointScaler:
    """One endpoint's config, policy state and what ``explain`` shows."""

    def __init__(self, name: str, config: ScalingConfig, replicas: int, now: float, profile: SeasonalProfile):
        self.name = name
        self.config = config
        self.state = PolicyState.start(replicas, now)
        self.profile = profile
        self.cost: float | None = None  # load per request/s (EWMA)
        self.decisions: deque[dict] = deque(maxlen=200)
        self.signals: deque[dict] = deque(maxlen=600)
        self.forecasts: deque[dict] = deque(maxlen=600)
        self.cold_starts: deque[dict] = deque(maxlen=50)
        self.busy: asyncio.Task | None = None
        self.waker: Waker | None = None
        self.provision_s: float | None = None  # the last scale-up's or wake's duration
        self.pending = False  # configured but not served yet
        self.lock = asyncio.Lock()  # a sleep and a wake never overlap
        self.asleep = False  # at zero replicas (the sleep finished)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("placing a down zone's copies again failed: %s", task.exception())


def _state(ep: EndpointScaler) -> str:
    if ep.pending:
        return "pending"  # configured, not deployed yet
    if ep.waker is None:
        return "serving"
    if ep.waker.task is not None and not ep.waker.task.done():
        return "waking"
    return "asleep" if ep.asleep else "sleeping"  # sleeping: draining and unloading on the way to zero


class Autoscaler:
    def __init__(
        self,
        dataplane,
        hooks,  # server.dataplane.fleet_hooks.FleetHooks
        sampler,  # server.control.scaling.signals.SignalSampler
        executor,  # server.control.scaling.executors.LocalExecutor | KubernetesGroupExecutor
        *,
        store=None,  # server.control.scaling.scaling_store.ScalingStore
        usage_store=None,  # server.tenancy.store.TenancyStore (metered history for the forecast)
        usage_flush_s: float = 5.0,
        weight_cache=None,  # server.control.scaling.weight_cache.WeightCache
        artifact_store=None,
        repository=None,  # Path of the Triton model repository (registry-deployed versions)
        evict_on_zero: bool = True,
        interval_s: float = 1.0,
        profile_period_s: float = 7 * 24 * 3600.0,
        profile_slot_s: float = 3600.0,
        lead_s: float | None = None,
        replicas=None,  # server.dataplane.replicas.ReplicaSet (held requests, wake on a missing model)
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.dp = dataplane
        self.hooks = hooks
        self.sampler = sampler
        self.executor = executor
        self.store = store
        self.usage_store = usage_store
        self.usage_flush_s = usage_flush_s
        self.weight_cache = weight_cache
        self.artifact_store = artifact_store
        self.repository = repository
        self.evict_on_zero = evict_on_zero
        self.interval_s = interval_s
        self.profile_period_s, self.profile_slot_s = profile_period_s, profile_slot_s
        self.lead_s = lead_s
        self.replicas = replicas
        self._clock, self._wall = clock, wall
        self.endpoints: dict[str, EndpointScaler] = {}
        # before a scale to zero unloads: every other serving process holds the endpoint's requests (the control plane's)
        self.announce: Callable[[str], Awaitable[None]] | None = None
        self._task: asyncio.Task | None = None
        self._healing: asyncio.Task | None = None
        if replicas is not None:
            replicas.on_missing = self._on_missing
            replicas.wait_budget = self._wait_budget

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self.store is not None:
            for name, data in (await asyncio.to_thread(self.store.all)).items():
                try:
                    await self.configure(name, data, persist=False)
                except (InferplaneError, ValueError) as err:
                    log.error("endpoint %s: stored autoscaling config not applied: %s", name, err)
        self._task = asyncio.create_task(self._forever(), name="autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._healing is not None:
            self._healing.cancel()
        for ep in self.endpoints.values():
            if ep.busy is not None:
                ep.busy.cancel()

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # one bad round must not stop autoscaling
                log.exception("autoscaler round failed")
            self._heal()

    def _heal(self) -> None:
        """The executor's zone check (``LocalExecutor.heal``: a zone down past its grace has its copies
        placed in the others), in the background: its loads never hold up a round."""
        if self._healing is None or self._healing.done():
            self._healing = asyncio.get_running_loop().create_task(self.executor.heal(), name="heal-zones")
            self._healing.add_done_callback(_log_failure)

    # ---- configuration -----------------------------------------------------------------------

    async def configure(self, name: str, data: dict | ScalingConfig, actor: str = "", *, persist: bool = True) -> dict:
        """Set an endpoint's scaling config (stored, audited) and apply it from the next tick; a
        dict sets the fields it names over the endpoint's current config."""
        ep = self.endpoints.get(name)
        if not isinstance(data, ScalingConfig) and ep is not None:
            data = {**ep.config.as_dict(), **dict(data)}
        try:
            config = data if isinstance(data, ScalingConfig) else ScalingConfig.from_dict(dict(data))
        except (TypeError, ValueError) as err:
            raise InvalidRequest(f"autoscaling config for '{name}': {err}") from None
        if persist and self.store is not None:
            await asyncio.to_thread(self.store.put, name, config.as_dict(), actor)
        if config.unit == "instances" and not hasattr(self.executor, "set_instances"):
            raise InvalidRequest(f"the {self.executor.name} executor scales replicas, not Triton instances (unit 'instances')")
        served = self.dp.signature(name) is not None
        current = (await self._count(name, config, read=True)) if served else 0
        if ep is None:
            ep = self.endpoints[name] = EndpointScaler(name, config, current, self._clock(), self._profile())
            await self._seed(ep)
        else:
            ep.config = config
            ep.state = replace(ep.state, replicas=current if served else ep.state.replicas)
        ep.pending = not served and ep.waker is None
        if ep.pending:  # the deploy that follows loads this many copies
            with contextlib.suppress(InferplaneError):
                await self.executor.prepare(name, max(1, config.floor))
        if ep.waker is not None:
            ep.waker.budget_s = config.cold_start_budget_s
        self._record(ep, {"action": "configure", "reason": f"config set by {actor or 'unknown'}", "config": config.as_dict()})
        return self.status_of(ep)

    def _profile(self) -> SeasonalProfile:
        return SeasonalProfile(self.profile_period_s, self.profile_slot_s)

    async def _seed(self, ep: EndpointScaler) -> None:
        """The forecast's history: the endpoint's metered request rate over the last four periods."""
        if self.usage_store is None:
            return
        try:
            points = await asyncio.to_thread(self._usage_points, ep.name)
        except Exception as err:  # a missing or older tenancy database: no history, no forecast yet
            log.warning("endpoint %s: no metered history for the forecast: %s", ep.name, err)
            return
        ep.profile.seed(points)

    def _usage_points(self, name: str) -> list[tuple[float, float]]:
        since = self._wall() - 4 * self.profile_period_s
        query = (
            select(UsageRow.ts, func.sum(UsageRow.requests)).where(UsageRow.model == name, UsageRow.ts >= since)
            .group_by(UsageRow.ts).order_by(UsageRow.ts)
        )  # fmt: skip
        with Session(self.usage_store.engine) as session:
            return [(float(ts), float(n) / self.usage_flush_s) for ts, n in session.execute(query)]

    # ---- the loop ----------------------------------------------------------------------------

    async def tick(self) -> None:
        samples = await self.sampler.sample()
        now, wall = self._clock(), self._wall()
        for name, ep in list(self.endpoints.items()):
            sample = samples.get(name)
            load = sample.signal(ep.config.signal) if sample is not None else 0.0
            qps = sample.qps if sample is not None else 0.0
            if sample is not None:
                ep.signals.append({**sample.as_dict(), "t": wall})  # the sample's own t is the sampler's monotonic clock
            forecast = self._forecast(ep, wall, load, qps)
            served = self.dp.signature(name) is not None
            if ep.waker is not None and served and (ep.busy is None or ep.busy.done()):
                self._awake(ep)  # loaded behind our back (a deploy): scaling as usual
            if not served and ep.waker is None:
                ep.pending = True
                continue
            ep.pending = False
            if ep.busy is not None and not ep.busy.done():
                continue
            if ep.waker is None:
                ep.state = replace(ep.state, replicas=await self._count(name, ep.config))
            demand = bool(self.sampler.held(name))  # held here, or by any frontend or worker that reports (signal_reports)
            standby = self.executor.standby_ready(name) if ep.config.unit == "replicas" else 0  # a cheap scale-up: the policy scales down sooner
            decision, ep.state = decide(ep.config, ep.state, Observation(now, load, forecast, demand, standby))
            if decision.action == HOLD:
                if not ep.decisions or ep.decisions[-1].get("action") != HOLD or ep.decisions[-1].get("reason") != decision.reason:
                    self._record(ep, self._decision(decision, wall))
                continue
            self._record(ep, self._decision(decision, wall))
            ep.busy = asyncio.get_running_loop().create_task(self._apply(ep, decision.previous, decision.replicas, decision.action))

    def _forecast(self, ep: EndpointScaler, wall: float, load: float, qps: float) -> float | None:
        ep.profile.observe(wall, qps)
        if qps > 0.5 and load > 0:
            per = load / qps
            ep.cost = per if ep.cost is None else 0.9 * ep.cost + 0.1 * per
        lead = self.lead_s if self.lead_s is not None else (ep.provision_s or DEFAULT_READY_S) + self.interval_s
        ahead = ep.profile.forecast(wall + lead)
        now_predicted = ep.profile.forecast(wall)
        ep.forecasts.append({"t": wall, "predicted_qps": now_predicted, "actual_qps": qps, "ahead_s": lead, "predicted_qps_ahead": ahead})
        if ahead is None or not ep.config.predictive:
            return None
        cost = 1.0 if ep.config.signal in ("qps",) else ep.cost
        if ep.config.signal not in ("qps", "inflight", "queue") or cost is None:
            return None
        return ahead * cost

    async def _apply(self, ep: EndpointScaler, previous: int, n: int, action: str) -> None:
        began = self._clock()
        try:
            if action == ZERO:
                await self.sleep(ep.name)
            elif action == WAKE:
                await self._wake_task(ep)
            elif ep.config.unit == "instances":
                await self.executor.set_instances(ep.name, n)
            else:
                await self.executor.set_replicas(ep.name, n)
                if action == UP:
                    ep.provision_s = self._clock() - began
        except Exception as err:
            log.error("endpoint %s: scaling %d -> %d failed: %s", ep.name, previous, n, err)
            self._record(ep, {"t": self._wall(), "action": "failed", "reason": f"{action} to {n}: {err}"})
            ep.state = replace(ep.state, replicas=await self._count(ep.name, ep.config))
        else:
            self._record(ep, {"t": self._wall(), "action": "done", "reason": f"{action} to {n} in {self._clock() - began:.2f}s"})

    # ---- scale to zero and back ----------------------------------------------------------------

    async def sleep(self, name: str) -> None:
        """Zero replicas: requests are held from now; in-flight ones finish first."""
        ep = self.endpoints[name]
        async with ep.lock:
            await self._sleep(ep)

    async def _sleep(self, ep: EndpointScaler) -> None:
        name = ep.name
        ep.waker = Waker(name, lambda: self._wake_load(name), ep.config.cold_start_budget_s, self._clock, ep.provision_s or DEFAULT_READY_S)
        self.hooks.wakers[name] = ep.waker
        if self.announce is not None:
            await self.announce(name)
        await self.dp.unload_model(name, missing_ok=True)  # the table first: nothing new reaches the replicas
        await self.executor.set_replicas(name, 0)
        if self.evict_on_zero and self.weight_cache is not None and self.repository is not None:
            stashed = await asyncio.to_thread(self.weight_cache.stash, self.repository / name)
            if stashed:
                log.info("endpoint %s: %d artifact(s) into the weight cache", name, len(stashed))
        ep.state = replace(ep.state, replicas=0)
        ep.asleep = True
        log.info("endpoint %s scaled to zero", name)

    async def _wake_task(self, ep: EndpointScaler) -> None:
        if ep.waker is not None:
            await asyncio.shield(ep.waker.start())

    def _on_missing(self, model: str) -> None:
        """The replica set holds a request no member serves: wake the model if it sleeps."""
        ep = self.endpoints.get(model)
        if ep is not None and ep.waker is not None:
            ep.waker.start()

    def _wait_budget(self, model: str) -> float | None:
        ep = self.endpoints.get(model)
        return ep.config.cold_start_budget_s if ep is not None else None

    async def _wake_load(self, name: str) -> None:
        ep = self.endpoints[name]
        async with ep.lock:
            if self.dp.signature(name) is None:
                await self._load_from_zero(ep)
        self._awake(ep)

    async def _load_from_zero(self, ep: EndpointScaler) -> None:
        name = ep.name
        began = self._clock()
        cache = "none"
        if self.weight_cache is not None and self.repository is not None:
            cache = await asyncio.to_thread(self.weight_cache.restore, self.repository / name, self.artifact_store)
        n = max(1, ep.config.floor)
        instances = ep.config.unit == "instances"
        await self.executor.prepare(name, 1 if instances else n)
        await self.dp.load_model(name)
        if instances and n > 1:
            await self.executor.set_instances(name, n)
        seconds = self._clock() - began
        ep.provision_s = seconds
        ep.cold_starts.append({"t": self._wall(), "seconds": round(seconds, 3), "weight_cache": cache, "replicas": n})
        self._record(ep, {"t": self._wall(), "action": WAKE, "reason": f"loaded from zero in {seconds:.2f}s (weight cache: {cache})", "replicas": n})
        log.info("endpoint %s woke in %.2fs (weight cache: %s)", name, seconds, cache)

    def _awake(self, ep: EndpointScaler) -> None:
        self.hooks.wakers.pop(ep.name, None)
        ep.waker = None
        ep.asleep = False
        now = self._clock()
        count = self.executor.instances(ep.name) if ep.config.unit == "instances" else self.executor.replicas(ep.name)
        ep.state = replace(ep.state, replicas=max(1, count), last_active=now, last_change=now, last_up=now)

    async def _count(self, name: str, config: ScalingConfig, *, read: bool = False) -> int:
        """What the endpoint has now, in the config's unit."""
        if config.unit == "instances":
            return await self.executor.read_instances(name) if read else self.executor.instances(name)
        return self.executor.replicas(name)

    # ---- reading -------------------------------------------------------------------------------

    def config(self, name: str) -> ScalingConfig | None:
        ep = self.endpoints.get(name)
        return ep.config if ep is not None else None

    def estimated_ready_s(self, name: str) -> float:
        ep = self.endpoints.get(name)
        if ep is not None and ep.provision_s is not None:
            return round(ep.provision_s, 2)
        return DEFAULT_READY_S

    def _decision(self, d, wall: float) -> dict:
        return {"t": wall, "action": d.action, "from": d.previous, "to": d.replicas, "reason": d.reason, "inputs": d.inputs}

    def _record(self, ep: EndpointScaler, entry: dict) -> None:
        entry.setdefault("t", self._wall())
        ep.decisions.append(entry)

    def status_of(self, ep: EndpointScaler) -> dict:
        latest = self.sampler.latest(ep.name)
        decisions = [d for d in ep.decisions if d.get("action") not in (HOLD,)]
        return {
            "endpoint": ep.name,
            "state": _state(ep),
            "replicas": ep.state.replicas,
            "serving_replicas": self.replicas.hosting_count(ep.name) if self.replicas is not None else ep.state.replicas,
            "unit": ep.config.unit,
            "signal": ep.config.signal,
            "value": latest.signal(ep.config.signal) if latest is not None else 0.0,
            "target": ep.config.target,
            "min_replicas": ep.config.min_replicas,
            "max_replicas": ep.config.max_replicas,
            "scale_to_zero_after_s": ep.config.scale_to_zero_after_s,
            "cold_start_budget_s": ep.config.cold_start_budget_s,
            "held": self.sampler.held(ep.name),
            "last_decisions": decisions[-5:],
            "latest": ep.decisions[-1] if ep.decisions else None,
        }

    def status(self) -> list[dict]:
        return [self.status_of(ep) for _, ep in sorted(self.endpoints.items())]

    def explain(self, name: str) -> dict:
        ep = self.endpoints.get(name)
        if ep is None:
            raise ModelNotFound(f"endpoint '{name}' has no autoscaling config")
        return {
            **self.status_of(ep),
            "config": ep.config.as_dict(),
            "executor": self.executor.describe(),
            "signals": list(ep.signals)[-120:],
            "forecast": list(ep.forecasts)[-120:],
            "profile": [row for row in ep.profile.table() if row["forecast"] is not None],
            "decisions": list(ep.decisions),
            "cold_starts": list(ep.cold_starts),
            "provision_s": ep.provision_s,
        }
