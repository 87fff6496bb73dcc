"""Zones on local Tritons (issue 29): replicas open in two zones (``INFERPLANE_LOCAL_ZONES=a,b``), the
frontend is in zone a (``INFERPLANE_ZONE``), one warm Triton waits (``INFERPLANE_WARM_POOL=1``). A
tier-1 endpoint gets two replicas, one per zone, on Tritons of its own — one of them the warm member
(its pid existed before the decision), the pool refilled behind it; its requests stay in zone a
while it serves; ``kill -9`` of every Triton of zone a under bounded load loses no admitted request
(the replica set spills to zone b, and retries the requests the dead Triton took with it there); a
zone a whose Tritons stay down past the grace period (each restart killed) has its copies placed again
in zone b, and they go back when zone a returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import grpc
import pytest

from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from tests.conftest import stop_stack, wait_until
from tests.integration.test_failure_domains import FRAUD, LGBM, Load, tree_stack
from tests.integration.test_fleet import triton_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {
    "INFERPLANE_LOCAL_ZONES": "a,b", "INFERPLANE_ZONE": "a", "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2",
    "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.2", "INFERPLANE_ISOLATION": "llm", "INFERPLANE_WARM_POOL": "1",
    "INFERPLANE_ZONE_DOWN_GRACE_S": "4",  # a zone whose Tritons stay down 4 s: its copies are placed in zone b
}  # fmt: skip


@pytest.fixture(scope="module")
def zoned(demo_repository, tmp_path_factory):
    stack = tree_stack(demo_repository, tmp_path_factory.mktemp("zones"), ENV)
    yield stack
    stop_stack(stack)


def _autoscale(stack):
    channel = grpc.insecure_channel(stack.grpc)
    return channel, autoscale_pb2_grpc.AutoscaleStub(channel)


def executor(stack) -> dict:
    channel, stub = _autoscale(stack)
    with channel:
        return json.loads(stub.Explain(apb.ExplainAutoscaleRequest(endpoint=FRAUD)).explain_json)["executor"]


def replicas(stack) -> list[dict]:
    return executor(stack)["replicas"]


def serving(stack) -> int:
    channel, stub = _autoscale(stack)
    with channel:
        return json.loads(stub.Explain(apb.ExplainAutoscaleRequest(endpoint=FRAUD)).explain_json)["serving_replicas"]


def rows(target: str) -> int:
    return triton_rows(target, FRAUD)


def test_tier_one_gets_two_replicas_in_two_zones_of_its_own(zoned):
    channel, stub = _autoscale(zoned)
    with channel:  # an autoscaling config first (tier 2, one copy): the executor is explainable
        stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=apb.AutoscaleConfig(min_replicas=1, max_replicas=1)))
    assert wait_until(lambda: len(executor(zoned)["warm"]) == 1, 60), executor(zoned)
    warm = executor(zoned)["warm"]
    channel, stub = _autoscale(zoned)
    with channel:
        status = json.loads(stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=apb.AutoscaleConfig(tier=1))).endpoints_json[0])
    assert status["min_replicas"] == 2  # tier 1 raised the default one replica to two
    # the copy on the shared local-0 moves out: loaded on the two new replicas first, then drained and unloaded
    assert wait_until(lambda: serving(zoned) == 2 and sum(FRAUD in r["models"] for r in replicas(zoned)) == 2, 90), replicas(zoned)
    hosts = [r for r in replicas(zoned) if FRAUD in r["models"]]
    assert sorted(r["zone"] for r in hosts) == ["a", "b"]
    assert all(r["models"] == [FRAUD] for r in hosts)  # no co-tenants: lightgbm is elsewhere
    assert [r["zone"] for r in replicas(zoned) if LGBM in r["models"]] == ["a"]
    # the scale-up took the warm member (started before the decision, empty) and the pool refilled
    assert warm[0] in {r["pid"] for r in hosts} and len(executor(zoned)["from_warm"]) == 1
    assert wait_until(lambda: len(executor(zoned)["warm"]) == 1 and executor(zoned)["warm"] != warm, 60), executor(zoned)


def test_requests_stay_in_the_frontends_zone_while_it_serves(zoned):
    hosts = {r["zone"]: r for r in replicas(zoned) if FRAUD in r["models"]}
    before = {z: rows(r["target"]) for z, r in hosts.items()}
    with Load(zoned, FRAUD, threads=2) as load:  # 2 in flight at most: below the spill threshold (8)
        load.served(200)
    assert not load.errors
    assert rows(hosts["a"]["target"]) - before["a"] >= load.ok
    assert rows(hosts["b"]["target"]) == before["b"]


def _tier_one(stack) -> None:
    """fraud_xgboost on two replicas, one per zone (what the first test arranges), when it is not yet, and
    every zone up (an earlier drill's stand-ins gone: lightgbm in zone a only)."""
    channel, stub = _autoscale(stack)
    with channel:
        stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=apb.AutoscaleConfig(tier=1)))

    def settled() -> bool:
        listed = executor(stack)
        zones = {m: sorted(r["zone"] for r in listed["replicas"] if m in r["models"]) for m in (FRAUD, LGBM)}
        up = all(r["state"] == "up" for r in listed["replicas"])
        return serving(stack) == 2 and zones == {FRAUD: ["a", "b"], LGBM: ["a"]} and up and listed["down_zones"] == []

    assert wait_until(settled, 90), executor(stack)


