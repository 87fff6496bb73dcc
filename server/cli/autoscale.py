"""CLI of the fleet: ``autoscale status|explain|set`` (the running frontend's ``inferplane.v1.Autoscale``
gRPC) and ``control run`` (the cluster's control-plane loop).

```
inferplane deploy fraud:3 --min-replicas 1 --max-replicas 4 --target-inflight 8 --scale-to-zero-after 300s
inferplane autoscale status                # per endpoint: replicas, signal, target, last decisions and why
inferplane autoscale explain fraud         # the signal history, the forecast beside reality, each decision with its inputs
inferplane autoscale set fraud --max-replicas 6
inferplane control run --frontend-url frontend:8001 --executor kubernetes
```
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from server.cli.options import (
    ACTOR, API_KEY, URL, ColdStartBudget, MaxReplicas, MinReplicas, ScaleToZeroAfter, TargetInflight, Tier, frontend_call, parse_duration,
    scaling_options, table_wanted,
)  # fmt: skip
from server.runtime.process import log_to_stderr

autoscale_app = typer.Typer(help="Autoscaling of deployed endpoints: status, explain, set.", no_args_is_help=True)
control_app = typer.Typer(help="The control plane of a cluster (registry, autoscaler, Kubernetes executor).", no_args_is_help=True)


def mount(app: typer.Typer) -> None:
    app.add_typer(autoscale_app, name="autoscale")
    app.add_typer(control_app, name="control")


def _call(url: str, actor: Optional[str], api_key: Optional[str], method: str, request, timeout: float = 60.0):
    from server.protogen.inferplane.v1 import autoscale_pb2_grpc

    return frontend_call(autoscale_pb2_grpc.AutoscaleStub, url, actor, api_key, method, request, timeout)


def configure(url: str, endpoint: str, fields: dict, actor: Optional[str] = None, api_key: Optional[str] = None) -> dict:
    """Set ``fields`` of the endpoint's autoscaling config through the frontend (the fields not
    given keep the endpoint's current values); returns its status."""
    from server.protogen.inferplane.v1 import autoscale_pb2 as apb

    answer = _call(url, actor, api_key, "Configure", apb.ConfigureAutoscaleRequest(endpoint=endpoint, config=apb.AutoscaleConfig(**fields)))
    return json.loads(answer.endpoints_json[0])


# ---- autoscale ----------------------------------------------------------------------------------


