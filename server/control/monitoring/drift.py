"""Drift: each feature's live distribution against the endpoint's validation set, off the hot path.

The reference is the registered validation set (``validation.npz``: an array per input, or
``features`` for a single input; the model's outputs on it as an array per output, or ``expected``).
Per feature (column of a 2-D tensor, ``features[3]``; outputs as ``output:probability[0]``) it keeps
the reference values and their decile bins.

The pipeline copies a sampled fraction of answered requests, undecoded, into a bounded ring
(``server.dataplane.observe``); every ``drift_interval_s`` this monitor drains it, decodes the rows,
keeps the last ``drift_window_rows`` per model and, once ``drift_min_rows`` are there, computes per
feature:

- **PSI** (population stability index) over the reference's deciles:
  ``sum((live% - ref%) * ln(live% / ref%))``; below 0.1 stable, 0.1-0.25 moderate, above 0.25 a shift.
- **KS**: the two-sample Kolmogorov-Smirnov statistic (``scipy.stats.ks_2samp``).

Both go to /metrics (``inferplane_drift_psi`` / ``inferplane_drift_ks``, alerted on by the rules in
``deploy/prometheus``); ``inferplane drift NAME`` prints the worst features.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import ks_2samp
from prometheus_client.parser import text_string_to_metric_families

from server.dataplane import codecs
from server.protogen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

BINS = 10
EPSILON = 1e-4
MAX_FEATURES = 256  # per model: wider tensors are watched on their first columns only


@dataclass
class FeatureReport:
    feature: str
    psi: float
    ks: float
    ks_pvalue: float
    live_mean: float
    reference_mean: float

    def as_dict(self) -> dict:
        return self.__dict__.copy()


class FeatureReference:
    """One feature's reference values and decile bins."""

    def __init__(self, values: np.ndarray):
        values = np.asarray(values, dtype=np.float64)
        self.values = np.sort(values[np.isfinite(values)])
        edges = np.unique(np.quantile(self.values, np.linspace(0, 1, BINS + 1)[1:-1])) if self.values.size else np.array([])
        self.edges = edges
        self.proportions = _proportions(self.values, edges)
        self.mean = float(self.values.mean()) if self.values.size else float("nan")


