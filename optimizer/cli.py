"""``inferplane optimize NAME:VERSION [--graph] [--fp16] [--int8 dynamic|static] [--int4] [--tree-onnx] [--tensorrt] [--all]``.

Works on the registry directly (``--database-url`` / ``INFERPLANE_DATABASE_URL``,
``--artifact-store`` / ``INFERPLANE_ARTIFACT_STORE``), like ``inferplane models``. Heavy imports
happen inside the command so ``inferplane --help`` stays fast. Also runs on its own:
``python -m optimizer.cli NAME:VERSION --all``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Optimize a registered version: quantize / compile, gate on accuracy, measure, register.", add_completion=False)

INT8_MODES = {"dynamic": "int8-dynamic", "static": "int8-static"}


def mount(parent: typer.Typer) -> None:
    parent.command("optimize")(optimize)


def _concurrencies(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"--concurrency takes integers like 1,8 (got {text!r})") from None
    if not values or min(values) < 1:
        raise typer.BadParameter("--concurrency needs positive integers")
    return values


def optimize(
    ref: str = typer.Argument(..., help="NAME:VERSION (or NAME for the latest version) to optimize."),
    graph: bool = typer.Option(False, "--graph", help="ONNX Runtime offline graph optimization (extended) + onnxslim."),
    fp16: bool = typer.Option(False, "--fp16", help="Float16 weights and compute, float32 I/O (GPU targets)."),
    int8: Optional[list[str]] = typer.Option(None, "--int8", help="INT8 quantization: dynamic or static (QDQ, calibrated); repeatable."),
    calibration: Optional[Path] = typer.Option(None, help="Calibration rows for --int8 static (.npz with the input's name or 'features', or .npy); default: the version's validation rows."),
    int4: bool = typer.Option(False, "--int4", help="INT4 weight-only MatMulNBits (transformer graphs)."),
    tree_onnx: bool = typer.Option(False, "--tree-onnx", help="Compile an XGBoost / LightGBM model to ONNX."),
    tensorrt: bool = typer.Option(False, "--tensorrt", help="TensorRT engine plan (needs a GPU and TensorRT; otherwise reported as skipped)."),
    all_: bool = typer.Option(False, "--all", help="Every recipe that fits the model."),
    task: Optional[str] = typer.Option(None, help="classification | binary | regression | embedding (default: from the tags or the outputs)."),
    threshold: Optional[list[str]] = typer.Option(None, "--threshold", help="Gate threshold KEY=VALUE (e.g. min_top1_agreement=0.99, max_rel_error=0.001); repeatable."),
    profile: bool = typer.Option(True, "--profile/--no-profile", help="Measure parent and candidates in a real Triton with loadtest."),
    concurrency: str = typer.Option("1,8", help="Closed-loop concurrencies for the profile, comma separated."),
    duration: float = typer.Option(3.0, help="Measured seconds per profile run."),
    warmup: float = typer.Option(1.0, help="Warm-up seconds per profile run."),
    rounds: int = typer.Option(2, help="Interleaved rounds per concurrency (medians are reported)."),
    batch: int = typer.Option(1, help="Rows per request in the profile."),
    register: bool = typer.Option(True, "--register/--no-register", help="Register accepted candidates (--no-register: report only)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full report (all metrics) as JSON."),
    sign_key: Optional[Path] = typer.Option(None, help="Ed25519 private key (PEM) to sign registered candidates with."),
    database_url: Optional[str] = typer.Option(None, "--database-url", help="Registry database URL [env INFERPLANE_DATABASE_URL]."),
    artifact_store: Optional[str] = typer.Option(None, "--artifact-store", help="Artifact store [env INFERPLANE_ARTIFACT_STORE]."),
    actor: Optional[str] = typer.Option(None, "--actor", help="Who is acting, for the audit log (default: the OS user)."),
) -> None:
    """Make optimized candidates of a registered version, gate each on accuracy against it, measure
    them beside it in Triton, and register the accepted ones as new versions with lineage."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from optimizer.pipeline import optimize as run_optimize
    from optimizer.profile import ProfileSettings
    from server.errors import InferplaneError
    from server.cli.options import actor_name
    from server.cli.registry import fail, key_values, open_registry

    requested = [name for flag, name in ((graph, "graph"), (fp16, "fp16"), (int4, "int4"), (tree_onnx, "tree-onnx"), (tensorrt, "tensorrt")) if flag]
    for mode in int8 or []:
        if mode not in INT8_MODES:
            raise typer.BadParameter(f"--int8 takes dynamic or static, got {mode!r}")
        requested.append(INT8_MODES[mode])
    if calibration is not None and "int8-static" not in requested and not all_:
        raise typer.BadParameter("--calibration is for --int8 static (or --all)")
    if not requested and not all_:
        raise typer.BadParameter("give at least one recipe (--graph, --fp16, --int8 dynamic|static, --int4, --tree-onnx, --tensorrt) or --all")
    settings = ProfileSettings(_concurrencies(concurrency), warmup, duration, rounds, batch) if profile else None
    console = Console(stderr=True)
    registry = None
    try:
        registry = open_registry(database_url, artifact_store)
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        ) as progress:  # fmt: skip
            report = run_optimize(
                registry, ref, requested, all_=all_, calibration=calibration, thresholds=key_values(threshold, "--threshold"),
                task=task, profile_settings=settings, register=register, actor=actor_name(actor),
                sign_key=sign_key.read_bytes() if sign_key else None, progress=progress,
            )  # fmt: skip
    except InferplaneError as err:
        fail(err)
    finally:
        if registry is not None:
            registry.close()
    typer.echo(f"{report.parent}: {report.task} model; speed from {report.speed_source}")
    typer.echo(report.table())
    for row in report.rows[1:]:
        if row.gate is not None and not row.gate.passed:
            typer.echo(f"\n{row.label} rejected by the accuracy gate:\n{row.gate.report()}")
        if row.registered:
            verb = "registered" if row.created else "already registered as"
            typer.echo(f"{row.label}: {verb} {row.registered} (parent {report.parent}); deploy with `inferplane deploy {row.registered}`")
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_dict(), indent=2, default=float) + "\n")


app.command()(optimize)

if __name__ == "__main__":  # pragma: no cover
    app()
