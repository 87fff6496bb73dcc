"""``inferplane slo status|rules``, ``inferplane drift NAME``, ``inferplane dashboard``, ``inferplane chargeback``,
``inferplane rightsize``: what an on-call engineer asks a running frontend (its /metrics) or the usage records."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Annotated, Optional

import typer

from server.cli.options import table_wanted

slo_app = typer.Typer(help="Service-level objectives: error budgets and the Prometheus rules.", no_args_is_help=True)

MetricsUrl = Annotated[Optional[str], typer.Option("--metrics-url", help="A running frontend's /metrics [default: the settings' host and metrics port].")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
DEFAULT_METRICS = None  # the settings' host:metrics_port


def _metrics_url(url: str | None) -> str:
    if url:
        return url
    from server.settings import Settings

    settings = Settings()
    return f"http://{settings.host}:{settings.metrics_port}/metrics"


def _scrape(url: str | None) -> str:
    url = _metrics_url(url)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()
    except OSError as err:
        typer.secho(f"error: cannot read {url}: {err}", err=True, fg="red")
        raise typer.Exit(2) from None


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.3f}%"


@slo_app.command("status")
def slo_status(metrics_url: MetricsUrl = DEFAULT_METRICS, as_json: AsJson = False) -> None:
    """Each endpoint's objectives, what it achieved over the window and the error budget left."""
    from server.control.monitoring.slo import statuses_from_metrics

    rows = statuses_from_metrics(_scrape(metrics_url))
    if not table_wanted(rows, as_json, "no SLO figures yet (the frontend computes them a few seconds after it starts)"):
        return
    typer.echo(f"{'endpoint':<28} {'slo':<13} {'objective':>10} {'achieved':>10} {'budget left':>12}")
    for r in rows:
        slo = r["slo"] + (f" {r['threshold_ms']:g}ms" if "threshold_ms" in r else "")
        typer.echo(f"{r['model']:<28} {slo:<13} {_pct(r.get('objective')):>10} {_pct(r.get('good_ratio')):>10} {_pct(r.get('budget_remaining')):>12}")


@slo_app.command("rules")
def slo_rules(
    repository: Annotated[Path, typer.Option(help="Triton model repository whose configs name the objectives.")] = Path("var/model_repository"),
    out: Annotated[Optional[Path], typer.Option(help="Write here (default: print).")] = None,
) -> None:
    """Generate the Prometheus recording and burn-rate alert rules (SLOs and drift) for the endpoints."""
    from server.control.monitoring.slo import repository_objectives, rules_yaml
    from server.settings import Settings

    settings = Settings()
    text = rules_yaml(repository_objectives(repository, settings), psi_threshold=settings.drift_psi_threshold, ks_threshold=settings.drift_ks_threshold)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        typer.echo(f"wrote {out}")


def drift(
    name: str,
    metrics_url: MetricsUrl = DEFAULT_METRICS,
    top: Annotated[int, typer.Option(help="How many features to print.")] = 10,
    as_json: AsJson = False,
) -> None:
    """The features of NAME whose live distribution moved most from the validation set (PSI, KS)."""
    from server.control.monitoring.drift import report_from_metrics
    from server.settings import Settings

    settings = Settings()
    rows = report_from_metrics(_scrape(metrics_url), name)[:top]
    for r in rows:
        r["drifted"] = r.get("psi", 0.0) > settings.drift_psi_threshold or r.get("ks", 0.0) > settings.drift_ks_threshold
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no drift figures for {name} (not watched, no validation set, or fewer live rows than INFERPLANE_DRIFT_MIN_ROWS)")
        raise typer.Exit(1)
    typer.echo(f"{'feature':<32} {'psi':>8} {'ks':>8}  (thresholds: psi {settings.drift_psi_threshold:g}, ks {settings.drift_ks_threshold:g})")
    for r in rows:
        typer.echo(f"{r['feature']:<32} {r.get('psi', float('nan')):>8.4f} {r.get('ks', float('nan')):>8.4f}{'  DRIFTED' if r['drifted'] else ''}")


def dashboard(out: Annotated[Optional[Path], typer.Option(help="Write here (default: print).")] = None) -> None:
    """The Grafana dashboard JSON, generated from the metric names the frontend exports."""
    from server.control.monitoring.dashboard import dashboard_json

    text = dashboard_json()
    if out is None:
        typer.echo(text)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}")


