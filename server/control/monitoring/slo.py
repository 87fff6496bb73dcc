"""SLOs per endpoint: objectives from the endpoint's config, the error budget the frontend computes from
its own counters, and the Prometheus rules file (recording rules + multi-window multi-burn-rate alerts).

Objectives (model config parameters; defaults from the settings ``INFERPLANE_SLO_*``):

- ``inferplane.slo_availability`` — share of requests that are not a server-side failure
  (``INTERNAL``, ``UNAVAILABLE``, ``MODEL_NOT_READY``, ``DEADLINE_EXCEEDED``, or refused by a full
  fair queue). A caller's mistake (bad input, unknown model, quota) is not the platform's failure.
- ``inferplane.slo_latency_ms`` + ``inferplane.slo_latency_target`` — share of requests answered
  within the threshold (rounded down to a bucket of ``inferplane_request_duration_seconds``).

The alerts follow the Google SRE workbook (chapter "Alerting on SLOs", multiwindow, multi-burn-rate):
page when the budget burns 14.4x over 1 h and 5 min, or 6x over 6 h and 30 min; open a ticket at
1x over 3 d and 6 h. ``deploy/prometheus/`` holds the generated file and its ``promtool`` tests.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
import yaml

from server.control.monitoring import scrape
from server.dataplane.metrics import LATENCY_BUCKETS, UNKNOWN_MODEL_LABEL
from model_repository.config_writer import read_config

# server-side failures: the platform's, not the caller's
BAD_CODES = ("INTERNAL", "UNAVAILABLE", "MODEL_NOT_READY", "DEADLINE_EXCEEDED")
AVAILABILITY, LATENCY = "availability", "latency"
WINDOWS = ("5m", "30m", "1h", "6h", "3d", "30d")
# (name, severity, burn rate, long window, short window, for)
ALERTS = (
    ("InferplaneSLOBurnPageFast", "page", 14.4, "1h", "5m", "2m"),
    ("InferplaneSLOBurnPageSlow", "page", 6.0, "6h", "30m", "15m"),
    ("InferplaneSLOBurnTicket", "ticket", 1.0, "3d", "6h", "1h"),
)


@dataclass(frozen=True)
class Objective:
    model: str
    availability: float = 0.999
    latency_s: float = 0.1
    latency_target: float = 0.99

    @property
    def latency_bucket(self) -> float:
        """The histogram bucket the latency SLI counts as fast: the largest bound <= the threshold."""
        i = bisect.bisect_right(LATENCY_BUCKETS, self.latency_s + 1e-12)
        return LATENCY_BUCKETS[max(0, i - 1)]

    def target(self, slo: str) -> float:
        return self.availability if slo == AVAILABILITY else self.latency_target


def objective_for(name: str, params: dict[str, str], settings=None) -> Objective:
    """An endpoint's objective from its config's ``inferplane.slo_*`` parameters (or the defaults)."""
    defaults = Objective(name) if settings is None else Objective(
        name, settings.slo_availability, settings.slo_latency_ms / 1000.0, settings.slo_latency_target
    )  # fmt: skip

    def number(key: str, default: float, scale: float = 1.0) -> float:
        try:
            value = float(params[key]) * scale
        except (KeyError, ValueError):
            return default
        return value if value > 0 else default

    availability = number("inferplane.slo_availability", defaults.availability)
    target = number("inferplane.slo_latency_target", defaults.latency_target)
    return Objective(
        name,
        availability if availability < 1 else defaults.availability,
        number("inferplane.slo_latency_ms", defaults.latency_s, 1e-3),
        target if target < 1 else defaults.latency_target,
    )


def repository_objectives(repository, settings=None) -> list[Objective]:
    """Objectives of every model folder in a Triton model repository (its config.pbtxt parameters)."""
    out = []
    for folder in sorted(p for p in Path(repository).iterdir() if (p / "config.pbtxt").is_file()):
        config = read_config(folder)
        out.append(objective_for(config.name or folder.name, {k: v.string_value for k, v in config.parameters.items()}, settings))
    return out


# ---- the frontend's own budget (from its counters) -------------------------------------------


@dataclass
class Counts:
    """Cumulative counts of one endpoint at one reading."""

    total: float = 0.0
    bad: float = 0.0  # availability failures
    observed: float = 0.0  # latency histogram count
    buckets: tuple = ()  # ((le, cumulative count), ...) of the latency histogram

    def fast(self, bound: float) -> float:
        for le, count in self.buckets:
            if abs(le - bound) < 1e-12:
                return count
        return 0.0


def read_counts(text: str) -> dict[str, Counts]:
    """Per model: the counters the SLIs need, from a /metrics text (all workers summed)."""
    out: dict[str, Counts] = {}

    def add(model: str, s) -> None:
        if s.name == "inferplane_requests_total":
            c = out.setdefault(model, Counts())
            c.total += s.value
            if s.labels.get("code") in BAD_CODES:
                c.bad += s.value
        elif s.name == "inferplane_admissions_total":
            if s.labels.get("path") == "refused":
                out.setdefault(model, Counts()).bad += s.value
        elif s.name == "inferplane_request_duration_seconds_count":
            out.setdefault(model, Counts()).observed += s.value

    for model, buckets in scrape.per_model(text, add).items():
        out.setdefault(model, Counts()).buckets = buckets
    return out


@dataclass
class Status:
    model: str
    slo: str
    objective: float
    good_ratio: float | None  # None: no requests in the window
    budget_remaining: float
    requests: float
    window_s: float

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def budget(objective: Objective, now: Counts, then: Counts | None, window_s: float) -> list[Status]:
    """Availability and latency status of one endpoint between two readings (``then`` None: since start)."""
    then = then or Counts()
    out = []
    total = _delta(now.total, then.total)
    bad = min(total, _delta(now.bad, then.bad)) if total else 0.0
    out.append(_status(objective, AVAILABILITY, total, bad, window_s))
    observed = _delta(now.observed, then.observed)
    bound = objective.latency_bucket
    fast = min(observed, _delta(now.fast(bound), then.fast(bound))) if observed else 0.0
    out.append(_status(objective, LATENCY, observed, observed - fast, window_s))
    return out


def _delta(now: float, then: float) -> float:
    return now - then if now >= then else now  # a counter reset: the process restarted


def _status(objective: Objective, slo: str, total: float, bad: float, window_s: float) -> Status:
    target = objective.target(slo)
    if not total:
        return Status(objective.model, slo, target, None, 1.0, 0.0, window_s)
    error_ratio = bad / total
    return Status(objective.model, slo, target, 1.0 - error_ratio, 1.0 - error_ratio / (1.0 - target), total, window_s)


class SLOTracker:
    """Reads the summed counters every ``step_s`` and keeps at most ``points`` readings over the window:
    the budget left is over (the oldest reading inside the window, now)."""

    def __init__(
        self,
        read: Callable[[], dict[str, Counts]],
        objectives: Callable[[], dict[str, Objective]],
        metrics=None,
        *,
        window_s: float = 30 * 86400.0,
        points: int = 1440,
        clock: Callable[[], float] = time.time,
    ):
        self._read = read
        self._objectives = objectives
        self.metrics = metrics
        self.window_s = window_s
        self._clock = clock
        self._every = window_s / points
        self._readings: deque[tuple[float, dict[str, Counts]]] = deque()
        self.latest: list[Status] = []

    def step(self) -> list[Status]:
        now = self._clock()
        counts = self._read()
        readings = self._readings
        if not readings or now - readings[-1][0] >= self._every:
            readings.append((now, counts))
        start = now - self.window_s
        while len(readings) > 1 and readings[1][0] <= start:
            readings.popleft()
        # the window's base: the last reading at or before its start; none yet: since the counters began
        then = readings[0][1] if readings and readings[0][0] <= start else None
        statuses = []
        for name, objective in sorted(self._objectives().items()):
            statuses += budget(objective, counts.get(name, Counts()), None if then is None else then.get(name), self.window_s)
        self.latest = statuses
        if self.metrics is not None:
            export(self.metrics, statuses, self._objectives())
        return statuses


def export(metrics, statuses: Iterable[Status], objectives: dict[str, Objective]) -> None:
    for o in objectives.values():
        metrics.slo_latency_threshold.labels(o.model).set(o.latency_bucket)
    for s in statuses:
        metrics.slo_objective.labels(s.model, s.slo).set(s.objective)
        metrics.slo_budget_remaining.labels(s.model, s.slo).set(s.budget_remaining)
        if s.good_ratio is not None:
            metrics.slo_good_ratio.labels(s.model, s.slo).set(s.good_ratio)


def statuses_from_metrics(text: str) -> list[dict]:
    """What ``inferplane slo status`` prints: the SLO gauges of a running frontend's /metrics."""
    rows: dict[tuple[str, str], dict] = {}
    thresholds: dict[str, float] = {}
    names = {"inferplane_slo_objective": "objective", "inferplane_slo_good_ratio": "good_ratio",
             "inferplane_slo_error_budget_remaining": "budget_remaining"}  # fmt: skip
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                row = rows.setdefault((s.labels["model"], s.labels["slo"]), {"model": s.labels["model"], "slo": s.labels["slo"], "good_ratio": None})
                row[names[s.name]] = s.value
            elif s.name == "inferplane_slo_latency_threshold_seconds":
                thresholds[s.labels["model"]] = s.value
    for (model, slo), row in rows.items():
        if slo == LATENCY and model in thresholds:
            row["threshold_ms"] = thresholds[model] * 1000
    return [rows[k] for k in sorted(rows)]


