"""Traffic policy, pure: weighted splits, sticky assignment, canary verdicts and steps.

Nothing here does I/O or reads a clock; callers pass ``now``. The router (``server.dataplane.routing``)
and the controller (``server.control.rollout.traffic``) call these.

* **Sticky assignment** is weighted rendezvous (highest-random-weight) hashing on the caller's
  key: every arm scores ``-w / ln(u)`` with ``u`` a hash of (key, arm) in (0, 1); the key goes to
  the best score. The chance of winning is exactly the arm's weight share, and changing one arm's
  weight moves only the keys that must move: raising the canary's weight takes keys from the
  other arms to the canary and never between them; a key on the canary stays there.
* **Unkeyed requests** go through smooth weighted round robin (nginx's): exact proportions over
  every ``sum(weights)`` requests, the minority arm spread evenly (never clumped).
* **Canary verdicts** compare the canary's window with the stable one's: error rate and p99
  against absolute limits and relative to stable, after a minimum number of samples.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_SCALE = float(1 << 64)

# what counts as the version's failure (a caller's bad request, quota or cancel does not)
VERSION_ERROR_CODES = frozenset({"INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "MODEL_NOT_READY"})


# ---- splits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str  # "stable", "canary", "a", "b", ...
    version: str
    weight: float


def check_arms(arms: Sequence[Arm]) -> None:
    """Arms of a split: at least one, distinct names, weights >= 0 summing to more than 0."""
    if not arms:
        raise ValueError("a split needs at least one arm")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be distinct, got {names}")
    for a in arms:
        if not a.name or not a.version:
            raise ValueError("every arm needs a name and a version")
        if not (a.weight >= 0 and math.isfinite(a.weight)):
            raise ValueError(f"arm '{a.name}': weight must be a finite number >= 0, got {a.weight}")
    if sum(a.weight for a in arms) <= 0:
        raise ValueError("the arms' weights sum to 0")


def unit_hash(key: str, salt: str) -> float:
    """A uniform number in the open interval (0, 1) from ``key`` and ``salt`` (stable across processes)."""
    digest = hashlib.blake2b(f"{salt}\x00{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _SCALE


def sticky_arm(key: str, arms: Sequence[Arm], salt: str = "") -> Arm:
    """The arm ``key`` belongs to: weighted rendezvous hashing (see the module docstring)."""
    best, best_score = arms[0], -math.inf
    for arm in arms:
        if arm.weight <= 0:
            continue
        score = -arm.weight / math.log(unit_hash(key, f"{salt}/{arm.name}"))
        if score > best_score:
            best, best_score = arm, score
    return best


class SmoothWeighted:
    """Smooth weighted round robin over arms (pure state, no clock, no randomness)."""

    def __init__(self, arms: Sequence[Arm]):
        self.arms = list(arms)
        self._total = float(sum(a.weight for a in self.arms))
        self._current = [0.0] * len(self.arms)

    def next(self) -> Arm:
        best = 0
        for i, arm in enumerate(self.arms):
            self._current[i] += arm.weight
            if self._current[i] > self._current[best]:
                best = i
        self._current[best] -= self._total
        return self.arms[best]


def canary_arms(stable: str, canary: str, percent: float) -> list[Arm]:
    percent = min(100.0, max(0.0, float(percent)))
    return [Arm("stable", stable, 100.0 - percent), Arm("canary", canary, percent)]


# ---- windowed statistics ---------------------------------------------------------------------


@dataclass(frozen=True)
class WindowStats:
    """One arm's requests in the analysis window."""

    requests: int = 0
    errors: int = 0
    p99_s: float = 0.0
    mean_s: float = 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---- canary analysis -------------------------------------------------------------------------


