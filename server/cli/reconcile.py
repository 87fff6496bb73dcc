"""CLI of a cluster's database and Tritons: ``control migrate`` (the schema, once; a Kubernetes Job
runs it before the control plane and the frontends roll out) and ``control reconcile`` (the Triton
reconciler, ``server.control.service.reconciler``, on its own: desired placements to every Triton's loaded
models; ``control run`` runs the same loop under its leader lease).

```
inferplane control migrate                                   # INFERPLANE_DATABASE_URL to the newest revision
inferplane control reconcile --repository s3://models/repository   # one loop per group of INFERPLANE_MODEL_GROUPS_FILE
inferplane control reconcile --triton-service triton-general:8001 --repository s3://models/repository
inferplane control reconcile --triton-url 127.0.0.1:8001,127.0.0.1:8011 --repository var/model_repository --once
```
"""

from __future__ import annotations

import asyncio
from typing import Optional

import typer

from server.cli.autoscale import control_app
from server.cli.options import parse_duration
from server.runtime.process import log_to_stderr, stop_on_signals


def mount(app: typer.Typer) -> None:
    """The commands join ``control`` (mounted by ``server.cli.autoscale``)."""


@control_app.command("migrate")
def control_migrate() -> None:
    """Bring INFERPLANE_DATABASE_URL's schema to the newest revision, under the database's migration
    lock: however many run at once, one migrates and the others find the schema at head."""
    from server import migrations
    from server.db import display_url, make_engine
    from server.settings import Settings

    settings = Settings()
    engine = make_engine(settings.database_url)
    try:
        before, after = migrations.upgrade(engine)
    finally:
        engine.dispose()
    where = display_url(settings.database_url)
    typer.echo(f"migrated {where} from {before or 'empty'} to {after}" if before != after else f"{where} already at {after}")


@control_app.command("reconcile")
def control_reconcile(
    triton_url: Optional[str] = typer.Option(None, "--triton-url", help="Tritons' gRPC addresses, comma-separated [default: INFERPLANE_TRITON_URL]."),
    triton_service: Optional[str] = typer.Option(None, "--triton-service", help="A headless Service HOST:PORT whose addresses are the Tritons."),
    repository: Optional[str] = typer.Option(None, "--repository", help="The model repository every Triton reads (folder or s3:// gs:// URL) [default: INFERPLANE_MODEL_REPOSITORY_URL]."),
    drain: Optional[str] = typer.Option(None, "--drain", help="How long a removed version stays loaded before it is unloaded [default: 30s]."),
    interval: Optional[str] = typer.Option(None, "--interval", help="How often to reconcile [default: 2s]."),
    prune: bool = typer.Option(False, "--prune", help="Also unload models no placement names (Tritons owned outright)."),
    once: bool = typer.Option(False, "--once", help="One round, print what was applied, exit."),
) -> None:
    """Load every placed model version on the Tritons it is placed on; unload removed ones after their drain.
    Without --triton-url / --triton-service: one loop per model group of INFERPLANE_MODEL_GROUPS_FILE."""
    from server.settings import Settings

    if triton_url and triton_service:
        raise typer.BadParameter("name the Tritons with one of --triton-url or --triton-service")
    given = {"triton_url": triton_url, "model_repository_url": repository}
    if drain is not None:
        given["reconcile_drain_s"] = parse_duration(drain)
    if interval is not None:
        given["reconcile_interval_s"] = parse_duration(interval)
    settings = Settings(**{k: v for k, v in given.items() if v is not None})
    if not (settings.triton_urls or triton_service or settings.model_groups_file):
        raise typer.BadParameter("name the Tritons: --triton-url, --triton-service or INFERPLANE_MODEL_GROUPS_FILE")
    log_to_stderr(settings.log_level)
    asyncio.run(_reconcile(settings, triton_service, prune, once))


async def _reconcile(settings, triton_service: str | None, prune: bool, once: bool) -> None:
    from server import migrations
    from server.control.scaling.placement_store import PlacementStore
    from server.control.service.reconciler import TritonReconciler, from_settings, settings_kwargs
    from server.dataplane.replicas import DnsSource
    from server.db import make_engine

    engine = make_engine(settings.database_url)
    await asyncio.to_thread(migrations.upgrade, engine)
    store = PlacementStore(engine)
    if triton_service:
        host, _, port = triton_service.rpartition(":")
        reconcilers = [TritonReconciler(store, DnsSource(host, int(port)), prune=prune, **settings_kwargs(settings))]
    else:
        reconcilers = from_settings(settings, store, prune=prune)
    try:
        if once:
            for reconciler in reconcilers:
                for target, actions in (await reconciler.reconcile_once()).items():
                    state = reconciler.state[target]
                    typer.echo(f"{target}: {', '.join(map(str, actions)) or 'in step'}" + (f" ({state.error})" if state.error else ""))
            return
        stop = stop_on_signals()
        await asyncio.gather(*(r.run(stop, settings.reconcile_interval_s) for r in reconcilers))
    finally:
        for reconciler in reconcilers:
            await reconciler.close()
        engine.dispose()