def _when(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "-"


def _decision_line(d: dict | None) -> str:
    if not d:
        return "-"
    moved = f" {d['from']}->{d['to']}" if "from" in d else ""
    return f"{d.get('action')}{moved}: {d.get('reason', '')} ({_when(d.get('t'))})"


@autoscale_app.command("status")
def status(
    url: str = URL,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per endpoint."),
    api_key: Optional[str] = API_KEY,
    actor: Optional[str] = ACTOR,
) -> None:
    """Per endpoint: replicas, signal, target, last decisions and why."""
    from server.protogen.inferplane.v1 import autoscale_pb2 as apb

    rows = [json.loads(s) for s in _call(url, actor, api_key, "Status", apb.AutoscaleStatusRequest()).endpoints_json]
    if not table_wanted(rows, as_json, "no autoscaled endpoints (inferplane deploy NAME:VERSION --min-replicas ... --max-replicas ...)"):
        return
    typer.echo(f"{'ENDPOINT':24} {'STATE':9} {'REPLICAS':>8} {'SERVING':>7} {'SIGNAL':10} {'VALUE':>8} {'TARGET':>7} {'MIN..MAX':>9} {'HELD':>5}  LAST DECISION")
    for r in rows:
        bounds = f"{r['min_replicas']}..{r['max_replicas']}"
        typer.echo(
            f"{r['endpoint']:24} {r['state']:9} {r['replicas']:>8} {r['serving_replicas']:>7} {r['signal']:10} {r['value']:>8.2f} "
            f"{r['target']:>7g} {bounds:>9} {r['held']:>5}  {_decision_line((r['last_decisions'] or [None])[-1])}"
        )
        for d in r["last_decisions"][:-1][-3:]:
            typer.echo(f"{'':24} {'':9} {'':>8} {'':>7} {'':10} {'':>8} {'':>7} {'':>9} {'':>5}  {_decision_line(d)}")


@autoscale_app.command("explain")
def explain(
    endpoint: str = typer.Argument(..., help="Endpoint (model) name."),
    url: str = URL,
    last: int = typer.Option(20, help="How many samples and forecasts to print."),
    as_json: bool = typer.Option(False, "--json", help="Everything, as JSON."),
    api_key: Optional[str] = API_KEY,
    actor: Optional[str] = ACTOR,
) -> None:
    """The signal history, the forecast next to reality, each decision with its inputs."""
    from server.protogen.inferplane.v1 import autoscale_pb2 as apb

    e = json.loads(_call(url, actor, api_key, "Explain", apb.ExplainAutoscaleRequest(endpoint=endpoint)).explain_json)
    if as_json:
        typer.echo(json.dumps(e, indent=2))
        return
    c = e["config"]
    typer.echo(
        f"{e['endpoint']}: {e['state']}, {e['replicas']} replica(s) ({e['serving_replicas']} serving) — target {c['target']:g} {c['signal']} "
        f"per replica, {c['min_replicas']}..{c['max_replicas']}, scale to zero after "
        f"{'never' if c['scale_to_zero_after_s'] is None else format(c['scale_to_zero_after_s'], 'g') + 's'}, cold-start budget {c['cold_start_budget_s']:g}s"
    )
    typer.echo(f"  windows: up {c['scale_up_window_s']:g}s / down {c['scale_down_window_s']:g}s; steps +{c['max_step_up']}/-{c['max_step_down']}; "
               f"cooldowns up {c['up_cooldown_s']:g}s / down {c['down_cooldown_s']:g}s; predictive {'on' if c['predictive'] else 'off'}")
    typer.echo(f"  executor: {e['executor'].get('executor')}; last provisioning {e['provision_s'] if e['provision_s'] is not None else '-'} s")
    typer.echo("\nsignals (latest last):")
    typer.echo(f"  {'TIME':8} {'INFLIGHT':>8} {'QUEUE':>6} {'WAIT_MS':>8} {'QPS':>8} {'TOK/S':>7} {'TRITON_Q_MS':>11} {'REPLICAS':>8}")
    for s in e["signals"][-last:]:
        tq = "-" if s.get("triton_queue_ms") is None else f"{s['triton_queue_ms']:.2f}"
        typer.echo(f"  {_when(s['t']):8} {s['inflight']:>8.1f} {s['queue']:>6.1f} {s['wait_ms']:>8.1f} {s['qps']:>8.1f} {s['tokens_per_s']:>7.1f} {tq:>11} {s['replicas']:>8}")
    typer.echo("\nforecast (request rate) next to reality:")
    typer.echo(f"  {'TIME':8} {'PREDICTED':>9} {'ACTUAL':>8} {'AHEAD':>6} {'PREDICTED_AHEAD':>15}")
    for f in e["forecast"][-last:]:
        p = "-" if f["predicted_qps"] is None else f"{f['predicted_qps']:.1f}"
        pa = "-" if f["predicted_qps_ahead"] is None else f"{f['predicted_qps_ahead']:.1f}"
        typer.echo(f"  {_when(f['t']):8} {p:>9} {f['actual_qps']:>8.1f} {f['ahead_s']:>5.0f}s {pa:>15}")
    typer.echo("\ndecisions:")
    for d in e["decisions"]:
        typer.echo(f"  {_decision_line(d)}")
        inputs = d.get("inputs")
        if inputs:
            shown = {k: v for k, v in inputs.items() if v is not None}
            typer.echo("      " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))
    if e["cold_starts"]:
        typer.echo("\ncold starts:")
        for c in e["cold_starts"]:
            typer.echo(f"  {_when(c['t'])} {c['seconds']:.2f}s weight cache: {c['weight_cache']} -> {c['replicas']} replica(s)")


