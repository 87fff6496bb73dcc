"""`inferplane keys|tenants|usage|cost` end to end on a SQLite file."""

import json

import typer
from typer.testing import CliRunner

from server.tenancy.identity import KeyRing
from server.cli import cost
from server.cli.tenancy import mount
from server.tenancy.store import TenancyStore, UsageRecord


def _app():
    app = typer.Typer()
    mount(app)
    cost.mount(app)
    return app


def test_keys_lifecycle_and_reports(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/cli.db"
    monkeypatch.setenv("INFERPLANE_DATABASE_URL", url)
    monkeypatch.setenv("INFERPLANE_KEY_PEPPER", "pep")
    run = CliRunner().invoke
    app = _app()

    out = run(app, ["keys", "create", "--tenant", "acme", "--team", "ml", "--plan", "premium", "--model", "m1,m2", "--rpm", "60", "--model-quota", "m1:rps=5", "--json"])
    assert out.exit_code == 0, out.output
    created = json.loads(out.output)
    key = created["key"]
    store = TenancyStore(url)
    ring = KeyRing(b"pep")
    ring.load(*store.snapshot())
    tenant = ring.authenticate(key).tenant
    assert tenant.team == "ml" and tenant.plan == "premium" and tenant.models == frozenset({"m1", "m2"})
    assert tenant.quota.rpm == 60 and tenant.model_quota("m1").rps == 5

    listed = run(app, ["keys", "list", "--json"])
    assert key not in listed.output and json.loads(listed.output)[0]["state"] == "active"

    rotated = json.loads(run(app, ["keys", "rotate", created["key_id"], "--grace", "1h", "--json"]).output)
    assert rotated["replaces"] == created["key_id"]
    states = {r["key_id"]: r["state"] for r in json.loads(run(app, ["keys", "list", "--json"]).output)}
    assert states == {created["key_id"]: "expiring", rotated["key_id"]: "active"}
    assert run(app, ["keys", "revoke", created["key_id"]]).exit_code == 0
    assert run(app, ["keys", "revoke", created["key_id"]]).exit_code == 1

    out = run(app, ["tenants", "set", "acme", "--model", "m3", "--plan", "free"])
    assert json.loads(out.output)["models"] == ["m3"]
    assert run(app, ["tenants", "set", "acme", "--plan", "gold"]).exit_code != 0

    store.write_usage([UsageRecord(1e10 - 5, "acme", "ml", "m3", "1", 3, 50, 7_200_000_000, input_tokens=20, output_tokens=30)])
    usage = json.loads(run(app, ["usage", "--by", "team", "--since", "1e9", "--json"]).output)
    assert usage == [{"team": "ml", "requests": 3, "input_tokens": 20, "output_tokens": 30, "tokens": 50, "compute_s": 7200.0}]
    out = run(app, ["usage", "--by", "model_version", "--since", "1e9"])
    header, line = out.output.splitlines()
    assert header.split() == ["model_version", "requests", "in_tokens", "out_tokens", "tokens", "compute_s"]
    assert line.split() == ["m3@1", "3", "20", "30", "50", "7200.000"]
    cost = json.loads(run(app, ["cost", "--by", "caller", "--window", "30d", "--until", "1e10", "--format", "json"]).output)
    assert cost[0]["team"] == "ml" and cost[0]["compute_s"] == 7200.0 and cost[0]["priced"] is False  # no replica reserved it