def _proportions(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    counts = np.bincount(np.searchsorted(edges, values, side="right"), minlength=edges.size + 1).astype(np.float64)
    total = counts.sum()
    return counts / total if total else counts


def psi(reference: FeatureReference, live: np.ndarray) -> float:
    ref = np.clip(reference.proportions, EPSILON, None)
    got = np.clip(_proportions(np.asarray(live, dtype=np.float64), reference.edges), EPSILON, None)
    return float(np.sum((got - ref) * np.log(got / ref)))


def ks(reference: FeatureReference, live: np.ndarray) -> tuple[float, float]:
    result = ks_2samp(reference.values, np.asarray(live, dtype=np.float64))
    return float(result.statistic), float(result.pvalue)


def _columns(prefix: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """Feature name -> column, for a [rows, ...] array (trailing dimensions flattened)."""
    if array.ndim == 0:
        return {}
    rows = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(-1, 1)
    return {f"{prefix}[{i}]": rows[:, i] for i in range(min(rows.shape[1], MAX_FEATURES))}


class ModelReference:
    """Every watched feature of one endpoint: its inputs' and outputs' columns in the validation set."""

    def __init__(self, name: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
        self.name = name
        self.inputs = set(inputs)
        self.outputs = set(outputs)
        self.features: dict[str, FeatureReference] = {}
        for tensor, array in inputs.items():
            for feature, column in _columns(tensor, array).items():
                self.features[feature] = FeatureReference(column)
        for tensor, array in outputs.items():
            for feature, column in _columns(f"output:{tensor}", array).items():
                self.features[feature] = FeatureReference(column)

    @classmethod
    def from_arrays(cls, name: str, signature, arrays: dict[str, np.ndarray]) -> "ModelReference | None":
        """From a validation set's arrays and the model's signature (None when nothing numeric matches)."""
        inputs, outputs = {}, {}
        for t in signature.inputs.values():
            array = arrays.get(t.name, arrays.get("features") if len(signature.inputs) == 1 else None)
            if array is not None and np.issubdtype(np.asarray(array).dtype, np.number):
                inputs[t.name] = np.asarray(array)
        for t in signature.outputs.values():
            array = arrays.get(t.name, arrays.get("expected") if len(signature.outputs) == 1 else None)
            if array is not None and np.issubdtype(np.asarray(array).dtype, np.number):
                outputs[t.name] = np.asarray(array)
        return cls(name, inputs, outputs) if inputs or outputs else None


def decode(sample, reference: ModelReference) -> dict[str, np.ndarray]:
    """Feature -> live column of one sampled request (its inputs and its answer's outputs)."""
    out: dict[str, np.ndarray] = {}
    request = sample.request
    for i, tensor in enumerate(request.inputs):
        if tensor.name in reference.inputs and i < len(request.raw_input_contents) and tensor.datatype != "BYTES":
            array = codecs.to_numpy(request.raw_input_contents[i], tensor.datatype, list(tensor.shape))
            out.update(_columns(tensor.name, array))
    if sample.answer is not None and reference.outputs:
        response = pb.ModelInferResponse.FromString(sample.answer)
        for i, tensor in enumerate(response.outputs):
            if tensor.name in reference.outputs and i < len(response.raw_output_contents) and tensor.datatype != "BYTES":
                array = codecs.to_numpy(response.raw_output_contents[i], tensor.datatype, list(tensor.shape))
                out.update(_columns(f"output:{tensor.name}", array))
    return out


class DriftMonitor:
    """Drains the observer's drift ring, keeps a live window per model, publishes PSI and KS."""

    def __init__(
        self,
        observer,  # server.dataplane.observe.Observer
        metrics,
        load_reference: Callable[[str], "ModelReference | None"],
        *,
        window_rows: int = 2000,
        min_rows: int = 200,
        interval_s: float = 30.0,
    ):
        self.observer = observer
        self.metrics = metrics
        self._load = load_reference
        self.window_rows = window_rows
        self.min_rows = min_rows
        self.interval_s = interval_s
        self.references: dict[str, ModelReference] = {}
        self._live: dict[str, dict[str, deque]] = {}
        self.reports: dict[str, list[FeatureReport]] = {}

    def watch(self, names) -> list[str]:
        """Load the references of these models; those with one are sampled from now on."""
        for name in names:
            if name in self.references:
                continue
            try:
                reference = self._load(name)
            except Exception as err:  # a broken validation set must not stop the frontend
                log.warning("no drift reference for %s: %s", name, err)
                reference = None
            if reference is not None and reference.features:
                self.references[name] = reference
        self.observer.drift_models.update(self.references)
        return sorted(self.references)

    def step(self, samples: list | None = None) -> dict[str, list[FeatureReport]]:
        """Decode ``samples`` (default: drain the ring now) and recompute the models they touched."""
        touched = set()
        for sample in self.observer.drift.drain() if samples is None else samples:
            reference = self.references.get(sample.model)
            if reference is None or sample.request is None:
                continue
            try:
                columns = decode(sample, reference)
            except Exception as err:  # a request the codec cannot read: skip it
                log.debug("drift: cannot decode a sample of %s: %s", sample.model, err)
                continue
            live = self._live.setdefault(sample.model, {})
            for feature, column in columns.items():
                window = live.get(feature)
                if window is None:
                    window = live[feature] = deque(maxlen=self.window_rows)
                window.extend(column.tolist())
            touched.add(sample.model)
        for name in touched:
            self.reports[name] = self._compute(name)
        return {name: self.reports[name] for name in touched}

    def _compute(self, name: str) -> list[FeatureReport]:
        reference = self.references[name]
        live = self._live.get(name, {})
        rows = max((len(w) for w in live.values()), default=0)
        self.metrics.drift_rows.labels(name).set(rows)
        reports = []
        for feature, ref in reference.features.items():
            window = live.get(feature)
            if window is None or len(window) < self.min_rows or not ref.values.size:
                continue
            values = np.fromiter(window, dtype=np.float64, count=len(window))
            statistic, pvalue = ks(ref, values)
            report = FeatureReport(feature, psi(ref, values), statistic, pvalue, float(values.mean()), ref.mean)
            reports.append(report)
            self.metrics.drift_psi.labels(name, feature).set(report.psi)
            self.metrics.drift_ks.labels(name, feature).set(report.ks)
        reports.sort(key=lambda r: (-r.psi if math.isfinite(r.psi) else 0.0, -r.ks))
        return reports

    def report(self, name: str, top: int | None = None) -> dict:
        reports = self.reports.get(name, [])
        live = self._live.get(name, {})
        return {
            "model": name,
            "watched": name in self.references,
            "live_rows": max((len(w) for w in live.values()), default=0),
            "min_rows": self.min_rows,
            "features": [r.as_dict() for r in (reports[:top] if top else reports)],
        }

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                samples = self.observer.drift.drain()  # on the loop, where the pipeline fills it
                if samples:
                    await asyncio.to_thread(self.step, samples)
            except Exception:
                log.exception("drift computation failed")


def report_from_metrics(text: str, name: str) -> list[dict]:
    """What ``inferplane drift NAME`` prints: a running frontend's drift gauges for one model, worst first."""
    rows: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("inferplane_drift_psi", "inferplane_drift_ks") and s.labels.get("model") == name:
                rows.setdefault(s.labels["feature"], {"feature": s.labels["feature"]})[s.name.rsplit("_", 1)[1]] = s.value
    return sorted(rows.values(), key=lambda r: (-r.get("psi", 0.0), -r.get("ks", 0.0)))