@autoscale_app.command("set")
def set_config(
    endpoint: str = typer.Argument(..., help="Endpoint (model) name."),
    min_replicas: MinReplicas = None,
    max_replicas: MaxReplicas = None,
    target_inflight: TargetInflight = None,
    target: Optional[float] = typer.Option(None, help="Target per replica of --signal."),
    signal: Optional[str] = typer.Option(None, help="inflight | queue | qps | tokens_per_s | triton_queue_ms"),
    scale_to_zero_after: ScaleToZeroAfter = None,
    cold_start_budget: ColdStartBudget = None,
    unit: Optional[str] = typer.Option(None, help="replicas (processes / pods) | instances (the model's Triton instances, local executor)."),
    predictive: Optional[bool] = typer.Option(None, "--predictive/--reactive", help="Pre-scale from the forecast, or react only."),
    tier: Tier = None,
    standby_down_factor: Optional[float] = typer.Option(
        None, help="In (0, 1]: while a warm standby of the endpoint is ready, the scale-down window and down cooldown shrink to this fraction."
    ),
    url: str = URL,
    api_key: Optional[str] = API_KEY,
    actor: Optional[str] = ACTOR,
) -> None:
    """Set an endpoint's autoscaling config (stored with the endpoint, audited)."""
    fields = scaling_options(min_replicas, max_replicas, target_inflight, scale_to_zero_after, cold_start_budget, signal, target, tier)
    if unit is not None:
        fields["unit"] = unit
    if predictive is not None:
        fields["predictive"] = predictive
    if standby_down_factor is not None:
        fields["standby_down_factor"] = standby_down_factor
    r = configure(url, endpoint, fields, actor, api_key)
    typer.echo(f"{r['endpoint']}: {r['min_replicas']}..{r['max_replicas']} replicas, target {r['target']:g} {r['signal']}, state {r['state']}")


# ---- control run --------------------------------------------------------------------------------


@control_app.command("run")
def control_run(
    database_url: Optional[str] = typer.Option(None, "--database-url", help="The desired state's database (SQLAlchemy URL) [default: INFERPLANE_DATABASE_URL]."),
    triton_url: Optional[str] = typer.Option(None, "--triton-url", help="HOST:PORT of the Triton the deployer loads into [default: start an embedded one]."),
    model_repository: Optional[Path] = typer.Option(None, help="The model repository every Triton reads [default: var/model_repository]."),
    host: Optional[str] = typer.Option(None, help="Address the control RPCs listen on [default: 127.0.0.1]."),
    grpc_port: int = typer.Option(0, help="Port of the control RPCs (frontends find it in the lease row); 0 picks a free one."),
    advertise: Optional[str] = typer.Option(None, help="HOST:PORT frontends dial (a pod IP) [default: host:port]."),
    workdir: Optional[Path] = typer.Option(None, help="Logs and the embedded Triton's files [default: var/run]."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="Models to adopt at start [default: all]."),
    frontend_url: str = typer.Option("127.0.0.1:8001", "--frontend-url", help="--executor kubernetes: a frontend's gRPC address (load signals when no Prometheus is set)."),
    executor: str = typer.Option("", "--executor", help="Unset: the control-plane service; kubernetes: only the cluster autoscaler loop."),
    interval: str = typer.Option("5s", help="--executor kubernetes: how often to decide."),
    once: bool = typer.Option(False, "--once", help="--executor kubernetes: one round, print the decisions, exit (a dry look)."),
) -> None:
    """The control-plane service: deployer, traffic controller, autoscaler, batch runner, retention and the
    desired state's publisher behind one leader lease (PostgreSQL advisory lock; SQLite: a lease row). Run
    two or more: one leads, the others stand by and take over when its lease lapses. Frontends started with
    INFERPLANE_CONTROL_PLANE=external carry control RPCs here and apply the desired state it publishes.

    --executor kubernetes: the cluster's autoscaling loop alone. Settings from the environment:
    INFERPLANE_DATABASE_URL (the registry: configs), INFERPLANE_MODEL_GROUPS_FILE (endpoint -> Deployment),
    INFERPLANE_KUBERNETES_NAMESPACE, INFERPLANE_PROMETHEUS_URL (fleet-wide load; unset: the frontend's own samples)."""
    import asyncio

    from server.settings import Settings

    if not executor:
        _control_service(database_url, triton_url, model_repository, host, grpc_port, advertise, workdir, model)
        return
    if executor != "kubernetes":
        raise typer.BadParameter("--executor: only 'kubernetes' runs here (the local executor lives in `inferplane serve`)")
    settings = Settings()
    if settings.model_groups_file is None:
        typer.secho("error: INFERPLANE_MODEL_GROUPS_FILE is not set (the model groups: which Deployment serves which model)", err=True, fg="red")
        raise typer.Exit(2)
    log_to_stderr(settings.log_level)
    asyncio.run(_control(settings, frontend_url, parse_duration(interval), once))


