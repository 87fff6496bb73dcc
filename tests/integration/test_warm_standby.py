"""Warm standbys (issue 29): ``INFERPLANE_WARM_STANDBY=fraud_xgboost=1`` keeps a Triton holding
fraud_xgboost loaded, out of rotation, and gives fraud_xgboost a replica of its own (not the embedded
Triton, where lightgbm_regressor stays: server.control.scaling.isolation). ``kill -9`` of the Triton
serving its one copy under bounded load: the standby takes its place (the drill of issue 29 for a
tree model), fraud_xgboost answers bit-exact again and lightgbm_regressor sees no error. A scale-up to two copies takes it (its pid existed before the
decision) into rotation without loading anything, its answers bit-exact with the first copy's and the
frontend's, and the pool loads another standby behind it; placement counts the standby's memory (a
standby larger than a replica is refused: tests/unit/test_warm_pool.py). ``kill -9`` of that replica's Triton under
bounded load: the new standby takes its place at once (the frontend sends it traffic), the dead one
restarts as the standby, and no admitted request is lost. While a standby is ready, a scale-down
waits only ``standby_down_factor`` of its window (set through the gRPC ``AutoscaleConfig`` and
``inferplane autoscale set``). The pool converges on what it keeps: ``kill -9`` of the standby itself
restarts it loaded again; a standby whose load fails (its model's artifact missing while the pool
refills behind a scale-up) is started again after a backoff until it loads, and then takes over a
replica's ``kill -9``. Timings go to ``loadtest/warm_pool.py``
and ``loadtest/crash_isolation.py`` (BENCHMARKS.md §19), not here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from tests.conftest import stop_stack, wait_until
from tests.integration.test_failure_domains import FRAUD, LGBM, Load, tree_stack
from tests.integration.test_fleet import triton_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {
    "INFERPLANE_ISOLATION": "llm", "INFERPLANE_WARM_STANDBY": f"{FRAUD}=1", "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2",
    "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.2",
}  # fmt: skip
QUICK = {"scale_down_window_s": 0.0, "down_cooldown_s": 0.0, "target": 1000.0, "predictive": False}


@pytest.fixture(scope="module")
def standby(demo_repository, tmp_path_factory):
    stack = tree_stack(demo_repository, tmp_path_factory.mktemp("standby"), ENV)
    yield stack
    stop_stack(stack)


def configure(stack, **fields) -> None:
    with grpc.insecure_channel(stack.grpc) as channel:
        config = apb.AutoscaleConfig(**{**QUICK, **fields})
        autoscale_pb2_grpc.AutoscaleStub(channel).Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=config))


def explain(stack) -> dict:
    with grpc.insecure_channel(stack.grpc) as channel:
        return json.loads(autoscale_pb2_grpc.AutoscaleStub(channel).Explain(apb.ExplainAutoscaleRequest(endpoint=FRAUD)).explain_json)


def hosts(stack) -> dict[str, dict]:
    return {r["id"]: r for r in explain(stack)["executor"]["replicas"] if FRAUD in r["models"]}


def standbys(stack) -> list[int]:
    return explain(stack)["executor"]["standby"].get(FRAUD, [])


def one_standby(stack, other_than: int | None = None) -> int:
    """The pid of the one ready standby of fraud (not ``other_than``), from the Explain that showed it: a list read
    again could differ (a standby is listed only while ready)."""
    seen: list[int] = []

    def one() -> bool:
        seen[:] = standbys(stack)
        return len(seen) == 1 and seen[0] != other_than

    assert wait_until(one, 90), explain(stack)["executor"]
    return seen[0]


def kill_and_take_over(stack, victim: dict, standby_pid: int) -> int:
    """kill -9 of ``victim``'s Triton (a replica's row of Explain); the standby ``standby_pid`` takes its place,
    and the count of take-overs grows by one: that count, returned."""
    taken_before = explain(stack)["executor"]["taken_over"]
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_until(lambda: hosts(stack)[victim["id"]]["pid"] == standby_pid, 30), explain(stack)["executor"]
    taken = explain(stack)["executor"]["taken_over"]
    assert taken == taken_before + 1
    return taken


def answer(target: str) -> bytes:
    x = grpcclient.InferInput("features", [8, 32], "FP32")
    x.set_data_from_numpy(np.random.default_rng(29).random((8, 32), dtype=np.float32))
    with grpcclient.InferenceServerClient(target) as client:
        return client.infer(FRAUD, [x], client_timeout=30).as_numpy("probability").tobytes()


def test_the_model_with_a_standby_has_a_replica_of_its_own(standby):
    configure(standby, min_replicas=1, max_replicas=1)
    assert wait_until(lambda: len(standbys(standby)) == 1, 90), explain(standby)["executor"]
    (host,) = hosts(standby).values()
    assert host["id"] != "local-0" and host["models"] == [FRAUD]  # alone: the standby can take its place
    (embedded,) = [r for r in explain(standby)["executor"]["replicas"] if r["id"] == "local-0"]
    assert embedded["models"] == [LGBM]  # its co-tenant stays in the embedded Triton


def test_kill_9_of_the_one_copys_triton_hands_it_to_the_standby_and_the_other_endpoint_sees_nothing(standby):
    (victim,) = hosts(standby).values()
    waiting = one_standby(standby)
    before = answer(standby.grpc)
    with Load(standby, FRAUD, threads=2) as fraud, Load(standby, LGBM, threads=2) as other:
        fraud.served(50)
        other.served(50)
        assert kill_and_take_over(standby, victim, waiting) == 1
        fraud.served(100)  # served again, through the standby-turned-replica
        other.served(100)
        # the dead Triton restarted, loaded the model again and is the standby now
        assert wait_until(lambda: standbys(standby) and standbys(standby)[0] not in (waiting, victim["pid"]), 90), explain(standby)["executor"]
    assert not other.errors, other.errors[:5]  # the other endpoint: 0 errors through the drill
    assert not fraud.errors, fraud.errors[:5]  # the lost calls were retried on the standby (retry_lost)
    (taken,) = hosts(standby).values()
    assert taken["pid"] == waiting and answer(taken["target"]) == answer(standby.grpc) == before  # bit-exact


def test_a_scale_up_takes_the_loaded_standby_into_rotation(standby):
    (first,) = hosts(standby).values()
    waiting = one_standby(standby)
    executor = explain(standby)["executor"]
    assert waiting not in {r["pid"] for r in executor["replicas"]}  # out of rotation
    assert executor["standby_refused"] == {} and executor["memory_mb"]["standby"] > 0  # placed: it holds the model's memory
    configure(standby, min_replicas=2, max_replicas=2)
    assert wait_until(lambda: explain(standby)["serving_replicas"] == 2, 90), explain(standby)["executor"]
    copies = hosts(standby)
    (new,) = [r for r in copies.values() if r["id"] != first["id"]]
    assert new["pid"] == waiting and new["models"] == [FRAUD]  # the standby's Triton, not a process started now
    assert explain(standby)["executor"]["from_warm"][new["id"]] == FRAUD
    assert answer(new["target"]) == answer(copies[first["id"]]["target"]) == answer(standby.grpc)  # bit-exact
    # the pool loads another standby behind it (a new process, not the one taken)
    assert wait_until(lambda: len(standbys(standby)) == 1 and standbys(standby) != [waiting], 90), explain(standby)["executor"]


def test_kill_9_of_its_triton_hands_the_replica_to_the_standby(standby):
    victim = max(hosts(standby).values(), key=lambda r: r["id"])  # the copy the scale-up added
    waiting = one_standby(standby)
    with Load(standby, FRAUD, threads=4) as load:
        load.served(100)
        kill_and_take_over(standby, victim, waiting)
        taken = hosts(standby)[victim["id"]]
        before = triton_rows(taken["target"], FRAUD)
        load.served(300)
        assert triton_rows(taken["target"], FRAUD) > before  # the frontend sends the standby-turned-replica traffic
        # the dead Triton restarted, loaded the model again and is the standby now
        assert wait_until(lambda: standbys(standby) and standbys(standby)[0] not in (waiting, victim["pid"]), 90), explain(standby)["executor"]
        load.served(50)
    assert not load.errors, load.errors[:5]
    assert answer(taken["target"]) == answer(standby.grpc)


def test_a_ready_standby_shortens_the_scale_down_window_set_through_grpc(standby):
    """A 600 s scale-down window at factor 0.001 is 0.6 s while the standby is ready: the idle
    second copy goes within the bounded wait (at the default factor 0.25 it would take 150 s)."""
    assert wait_until(lambda: len(standbys(standby)) == 1 and explain(standby)["serving_replicas"] == 2, 90), explain(standby)["executor"]
    with pytest.raises(grpc.RpcError) as refused:
        configure(standby, standby_down_factor=1.5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "standby_down_factor must be in (0, 1]" in refused.value.details()
    done = subprocess.run([sys.executable, "-m", "server.cli.main", "autoscale", "set", FRAUD, "--min-replicas", "2", "--max-replicas", "2",
                           "--standby-down-factor", "0.5", "--url", standby.grpc], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert explain(standby)["config"]["standby_down_factor"] == 0.5  # the CLI's flag, stored
    configure(standby, min_replicas=1, max_replicas=2, scale_down_window_s=600.0, standby_down_factor=0.001)
    assert explain(standby)["config"]["standby_down_factor"] == 0.001 and explain(standby)["config"]["scale_down_window_s"] == 600.0
    assert wait_until(lambda: explain(standby)["serving_replicas"] == 1, 60), explain(standby)["decisions"][-5:]
    (down, *_) = [d for d in explain(standby)["decisions"] if d.get("action") == "down"]
    assert "a standby is ready" in down["reason"], down
    (left,) = hosts(standby).values()
    assert answer(left["target"]) == answer(standby.grpc)  # the copy that stays answers bit-exact


def test_the_pool_converges_a_killed_standby_reloads_and_a_failed_one_is_started_again(standby):
    waiting = one_standby(standby)
    os.kill(waiting, signal.SIGKILL)  # the standby itself: its supervisor restarts it, and it loads the model again
    waiting = one_standby(standby, other_than=waiting)
    failures = explain(standby)["executor"]["warm_failures"]
    artifact = standby.repository / FRAUD / "1" / "model.json"
    away = artifact.with_name("model.json.away")
    # the next standby's load fails (the adapter finds no artifact); a rename keeps the folder's files'
    # count and mtimes, so the standby waiting now is still current and the scale-up takes it
    artifact.rename(away)
    try:
        configure(standby, min_replicas=2, max_replicas=2)
        assert wait_until(lambda: explain(standby)["serving_replicas"] == 2, 90), explain(standby)["executor"]
        assert waiting in {r["pid"] for r in hosts(standby).values()}  # the scale-up took the standby
        assert wait_until(lambda: explain(standby)["executor"]["warm_failures"] > failures, 90), explain(standby)["executor"]
        assert standbys(standby) == []  # the refill behind it failed: short
    finally:
        away.rename(artifact)
    # started again after its backoff (not left short: nothing else changes the placement now), loaded
    again = one_standby(standby)
    assert again not in {r["pid"] for r in hosts(standby).values()}
    victim = max(hosts(standby).values(), key=lambda r: r["id"])
    with Load(standby, FRAUD, threads=2) as load:
        load.served(50)
        kill_and_take_over(standby, victim, again)
        load.served(100)
    assert not load.errors, load.errors[:5]
    assert answer(hosts(standby)[victim["id"]]["target"]) == answer(standby.grpc)  # bit-exact
