"""The accuracy gate: a candidate against its parent on the stored validation rows (pure).

What is compared depends on the task the parent's outputs answer:

* ``classification`` (a probability row per input): top-1 agreement with the parent, probability
  error, and the accuracy delta when the validation set carries ``labels``;
* ``binary`` (one probability per row): decision agreement at ``decision_threshold``, probability
  error, accuracy delta with ``labels``;
* ``regression``: max / mean absolute error, also relative to the spread (std) of the parent's
  outputs so one default fits a target in [0, 1] and one in the thousands;
* ``embedding``: cosine similarity of each row's vectors (min and mean).

Thresholds: per-task defaults (``DEFAULTS``), overridden per model by the parent version's tags
``gate.KEY=VALUE`` and then by the caller (``--threshold KEY=VALUE``). ``None`` means "reported,
not gated". A candidate outside any threshold fails with one line per violated threshold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TASKS = ("classification", "binary", "regression", "embedding")

DEFAULTS: dict[str, dict[str, float | None]] = {
    # INT8 flips a few near-tie rows of a small classifier (~1-2 %); more than 3 % is a real change
    "classification": {"min_top1_agreement": 0.97, "max_accuracy_drop": 0.01, "max_abs_error": None, "mean_abs_error": None},
    "binary": {"min_decision_agreement": 0.99, "max_abs_error": 0.02, "mean_abs_error": None, "max_accuracy_drop": 0.01, "decision_threshold": 0.5},
    "regression": {"max_rel_error": 0.01, "mean_rel_error": 0.002, "max_abs_error": None, "mean_abs_error": None},
    "embedding": {"min_cosine": 0.99, "min_mean_cosine": 0.995},
}  # fmt: skip
TAG_PREFIX = "gate."
_EMBEDDING_OUTPUT_HINTS = ("embed", "vector", "pooled")


@dataclass(frozen=True)
class GateResult:
    task: str
    passed: bool
    metrics: dict[str, float]
    thresholds: dict[str, float | None]
    failures: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        """One short line for the results table's 'accuracy delta' column."""
        m = self.metrics
        if "error" in m:
            return "non-finite outputs"
        if self.task == "classification":
            text = f"top1 {m['top1_agreement']:.1%}, max|Δp| {m['max_abs_error']:.2g}"
        elif self.task == "binary":
            text = f"agree {m['decision_agreement']:.1%}, max|Δp| {m['max_abs_error']:.2g}"
        elif self.task == "regression":
            text = f"max|Δ| {m['max_abs_error']:.2g} ({m['max_rel_error']:.1e}σ), mean {m['mean_abs_error']:.2g}"
        else:
            text = f"cos min {m['min_cosine']:.4f}, mean {m['mean_cosine']:.4f}"
        if "accuracy_delta" in m:
            text += f", acc Δ {m['accuracy_delta']:+.2%}"
        return text

    def report(self) -> str:
        """The full report: every metric, every threshold, every violation."""
        lines = [f"task {self.task}: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  {k} = {v:.6g}" for k, v in sorted(self.metrics.items())]
        gated = {k: v for k, v in self.thresholds.items() if v is not None}
        lines.append("  thresholds: " + ", ".join(f"{k}={v:g}" for k, v in sorted(gated.items())))
        lines += [f"  violated: {f}" for f in self.failures]
        return "\n".join(lines)


def infer_task(outputs: np.ndarray, tags: Mapping[str, str] | None = None, output_name: str = "") -> str:
    """The task the parent's outputs answer: a ``task`` / ``gate.task`` tag wins, else the shape of the numbers."""
    tags = tags or {}
    explicit = tags.get(f"{TAG_PREFIX}task") or tags.get("task")
    if explicit:
        if explicit not in TASKS:
            raise ValueError(f"unknown task {explicit!r} (one of {', '.join(TASKS)})")
        return explicit
    y = np.asarray(outputs, dtype=np.float64).reshape(len(outputs), -1)
    width = y.shape[1]
    in_unit = bool(y.size) and float(y.min()) >= 0.0 and float(y.max()) <= 1.0
    if width > 1 and in_unit and np.allclose(y.sum(axis=1), 1.0, atol=1e-3):
        return "classification"
    if width == 1 and in_unit:
        return "binary"
    if width > 1 and any(h in output_name.lower() for h in _EMBEDDING_OUTPUT_HINTS):
        return "embedding"
    return "regression"