def chargeback(
    since: Annotated[str, typer.Option(help="1h, 30m, 7d, an ISO date, or unix seconds")] = "30d",
    prices: Annotated[Optional[Path], typer.Option(help="JSON {hardware: USD per device-hour} or deploy/pricing.json's shape")] = None,
    hardware: Annotated[Optional[list[str]], typer.Option("--hardware", help="MODEL=HARDWARE (repeatable)")] = None,
    default_hardware: Annotated[str, typer.Option(help="Hardware of endpoints not named by --hardware")] = "cpu",
    database_url: Annotated[Optional[str], typer.Option("--database-url", help="Tenancy database [default: the settings']")] = None,
    as_json: AsJson = False,
) -> None:
    """Compute seconds and cost per team and endpoint (metered usage x the price table), with team totals."""
    from server.control.planning.rightsizing import chargeback as report
    from server.tenancy.metering import parse_since
    from server.tenancy.store import TenancyStore

    table, mapping = None, dict(item.split("=", 1) for item in hardware or [])
    if prices is not None:
        doc = json.loads(prices.read_text())
        table = doc.get("prices", doc)
        mapping = {**doc.get("hardware", {}), **mapping}
        default_hardware = doc.get("default_hardware", default_hardware) if default_hardware == "cpu" else default_hardware
    try:
        rows = report(TenancyStore(database_url).usage("team_model", parse_since(since)), table, mapping, default_hardware)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo(f"{'team':<20} {'endpoint':<24} {'hardware':<8} {'requests':>10} {'compute_s':>12} {'cost_usd':>12}")
    for r in rows:
        typer.echo(f"{r['team']:<20} {r['endpoint']:<24} {r['hardware']:<8} {r['requests']:>10} {r['compute_s']:>12.3f} {r['cost_usd']:>12.6f}")


def rightsize(
    metrics_url: MetricsUrl = DEFAULT_METRICS,
    interval: Annotated[float, typer.Option(min=1.0, help="Seconds between the two readings.")] = 30.0,
    target_utilization: Annotated[float, typer.Option(min=0.05, max=1.0)] = 0.6,
    url: Annotated[Optional[str], typer.Option("--url", help="The frontend's gRPC (instances, max batch) [env INFERPLANE_URL].")] = None,
    as_json: AsJson = False,
) -> None:
    """Observed utilization per endpoint: instances needed at the target utilization, rows per call, p99 vs SLO."""
    import time

    from server.control.planning.rightsizing import readings
    from server.control.planning.rightsizing import rightsize as report
    from server.control.monitoring.slo import statuses_from_metrics

    first = readings(_scrape(metrics_url))
    time.sleep(interval)
    text = _scrape(metrics_url)
    if not url:
        from server.settings import Settings

        url = Settings().url
    instances, max_batch = _model_shapes(url)
    thresholds = {r["model"]: r["threshold_ms"] / 1000 for r in statuses_from_metrics(text) if "threshold_ms" in r}
    rows = report(first, readings(text), interval, instances=instances, slo_latency_s=thresholds, max_batch=max_batch, target_utilization=target_utilization)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo(f"{'endpoint':<24} {'rps':>8} {'busy':>6} {'inst':>5} {'util':>6} {'need':>5} {'rows/call':>9} {'p99 ms':>8} {'slo ms':>7}  batching")
    for r in rows:
        typer.echo(
            f"{r['model']:<24} {r['rps']:>8.1f} {r['busy_instances']:>6.2f} {r['instances']:>5} {r['utilization']:>6.2f} {r['recommended_instances']:>5} "
            f"{r['rows_per_call'] if r['rows_per_call'] is not None else '-':>9} {r['p99_ms'] if r['p99_ms'] is not None else '-':>8} "
            f"{r['slo_latency_ms'] if r['slo_latency_ms'] is not None else '-':>7}  {r['batching']}"
        )


def _model_shapes(url: str) -> tuple[dict[str, int], dict[str, int]]:
    """Instances and max batch size per served model, from the frontend's ModelConfig (empty when unreachable)."""
    try:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url)
        instances, batch = {}, {}
        for m in client.get_model_repository_index().models:
            config = client.get_model_config(m.name).config
            instances[m.name] = max(1, sum(max(1, g.count) for g in config.instance_group))
            batch[m.name] = config.max_batch_size
        client.close()
        return instances, batch
    except Exception:  # noqa: BLE001 - the report works without them (one instance assumed)
        return {}, {}


def mount(app: typer.Typer) -> None:
    """Add ``slo``, ``drift``, ``dashboard``, ``chargeback`` and ``rightsize`` to the ``inferplane`` command line."""
    app.add_typer(slo_app, name="slo")
    app.command("drift")(drift)
    app.command("dashboard")(dashboard)
    app.command("chargeback")(chargeback)
    app.command("rightsize")(rightsize)
