"""Cost reports from the database for any past window: the owner and caller views
(``server.control.planning.cost_views``) over the replica ledger and the metered usage, and their Prometheus
series (text exposition, for a textfile collector or a scrape of ``inferplane cost --format prom``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from server.control.planning.budgets import Assessment
from server.control.planning.cost_store import CostStore
from server.control.planning.cost_views import caller_view, owner_view
from server.control.planning.prices import PriceBook

VIEWS = ("owner", "caller")


def owners_of(registry) -> dict[str, str]:
    """Endpoint -> owning team (the registry's model owner; an endpoint is named after its model)."""
    return {m.name: m.owner_team for m in registry.list_models()}


def views(cost_store: CostStore, usage_store, prices: PriceBook, since: float, until: float) -> tuple[list[dict], list[dict]]:
    """(owner rows, caller rows) for [since, until)."""
    owner = owner_view(cost_store.intervals(since, until), prices, since, until, owners_of(cost_store.registry))
    caller = caller_view(usage_store.usage("team_model", since, until), owner)
    return owner, caller


def exposition(owner: list[dict], caller: list[dict], assessments: list[Assessment] = ()) -> bytes:
    """The views (and budgets) as Prometheus gauges; alert rules: deploy/prometheus/inferplane-budget-rules.yaml."""
    reg = CollectorRegistry()
    owner_g = Gauge("inferplane_cost_owner_usd", "Reserved cost in the window (replica-seconds x price), per owner team and endpoint.",
                    ["team", "endpoint", "prices"], registry=reg)  # fmt: skip
    caller_g = Gauge("inferplane_cost_caller_usd", "Consumed cost in the window, per calling team and endpoint ('(idle)': reserved, unused).",
                     ["team", "endpoint"], registry=reg)  # fmt: skip
    compute_g = Gauge("inferplane_cost_caller_compute_seconds", "Metered compute seconds in the window per calling team and endpoint.",
                      ["team", "endpoint"], registry=reg)  # fmt: skip
    tokens_g = Gauge("inferplane_cost_caller_tokens", "Metered tokens in the window per calling team and endpoint.", ["team", "endpoint"], registry=reg)
    for r in owner:
        owner_g.labels(r["team"], r["endpoint"], r["prices"]).set(r["cost_usd"])
    for r in caller:
        caller_g.labels(r["team"], r["endpoint"]).inc(r["cost_usd"])
        compute_g.labels(r["team"], r["endpoint"]).inc(r["compute_s"])
        tokens_g.labels(r["team"], r["endpoint"]).inc(r["tokens"])
    if assessments:
        budget_g = Gauge("inferplane_budget_usd", "Monthly budget.", ["scope", "name"], registry=reg)
        spend_g = Gauge("inferplane_budget_spend_usd", "Spend this calendar month (owner view).", ["scope", "name"], registry=reg)
        forecast_g = Gauge("inferplane_budget_forecast_usd", "Month-end spend forecast from the burn so far.", ["scope", "name"], registry=reg)
        for a in assessments:
            budget_g.labels(a.budget.scope, a.budget.name).set(a.budget.amount_usd)
            spend_g.labels(a.budget.scope, a.budget.name).set(a.spent_usd)
            forecast_g.labels(a.budget.scope, a.budget.name).set(a.forecast_usd)
    return generate_latest(reg)