def _hosts(stack, model: str) -> list[tuple[str, str]]:
    return sorted((r["zone"], r["id"]) for r in replicas(stack) if model in r["models"])


def test_a_zone_that_stays_down_has_its_copies_placed_in_the_other_and_back_when_it_returns(zoned):
    _tier_one(zoned)
    zone_a = {r["id"] for r in replicas(zoned) if r["zone"] == "a"}
    before = {FRAUD: _hosts(zoned, FRAUD), LGBM: _hosts(zoned, LGBM)}

    def kill_zone_a() -> None:
        for r in replicas(zoned):
            if r["id"] in zone_a and r["pid"] is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r["pid"], signal.SIGKILL)

    def placed_in_b() -> bool:
        kill_zone_a()  # zone a's Tritons do not come back: each restart is killed as soon as it has a process
        in_b = {m: [h for h in _hosts(zoned, m) if h[0] == "b"] for m in (FRAUD, LGBM)}
        return len(in_b[FRAUD]) == 2 and len(in_b[LGBM]) == 1 and executor(zoned)["down_zones"] == ["a"]

    with Load(zoned, FRAUD, threads=2) as load:
        load.served(50)
        assert wait_until(placed_in_b, 60), replicas(zoned)  # the grace (4 s), then fraud's copy and lgbm in b
        kill_zone_a()
        assert wait_until(lambda: serving(zoned) >= 2, 60), replicas(zoned)  # two copies serving, both in zone b
        load.served(100)
        # zone a returns (its restarts no longer killed): the stand-ins in b go, the copies are as before
        assert wait_until(lambda: {m: _hosts(zoned, m) for m in before} == before, 90), replicas(zoned)
        assert wait_until(lambda: serving(zoned) == 2, 60), replicas(zoned)
        load.served(50)
    assert not load.errors, load.errors[:5]


def test_kill_9_of_zone_a_loses_no_admitted_request(zoned):
    zone_a = [r for r in replicas(zoned) if r["zone"] == "a"]
    b = next(r for r in replicas(zoned) if r["zone"] == "b" and FRAUD in r["models"])
    before_b = rows(b["target"])
    with Load(zoned, FRAUD, threads=4) as load:
        load.served(100)
        for replica in zone_a:
            os.kill(replica["pid"], signal.SIGKILL)
        killed_at = load.ok
        load.served(300)  # zone b serves through the outage
        assert rows(b["target"]) > before_b  # ... it did: the frontend spilled over
        pids = {r["id"]: r["pid"] for r in zone_a}
        assert wait_until(lambda: all(r["pid"] not in (None, pids[r["id"]]) for r in replicas(zoned) if r["id"] in pids), 90)
        assert wait_until(lambda: serving(zoned) == 2, 90), replicas(zoned)
        load.served(100)
    assert load.ok > killed_at and not load.errors, load.errors[:5]
