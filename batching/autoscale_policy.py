"""Autoscaling policy: how many replicas an endpoint should have, as a pure function of what was
observed and a clock the caller passes in (no I/O, no wall clock, nothing of ``server/``).

Target tracking on one signal (by default requests in flight, frontend queue included): the raw
recommendation is ``ceil(load / target)`` replicas, unless the load per current replica is
within ``tolerance`` of the target (then the count stays). Around it, in this order:

* **stabilization** (the HPA's rule): scale up only to the *lowest* recommendation seen during
  the last ``scale_up_window_s``, scale down only to the *highest* seen during the last
  ``scale_down_window_s``, so a blip shorter than a window moves nothing;
* **step limits**: at most ``max_step_up`` / ``max_step_down`` replicas per decision;
* **cooldowns**: no scale-up within ``up_cooldown_s`` of the last one, no scale-down within
  ``down_cooldown_s`` of any change;
* **bounds**: never above ``max_replicas``, never below ``min_replicas`` — except scale to zero:
  with ``scale_to_zero_after_s`` set, an endpoint that saw no load at all for that long goes to 0,
  and from 0 any load (or a request held at the door, ``demand``) brings back
  ``max(1, min_replicas)`` (or more if the load asks) at once, bypassing windows and cooldowns.
  With ``predictive`` on, a forecast of at least ``WAKE_FORECAST_FRACTION`` of one replica's target
  counts as expected load (less is a profile slot's decaying memory of traffic long gone, which never
  reaches 0 and would keep the endpoint awake in that slot for ever): it keeps the endpoint from
  going to zero, and at zero it wakes the endpoint ahead of its traffic as a scale-up does (once the
  forecast held for ``scale_up_window_s``, outside ``up_cooldown_s``, at most ``max_step_up`` replicas,
  at least the floor, at most ``max_replicas``).

A forecast of the load (``Observation.forecast``, for the moment the new replicas would be warm)
joins the raw recommendation as ``max(reactive, ceil(forecast / target))``: predictive
pre-scaling adds capacity ahead of a ramp the history predicts and never removes capacity the
present load needs. :class:`SeasonalProfile` is that history: an exponentially weighted mean per
slot of a period (hour of week by default).

A loaded warm standby (``Observation.standby``: Tritons holding the endpoint's model out of
rotation, issue 29) makes a scale-up cheap — it takes the standby into rotation (~0.2 s here)
instead of starting a process and loading (~1 s) — so a mistaken scale-down costs little: while
one is ready, the scale-down window and the down cooldown shrink to ``standby_down_factor`` of
theirs (1: no change), and replicas the load no longer needs stop sooner.

Guarantee (property-tested in ``tests/unit/test_autoscale_policy.py``): a scale-down never comes
within ``scale_down_window_s`` of a scale-up (``standby_down_factor`` of it while a standby is
ready), so whatever the load does the count cannot flap faster than that window; under steady load
the count moves monotonically and then stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

SIGNALS = ("inflight", "queue", "qps", "tokens_per_s", "triton_queue_ms")
UNITS = ("replicas", "instances")  # what the count scales: replica processes, or Triton instances of the model
UP, DOWN, HOLD, ZERO, WAKE = "up", "down", "hold", "zero", "wake"
TIERS = (1, 2, 3)
WAKE_FORECAST_FRACTION = 0.1  # of one replica's target: the least forecast that wakes or keeps up a scale-to-zero endpoint
TIER1_MIN_REPLICAS = 2


@dataclass(frozen=True)
class ScalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target: float = 8.0  # of ``signal`` per replica
    signal: str = "inflight"
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 60.0
    max_step_up: int = 4
    max_step_down: int = 1
    up_cooldown_s: float = 0.0
    down_cooldown_s: float = 30.0
    scale_to_zero_after_s: float | None = None  # idle this long: 0 replicas (None: never)
    cold_start_budget_s: float = 30.0  # how long a request waits for a scaled-to-zero endpoint to load
    predictive: bool = True
    unit: str = "replicas"
    tier: int = 2  # availability tier: 1 gets >= 2 replicas (in 2 zones, on Tritons of its own); 2 and 3 share
    standby_down_factor: float = 0.25  # while a loaded standby is ready: this fraction of the down window and cooldown

    def __post_init__(self) -> None:
        problems = []
        if self.tier not in TIERS:
            problems.append(f"tier must be 1, 2 or 3 (got {self.tier!r})")
        elif self.tier == 1:  # never fewer than two replicas (a lost zone leaves one serving)
            object.__setattr__(self, "min_replicas", max(self.min_replicas, TIER1_MIN_REPLICAS))
            object.__setattr__(self, "max_replicas", max(self.max_replicas, self.min_replicas))
        if self.min_replicas < 0:
            problems.append(f"min_replicas must be >= 0 (got {self.min_replicas})")
        if self.max_replicas < max(1, self.min_replicas):
            problems.append(f"max_replicas must be >= max(1, min_replicas) (got {self.max_replicas}, min {self.min_replicas})")
        if not (self.target > 0 and math.isfinite(self.target)):
            problems.append(f"target must be a positive number (got {self.target})")
        if self.unit not in UNITS:
            problems.append(f"unit must be one of {', '.join(UNITS)} (got {self.unit!r})")
        if self.signal not in SIGNALS:
            problems.append(f"signal must be one of {', '.join(SIGNALS)} (got {self.signal!r})")
        if not 0 <= self.tolerance < 1:
            problems.append(f"tolerance must be in [0, 1) (got {self.tolerance})")
        for name in ("scale_up_window_s", "scale_down_window_s", "up_cooldown_s", "down_cooldown_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0 (got {getattr(self, name)})")
        if not 0 < self.standby_down_factor <= 1:
            problems.append(f"standby_down_factor must be in (0, 1] (got {self.standby_down_factor})")
        if self.max_step_up < 1 or self.max_step_down < 1:
            problems.append("max_step_up and max_step_down must be >= 1")
        if self.scale_to_zero_after_s is not None and self.scale_to_zero_after_s <= 0:
            problems.append(f"scale_to_zero_after_s must be > 0 (got {self.scale_to_zero_after_s})")
        if self.cold_start_budget_s <= 0:
            problems.append(f"cold_start_budget_s must be > 0 (got {self.cold_start_budget_s})")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def floor(self) -> int:
        """The fewest replicas while the endpoint is in use."""
        return max(1, self.min_replicas) if self.scale_to_zero_after_s is not None else self.min_replicas

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict) -> "ScalingConfig":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown autoscaling field(s): {', '.join(unknown)}")
        return cls(**known)


@dataclass(frozen=True)
class Observation:
    now: float
    load: float  # the signal, summed over the endpoint (not per replica)
    forecast: float | None = None  # the load predicted for when a new replica would be ready
    demand: bool = False  # a request is held waiting for the endpoint (scaled to zero)
    standby: int = 0  # loaded warm standbys of the endpoint ready to take into rotation


@dataclass(frozen=True)
class PolicyState:
    replicas: int
    recommendations: tuple[tuple[float, int], ...] = ()  # (time, raw recommendation), oldest first
    last_up: float = -math.inf
    last_change: float = -math.inf
    last_active: float = -math.inf  # the last time any load (or, predictive, a forecast of load) was seen
    held: tuple[float, int] | None = None  # (time, count) found at start: no scale-down below it within a window

    @classmethod
    def start(cls, replicas: int, now: float) -> "PolicyState":
        return cls(replicas=replicas, last_active=now, held=(now, replicas))


@dataclass(frozen=True)
class Decision:
    replicas: int
    previous: int
    action: str  # up | down | hold | zero | wake
    reason: str
    inputs: dict = field(default_factory=dict)


def recommend(config: ScalingConfig, current: int, load: float, forecast: float | None) -> tuple[int, int, int | None]:
    """(recommendation, reactive part, predictive part): replicas for ``load`` (and ``forecast``)."""
    load = max(0.0, load)
    if current > 0 and load > 0 and abs(load / (current * config.target) - 1.0) <= config.tolerance:
        reactive = current
    else:
        reactive = max(1, math.ceil(load / config.target - 1e-9)) if load > 0 else 0
    predictive = None
    if config.predictive and forecast is not None and forecast > 0:
        predictive = max(1, math.ceil(forecast / config.target - 1e-9))
    raw = max(reactive, predictive or 0)
    return raw, reactive, predictive


def decide(config: ScalingConfig, state: PolicyState, obs: Observation) -> tuple[Decision, PolicyState]:
    """One decision; returns it with the state to pass to the next call."""
    now = obs.now
    current = state.replicas
    active = obs.load > 0 or obs.demand
    raw, reactive, predictive = recommend(config, current, obs.load, obs.forecast)
    foreseen = predictive is not None and obs.forecast >= WAKE_FORECAST_FRACTION * config.target  # (predictive) traffic is forecast
    expected = active or foreseen  # load now, or a forecast of it: not idle
    last_active = now if expected else state.last_active
    horizon = max(config.scale_up_window_s, config.scale_down_window_s)
    recs = tuple((t, r) for t, r in state.recommendations if t >= now - horizon) + ((now, raw),)
    inputs = {
        "load": obs.load, "forecast": obs.forecast, "target": config.target, "signal": config.signal,
        "per_replica": obs.load / current if current else None, "reactive": reactive, "predictive": predictive,
        "recommendation": raw, "demand": obs.demand, "idle_s": None if expected else now - state.last_active,
        "standby": obs.standby,
    }  # fmt: skip

    def done(replicas: int, action: str, reason: str) -> tuple[Decision, PolicyState]:
        changed = replicas != current
        new = replace(
            state, replicas=replicas, recommendations=recs, last_active=last_active,
            last_up=now if replicas > current else state.last_up, last_change=now if changed else state.last_change,
        )  # fmt: skip
        return Decision(replicas, current, action if changed else HOLD, reason, inputs), new

    floor = config.floor
    # ---- scale to zero and back --------------------------------------------------------------
    if current == 0:
        if active:
            want = min(config.max_replicas, max(floor, 1, raw))
            return done(want, WAKE, f"load {obs.load:g}{' and a held request' if obs.demand else ''} at zero replicas: wake to {want}")
        if config.scale_to_zero_after_s is not None or config.min_replicas == 0:
            if not foreseen:
                return done(0, HOLD, "idle at zero replicas")
            # traffic is forecast: wake ahead of it, as a scale-up (its window, cooldown, step and bounds)
            ahead = f"forecast {obs.forecast:g} at zero replicas"
            up_rec = min(r for t, r in recs if t >= now - config.scale_up_window_s)
            if up_rec == 0:
                return done(0, HOLD, f"{ahead} not yet stable for {config.scale_up_window_s:g}s")
            if now - state.last_up < config.up_cooldown_s:
                return done(0, HOLD, f"{ahead}; up cooldown ({config.up_cooldown_s:g}s) not over")
            want = min(config.max_replicas, max(floor, min(up_rec, config.max_step_up)))
            return done(want, WAKE, f"{ahead}: wake to {want} ahead of its traffic")
    idle_s = now - state.last_active
    if config.scale_to_zero_after_s is not None and not expected and idle_s >= config.scale_to_zero_after_s:
        return done(0, ZERO, f"no load{' nor forecast' if config.predictive else ''} for {idle_s:.0f}s (scale to zero after {config.scale_to_zero_after_s:g}s)")

    # ---- stabilization windows -----------------------------------------------------------------
    cheap = config.standby_down_factor if obs.standby > 0 else 1.0  # a scale-up would take a loaded standby
    down_window, down_cooldown = config.scale_down_window_s * cheap, config.down_cooldown_s * cheap
    up_rec = min(r for t, r in recs if t >= now - config.scale_up_window_s)
    down_rec = max(r for t, r in recs if t >= now - down_window)
    if state.held is not None and state.held[0] >= now - config.scale_down_window_s:
        down_rec = max(down_rec, state.held[1])
    inputs["up_recommendation"], inputs["down_recommendation"] = up_rec, down_rec
    want, why = current, f"load {obs.load:g} ~ {current} x target {config.target:g}"
    if up_rec > current:
        want = up_rec
        why = f"load {obs.load:g} > {current} x {config.target:g}" + (f" (forecast {obs.forecast:g})" if predictive and predictive >= reactive else "")
    elif down_rec < current:
        want = down_rec
        why = f"highest recommendation in the last {down_window:g}s is {down_rec}" + (" (a standby is ready)" if cheap < 1 else "")
    elif raw != current:
        window = config.scale_up_window_s if raw > current else down_window
        why = f"recommendation {raw} not yet stable for {window:g}s"

    # ---- step limits, cooldowns, bounds ---------------------------------------------------------
    if want > current:
        if now - state.last_up < config.up_cooldown_s:
            return done(current, HOLD, f"{why}; up cooldown ({config.up_cooldown_s:g}s) not over")
        want = min(want, current + config.max_step_up)
    elif want < current:
        if now - state.last_change < down_cooldown:
            return done(current, HOLD, f"{why}; down cooldown ({down_cooldown:g}s) not over")
        want = max(want, current - config.max_step_down)
    bounded = min(config.max_replicas, max(floor, want))
    if bounded != want:
        why += f"; bounded to [{floor}, {config.max_replicas}]"
    action = UP if bounded > current else DOWN if bounded < current else HOLD
    return done(bounded, action, why)


# ---- the history behind the forecast ---------------------------------------------------------------

WEEK_S = 7 * 24 * 3600.0
HOUR_S = 3600.0


class SeasonalProfile:
    """An exponentially weighted mean of a value per slot of a repeating period.

    By default the period is a week and a slot an hour (hour-of-week); the benchmark compresses
    both. ``observe(t, value)`` accumulates the mean of the current slot; when ``t`` enters the
    next slot, the finished slot's mean is folded into that slot's weighted mean with weight
    ``alpha``. ``forecast(t)`` interpolates between slot centers and is ``None`` until both slots
    around ``t`` were seen once. Pure: the caller passes the time.
    """

    def __init__(self, period_s: float = WEEK_S, slot_s: float = HOUR_S, alpha: float = 0.5):
        if period_s <= 0 or slot_s <= 0 or abs(period_s / slot_s - round(period_s / slot_s)) > 1e-6:
            raise ValueError("period_s must be a positive whole multiple of slot_s")
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.period_s, self.slot_s, self.alpha = period_s, slot_s, alpha
        self.slots = int(round(period_s / slot_s))
        self.means: list[float | None] = [None] * self.slots
        self.last: list[float | None] = [None] * self.slots  # the last finished occurrence (reality, for explain)
        self._open: tuple[int, int] | None = None  # (period number, slot) being accumulated
        self._sum = 0.0
        self._n = 0

    def slot(self, t: float) -> tuple[int, int]:
        k = math.floor(t / self.slot_s)
        return k // self.slots, k % self.slots

    def observe(self, t: float, value: float) -> None:
        key = self.slot(t)
        if self._open is not None and key != self._open:
            self._fold()
        self._open = key
        self._sum += value
        self._n += 1

    def _fold(self) -> None:
        if self._open is None or not self._n:
            return
        slot = self._open[1]
        mean = self._sum / self._n
        old = self.means[slot]
        self.means[slot] = mean if old is None else self.alpha * mean + (1 - self.alpha) * old
        self.last[slot] = mean
        self._sum, self._n = 0.0, 0

    def forecast(self, t: float) -> float | None:
        """The expected value at time ``t`` (interpolated between the two nearest slot centers)."""
        x = t / self.slot_s - 0.5
        k = math.floor(x)
        frac = x - k
        a, b = self.means[k % self.slots], self.means[(k + 1) % self.slots]
        if a is None or b is None:
            return a if b is None and frac < 0.5 else b if a is None and frac >= 0.5 else None
        return a + (b - a) * frac

    def seed(self, points) -> None:
        """Observe historical (t, value) points in time order (e.g. metered request rates)."""
        for t, value in points:
            self.observe(t, value)
        self._fold()
        self._open = None

    def table(self) -> list[dict]:
        return [{"slot": i, "forecast": m, "last": last} for i, (m, last) in enumerate(zip(self.means, self.last))]
