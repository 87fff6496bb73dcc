"""Owner and caller views of cost on a synthetic month with known answers (November 2026: 30 days, 720 h).

Prices (per replica-hour): cpu on-demand 0.10; a100 on-demand 3.60, spot 1.80.

Reserved capacity (the replica ledger), owner view:
- ``fraud`` (team risk): replica fraud#0, cpu, all month: 720 h x 0.10 = 72.00; replica fraud#1, cpu,
  up from 25 October to 11 November: 10 days in the window = 240 h x 0.10 = 24.00. fraud = 96.00 (960 h).
- ``llm`` (team ml) and ``embed`` (team search) share replica gpu-0 (a100 on-demand, 3.60/h), llm holding
  30 GiB and embed 10 GiB; embed leaves after 15 days. First 360 h: 360 x 3.60 = 1296.00, split 3/4 : 1/4
  -> llm 972.00 (270 h), embed 324.00 (90 h); last 360 h: llm alone 1296.00 (360 h). llm = 2268.00 (630 h),
  embed = 324.00 (90 h).
- ``batchy`` (team risk): a100 spot, 100 h x 1.80 = 180.00; nobody calls it.
- an interval in December: outside the window, costs nothing.
Owner total 96 + 2268 + 324 + 180 = 2868.00; per team risk 276.00, ml 2268.00, search 324.00.

Metered usage, caller view (each endpoint's callers share owner_cost x min(1, compute / reserved)):
- fraud: payments 480 h, risk 96 h of 960 h reserved -> used 0.6 x 96 = 57.60: payments 48.00, risk 9.60; idle 38.40.
- llm: support 315 h of 630 h -> 0.5 x 2268 = 1134.00 to support; idle 1134.00.
- embed: search 180 h of 90 h reserved (concurrent instances): capped at 1 -> search 324.00; no idle.
- batchy: idle 180.00.   - ghost (never in the ledger): team x 10 h, unpriced, 0.00.
Caller total 48 + 9.6 + 1134 + 324 + 0 + (38.4 + 1134 + 180) = 2868.00 = the owner total.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from server.control.planning.cost_store import CostStore, Interval
from server.control.planning.cost_views import IDLE, by_team, caller_view, owner_view, total
from server.control.planning.prices import load_prices, parse_prices

H = 3600.0
GIB = 1 << 30
START = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()
END = datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
PRICES = {"version": "test-1", "prices": {"cpu": {"on_demand": 0.10}, "a100": {"on_demand": 3.60, "spot": 1.80}}}
OWNERS = {"fraud": "risk", "llm": "ml", "embed": "search", "batchy": "risk"}

INTERVALS = [
    Interval("fraud#0", "fraud", "cpu", "on_demand", 0, START, None),
    Interval("fraud#1", "fraud", "cpu", "on_demand", 0, START - 7 * 24 * H, START + 10 * 24 * H),
    Interval("gpu-0", "llm", "a100", "on_demand", 30 * GIB, START, None),
    Interval("gpu-0", "embed", "a100", "on_demand", 10 * GIB, START, START + 360 * H),
    Interval("spot-0", "batchy", "a100", "spot", 0, START + 5 * H, START + 105 * H),
    Interval("fraud#2", "fraud", "cpu", "on_demand", 0, END + H, END + 2 * H),
]


def _usage(team, model, hours, requests=100, tokens=0):
    return {"team": team, "model": model, "requests": requests, "input_tokens": tokens, "output_tokens": 0, "tokens": tokens,
            "compute_us": int(hours * H * 1e6)}  # fmt: skip


USAGE = [
    _usage("payments", "fraud", 480), _usage("risk", "fraud", 96), _usage("support", "llm", 315, tokens=5_000_000),
    _usage("search", "embed", 180), _usage("x", "ghost", 10),
]  # fmt: skip


def test_the_owner_view_charges_reserved_time_idle_included_split_by_memory():
    rows = owner_view(INTERVALS, parse_prices(PRICES), START, END, OWNERS)
    got = {r["endpoint"]: (r["team"], r["replica_s"] / H, r["cost_usd"]) for r in rows}
    assert got == {
        "fraud": ("risk", pytest.approx(960), pytest.approx(96.0)),
        "llm": ("ml", pytest.approx(630), pytest.approx(2268.0)),
        "embed": ("search", pytest.approx(90), pytest.approx(324.0)),
        "batchy": ("risk", pytest.approx(100), pytest.approx(180.0)),
    }
    assert by_team(rows) == {"risk": pytest.approx(276.0), "ml": pytest.approx(2268.0), "search": pytest.approx(324.0)}
    assert all(r["prices"] == "test-1" for r in rows)


def test_the_caller_view_prices_consumption_and_both_views_agree_on_the_total():
    owner = owner_view(INTERVALS, parse_prices(PRICES), START, END, OWNERS)
    caller = caller_view(USAGE, owner)
    got = {(r["team"], r["endpoint"]): r["cost_usd"] for r in caller}
    assert got == {
        ("payments", "fraud"): pytest.approx(48.0), ("risk", "fraud"): pytest.approx(9.6), ("support", "llm"): pytest.approx(1134.0),
        ("search", "embed"): pytest.approx(324.0), ("x", "ghost"): 0.0,
        (IDLE, "fraud"): pytest.approx(38.4), (IDLE, "llm"): pytest.approx(1134.0), (IDLE, "batchy"): pytest.approx(180.0),
    }  # fmt: skip
    assert total(caller) == pytest.approx(total(owner), abs=1e-4) == pytest.approx(2868.0)
    ghost = next(r for r in caller if r["endpoint"] == "ghost")
    assert ghost["priced"] is False and ghost["compute_s"] == 36000.0
    assert next(r for r in caller if r["team"] == "support")["tokens"] == 5_000_000


def test_a_window_inside_the_month_clips_intervals():
    """Day 10-20 only: fraud#0 240 h + fraud#1 one day (24 h) x 0.10 = 26.40."""
    rows = owner_view(INTERVALS, parse_prices(PRICES), START + 9 * 24 * H, START + 19 * 24 * H, OWNERS)
    assert {r["endpoint"]: r["cost_usd"] for r in rows}["fraud"] == pytest.approx(26.4)