def thresholds_for(task: str, *overrides: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The task's defaults with each mapping of overrides applied in turn (later wins).

    Keys may carry the ``gate.`` tag prefix; unknown keys for the task raise (a typo must not
    silently leave a model ungated); ``none`` / empty values switch a check off.
    """
    if task not in DEFAULTS:
        raise ValueError(f"unknown task {task!r} (one of {', '.join(TASKS)})")
    out = dict(DEFAULTS[task])
    for mapping in overrides:
        for key, value in (mapping or {}).items():
            key = key[len(TAG_PREFIX) :] if key.startswith(TAG_PREFIX) else key
            if key == "task":
                continue
            if key not in out:
                raise ValueError(f"unknown threshold {key!r} for a {task} model (known: {', '.join(sorted(out))})")
            out[key] = None if value is None or str(value).strip().lower() in ("", "none", "off") else float(value)
    return out


def tag_overrides(tags: Mapping[str, str] | None) -> dict[str, str]:
    """The ``gate.*`` tags of a version: its per-model thresholds."""
    return {k: v for k, v in (tags or {}).items() if k.startswith(TAG_PREFIX)}


def _metrics(task: str, parent: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None, th: Mapping[str, float | None]) -> dict[str, float]:
    p = parent.reshape(len(parent), -1).astype(np.float64)
    c = candidate.reshape(len(candidate), -1).astype(np.float64)
    diff = np.abs(c - p)
    m = {"rows": float(len(p)), "max_abs_error": float(diff.max(initial=0.0)), "mean_abs_error": float(diff.mean()) if diff.size else 0.0}
    if task == "classification":
        p_top, c_top = p.argmax(axis=1), c.argmax(axis=1)
        m["top1_agreement"] = float(np.mean(p_top == c_top))
        if labels is not None:
            y = labels.reshape(-1).astype(np.int64)
            m["parent_accuracy"] = float(np.mean(p_top == y))
            m["candidate_accuracy"] = float(np.mean(c_top == y))
            m["accuracy_delta"] = m["candidate_accuracy"] - m["parent_accuracy"]
    elif task == "binary":
        cut = th.get("decision_threshold") or 0.5
        p_dec, c_dec = p[:, 0] >= cut, c[:, 0] >= cut
        m["decision_agreement"] = float(np.mean(p_dec == c_dec))
        if labels is not None:
            y = labels.reshape(-1) >= 0.5
            m["parent_accuracy"] = float(np.mean(p_dec == y))
            m["candidate_accuracy"] = float(np.mean(c_dec == y))
            m["accuracy_delta"] = m["candidate_accuracy"] - m["parent_accuracy"]
    elif task == "regression":
        scale = float(p.std()) or 1.0
        m["output_std"] = scale
        m["max_rel_error"] = m["max_abs_error"] / scale
        m["mean_rel_error"] = m["mean_abs_error"] / scale
        if labels is not None:
            y = labels.reshape(len(p), -1).astype(np.float64)
            m["parent_mae"] = float(np.abs(p - y).mean())
            m["candidate_mae"] = float(np.abs(c - y).mean())
            m["mae_delta"] = m["candidate_mae"] - m["parent_mae"]
    else:
        norms = np.linalg.norm(p, axis=1) * np.linalg.norm(c, axis=1)
        cos = np.sum(p * c, axis=1) / np.where(norms == 0, 1.0, norms)
        m["min_cosine"] = float(cos.min(initial=1.0))
        m["mean_cosine"] = float(cos.mean()) if cos.size else 1.0
    return m


# (threshold key, metric key, direction): "min" means the metric must be >= the threshold
_CHECKS = (
    ("min_top1_agreement", "top1_agreement", "min"),
    ("min_decision_agreement", "decision_agreement", "min"),
    ("max_abs_error", "max_abs_error", "max"),
    ("mean_abs_error", "mean_abs_error", "max"),
    ("max_rel_error", "max_rel_error", "max"),
    ("mean_rel_error", "mean_rel_error", "max"),
    ("min_cosine", "min_cosine", "min"),
    ("min_mean_cosine", "mean_cosine", "min"),
)


def evaluate(
    parent: np.ndarray,
    candidate: np.ndarray,
    task: str,
    thresholds: Mapping[str, float | None] | None = None,
    labels: np.ndarray | None = None,
) -> GateResult:
    """Compare ``candidate`` outputs with ``parent`` outputs (same rows, same shape) under ``thresholds``."""
    th = dict(thresholds) if thresholds is not None else thresholds_for(task)
    parent, candidate = np.asarray(parent), np.asarray(candidate)
    if parent.shape != candidate.shape:
        return GateResult(task, False, {"error": 1.0}, th, (f"output shape {candidate.shape} differs from the parent's {parent.shape}",))
    if not np.all(np.isfinite(candidate)):
        bad = int(np.sum(~np.isfinite(candidate)))
        return GateResult(task, False, {"error": 1.0}, th, (f"{bad} non-finite output values (NaN/inf)",))
    m = _metrics(task, parent, candidate, labels, th)
    failures = []
    for key, metric, direction in _CHECKS:
        limit = th.get(key)
        if limit is None or metric not in m:
            continue
        value = m[metric]
        if (direction == "min" and value < limit) or (direction == "max" and value > limit):
            failures.append(f"{metric} {value:.6g} {'<' if direction == 'min' else '>'} {key} {limit:g}")
    drop = th.get("max_accuracy_drop")
    if drop is not None and "accuracy_delta" in m and -m["accuracy_delta"] > drop:
        failures.append(f"accuracy fell by {-m['accuracy_delta']:.4g} > max_accuracy_drop {drop:g}")
    return GateResult(task, not failures, m, th, tuple(failures))
