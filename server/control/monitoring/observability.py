"""The observability tasks of one frontend process, started by ``server.app`` from the settings:

- the SLO tracker (the process that serves /metrics: budgets from the summed counters),
- the status page's history (rates and latency percentiles over the last minutes, for its charts),
- the drift monitor and the payload log writer (each process that serves requests: they drain that
  process's sampled copies),
- the device poll (Triton's Prometheus endpoint: GPU and host utilization and memory).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
import io

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
import aiohttp

from server.control.monitoring import slo
from server.control.monitoring.drift import DriftMonitor, ModelReference
from server.control.monitoring.payload_log import PayloadLog, redaction_for
from server.control.registry.envelope import KeyRing
from server.dataplane.triton_stats import export_devices
from server.periodic import stop_tasks

log = logging.getLogger(__name__)

HISTORY_POINTS = 120  # ten minutes at 5 s


class History:
    """Summed counters every few seconds: per endpoint request rate, error rate and p50/p99 over the last
    interval, for the status page's numbers and charts."""

    def __init__(self, render, points: int = HISTORY_POINTS, clock=time.time):
        self._render = render
        self._clock = clock
        self.points: deque[tuple[float, dict[str, slo.Counts], dict[str, float]]] = deque(maxlen=points)

    def step(self) -> None:
        text = self._render().decode()
        self.points.append((self._clock(), slo.read_counts(text), _errors(text)))

    def series(self, model: str) -> list[dict]:
        out = []
        pts = list(self.points)
        for (t0, c0, e0), (t1, c1, e1) in zip(pts, pts[1:]):
            a, b = c0.get(model, slo.Counts()), c1.get(model, slo.Counts())
            dt_s = max(1e-9, t1 - t0)
            requests = max(0.0, b.total - a.total)
            out.append({
                "t": t1, "rps": requests / dt_s, "errors_per_s": max(0.0, e1.get(model, 0.0) - e0.get(model, 0.0)) / dt_s,
                "p50_ms": _quantile(a, b, 0.5), "p99_ms": _quantile(a, b, 0.99),
            })  # fmt: skip
        return out

    def summary(self, model: str, seconds: float = 60.0) -> dict:
        """Rate, error rate and p50/p99 over (about) the last ``seconds``."""
        pts = list(self.points)
        if len(pts) < 2:
            return {"rps": None, "errors_per_s": None, "p50_ms": None, "p99_ms": None}
        t1, c1, e1 = pts[-1]
        t0, c0, e0 = next(((t, c, e) for t, c, e in pts if t >= t1 - seconds - 1e-6), pts[0])
        if t0 >= t1:
            t0, c0, e0 = pts[-2]
        a, b = c0.get(model, slo.Counts()), c1.get(model, slo.Counts())
        span = max(1e-9, t1 - t0)
        return {
            "rps": max(0.0, b.total - a.total) / span,
            "errors_per_s": max(0.0, e1.get(model, 0.0) - e0.get(model, 0.0)) / span,
            "p50_ms": _quantile(a, b, 0.5), "p99_ms": _quantile(a, b, 0.99),
        }  # fmt: skip

    def models(self) -> list[str]:
        return sorted(self.points[-1][1]) if self.points else []


def _errors(text: str) -> dict[str, float]:
    """Per model: answered requests whose code is not OK (any error, the caller's included)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "inferplane_requests_total" and s.labels.get("code") != "OK":
                out[s.labels["model"]] = out.get(s.labels["model"], 0.0) + s.value
    return out


def _quantile(a: slo.Counts, b: slo.Counts, q: float) -> float | None:
    """A latency quantile (ms) of the requests between two readings, linear inside its bucket."""
    before = dict(a.buckets)
    deltas = [(le, max(0.0, count - before.get(le, 0.0))) for le, count in b.buckets]
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, seen = 0.0, 0.0
    for le, count in deltas:
        if count >= rank:
            if le == float("inf"):
                return lower * 1000
            inside = count - seen
            return (lower + (le - lower) * ((rank - seen) / inside if inside else 1.0)) * 1000
        lower, seen = le, count
    return lower * 1000


def reference_loader(settings, dataplane, registry=None):
    """The validation set of an endpoint: the registry's (its registered version's) or the model
    folder's ``validation.npz`` in the Triton repository."""

    def load(name: str):
        signature = dataplane.signature(name)
        if signature is None:
            return None
        arrays = None
        if registry is not None:
            try:
                record = registry.get(name)
                if record.validation_sha256:

                    with np.load(io.BytesIO(registry.store.get(record.validation_sha256)), allow_pickle=False) as npz:
                        arrays = {k: npz[k] for k in npz.files}
            except Exception:  # not registered: the repository's copy
                arrays = None
        if arrays is None:
            path = Path(settings.model_repository) / name / "validation.npz"
            if not path.is_file():
                return None
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        return ModelReference.from_arrays(name, signature, arrays)

    return load