def test_price_lists_are_versioned_and_checked():
    book = load_prices()  # the newest file under deploy/prices/
    assert book.version and book.hourly("a100", "spot") < book.hourly("a100", "on_demand")
    with pytest.raises(ValueError, match="no hardware class 'tpu'"):
        book.hourly("tpu")
    with pytest.raises(ValueError, match="no `version:`"):
        parse_prices({"prices": {"cpu": {"on_demand": 1}}})
    with pytest.raises(ValueError, match="unknown capacity types"):
        parse_prices({"version": "x", "prices": {"cpu": {"on_demand": 1, "preemptible": 0.5}}})
    with pytest.raises(ValueError, match="no 'spot' price"):
        parse_prices(PRICES).hourly("cpu", "spot")


@pytest.fixture
def month_db(tmp_path):
    """The synthetic month in a real SQLite database: registry owners, replica ledger, metered usage."""
    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry
    from server.tenancy.store import TenancyStore, UsageRecord
    from tests.unit.test_registry import SIGNATURE, lightgbm

    url = f"sqlite:///{tmp_path}/cost.db"
    registry = Registry(url, ArtifactStore(tmp_path / "artifacts"))
    for i, (endpoint, team) in enumerate(OWNERS.items()):
        registry.register(endpoint, lightgbm(i + 2), signature=SIGNATURE, owner_team=team)
    store = CostStore(registry)
    for iv in INTERVALS:
        store.replica_up(iv.replica, iv.endpoint, hardware=iv.hardware, capacity_type=iv.capacity_type, memory_bytes=iv.memory_bytes, at=iv.started_at)
        if iv.ended_at is not None:
            store.replica_down(iv.replica, iv.endpoint, at=iv.ended_at)
    usage = TenancyStore(url)
    usage.write_usage([UsageRecord(START + 3600, "t-" + u["team"], u["team"], u["model"], "1", u["requests"], u["tokens"], u["compute_us"],
                                   input_tokens=u["tokens"]) for u in USAGE])  # fmt: skip
    prices = tmp_path / "prices.yaml"
    prices.write_text(json.dumps(PRICES))  # JSON is YAML
    yield url, store, usage, prices
    registry.close()
    usage.close()


