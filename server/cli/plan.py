"""``inferplane plan capacity|gpus|cost``: fleet arithmetic, GPU packing, cost from metering.

Pure arithmetic over measured profiles (the load generator's JSON results), an inventory, and the
metered usage; nothing here talks to a cluster. ``plan gpus --out DIR`` writes the kustomize
overlay the gpu manifests consume (``deploy/overlays/gpu/packing``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Capacity planning: replicas, GPUs, memory and cost, with the arithmetic shown.", no_args_is_help=True)

DEFAULT_PROFILES = [Path("benchmarks/frontend/results.json")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")]


def _print_plans(plans, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([{"title": p.title, **p.figures} for p in plans], indent=2, default=str))
        return
    for i, p in enumerate(plans):
        if i:
            typer.echo("")
        typer.echo(p.text())


@app.command()
def capacity(
    example: Annotated[Optional[str], typer.Option(help="70b: the 70B memory arithmetic; fleet: 2M requests/s, a 50k tree endpoint, 500 versions.")] = None,
    profile: Annotated[Optional[list[Path]], typer.Option("--profile", help="Loadtest JSON results (repeatable); default benchmarks/frontend/results.json.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Size this model's endpoint for --target-rps.")] = None,
    target_rps: Annotated[Optional[float], typer.Option(help="Requests/s the endpoint must serve.")] = None,
    utilization: Annotated[float, typer.Option(min=0.05, max=1.0, help="Share of the throughput measured within the SLO planned per replica.")] = 1.0,
    zones: Annotated[int, typer.Option(min=1, help="Zones the fleet spreads over, sized N+1: losing one leaves capacity for the SLO.")] = 3,
    cores_per_replica: Annotated[float, typer.Option(min=0.1, help="Cores of the measured replica (the benchmark machine's).")] = 2.0,
    slo_p99_ms: Annotated[float, typer.Option(help="Use only measurements whose p99 meets this (the requirements' 20 ms).")] = 20.0,
    context: Annotated[int, typer.Option(min=1, help="70b: tokens per sequence (prompt + completion).")] = 4096,
    headroom: Annotated[float, typer.Option(min=0.0, max=0.9, help="70b: share of each GPU kept for activations and the CUDA context.")] = 0.10,
    gpu_memory_gib: Annotated[float, typer.Option(min=1.0, help="70b: memory of one GPU, GiB (an '80 GB' GPU holds 80 GiB = 85.9e9 bytes).")] = 80.0,
    streams: Annotated[int, typer.Option(min=1, help="70b: concurrent streams to size 4-GPU replicas for.")] = 10_000,
    aggregate_rps: Annotated[float, typer.Option(min=1.0, help="fleet: requests/s across all endpoints.")] = 2_000_000,
    tree_rps: Annotated[float, typer.Option(min=1.0, help="fleet: requests/s of the tree endpoint.")] = 50_000,
    tree_model: Annotated[str, typer.Option(help="fleet: the measured tree model.")] = "fraud_xgboost",
    versions: Annotated[int, typer.Option(min=1, help="fleet: model versions to store.")] = 500,
    as_json: AsJson = False,
) -> None:
    """Replicas, GPUs, memory and monthly cost for a traffic target, printing the arithmetic."""
    from server.control.planning import capacity as cap
    from server.tenancy.metering import DEFAULT_PRICES

    try:
        if example == "70b":
            plans = cap.example_70b(
                context=context, headroom=headroom, gpu_memory_gib=gpu_memory_gib, price_per_gpu_hour=DEFAULT_PRICES["h100"], streams=streams, zones=zones,
            )  # fmt: skip
        elif example in ("fleet", None):
            if example is None and (model is None or target_rps is None):
                raise typer.BadParameter("give --example 70b|fleet, or --model and --target-rps (with --profile)")
            profiles = cap.load_profiles(profile or DEFAULT_PROFILES, slo_p99_ms=slo_p99_ms)
            kw = dict(utilization=utilization, zones=zones, cores_per_replica=cores_per_replica, price_per_core_hour=DEFAULT_PRICES["cpu"])
            if example == "fleet":
                plans = cap.example_fleet(profiles, aggregate_rps=aggregate_rps, tree_rps=tree_rps, tree_model=tree_model, versions=versions, **kw)
            else:
                if model not in profiles:
                    raise typer.BadParameter(f"no measured profile for {model!r} (have: {', '.join(sorted(profiles)) or 'none'})")
                plans = [cap.replicas_for(target_rps, profiles[model], **kw)]
        else:
            raise typer.BadParameter(f"--example takes 70b or fleet, got {example!r}")
    except (ValueError, OSError) as err:
        raise typer.BadParameter(str(err)) from None
    _print_plans(plans, as_json)


@app.command()
def gpus(
    plan_file: Annotated[Path, typer.Argument(help='JSON {"nodes": [...], "models": [...]} (see deploy/overlays/gpu/inventory.json).')],
    out: Annotated[Optional[Path], typer.Option(help="Write the kustomize overlay of model groups here (e.g. deploy/overlays/gpu/packing).")] = None,
    reserve_gb: Annotated[float, typer.Option(min=0.0, help="GB kept free in every slot for the CUDA context.")] = 0.5,
    as_json: AsJson = False,
) -> None:
    """Pack models onto a GPU inventory (whole GPUs, MIG slices, MPS shares), best-fit decreasing."""
    from server.control.planning.gpu_packing import Model, Node, PackingError, overlay_files, pack

    try:
        spec = json.loads(plan_file.read_text())
        packing = pack([Node.from_dict(n) for n in spec["nodes"]], [Model.from_dict(m) for m in spec["models"]], reserve_gb=reserve_gb)
    except (OSError, ValueError, KeyError, TypeError) as err:
        message = f"lacks {err}" if isinstance(err, KeyError) else str(err)
        raise typer.BadParameter(f"{plan_file}: {message}") from None
    report = packing.report()
    if out is not None:
        files = overlay_files(packing)
        if out.exists():
            for old in sorted(out.rglob("*"), reverse=True):  # the folder is ours: written whole each time
                old.unlink() if old.is_file() else old.rmdir()
        for rel, text in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_text(text)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        for s in report["slots"]:
            typer.echo(
                f"{s['slot']:<32} {s['resource']:<24} {s['used_gb']:>7.2f}/{s['memory_gb']:<6g} GB"
                f"  compute {s['used_compute']:.2f}/{s['compute']:.2f}  {', '.join(s['models'])}"
            )
        base = report["one_model_per_gpu"]
        typer.echo(
            f"packed: {report['gpus_used']} of {report['gpus_total']} GPUs, {report['memory_placed_gb']:g} GB of models"
            f" in {report['memory_of_used_gpus_gb']:g} GB = {report['utilization']:.1%} utilization"
        )
        typer.echo(
            f"one model per GPU: {base['gpus']} GPUs, {base['utilization']:.1%} utilization"
            + ("" if base["fits_inventory"] else " (more GPUs than the inventory has)")
        )
        typer.echo(f"dedicated GPUs: {', '.join(report['dedicated']) or 'none'}")
        for u in report["unplaceable"]:
            typer.echo(f"unplaceable: {u['model']}: {u['reason']}")
    if out is not None:
        typer.echo(f"wrote {len(files)} files to {out}", err=True)
    if report["unplaceable"]:
        raise typer.Exit(3)


@app.command()
def cost(
    since: Annotated[str, typer.Option(help="1h, 30m, 7d, an ISO date, or unix seconds")] = "30d",
    config: Annotated[Optional[Path], typer.Option(help='JSON {"prices": {hw: USD/h}, "hardware": {model: hw}, "spot_discount": {hw: share}, "interruptible": [model]}; see deploy/pricing.json.')] = None,
    database_url: Annotated[Optional[str], typer.Option("--database-url", help="SQLAlchemy URL of the tenancy store [env INFERPLANE_DATABASE_URL; default: the settings']")] = None,
    as_json: AsJson = False,
) -> None:
    """Device-hours and dollars per endpoint and team from metered usage; spot savings for batch/shadow."""
    from server.control.planning.capacity import endpoint_costs
    from server.tenancy.metering import DEFAULT_PRICES, parse_since
    from server.tenancy.store import TenancyStore

    try:
        table = json.loads(config.read_text()) if config else {}
        rows = TenancyStore(database_url).usage("team_model", parse_since(since))
        plan = endpoint_costs(
            rows,
            prices=table.get("prices", DEFAULT_PRICES),
            hardware=table.get("hardware", {}),
            default_hardware=table.get("default_hardware", "cpu"),
            spot_discount=table.get("spot_discount", {}),
            interruptible=frozenset(table.get("interruptible", [])),
        )
    except (OSError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None
    _print_plans([plan], as_json)


def mount(root: typer.Typer) -> None:
    root.add_typer(app, name="plan")