class Observability:
    """Built by ``server.app``; ``start`` launches what this process runs, ``stop`` ends it."""

    def __init__(self, settings, metrics, dataplane, *, serves_metrics: bool, serves_requests: bool, triton_metrics_url: str = "", registry=None):
        self.settings = settings
        self.metrics = metrics
        self.dataplane = dataplane
        self.serves_metrics = serves_metrics
        self.serves_requests = serves_requests
        self.triton_metrics_url = triton_metrics_url
        self.history = History(metrics.render)
        self.slo = slo.SLOTracker(self._counts, self.objectives, metrics, window_s=settings.slo_window_s)
        self.drift: DriftMonitor | None = None
        self.payloads: PayloadLog | None = None
        self.registry = registry
        self._tasks: list[asyncio.Task] = []

    def objectives(self) -> dict[str, slo.Objective]:
        dp = self.dataplane
        out = {}
        for name in dp.names():
            signature = dp.signature(name)
            out[name] = slo.objective_for(name, signature.params if signature is not None else {}, self.settings)
        return out

    def _triton_metrics(self) -> str:
        url = self.triton_metrics_url
        return url() if callable(url) else url

    def _counts(self) -> dict[str, slo.Counts]:
        return slo.read_counts(self.metrics.render().decode())

    def start(self) -> None:
        s = self.settings
        observer = self.dataplane.observer
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._every(s.status_history_step_s, self.history.step), name="status-history"))
        if self.serves_metrics:
            self._tasks.append(loop.create_task(self._every(s.slo_step_s, self.slo.step, first=1.0), name="slo-budget"))
            if self._triton_metrics():
                self._tasks.append(loop.create_task(self._poll_devices(), name="triton-devices"))
        if self.serves_requests and observer is not None:
            if s.drift_sample_ratio > 0:
                self.drift = DriftMonitor(
                    observer, self.metrics, reference_loader(s, self.dataplane, self.registry),
                    window_rows=s.drift_window_rows, min_rows=s.drift_min_rows, interval_s=s.drift_interval_s,
                )  # fmt: skip
                watched = self.drift.watch(self.dataplane.names())
                log.info("drift: watching %s", ", ".join(watched) or "no model (none has a validation set)")
                self._tasks.append(loop.create_task(self.drift.run(), name="drift"))

            self.payloads = PayloadLog(
                observer, self.metrics, s.payload_log_destination, redaction_for(self.dataplane),
                max_records=s.payload_log_max_records, max_bytes=s.payload_log_max_bytes, file_records=s.payload_log_file_records,
                keys=KeyRing.from_settings(s),  # sealed at rest when an encryption key is set (issue 23)
            )  # fmt: skip
            self._tasks.append(loop.create_task(self.payloads.run(), name="payload-log"))

    async def _every(self, period: float, fn, first: float | None = None) -> None:
        await asyncio.sleep(first if first is not None else period)
        while True:
            try:
                await asyncio.to_thread(fn)
            except Exception:
                log.exception("%s failed", getattr(fn, "__qualname__", fn))
            await asyncio.sleep(period)

    async def _poll_devices(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                try:
                    async with session.get(self._triton_metrics()) as response:
                        export_devices(self.metrics, await response.text())
                except Exception as err:  # Triton restarting
                    log.debug("reading Triton's metrics failed: %s", err)
                await asyncio.sleep(self.settings.stats_poll_s)

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        if self.payloads is not None:
            await self.payloads.flush()  # what was sampled before the end