def test_the_views_from_the_database_and_the_cli(month_db):
    from server.cli.main import app
    from server.control.planning.cost_reports import views

    url, store, usage, prices = month_db
    assert store.replica_up("gpu-0", "llm", hardware="a100") is False  # one open interval per (replica, endpoint)
    owner, caller = views(store, usage, parse_prices(PRICES), START, END)
    assert total(owner) == pytest.approx(2868.0) and total(caller) == pytest.approx(2868.0, abs=1e-4)

    run = CliRunner().invoke
    common = ["--window", "30d", "--until", "2026-12-01", "--prices", str(prices), "--database-url", url]
    out = run(app, ["cost", "--by", "owner", "--format", "csv", *common])
    assert out.exit_code == 0, out.output
    table = list(csv.DictReader(io.StringIO(out.output)))
    assert {r["endpoint"]: float(r["cost_usd"]) for r in table} == {"fraud": 96.0, "llm": 2268.0, "embed": 324.0, "batchy": 180.0}
    out = run(app, ["cost", "--by", "caller", "--format", "json", *common])
    assert out.exit_code == 0, out.output
    assert sum(r["cost_usd"] for r in json.loads(out.output)) == pytest.approx(2868.0, abs=1e-4)
    out = run(app, ["cost", "--by", "caller", "--format", "prom", *common])
    assert 'inferplane_cost_caller_usd{endpoint="llm",team="support"} 1134.0' in out.output
    assert 'inferplane_cost_owner_usd{endpoint="fraud",prices="test-1",team="risk"} 96.0' in out.output
    out = run(app, ["cost", "--by", "team", *common])
    assert out.exit_code != 0 and "owner, caller" in out.output


def test_the_replica_ledger_follows_what_the_fleet_serves(month_db):
    """Sync opens an interval per new (replica, endpoint), closes the ones gone; stop closes the rest."""
    from server.control.planning.replica_ledger import ReplicaLedger, ledger_changes

    assert ledger_changes({("r0", "a"), ("r0", "b")}, {"r0": {"a"}, "r1": {"a"}}) == ({("r1", "a")}, {("r0", "b")})
    _, store, _, _ = month_db
    for replica, endpoint in store.open_pairs():
        store.replica_down(replica, endpoint, at=END)
    now = [END + H]
    observed = {"local-0": {"fraud", "llm"}}
    ledger = ReplicaLedger(store, lambda: observed, hardware="a100", capacity_type="spot", memory_of=lambda m: GIB, clock=lambda: now[0])
    assert ledger.sync() == (2, 0) and ledger.sync() == (0, 0)
    now[0] = END + 2 * H
    observed = {"local-0": {"fraud"}, "local-1": {"fraud"}}
    assert ledger.sync() == (1, 1)
    now[0] = END + 3 * H
    asyncio.run(ledger.stop())
    assert store.open_pairs() == set()
    # hour 1: fraud and llm share local-0 (a100 spot 1.80/h) half each; hour 2: fraud alone on local-0 and
    # local-1 (2 x 1.80); plus the fixture's December interval fraud#2 (one cpu hour, 0.10)
    rows = owner_view(store.intervals(END, END + 4 * H), parse_prices(PRICES), END, END + 4 * H, OWNERS)
    assert {r["endpoint"]: r["cost_usd"] for r in rows} == {"fraud": pytest.approx(0.9 + 3.6 + 0.1), "llm": pytest.approx(0.9)}
