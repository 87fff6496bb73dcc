"""``inferplane dev cluster``: the production topology on this machine (server.runtime.local_cluster)."""

from __future__ import annotations

from pathlib import Path

import typer

from server.runtime.process import log_to_stderr, stop_on_signals

dev_app = typer.Typer(help="Development helpers: a local cluster on loopback.", no_args_is_help=True)


def mount(app: typer.Typer) -> None:
    app.add_typer(dev_app, name="dev")


@dev_app.command("cluster")
def cluster(
    database_url: str = typer.Option("postgresql://postgres@127.0.0.1:5432/inferplane_dev", help="PostgreSQL (created when missing)."),
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", help="Redis for the shared quotas; '' for none."),
    model_repository: Path = typer.Option(Path("var/model_repository"), help="The one repository folder Triton reads."),
    workdir: Path = typer.Option(Path("var/cluster"), help="Logs and the processes' files."),
    controls: int = typer.Option(2, min=1, help="Control-plane replicas (one leads)."),
    frontends: int = typer.Option(2, min=1, help="Frontends (stateless)."),
    workers: int = typer.Option(2, min=1, help="Workers per frontend."),
    tritons: int = typer.Option(3, min=1, help="Triton processes, all reading the one repository folder."),
    auth: str = typer.Option("off", help="off: development mode (no API keys); on: keys required."),
) -> None:
    """PostgreSQL + Redis (this machine's), TRITONS Triton processes, CONTROLS control-plane replicas, FRONTENDS frontends with
    WORKERS workers each, all on loopback; prints the addresses; Ctrl-C stops everything."""
    import asyncio

    from server.runtime.local_cluster import ClusterError, LocalCluster, check_postgres, check_redis

    log_to_stderr("INFO")
    if not model_repository.is_dir():
        typer.secho(f"error: {model_repository} is not a folder: `make models` builds the demo models there", err=True, fg="red")
        raise typer.Exit(2)

    async def main() -> None:
        check_postgres(database_url)
        if redis_url:
            check_redis(redis_url)
        local = LocalCluster(database_url, redis_url or None, model_repository.resolve(), workdir.resolve(), controls, frontends, workers,
                             env={"INFERPLANE_AUTH": "true" if auth == "on" else "false"}, tritons=tritons)  # fmt: skip
        stop = stop_on_signals()
        try:
            await local.start()
            typer.echo("inferplane dev cluster ready\n" + local.describe(), color=False)
            typer.echo(f"deploy through any frontend: inferplane deploy NAME:V --url {local.members[-1].grpc}")
            await stop.wait()
        finally:
            await local.stop()
            typer.echo("inferplane dev cluster stopped")

    try:
        asyncio.run(main())
    except ClusterError as err:
        typer.secho(f"error: {err}", err=True, fg="red")
        raise typer.Exit(2) from None