def _control_service(database_url, triton_url, model_repository, host, grpc_port, advertise, workdir, models) -> None:
    """One control-plane replica: the embedded control plane of ``serve`` on a gRPC port of its own, one process."""
    from pydantic import ValidationError

    from server.app import StartupError, run
    from server.settings import Settings

    given = {
        "database_url": database_url, "triton_url": triton_url, "model_repository": model_repository, "host": host,
        "control_advertise": advertise, "workdir": workdir, "models": models or None,
    }  # fmt: skip
    try:
        settings = Settings(
            **{k: v for k, v in given.items() if v is not None}, control_plane="embedded", control_only=True, workers=1, grpc_port=grpc_port, http_port=0, metrics_port=0
        )
    except ValidationError as err:
        raise typer.BadParameter("; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in err.errors())) from None
    try:
        run(settings)
    except StartupError as err:
        typer.secho(f"error: {err}", err=True, fg="red")
        raise typer.Exit(2) from None


@control_app.command("status")
def control_status(
    database_url: Optional[str] = typer.Option(None, "--database-url", help="[default: INFERPLANE_DATABASE_URL]"),
) -> None:
    """Who leads the control plane: holder, address, term, and the desired state's generation."""
    from server.control.service.desired_state import DesiredStateStore
    from server.control.service.leader import lease_row
    from server.db import make_engine
    from server.settings import Settings

    from sqlalchemy.exc import DBAPIError

    settings = Settings(**({"database_url": database_url} if database_url else {}))
    engine = make_engine(settings.database_url)
    try:
        row = lease_row(engine)
        generation = DesiredStateStore(engine).generation()
    except DBAPIError:
        typer.secho("no control plane has run on this database yet (no lease table)", err=True, fg="red")
        raise typer.Exit(1) from None
    finally:
        engine.dispose()
    if row is None:
        typer.echo(f"no leader yet; desired state generation {generation}")
        return
    typer.echo(f"leader {row['holder']} at {row['address']} term {row['term']} (lease until {row['expires_at']:.1f}); desired state generation {generation}")


async def _control(settings, frontend_url: str, interval_s: float, once: bool) -> None:
    import asyncio

    from server.control.registry.artifacts import ArtifactStore
    from server.control.scaling.cluster import ClusterAutoscaler, FrontendSource, PrometheusSource
    from server.control.scaling.executors import KubernetesGroupExecutor, ModelGroups
    from server.control.scaling.kubernetes_executor import KubernetesExecutor
    from server.control.registry.registry import Registry
    from server.control.scaling.kube_warm_pool import KubeWarmPool
    from server.control.scaling.placement_store import PlacementStore
    from server.control.scaling.scaling_store import ScalingStore
    from server.control.service.reconciler import converger, for_groups, settings_kwargs

    registry = await asyncio.to_thread(Registry, settings.database_url, ArtifactStore(settings.artifact_store))
    groups = ModelGroups.load(settings.model_groups_file)
    k8s = KubernetesExecutor.from_settings(settings)
    # a scale-up takes a group's warm pods first, loaded by the group's reconciler (one round on that pod)
    warm = KubeWarmPool(k8s, converger(for_groups(groups, PlacementStore(registry.engine), **settings_kwargs(settings))))
    executor = KubernetesGroupExecutor(k8s, groups, warm)
    api_key = settings.api_key.get_secret_value()
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    source = PrometheusSource(settings.prometheus_url) if settings.prometheus_url else FrontendSource(frontend_url, metadata)
    loop = ClusterAutoscaler(
        ScalingStore(registry), executor, source, interval_s=interval_s,
        profile_period_s=settings.autoscale_profile_period_s, profile_slot_s=settings.autoscale_profile_slot_s,
        lead_s=settings.autoscale_lead_s if settings.autoscale_lead_s is not None else 60.0,
    )  # fmt: skip
    typer.echo(f"inferplane control plane: {len(groups.groups)} model group(s), executor {executor.describe()}, load from "
               f"{'prometheus ' + settings.prometheus_url if settings.prometheus_url else 'frontend ' + frontend_url}", err=True)
    try:
        if once:
            for change in await loop.tick():
                typer.echo(json.dumps(change, default=str))
            for name, ep in sorted(loop.endpoints.items()):
                typer.echo(f"{name}: {ep.state.replicas} replica(s); {ep.decisions[-1]['reason'] if ep.decisions else 'no reading'}")
            return
        await loop.run_forever()
    finally:
        await source.close()
        registry.close()
