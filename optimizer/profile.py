"""Latency profile: parent and candidates loaded side by side into one real Triton, measured with loadtest.

Each variant becomes its own model in a temporary Triton repository, written the way
``model_repository/layout.py`` writes the demo models (``config.pbtxt`` built from the config
protobuf, the framework's Python-backend adapter as ``model.py``, the artifact pinned by sha256,
the validation rows as ``validation.npz`` for the request pool). One ``inferplane serve`` stack
(embedded Triton, one frontend worker) loads them all; the loadtest runner then drives each
model **directly on Triton's gRPC port** (the frontend adds the same ~constant cost to every
variant, and on a 2-core box it would compete with the model for CPU), closed loop at each
concurrency, in interleaved rounds (A, B, C, then B, C, A, ...) so machine drift falls on all
variants alike. Figures are medians over the rounds.
"""

from __future__ import annotations

import re
import shutil
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_repository.config_writer import ServingConfig, python_backend_config, write_config
from model_repository.layout import ADAPTERS, VALIDATION_FILE, install_adapter, save_npz, sha256_bytes
from server.control.registry import safe_formats

# formats the embedded Triton's adapters load (XGBoost UBJ is refused by the xgboost adapter)
MEASURABLE = {safe_formats.ONNX, safe_formats.XGBOOST_JSON, safe_formats.LIGHTGBM_TEXT}
STACK_ENV = {"INFERPLANE_AUTH": "off", "INFERPLANE_STATS_POLL_S": "5"}


@dataclass(frozen=True)
class ProfileSettings:
    concurrencies: tuple[int, ...] = (1, 8)
    warmup_s: float = 1.0
    duration_s: float = 3.0
    rounds: int = 2
    batch: int = 1  # rows per request

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1 or self.rounds < 1 or self.duration_s <= 0:
            raise ValueError(f"invalid profile settings: {self}")

    def runs(self, variants: int) -> int:
        return len(self.concurrencies) * self.rounds * variants


@dataclass(frozen=True)
class Variant:
    label: str
    format: str
    artifact: bytes
    signature: Mapping[str, Any]


def unmeasurable(fmt: str) -> str:
    """'' when the embedded Triton can run ``fmt``; otherwise why not."""
    if fmt in MEASURABLE:
        return ""
    if fmt == safe_formats.TENSORRT_PLAN:
        return "the embedded Triton has no TensorRT backend (measure plans on a GPU Triton)"
    return f"the embedded Triton has no adapter for {fmt}"


def _model_name(index: int, label: str) -> str:
    return f"opt{index}_{re.sub(r'[^A-Za-z0-9_]', '_', label)}"[:100]


def write_repository(root: Path, variants: Sequence[Variant], features: np.ndarray) -> dict[str, str]:
    """One Triton model per variant under ``root``; returns label -> model name."""
    names = {}
    for i, v in enumerate(variants):
        why = unmeasurable(v.format)
        if why:
            raise ValueError(f"cannot profile {v.label}: {why}")
        name = _model_name(i, v.label)
        model_dir = root / name
        version_dir = model_dir / "1"
        version_dir.mkdir(parents=True)
        artifact_name = safe_formats.FILE_NAMES[v.format]
        (version_dir / artifact_name).write_bytes(v.artifact)
        install_adapter(version_dir, ADAPTERS[safe_formats.FRAMEWORKS[v.format]])
        sig = v.signature
        serving = ServingConfig(max_batch_size=int(sig.get("max_batch_size", 64)) or 64)
        parameters = {"artifact": artifact_name, "artifact_sha256": sha256_bytes(v.artifact), "threads": "1"}
        config = python_backend_config(
            name,
            {t["name"]: t["dims"] for t in sig["inputs"]},
            {t["name"]: t["dims"] for t in sig["outputs"]},
            serving,
            parameters,
        )
        write_config(config, model_dir)
        save_npz(model_dir / VALIDATION_FILE, {"features": np.ascontiguousarray(features, dtype=np.float32)})
        names[v.label] = name
    return names


def _figures(result: dict) -> dict[str, float]:
    lat = result["latency_ms"]
    return {
        "p50_ms": float(lat["p50"]),
        "p99_ms": float(lat["p99"]),
        "throughput_rps": float(result["throughput_rps"]),
        "cpu_ms_per_request": float((result.get("cpu") or {}).get("total_cpu_ms_per_request") or 0.0),
        "errors": float(result["errors_total"]),
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: float(statistics.median(r[key] for r in runs)) for key in runs[0]}


def profile(
    variants: Sequence[Variant],
    features: np.ndarray,
    settings: ProfileSettings = ProfileSettings(),
    *,
    workdir: Path | None = None,
    on_run: Callable[[str, int, int], None] | None = None,
) -> dict[str, dict[int, dict[str, float]]]:
    """label -> concurrency -> {p50_ms, p99_ms, throughput_rps, cpu_ms_per_request, errors} (medians)."""
    from loadtest.runner import prepare_pool

    if len({v.label for v in variants}) != len(variants):
        raise ValueError("variant labels must be unique")

    def pools(stack, repository: Path, names: Mapping[str, str]) -> dict[str, list[bytes]]:
        return {
            label: prepare_pool(stack.triton, name, data="validation", repository=str(repository), batch=settings.batch)
            for label, name in names.items()
        }

    return measure(lambda repository: write_repository(repository, variants, features), pools, settings, workdir=workdir, on_run=on_run)


def measure(
    write: Callable[[Path], dict[str, str]],
    make_pools: Callable[[Any, Path, Mapping[str, str]], dict[str, list[bytes]]],
    settings: ProfileSettings = ProfileSettings(),
    *,
    workdir: Path | None = None,
    on_run: Callable[[str, int, int], None] | None = None,
) -> dict[str, dict[int, dict[str, float]]]:
    """The measuring loop behind ``profile``, for any repository layout.

    ``write(repository)`` writes one Triton model per variant and returns label -> model name;
    ``make_pools(stack, repository, names)`` returns label -> pre-serialized requests. One stack,
    interleaved rounds, medians (see the module docstring).
    """
    from loadtest.engine import LoadSpec
    from loadtest.runner import RunConfig, run
    from loadtest.stack import start_stack, stop_stack

    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="inferplane-profile-")) if own else Path(workdir)
    try:
        repository = root / "model_repository"
        names = write(repository)
        env = {**STACK_ENV, "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts")}
        stack = start_stack(repository, root / "stack", "--workers", "1", env=env)
        try:
            triton_pid = stack.triton_pid()
            pools = make_pools(stack, repository, names)
            labels = list(names)
            runs: dict[str, dict[int, list[dict[str, float]]]] = {label: {c: [] for c in settings.concurrencies} for label in labels}
            for concurrency in settings.concurrencies:
                spec = LoadSpec(concurrency=concurrency, warmup=settings.warmup_s, duration=settings.duration_s)
                for rnd in range(settings.rounds):
                    order = labels[rnd % len(labels) :] + labels[: rnd % len(labels)]
                    for label in order:
                        if on_run is not None:
                            on_run(label, concurrency, rnd)
                        cfg = RunConfig(target=stack.triton, model=names[label], spec=spec, batch=settings.batch, pids=(triton_pid,), label=label)
                        runs[label][concurrency].append(_figures(run(cfg, pools[label])))
        except BaseException as err:
            tail = stack.log_tail(20)
            stop_stack(stack)
            if isinstance(err, Exception):
                raise RuntimeError(f"profiling failed: {err}\n{tail}") from err
            raise
        stop_stack(stack)
        return {label: {c: _median(r) for c, r in by_c.items()} for label, by_c in runs.items()}
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
