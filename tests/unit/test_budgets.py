"""Budgets: the month-end forecast, the 50/80/100 % and forecast-overrun alert rules under promtool
(deploy/prometheus/inferplane-budget-rules.test.yaml: they fire and stay silent as written), and the hard
action at 100 %: a deploy is refused with a clear error and the refusal is in the audit log."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.control.planning.budgets import BudgetExceeded, BudgetGuard, assess, forecast, month_bounds
from server.control.planning.cost_store import Budget, CostStore
from server.control.planning.prices import parse_prices
from server.errors import grpc_status, http_error
from tests.promtool import promtool, rules_test_with_alert_changed

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = DEPLOY / "inferplane-budget-rules.yaml"
TESTS = DEPLOY / "inferplane-budget-rules.test.yaml"
DEC = datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
DAY = 86400.0
PRICES = parse_prices({"version": "t", "prices": {"cpu": {"on_demand": 0.10}, "a100": {"on_demand": 3.60}}})


def test_month_bounds_and_a_linear_forecast():
    start, end = month_bounds(DEC + 10 * DAY + 5)
    assert (start, end) == (DEC, DEC + 31 * DAY)  # December has 31 days
    assert month_bounds(datetime(2027, 2, 14, tzinfo=timezone.utc).timestamp())[1] - month_bounds(datetime(2027, 2, 14, tzinfo=timezone.utc).timestamp())[0] == 28 * DAY
    # 100 USD in the first 10 days of 31 -> 310 USD at month end
    assert forecast(100.0, start, end, start + 10 * DAY) == pytest.approx(310.0)
    assert forecast(100.0, start, end, start) == 100.0  # nothing elapsed: no extrapolation


def test_assessment_thresholds_and_forecast_overrun():
    rows = [{"team": "risk", "endpoint": "fraud", "cost_usd": 450.0}, {"team": "risk", "endpoint": "batchy", "cost_usd": 400.0},
            {"team": "ml", "endpoint": "llm", "cost_usd": 100.0}]  # fmt: skip
    budgets = [Budget("team", "risk", 1000.0), Budget("endpoint", "llm", 200.0), Budget("team", "nobody", 10.0)]
    start, end = month_bounds(DEC)
    got = {a.budget.name: a for a in assess(budgets, rows, start, end, start + 15.5 * DAY)}  # half the month
    assert got["risk"].spent_usd == 850.0 and got["risk"].crossed == (0.5, 0.8) and not got["risk"].exhausted
    assert got["risk"].forecast_usd == pytest.approx(1700.0) and got["risk"].forecast_over
    assert got["llm"].crossed == (0.5,) and got["llm"].forecast_usd == pytest.approx(200.0) and not got["llm"].forecast_over
    assert got["nobody"].spent_usd == 0.0 and got["nobody"].crossed == ()


@pytest.mark.service("promtool")
def test_promtool_checks_the_budget_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@pytest.mark.service("promtool")
def test_budget_alerts_fire_and_stay_silent_as_written():
    out = promtool("test", "rules", TESTS.name, cwd=DEPLOY)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.service("promtool")
def test_promtool_catches_a_band_that_overlaps(tmp_path):
    """The unit tests can fail: with the 50 % band open at the top, the 90 % team fires it too."""
    out = rules_test_with_alert_changed(RULES, TESTS, tmp_path, "InferplaneBudget50", lambda _: "inferplane:budget_spent:ratio >= 0.5")
    assert out.returncode != 0 and "InferplaneBudget50" in out.stdout + out.stderr


@pytest.fixture
def spent(tmp_path):
    """Team risk owns ``fraud``, whose cpu replica has run 10 days of December: 240 h x 0.10 = 24 USD."""
    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry
    from tests.unit.test_registry import SIGNATURE, lightgbm

    url = f"sqlite:///{tmp_path}/budget.db"
    registry = Registry(url, ArtifactStore(tmp_path / "artifacts"))
    registry.register("fraud", lightgbm(2), signature=SIGNATURE, owner_team="risk")
    registry.register("other", lightgbm(3), signature=SIGNATURE, owner_team="ads")
    store = CostStore(registry, clock=lambda: DEC + 10 * DAY)
    store.replica_up("fraud#0", "fraud", hardware="cpu", at=DEC)
    yield url, registry, store
    registry.close()


def test_the_hard_action_refuses_a_deploy_and_is_audited(spent, tmp_path):
    from server.control.rollout.deployer import Deployer

    url, registry, store = spent
    guard = BudgetGuard(store, lambda: PRICES, clock=lambda: DEC + 10 * DAY)
    deployer = Deployer(registry, None, tmp_path / "repo")  # the guard answers before the dataplane is touched
    deployer.budget_guard = guard
    store.set_budget(Budget("team", "risk", 20.0, "refuse_deploys"), actor="finops")
    with pytest.raises(BudgetExceeded) as err:
        asyncio.run(deployer.deploy("fraud", actor="alice"))
    message = err.value.message
    assert "team 'risk' has spent $24.00 of its $20.00 monthly budget (120.0 %)" in message and "inferplane budget set risk" in message
    assert grpc_status(err.value).code.name == "FAILED_PRECONDITION" and http_error(err.value)[0] == 409
    log = registry.audit_log(10)
    refused = [e for e in log if e.action == "budget" and e.outcome == "refused"]
    assert len(refused) == 1 and refused[0].target == "fraud" and refused[0].actor == "alice" and "$24.00" in refused[0].detail
    assert any(e.action == "deploy" and e.outcome == "failed" and "refused" in e.detail for e in log)
    assert any(e.action == "budget" and e.target == "team:risk" and e.actor == "finops" for e in log)  # setting it is audited too

    guard.check_deploy("other", "alice")  # another team's endpoint deploys
    store.set_budget(Budget("team", "risk", 20.0, "none"), actor="finops")
    guard.check_deploy("fraud", "alice")  # without the hard action: alerts only
    store.set_budget(Budget("team", "risk", 30.0, "refuse_deploys"), actor="finops")
    guard.check_deploy("fraud", "alice")  # 80 % spent: still deploys
    store.set_budget(Budget("endpoint", "fraud", 10.0, "cap_replicas"), actor="finops")
    assert guard.replica_cap("fraud", 3) == 3 and guard.replica_cap("other", 3) is None
    assert any(e.outcome == "capped" for e in registry.audit_log(5))


def test_budget_cli_set_status_and_prometheus(spent, tmp_path):
    from server.cli.main import app

    url, registry, store = spent
    prices = tmp_path / "prices.yaml"
    prices.write_text("version: t\nprices:\n  cpu: {on_demand: 0.10}\n")
    run = CliRunner().invoke
    out = run(app, ["budget", "set", "risk", "5,000USD", "--hard-action", "refuse_deploys", "--actor", "finops", "--database-url", url])
    assert out.exit_code == 0 and "5,000.00 USD/month" in out.output, out.output
    assert run(app, ["budget", "set", "risk", "lots", "--database-url", url]).exit_code != 0
    assert run(app, ["budget", "set", "risk", "5USD", "--hard-action", "explode", "--database-url", url]).exit_code != 0
    assert run(app, ["budget", "set", "fraud", "100USD", "--endpoint", "--database-url", url]).exit_code == 0
    assert {(b.scope, b.name, b.amount_usd) for b in store.budgets()} == {("team", "risk", 5000.0), ("endpoint", "fraud", 100.0)}
    out = run(app, ["budget", "status", "--format", "prom", "--prices", str(prices), "--database-url", url])
    assert out.exit_code == 0, out.output
    assert 'inferplane_budget_usd{name="risk",scope="team"} 5000.0' in out.output
    assert "inferplane_budget_spend_usd" in out.output and "inferplane_budget_forecast_usd" in out.output
    assert run(app, ["budget", "remove", "fraud", "--endpoint", "--database-url", url]).exit_code == 0
    assert run(app, ["budget", "remove", "fraud", "--endpoint", "--database-url", url]).exit_code != 0
