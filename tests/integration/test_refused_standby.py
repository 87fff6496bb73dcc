"""A refused warm standby on the real stack (issue 29): ``INFERPLANE_WARM_STANDBY=fraud_xgboost=1``
asks for a standby, but the registry says one copy of fraud_xgboost needs 8 GiB (its hardware
metadata) and a local replica offers 4 GiB (``INFERPLANE_REPLICA_MEMORY_MB``'s default). The pool
starts the standby before the leader reads the registry's memory needs; once it has read them,
placement refuses the standby: its Triton stops, none starts again, ``inferplane autoscale
explain --json`` (the Explain RPC) reports it under ``standby_refused`` and holds no standby memory
— and the endpoint keeps serving on its replica, answers bit-exact, 0 errors under load. The
pure bookkeeping is tests/unit/test_warm_pool.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.control.rollout.llm_install import scratch_registry
from tests.conftest import stop_stack, wait_until
from tests.integration.test_failure_domains import FRAUD, Load, tree_stack
from tests.integration.test_warm_standby import ENV, answer, configure, explain, hosts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEED_MB = 8192  # one copy, per the registry: twice what a local replica offers (4096 MiB)


@pytest.fixture(scope="module")
def refused(demo_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    meta = json.loads((demo_repository / FRAUD / "inferplane.json").read_text())
    signature = dict(meta["signature"], **({"max_batch_size": meta["max_batch_size"]} if "max_batch_size" in meta else {}))
    registry = scratch_registry(root)  # the stack's registry (tree_stack points it there)
    try:
        registry.register(FRAUD, (demo_repository / FRAUD / meta["artifact"]).read_bytes(), signature=signature,
                          filename=meta["artifact"], hardware={"memory_mb": NEED_MB})  # fmt: skip
    finally:
        registry.close()
    stack = tree_stack(demo_repository, root, ENV)
    yield stack
    stop_stack(stack)


def explain_cli(stack) -> dict:
    done = subprocess.run([sys.executable, "-m", "server.cli.main", "autoscale", "explain", FRAUD, "--json", "--url", stack.grpc],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_a_standby_larger_than_a_replica_is_refused_and_the_endpoint_keeps_serving(refused):
    configure(refused, min_replicas=1, max_replicas=1)  # an autoscaling config makes it explainable
    assert wait_until(lambda: explain(refused)["executor"]["standby_refused"] == {FRAUD: 1}, 90), explain(refused)["executor"]
    executor = explain_cli(refused)["executor"]  # what a user reads: the CLI over the Explain RPC
    assert executor["standby_refused"] == {FRAUD: 1} and executor["capacity_mb"] == 4096
    assert executor["standby"].get(FRAUD, []) == [] and executor["memory_mb"]["standby"] == 0  # none waits, none holds memory
    # the serving copies: fraud_xgboost at the registry's need, lightgbm_regressor (not registered) at the 512 MiB default
    assert executor["memory_mb"]["replicas"] == NEED_MB + 512
    (host,) = hosts(refused).values()  # still one copy, where it was
    with Load(refused, FRAUD, threads=2) as load:
        load.served(200)
        assert explain(refused)["executor"]["standby"].get(FRAUD, []) == []  # and none started again meanwhile
        load.served(100)
    assert not load.errors, load.errors[:5]
    assert answer(host["target"]) == answer(refused.grpc)  # bit-exact: the replica and the frontend
    assert explain(refused)["serving_replicas"] == 1