# ---- the Prometheus rules file ----------------------------------------------------------------

SLI_METRIC = "inferplane:slo_errors:ratio_rate{window}"
BUDGET_METRIC = "inferplane:slo_error_budget"
REMAINING_METRIC = "inferplane:slo_error_budget_remaining:ratio_rate30d"


def rules(objectives: list[Objective], *, psi_threshold: float = 0.25, ks_threshold: float = 0.2) -> dict:
    """The rules document (``promtool check rules`` format) for these endpoints."""
    bad = "|".join(BAD_CODES)
    served = f'model!="{UNKNOWN_MODEL_LABEL}"'
    availability, latency, budgets = [], [], []
    for w in WINDOWS:
        total = f"sum by (model) (rate(inferplane_requests_total{{{served}}}[{w}]))"
        failed = (
            f'sum by (model) (rate(inferplane_requests_total{{{served},code=~"{bad}"}}[{w}]) '
            f'or rate(inferplane_admissions_total{{{served},path="refused"}}[{w}]))'
        )
        availability.append({
            "record": SLI_METRIC.format(window=w),
            "expr": f"({failed} or {total} * 0) / {total}",
            "labels": {"slo": AVAILABILITY},
        })  # fmt: skip
        for o in objectives:
            sel = f'model="{o.model}"'
            latency.append({
                "record": SLI_METRIC.format(window=w),
                "expr": (
                    f"1 - sum by (model) (rate(inferplane_request_duration_seconds_bucket{{{sel},le=\"{_le(o.latency_bucket)}\"}}[{w}])) "
                    f"/ sum by (model) (rate(inferplane_request_duration_seconds_count{{{sel}}}[{w}]))"
                ),
                "labels": {"model": o.model, "slo": LATENCY},
            })  # fmt: skip
    for o in objectives:
        for slo in (AVAILABILITY, LATENCY):
            budgets.append({"record": BUDGET_METRIC, "expr": _number(1.0 - o.target(slo)), "labels": {"model": o.model, "slo": slo}})
    budgets.append({
        "record": REMAINING_METRIC,
        "expr": f"1 - {SLI_METRIC.format(window='30d')} / on (model, slo) {BUDGET_METRIC}",
    })  # fmt: skip
    alerts = []
    for name, severity, rate, long_w, short_w, hold in ALERTS:
        threshold = f"on (model, slo) group_left () ({_number(rate)} * {BUDGET_METRIC})"
        alerts.append({
            "alert": name,
            "expr": (
                f"({SLI_METRIC.format(window=long_w)} > {threshold})\nand\n"
                f"({SLI_METRIC.format(window=short_w)} > {threshold})"
            ),
            "for": hold,
            "labels": {"severity": severity},
            "annotations": {
                "summary": f"{{{{ $labels.model }}}}: {{{{ $labels.slo }}}} error budget burning over {_number(rate)}x ({long_w} and {short_w} windows)",
            },
        })  # fmt: skip
    drift = [
        {
            "alert": "InferplaneDriftPSI",
            "expr": f"max by (model) (inferplane_drift_psi) > {_number(psi_threshold)}",
            "for": "15m",
            "labels": {"severity": "ticket"},
            "annotations": {"summary": f"{{{{ $labels.model }}}}: a feature drifted (PSI over {_number(psi_threshold)}; inferplane drift names it)"},
        },
        {
            "alert": "InferplaneDriftKS",
            "expr": f"max by (model) (inferplane_drift_ks) > {_number(ks_threshold)}",
            "for": "15m",
            "labels": {"severity": "ticket"},
            "annotations": {"summary": f"{{{{ $labels.model }}}}: a feature drifted (KS over {_number(ks_threshold)}; inferplane drift names it)"},
        },
    ]  # fmt: skip
    return {
        "groups": [
            {"name": "inferplane-slo-availability", "interval": "30s", "rules": availability},
            {"name": "inferplane-slo-latency", "interval": "30s", "rules": latency},
            {"name": "inferplane-slo-budget", "interval": "30s", "rules": budgets},
            {"name": "inferplane-slo-alerts", "rules": alerts},
            {"name": "inferplane-drift-alerts", "rules": drift},
        ]
    }


def rules_yaml(objectives: list[Objective], **kw) -> str:
    header = (
        "# Generated by `inferplane slo rules` from the endpoints' configs (server/control/monitoring/slo.py); do not edit.\n"
        "# Objectives: " + "; ".join(
            f"{o.model} availability {o.availability:g}, latency {o.latency_bucket * 1000:g} ms at {o.latency_target:g}" for o in objectives
        ) + "\n"
    )  # fmt: skip
    return header + yaml.safe_dump(rules(objectives, **kw), sort_keys=False, width=200)


def _le(bound: float) -> str:
    return repr(float(bound))


def _number(x: float) -> str:
    return f"{x:.6g}"
