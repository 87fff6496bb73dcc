"""``optimize NAME:VERSION``: recipes -> accuracy gate -> latency profile -> verdict -> registration.

1. The parent's artifact and validation set come from the registry (digest-verified); the
   parent's outputs on the validation rows are computed in this process by its framework.
2. Each requested recipe makes a candidate, or a "skipped" row saying why it does not apply.
3. Each candidate runs on the same rows; the gate compares it with the parent (``optimizer.gate``).
4. Parent and every candidate that passed the gate are measured together in one Triton
   (``optimizer.profile``); without a profile an in-process timing stands in for the speed rules.
5. Verdicts: outside the gate -> rejected (audited, never registered). A tree compiled to ONNX
   that is slower than the native model -> rejected (keep whichever is faster). FP16 slower than
   the parent on this CPU -> accepted as GPU-only. Otherwise accepted.
6. Accepted candidates are registered as new versions of the same model with ``parent`` lineage,
   the recipe and its parameters in tags, the gate and profile figures (theirs and the parent's)
   as offline metrics, and a validation set of their own outputs so ``inferplane deploy``'s
   warm-up check holds. Same input and recipe -> same bytes -> the registry returns the version
   it already has: optimizing twice registers nothing new.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer import gate, recipes, runtime
from optimizer.profile import ProfileSettings, Variant, unmeasurable
from server.errors import InvalidRequest
from server.control.registry.registry import Registry, VersionRecord, parse_ref

SLOWER = 0.95  # a candidate below 95 % of the parent's throughput (or above 105 % of its latency) is slower
PARENT = "parent"


@dataclass
class Row:
    label: str
    recipe: str | None = None
    format: str = ""
    size_bytes: int | None = None
    sha256: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    target: str = "cpu"
    gate: gate.GateResult | None = None
    profile: dict[int, dict[str, float]] | None = None
    local_us: float | None = None
    verdict: str = ""
    registered: str | None = None
    created: bool = False
    outputs: np.ndarray | None = field(default=None, repr=False)
    artifact: bytes | None = field(default=None, repr=False)

    @property
    def accepted(self) -> bool:
        return self.verdict.startswith("accepted")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "recipe": self.recipe, "format": self.format, "size_bytes": self.size_bytes,
            "sha256": self.sha256, "params": self.params, "notes": list(self.notes), "target": self.target,
            "gate": None if self.gate is None else {"task": self.gate.task, "passed": self.gate.passed, "metrics": self.gate.metrics, "failures": list(self.gate.failures)},
            "profile": None if self.profile is None else {str(c): f for c, f in self.profile.items()},
            "local_us": self.local_us, "verdict": self.verdict, "registered": self.registered, "created": self.created,
        }  # fmt: skip


@dataclass
class OptimizeReport:
    parent: str
    task: str
    thresholds: dict[str, float | None]
    rows: list[Row]
    settings: ProfileSettings | None
    speed_source: str  # "triton" | "in-process" | "none"

    def to_dict(self) -> dict[str, Any]:
        return {
            "parent": self.parent, "task": self.task, "thresholds": self.thresholds, "speed_source": self.speed_source,
            "profile": None if self.settings is None else {
                "concurrencies": list(self.settings.concurrencies), "duration_s": self.settings.duration_s,
                "warmup_s": self.settings.warmup_s, "rounds": self.settings.rounds, "batch": self.settings.batch,
            },
            "rows": [r.to_dict() for r in self.rows],
        }  # fmt: skip

    def table(self) -> str:
        """The results table (markdown): variant, size, p50, p99, throughput, accuracy delta, verdict."""
        conc = list(self.settings.concurrencies) if self.settings and self.speed_source == "triton" else []
        tag = f" (c={'/'.join(map(str, conc))})" if conc else ""
        parent_size = self.rows[0].size_bytes or 0
        head = ["variant", "size", f"p50 ms{tag}", f"p99 ms{tag}", f"req/s{tag}", f"Triton CPU ms/req{f' (c={conc[-1]})' if conc else ''}", "accuracy Δ vs parent", "verdict"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            name = f"{r.label} ({self.parent})" if r.label == PARENT else r.label
            if r.registered:
                name += f" → {r.registered}"
            size = "—" if r.size_bytes is None else _size(r.size_bytes) + ("" if r.label == PARENT or not parent_size else f" ({r.size_bytes / parent_size:.2f}×)")
            if r.profile and conc:
                p50 = " / ".join(f"{r.profile[c]['p50_ms']:.2f}" for c in conc)
                p99 = " / ".join(f"{r.profile[c]['p99_ms']:.2f}" for c in conc)
                thr = " / ".join(f"{r.profile[c]['throughput_rps']:.0f}" for c in conc)
                cpu = f"{r.profile[conc[-1]]['cpu_ms_per_request']:.3f}"
            elif r.local_us is not None:
                p50, p99, thr, cpu = f"{r.local_us / 1000:.3f} (in-process)", "—", "—", "—"
            else:
                p50 = p99 = thr = cpu = "—"
            acc = "—" if r.gate is None else (r.gate.summary() if r.label != PARENT else "reference")
            cells = [c.replace("|", "\\|") for c in (name, size, p50, p99, thr, cpu, acc, r.verdict)]  # "max|Δ|" in a cell
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    return buffer.getvalue()


def load_rows(path: Path, input_name: str) -> np.ndarray:
    """Calibration rows from an ``.npz`` (array named after the input, or ``features``) or an ``.npy``."""
    path = Path(path)
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    with np.load(path, allow_pickle=False) as npz:
        for key in (input_name, "features"):
            if key in npz.files:
                return np.asarray(npz[key])
        raise InvalidRequest(f"{path} has no '{input_name}' or 'features' array (has {sorted(npz.files)})")


class _Steps:
    """A rich progress task, or nothing."""

    def __init__(self, progress, description: str, total: int):
        self.progress = progress
        self.task = progress.add_task(description, total=total) if progress is not None else None

    def grow(self, n: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, total=self.progress.tasks[self.task].total + n)

    def step(self, text: str, advance: int = 1) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=advance, description=text)


def _validation(registry: Registry, record: VersionRecord) -> tuple[np.ndarray, np.ndarray | None]:
    if not record.validation_sha256:
        raise InvalidRequest(
            f"{record.ref} has no validation set: the accuracy gate needs one (register it with --validation FILE.npz)"
        )
    data = registry.store.get(record.validation_sha256)
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    name = record.signature["inputs"][0]["name"]
    features = arrays.get(name, arrays.get("features"))
    if features is None:
        raise InvalidRequest(f"the validation set of {record.ref} has no '{name}' or 'features' array (has {sorted(arrays)})")
    return np.ascontiguousarray(features, dtype=np.float32), arrays.get("labels")


def _slower(parent: Row, cand: Row, settings: ProfileSettings | None) -> bool | None:
    """Whether the candidate is slower than the parent on this machine (None: not measured)."""
    if parent.profile and cand.profile and settings is not None:
        top = settings.concurrencies[-1]
        return cand.profile[top]["throughput_rps"] < SLOWER * parent.profile[top]["throughput_rps"]
    if parent.local_us and cand.local_us:
        return cand.local_us * SLOWER > parent.local_us
    return None


def _verdict(parent: Row, cand: Row, settings: ProfileSettings | None, keep_slower: bool = False) -> None:
    """The candidate's verdict: the accuracy gate, then the speed rules (a tree compiled to ONNX that is
    slower than its native model is rejected, unless ``keep_slower``: then it is accepted and says slower)."""
    assert cand.gate is not None
    if not cand.gate.passed:
        cand.verdict = "rejected: outside the accuracy gate (" + "; ".join(cand.gate.failures) + ")"
        return
    slower = _slower(parent, cand, settings)
    if cand.recipe == "tree-onnx" and slower and not keep_slower:
        cand.verdict = "rejected: slower than the native model on this CPU (keeping the faster one)"
    elif cand.recipe == "fp16":
        cand.target = "gpu" if slower or slower is None else "cpu"
        cand.verdict = "accepted (GPU-only: slower on this CPU)" if slower else "accepted (GPU target)" if slower is None else "accepted"
    elif cand.target == "gpu":
        cand.verdict = "accepted (GPU)"
    elif slower:
        smaller = cand.size_bytes is not None and parent.size_bytes is not None and cand.size_bytes < parent.size_bytes
        cand.verdict = "accepted (smaller; slower on this CPU)" if smaller else "accepted (slower on this CPU)"
    else:
        cand.verdict = "accepted"


def _metrics(parent: Row, cand: Row) -> dict[str, float]:
    assert cand.gate is not None and cand.size_bytes is not None and parent.size_bytes
    out = {f"gate.{k}": float(v) for k, v in cand.gate.metrics.items()}
    out["size_bytes"] = float(cand.size_bytes)
    out["size_ratio"] = cand.size_bytes / parent.size_bytes
    for who, row in (("", cand), ("parent.", parent)):
        for c, figures in (row.profile or {}).items():
            for k, v in figures.items():
                out[f"{who}latency.c{c}.{k}"] = float(v)
        if row.local_us is not None:
            out[f"{who}latency.in_process_us"] = float(row.local_us)
    return out


def candidates(
    chosen: Sequence[str],
    source: recipes.Source,
    predict,
    parent_out: np.ndarray,
    task: str,
    limits: Mapping[str, float | None],
    labels: np.ndarray | None,
    steps: _Steps,
    ref: str,
) -> list[Row]:
    """One row per recipe: skipped / failed with why, or a candidate with its outputs (``predict(cand)``) gated."""
    rows = []
    for recipe in chosen:
        steps.step(f"{ref}: {recipe}", 0)
        row = Row(recipe, recipe)
        rows.append(row)
        try:
            cand = recipes.apply(recipe, source)
        except recipes.Skipped as skip:
            row.verdict = f"skipped: {skip.reason}"
            steps.step(f"{ref}: {recipe} skipped")
            continue
        except Exception as err:  # a converter crash is a row in the table, not the end of the run
            row.verdict = f"failed: {type(err).__name__}: {err}"
            steps.step(f"{ref}: {recipe} failed")
            continue
        row.format, row.size_bytes, row.sha256, row.artifact = cand.format, len(cand.artifact), cand.sha256, cand.artifact
        row.params, row.notes, row.target = cand.params, cand.notes, cand.target
        try:
            row.outputs = predict(cand)
        except Exception as err:
            row.verdict = f"failed: cannot run the candidate for the gate: {type(err).__name__}: {err}"
            steps.step(f"{ref}: {recipe} failed")
            continue
        row.gate = gate.evaluate(parent_out, row.outputs, task, limits, labels)
        steps.step(f"{ref}: {recipe} {'passed' if row.gate.passed else 'failed'} the gate")
    return rows


def optimize(
    registry: Registry,
    ref: str,
    requested: Sequence[str] = (),
    *,
    all_: bool = False,
    calibration: Path | None = None,
    thresholds: Mapping[str, Any] | None = None,
    task: str | None = None,
    profile_settings: ProfileSettings | None = ProfileSettings(),
    register: bool = True,
    actor: str = "",
    sign_key: bytes | None = None,
    progress=None,
    keep_slower: bool = False,
) -> OptimizeReport:
    """Optimize ``ref`` (NAME:VERSION) with the requested recipes; see the module docstring. ``keep_slower``:
    a gated candidate is registered even where it measured slower on this machine (its verdict says so)."""
    name, version = parse_ref(ref)
    record = registry.get(name, version)
    sig = record.signature
    if len(sig["inputs"]) != 1 or len(sig["outputs"]) != 1:
        raise InvalidRequest(f"{record.ref}: the optimizer handles one input and one output tensor (the adapters' contract)")
    unknown = [r for r in requested if r not in recipes.RECIPES]
    if unknown:
        raise InvalidRequest(f"unknown recipe(s) {unknown} (known: {', '.join(recipes.RECIPES)})")
    artifact = registry.read_artifact(record)
    features, labels = _validation(registry, record)
    out_name, out_dims = sig["outputs"][0]["name"], list(sig["outputs"][0]["dims"])
    chosen, skipped_up_front = recipes.select(requested, all_, record.format, artifact)
    if not chosen and not skipped_up_front:
        raise InvalidRequest("no recipe requested: give --graph, --fp16, --int8 dynamic|static, --int4, --tree-onnx, --tensorrt or --all")
    steps = _Steps(progress, f"optimize {record.ref}", 1 + len(chosen))

    steps.step(f"{record.ref}: parent outputs on {len(features)} validation rows", 0)
    parent_out = runtime.predict(record.format, artifact, features, out_dims)
    try:
        task = task or gate.infer_task(parent_out, record.tags, out_name)
        limits = gate.thresholds_for(task, gate.tag_overrides(record.tags), thresholds)
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    steps.step(f"{record.ref}: {task} model, parent evaluated")
    parent = Row(PARENT, None, record.format, record.size_bytes, record.sha256, outputs=parent_out, artifact=artifact,
                 gate=gate.evaluate(parent_out, parent_out, task, limits, labels), verdict="parent")  # fmt: skip
    rows = [parent]
    rows += [Row(r, r, verdict=f"skipped: {why}") for r, why in skipped_up_front.items()]

    calib = load_rows(calibration, sig["inputs"][0]["name"]) if calibration is not None else features
    source = recipes.Source(name, record.format, artifact, sig, calibration=calib, max_batch=int(sig.get("max_batch_size", 64) or 64))
    rows += candidates(
        chosen, source, lambda cand: runtime.predict(cand.format, cand.artifact, features, out_dims),
        parent_out, task, limits, labels, steps, record.ref,
    )  # fmt: skip

    order = {r: i for i, r in enumerate(recipes.RECIPES)}
    rows[1:] = sorted(rows[1:], key=lambda r: order.get(r.recipe or "", len(order)))
    gated = [r for r in rows[1:] if r.gate is not None and r.gate.passed]
    speed_source = "none"
    settings = profile_settings
    measured = [r for r in [parent, *gated] if not unmeasurable(r.format)]
    if settings is not None and len(measured) > 1:
        from optimizer.profile import profile

        steps.grow(settings.runs(len(measured)))
        variants = [Variant(r.label, r.format, r.artifact, sig) for r in measured]
        figures = profile(variants, features, settings, on_run=lambda label, c, rnd: steps.step(f"{record.ref}: profile {label} c={c} round {rnd + 1}"))
        for r in measured:
            r.profile = figures[r.label]
        speed_source = "triton"
    else:
        settings = None
        timed = [r for r in [parent, *gated] if not unmeasurable(r.format)]
        if len(timed) > 1:  # the speed rules still need a figure: time one-row calls in this process
            for r in timed:
                r.local_us = runtime.local_latency_us(r.format, r.artifact, features)
            speed_source = "in-process"
    for r in rows[1:]:
        if r.gate is not None:
            _verdict(parent, r, settings, keep_slower)

    report = OptimizeReport(record.ref, task, limits, rows, settings, speed_source)
    table = json.dumps([{"variant": r.label, "size_bytes": r.size_bytes, "verdict": r.verdict,
                         "accuracy": None if r.gate is None else r.gate.summary()} for r in rows])  # fmt: skip
    for r in rows[1:]:
        if r.gate is not None and not r.accepted:
            registry.audit(actor, "optimize", record.ref, "rejected", f"{r.recipe} sha256={r.sha256}: {r.verdict}")
        if not (register and r.accepted):
            continue
        steps.grow(1)
        r.registered, r.created = _register(registry, record, parent, r, task, table, features, labels, actor, sign_key)
        steps.step(f"{record.ref}: {r.recipe} -> {r.registered}")
    return report


def _register(
    registry: Registry, record: VersionRecord, parent: Row, row: Row, task: str, table: str,
    features: np.ndarray, labels: np.ndarray | None, actor: str, sign_key: bytes | None,
) -> tuple[str, bool]:  # fmt: skip
    from server.control.registry import safe_formats

    assert row.artifact is not None and row.outputs is not None and row.sha256 is not None
    validation = {"features": features, "expected": row.outputs}
    if labels is not None:
        validation["labels"] = labels
    tags = {
        **record.tags,
        "optimizer.recipe": row.recipe or "",
        "optimizer.params": json.dumps(row.params, sort_keys=True),
        "optimizer.tools": json.dumps(recipes.tool_versions(), sort_keys=True),
        "optimizer.target": row.target,
        "optimizer.task": task,
        "optimizer.verdict": row.verdict,
        "optimizer.parent_sha256": record.sha256,
        "optimizer.table": table,
    }
    hardware = dict(record.hardware)
    if row.target == "gpu":
        hardware["accelerator"] = "gpu"
    signature = None
    if sign_key is not None:
        from server.control.registry.signing import sign_digest

        signature = sign_digest(sign_key, row.sha256)
    rec, created = registry.register(
        record.name, row.artifact, signature=record.signature, filename=safe_formats.FILE_NAMES[row.format], format=row.format,
        validation=_npz(validation), metrics=_metrics(parent, row), hardware=hardware, tags=tags,
        training_run=record.training_run, dataset_version=record.dataset_version, experiment=record.experiment,
        parent=record.ref, owner_team=record.owner_team, artifact_signature=signature, actor=actor,
    )  # fmt: skip
    return rec.ref, created
