"""The generated Prometheus rules file: up to date with the endpoints' configs, valid for `promtool check
rules`, and its burn-rate and drift alerts fire (and stay silent) on the synthetic series of
deploy/prometheus/inferplane-rules.test.yaml under `promtool test rules` (Debian's prometheus package;
`make provision` installs it). Without promtool these tests fail: the alerts are only trusted once Prometheus's
own rule engine has evaluated them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.promtool import promtool, rules_test_with_alert_changed
from server.control.monitoring.slo import ALERTS, Objective, objective_for, repository_objectives, rules, rules_yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = DEPLOY / "inferplane-rules.yaml"
TESTS = DEPLOY / "inferplane-rules.test.yaml"


def test_the_rules_file_is_generated_from_the_demo_endpoints(tmp_path):
    from model_repository.demo import build_demo_repository

    repo = tmp_path / "repo"
    build_demo_repository(repo)
    assert RULES.read_text() == rules_yaml(repository_objectives(repo)), (
        "deploy/prometheus/inferplane-rules.yaml is stale: regenerate it with "
        "`inferplane slo rules --repository DIR --out deploy/prometheus/inferplane-rules.yaml` from `inferplane demo build --no-llm`"
    )


@pytest.mark.service("promtool")
def test_promtool_checks_the_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.service("promtool")
def test_promtool_unit_tests_fire_and_stay_silent_as_written():
    out = promtool("test", "rules", TESTS.name, cwd=DEPLOY)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.service("promtool")
def test_promtool_catches_a_rule_that_pages_too_early(tmp_path):
    """The unit tests can fail: with the fast page at 2x instead of 14.4x, the ticket-only endpoint pages."""
    out = rules_test_with_alert_changed(RULES, TESTS, tmp_path, "InferplaneSLOBurnPageFast", lambda expr: expr.replace("(14.4 *", "(2 *"))
    assert out.returncode != 0
    assert "lightgbm_regressor" in out.stdout + out.stderr


def test_alerts_follow_the_sre_workbook_windows():
    assert [(a[2], a[3], a[4]) for a in ALERTS] == [(14.4, "1h", "5m"), (6.0, "6h", "30m"), (1.0, "3d", "6h")]
    doc = rules([Objective("m", 0.995, 0.05, 0.9)])
    budgets = {(r["labels"]["model"], r["labels"]["slo"]): r["expr"] for g in doc["groups"] for r in g["rules"] if r.get("record") == "inferplane:slo_error_budget"}
    assert budgets == {("m", "availability"): "0.005", ("m", "latency"): "0.1"}
    latency = [r["expr"] for g in doc["groups"] for r in g["rules"] if r.get("labels", {}).get("slo") == "latency" and "record" in r and "le=" in r["expr"]]
    assert latency and all('le="0.05"' in e for e in latency)


def test_objectives_come_from_the_endpoint_config_with_defaults():
    o = objective_for("x", {"inferplane.slo_availability": "0.99", "inferplane.slo_latency_ms": "30", "inferplane.slo_latency_target": "0.95"})
    assert (o.availability, o.latency_s, o.latency_target, o.latency_bucket) == (0.99, 0.03, 0.95, 0.02)
    d = objective_for("y", {"inferplane.slo_availability": "1.5", "inferplane.slo_latency_ms": "nope"})
    assert (d.availability, d.latency_s) == (0.999, 0.1)
