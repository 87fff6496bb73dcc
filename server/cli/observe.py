"""``inferplane slo status|rules``, ``inferplane drift NAME``, ``inferplane dashboard``, ``inferplane chargeback``,
``inferplane rightsize``: what an on-call engineer asks a running frontend (its /metrics) or the usage records."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Annotated, Optional

import typer

slo_app = typer.Typer(help="Service-level objectives: error budgets and the Prometheus rules.", no_args_is_help=True)

MetricsUrl = Annotated[str, typer.Option("--metrics-url", envvar="INFERPLANE_METRICS_URL", help="A running frontend's /metrics.")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
DEFAULT_METRICS = "http://127.0.0.1:8002/metrics"


def _scrape(url: str) -> str:
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
    from server.control.slo import statuses_from_metrics

    rows = statuses_from_metrics(_scrape(metrics_url))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no SLO figures yet (the frontend computes them a few seconds after it starts)")
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
    from server.control.slo import repository_objectives, rules_yaml
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
    from server.control.drift import report_from_metrics
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
    from server.control.dashboard import dashboard_json

    text = dashboard_json()
    if out is None:
        typer.echo(text)
    else:
        out.write_text(text)
        typer.echo(f"wrote {out}")


def mount(app: typer.Typer) -> None:
    """Add ``slo``, ``drift`` and ``dashboard`` to the ``inferplane`` command line."""
    app.add_typer(slo_app, name="slo")
    app.command("drift")(drift)
    app.command("dashboard")(dashboard)
