"""``python -m optimizer.bench``: the optimizer tables for BENCHMARKS.md.

For each demo model (ONNX MLP, XGBoost, LightGBM) and the synthetic transformer block: register it
in a throwaway registry, run ``optimize --all`` (plus a forced INT4 on the MLP, to show the gate
rejecting), profile the parent and every gate-passing candidate together in one real Triton, and
print the tables as markdown. The embedding model (``minilm_embeddings``: all-MiniLM-L6-v2 exported
to ONNX, text in through the embedding adapter) goes through ``optimizer.embedding`` instead: same
recipes, a cosine gate on stored sentences, same profile, no registration.
``--models minilm_embeddings`` runs that one alone. Nothing here touches ``var/``.
"""

from __future__ import annotations

import io
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer

app = typer.Typer(add_completion=False)
MODELS = ("mlp_classifier", "fraud_xgboost", "lightgbm_regressor", "tiny_transformer", "minilm_embeddings")
EMBEDDING = "minilm_embeddings"  # not registered: see optimizer/embedding.py


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _register_demo(registry, name: str):
    from model_repository import demo
    from optimizer import synthetic

    if name == synthetic.NAME:
        rows = synthetic.rows(256)
        record, _ = registry.register(
            name, synthetic.transformer_block_onnx(), signature=synthetic.signature(), filename="model.onnx",
            validation=_npz(features=rows), tags={"gate.task": "embedding"}, actor="bench",
        )  # fmt: skip
        return record
    bundle = getattr(demo, name)()
    signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs], "max_batch_size": 64}
    record, _ = registry.register(
        name, bundle.artifact, signature=signature, filename=bundle.artifact_name,
        validation=_npz(features=bundle.features, expected=bundle.expected), training_run=f"seed-{bundle.seed}", actor="bench",
    )  # fmt: skip
    return record


@app.command()
def main(
    models: str = typer.Option(",".join(MODELS), help="Comma-separated subset of " + ", ".join(MODELS) + "."),
    concurrency: str = typer.Option("1,8", help="Closed-loop concurrencies."),
    duration: float = typer.Option(3.0, help="Measured seconds per run."),
    warmup: float = typer.Option(1.0, help="Warm-up seconds per run."),
    rounds: int = typer.Option(2, help="Interleaved rounds per concurrency (medians)."),
    out: Optional[Path] = typer.Option(None, help="Also write the markdown here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write every report as JSON here."),
) -> None:
    """Optimize every demo model with --all and print parent-vs-variant tables (markdown)."""
    import onnxruntime
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from optimizer.pipeline import optimize
    from optimizer.profile import ProfileSettings
    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry

    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise typer.BadParameter(f"unknown model(s) {unknown}")
    settings = ProfileSettings(tuple(int(c) for c in concurrency.split(",")), warmup, duration, rounds)
    started = time.perf_counter()
    parts = [
        "## Optimizer: parent vs candidates (`python -m optimizer.bench`)",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), no GPU; onnxruntime {onnxruntime.__version__}. "
        f"Each variant is its own model in one embedded Triton (Python-backend adapter, 1 instance, 1 thread, dynamic "
        f"batching up to 64); closed loop on Triton's gRPC port, 1 row per request, concurrency {'/'.join(map(str, settings.concurrencies))}, "
        f"{settings.warmup_s:g} s warm-up + {settings.duration_s:g} s measured, {settings.rounds} interleaved rounds, medians. "
        "Accuracy: the candidate against its parent on the stored validation rows (256 rows; the embedding model: sentences).",
    ]
    reports = []
    with tempfile.TemporaryDirectory(prefix="inferplane-bench-") as tmp:
        registry = Registry(f"sqlite:///{tmp}/registry.db", ArtifactStore(Path(tmp) / "artifacts"))
        try:
            with Progress(
                TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=True,
            ) as progress:  # fmt: skip
                for name in names:
                    if name == EMBEDDING:
                        from optimizer.embedding import SENTENCES, run_minilm

                        report = run_minilm(profile_settings=settings, progress=progress)
                        reports.append(report.to_dict())
                        parts += ["", f"### {name} (onnx, {report.task}; all-MiniLM-L6-v2, text in through the embedding adapter)", "",
                                  f"Every variant is the same adapter + tokenizer with its own model.onnx, one sentence per request; "
                                  f"accuracy: cosine against the parent on the {len(SENTENCES)} stored sentences (optimizer/embedding.py). "
                                  "Not registered (the registry keeps tokenizer companions for safetensors models only).", "",
                                  report.table()]  # fmt: skip
                        continue
                    record = _register_demo(registry, name)
                    forced = ["int4"] if name == "mlp_classifier" else []
                    report = optimize(registry, record.ref, forced, all_=True, profile_settings=settings, actor="bench", progress=progress)
                    reports.append(report.to_dict())
                    parts += ["", f"### {name} ({record.format}, {report.task})", "", report.table()]
        finally:
            registry.close()
    parts += ["", f"Total wall time: {time.perf_counter() - started:.0f} s."]
    text = "\n".join(parts)
    typer.echo(text)
    if out is not None:
        out.write_text(text + "\n")
    if json_out is not None:
        json_out.write_text(json.dumps(reports, indent=2, default=float) + "\n")


if __name__ == "__main__":
    app()
