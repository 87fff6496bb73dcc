"""``inferplane cost`` (owner and caller views of cost over any window) and ``inferplane budget``
(monthly budgets per team or endpoint, spend so far, month-end forecast, the hard action at 100 %)."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from server.cli.options import actor_name
from server.cli.registry import open_registry

budget_app = typer.Typer(help="Monthly cost budgets per team or endpoint: set, list, status, remove.", no_args_is_help=True)

DbUrl = Annotated[Optional[str], typer.Option("--database-url", help="Database URL of the registry and the usage [env INFERPLANE_DATABASE_URL].")]
Prices = Annotated[Optional[Path], typer.Option("--prices", help="Price list YAML (default: the newest deploy/prices/*.yaml).")]
Format = Annotated[str, typer.Option("--format", help="table | csv | json | prom (Prometheus text exposition)")]
FORMATS = ("table", "csv", "json", "prom")
_AMOUNT = re.compile(r"^\$?\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*(usd)?$", re.IGNORECASE)


def parse_amount(text: str) -> float:
    """``5000USD``, ``5000``, ``$5,000.50`` -> USD."""
    m = _AMOUNT.match(text.strip())
    if not m:
        raise typer.BadParameter(f"{text!r} is not an amount of USD (e.g. 5000USD)")
    return float(m.group(1).replace(",", ""))


def _stores(database_url: Optional[str]):
    from server.control.planning.cost_store import CostStore
    from server.tenancy.store import TenancyStore

    registry = open_registry(database_url, None)
    usage = TenancyStore(database_url) if database_url else TenancyStore()
    return CostStore(registry), usage


def _prices(path: Optional[Path]):
    from server.control.planning.prices import load_prices

    try:
        return load_prices(path)
    except (OSError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None


def _write(rows: list[dict], fmt: str, columns: list[str], prom: bytes | None = None) -> None:
    if fmt == "json":
        typer.echo(json.dumps(rows, indent=2, default=str))
    elif fmt == "prom":
        sys.stdout.write((prom or b"").decode())
    elif fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        typer.echo(buf.getvalue(), nl=False)
    else:
        widths = {c: max(len(c), *(len(_cell(r.get(c))) for r in rows)) if rows else len(c) for c in columns}
        typer.echo("  ".join(c.ljust(widths[c]) for c in columns))
        for r in rows:
            typer.echo("  ".join(_cell(r.get(c)).ljust(widths[c]) for c in columns))


def _cell(value) -> str:
    return f"{value:.6f}" if isinstance(value, float) else str(value if value is not None else "")


def cost(
    by: Annotated[str, typer.Option("--by", help="owner (reserved replica-seconds x price, idle included) | caller (metered compute and tokens)")] = "owner",
    window: Annotated[str, typer.Option("--window", help="How far back from --until: 30d, 12h, 1w")] = "30d",
    until: Annotated[Optional[str], typer.Option("--until", help="End of the window: an ISO date/time or unix seconds (default: now)")] = None,
    fmt: Format = "table",
    prices: Prices = None,
    database_url: DbUrl = None,
) -> None:
    """Cost over a window from the database: per owner team and endpoint, or per calling team (with the
    reserved time nobody used as '(idle)'); both views add up to the same total."""
    from server.control.planning.cost_reports import VIEWS, exposition, views
    from server.tenancy.metering import parse_since

    if by not in VIEWS:
        raise typer.BadParameter(f"--by must be one of {', '.join(VIEWS)}")
    if fmt not in FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}")
    try:
        end = time.time() if until is None else parse_since(until)
        start = parse_since(window, now=end)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    book = _prices(prices)
    cost_store, usage = _stores(database_url)
    owner, caller = views(cost_store, usage, book, start, end)
    if by == "owner":
        _write(owner, fmt, ["team", "endpoint", "hardware", "replica_s", "cost_usd", "prices"], exposition(owner, caller))
    else:
        _write(caller, fmt, ["team", "endpoint", "requests", "input_tokens", "output_tokens", "tokens", "compute_s", "cost_usd"], exposition(owner, caller))


@budget_app.command("set")
def budget_set(
    name: Annotated[str, typer.Argument(help="The team (or, with --endpoint, the endpoint)")],
    amount: Annotated[str, typer.Argument(help="Monthly budget, e.g. 5000USD")],
    endpoint: Annotated[bool, typer.Option("--endpoint", help="NAME is an endpoint, not a team")] = False,
    hard_action: Annotated[str, typer.Option("--hard-action", help="At 100 %: none | refuse_deploys | cap_replicas")] = "none",
    actor: Annotated[Optional[str], typer.Option("--actor", help="Who is acting, for the audit log")] = None,
    database_url: DbUrl = None,
) -> None:
    """Set a monthly budget (audited)."""
    from server.control.planning.cost_store import Budget

    cost_store, _ = _stores(database_url)
    try:
        cost_store.set_budget(Budget("endpoint" if endpoint else "team", name, parse_amount(amount), hard_action), actor_name(actor))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(f"budget of {'endpoint' if endpoint else 'team'} {name}: {parse_amount(amount):,.2f} USD/month, hard action {hard_action}")


@budget_app.command("remove")
def budget_remove(
    name: str, endpoint: Annotated[bool, typer.Option("--endpoint")] = False,
    actor: Annotated[Optional[str], typer.Option("--actor")] = None, database_url: DbUrl = None,
) -> None:  # fmt: skip
    """Remove a budget (audited)."""
    cost_store, _ = _stores(database_url)
    if not cost_store.remove_budget("endpoint" if endpoint else "team", name, actor_name(actor)):
        raise typer.BadParameter(f"no budget for {name}")


@budget_app.command("status")
def budget_status(fmt: Format = "table", prices: Prices = None, database_url: DbUrl = None) -> None:
    """Every budget: spend this calendar month (UTC), month-end forecast, percent used."""
    from server.control.planning.budgets import BudgetGuard
    from server.control.planning.cost_reports import exposition

    book = _prices(prices)
    cost_store, _ = _stores(database_url)
    assessments, owner = BudgetGuard(cost_store, lambda: book).month_to_date()
    rows = [a.as_dict() for a in assessments]
    _write(rows, fmt, ["scope", "name", "budget_usd", "spent_usd", "forecast_usd", "percent", "forecast_over", "hard_action"],
           exposition(owner, [], assessments))  # fmt: skip


def mount(app: typer.Typer) -> None:
    """Add ``cost`` and ``budget`` to the ``inferplane`` command line."""
    app.command("cost")(cost)
    app.add_typer(budget_app, name="budget")