@dataclass(frozen=True)
class CanaryThresholds:
    """When a canary fails. Relative limits apply once stable has ``min_samples`` too."""

    min_samples: int = 50  # canary requests in the window before any verdict
    max_error_rate: float = 0.05  # absolute
    max_error_increase: float = 0.02  # canary error rate - stable error rate
    max_p99_s: float = 1.0  # absolute
    max_p99_ratio: float = 2.0  # canary p99 / stable p99 ...
    p99_slack_s: float = 0.005  # ... ignored while the difference is below this (sub-ms noise)

    def __post_init__(self) -> None:
        if self.min_samples < 1:
            raise ValueError("min_samples must be >= 1")
        for name in ("max_error_rate", "max_error_increase", "max_p99_s", "max_p99_ratio", "p99_slack_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")


WAIT, PASS, FAIL = "wait", "pass", "fail"


@dataclass(frozen=True)
class Verdict:
    decision: str  # wait | pass | fail
    reasons: tuple[str, ...] = ()
    numbers: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        figures = " ".join(f"{k}={v:.6g}" for k, v in self.numbers.items())
        return f"{self.decision}: {'; '.join(self.reasons) or 'within thresholds'} [{figures}]"


def canary_verdict(canary: WindowStats, stable: WindowStats, t: CanaryThresholds) -> Verdict:
    """Compare the canary's window with the stable arm's (see :class:`CanaryThresholds`)."""
    numbers = {
        "canary_requests": float(canary.requests),
        "canary_errors": float(canary.errors),
        "canary_error_rate": canary.error_rate,
        "canary_p99_ms": canary.p99_s * 1000.0,
        "stable_requests": float(stable.requests),
        "stable_errors": float(stable.errors),
        "stable_error_rate": stable.error_rate,
        "stable_p99_ms": stable.p99_s * 1000.0,
    }
    if canary.requests < t.min_samples:
        return Verdict(WAIT, (f"{canary.requests} of {t.min_samples} canary samples",), numbers)
    reasons = []
    if canary.error_rate > t.max_error_rate:
        reasons.append(f"canary error rate {canary.error_rate:.2%} > {t.max_error_rate:.2%}")
    comparable = stable.requests >= t.min_samples
    if comparable and canary.error_rate - stable.error_rate > t.max_error_increase:
        reasons.append(
            f"canary error rate {canary.error_rate:.2%} exceeds stable's {stable.error_rate:.2%} by more than {t.max_error_increase:.2%}"
        )
    if canary.p99_s > t.max_p99_s:
        reasons.append(f"canary p99 {canary.p99_s * 1000:.1f} ms > {t.max_p99_s * 1000:.1f} ms")
    if comparable and canary.p99_s > t.max_p99_ratio * stable.p99_s and canary.p99_s - stable.p99_s > t.p99_slack_s:
        reasons.append(f"canary p99 {canary.p99_s * 1000:.1f} ms > {t.max_p99_ratio:g}x stable's {stable.p99_s * 1000:.1f} ms")
    return Verdict(FAIL if reasons else PASS, tuple(reasons), numbers)


HOLD, ADVANCE, PROMOTE, ROLLBACK = "hold", "advance", "promote", "rollback"


@dataclass(frozen=True)
class CanaryPlan:
    """Percent steps (the last one is followed by promotion) and how long each must pass."""

    steps: tuple[float, ...] = (5.0,)
    interval_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a canary plan needs at least one step")
        previous = 0.0
        for s in self.steps:
            if not (0 < s <= 100):
                raise ValueError(f"canary steps are percentages in (0, 100], got {s}")
            if s < previous:
                raise ValueError(f"canary steps must not decrease, got {list(self.steps)}")
            previous = s
        if not self.interval_s > 0:
            raise ValueError("the step interval must be > 0 seconds")


def canary_action(plan: CanaryPlan, step: int, step_started: float, now: float, verdict: Verdict) -> str:
    """What to do now: rollback on a failed verdict; after ``interval_s`` of the step with a
    passing verdict, advance (or promote after the last step); hold otherwise."""
    if verdict.decision == FAIL:
        return ROLLBACK
    if verdict.decision == PASS and now - step_started >= plan.interval_s:
        return PROMOTE if step >= len(plan.steps) - 1 else ADVANCE
    return HOLD
