"""``inferplane dev cluster`` (issue 27) as a user runs it, its default topology: the command on a fresh
PostgreSQL starts three Tritons on one repository folder, two control-plane replicas and two frontends of
two workers each, prints their addresses; a deploy through the second frontend is served by every worker
of both, and every Triton has the deployed version ready (the leader places it on each); the leader's autoscaler scales the endpoint by placing it on Tritons of the pool,
and a scale-up the leader's kill -9 interrupts is finished by the standby; SIGINT stops every process
it started."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import grpc
import psutil
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from tests.conftest import TEST_ENV, fresh_postgres_database, wait_until
from tests.integration.test_control_plane import _leader_pid, _steady_load, _until_all
from tests.integration.test_deploy import ACTOR, _bundle_request
from tests.integration.test_fleet import FAST, QUICK

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.service("postgresql")]

ENDPOINT = "scorer"


def _ready(target: str, model: str) -> set[str]:
    client = grpcclient.InferenceServerClient(target)
    try:
        return {m.version for m in client.get_model_repository_index().models if m.name == model and m.state == "READY"}
    except Exception:  # noqa: BLE001 - not up
        return set()
    finally:
        client.close()


@pytest.fixture(scope="module")
def cluster(demo_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("dev-cluster")
    repository = root / "model_repository"
    shutil.copytree(demo_repository / "mlp_classifier", repository / "mlp_classifier")
    with fresh_postgres_database() as url:
        env = {**os.environ, **TEST_ENV, **FAST, "PYTHONUNBUFFERED": "1", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
               "INFERPLANE_RECONCILE_INTERVAL_S": "0.5", "INFERPLANE_CONTROL_LEASE_TTL_S": "3"}  # fmt: skip
        args = [sys.executable, "-m", "server.cli.main", "dev", "cluster", "--database-url", url, "--redis-url", "",
                "--model-repository", str(repository), "--workdir", str(root / "work")]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("deploy through any frontend"):
                    break
            assert proc.poll() is None, "".join(lines[-30:])
            text = "".join(lines)
            yield {"tritons": re.findall(r"^triton\d+\s+(\S+)", text, re.M), "frontends": re.findall(r"^frontend\d+\s+grpc=(\S+)", text, re.M),
                   "controls": re.findall(r"^control\d+\s", text, re.M), "pid": proc.pid, "output": text, "database": url}  # fmt: skip
        finally:
            children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            for child in children:  # what it started is gone with it
                assert wait_until(lambda c=child: not c.is_running() or c.status() == psutil.STATUS_ZOMBIE, 30), child


@pytest.fixture(scope="module")
def deployed(cluster):
    """scorer:1 registered and deployed through the second frontend (which carries both to the leader)."""
    with grpc.insecure_channel(cluster["frontends"][1]) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        registered = admin.RegisterModel(_bundle_request(demo.lightgbm_regressor(rounds=10)), metadata=ACTOR).version.version
        live = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1"), metadata=ACTOR).result.version
    return registered, live


def test_the_cluster_starts_its_default_topology_and_a_deploy_reaches_every_triton_and_worker(cluster, deployed):
    assert len(cluster["tritons"]) == 3 and len(set(cluster["tritons"])) == 3, cluster["output"]
    assert (len(cluster["controls"]), len(cluster["frontends"])) == (2, 2) and "(2 workers," in cluster["output"], cluster["output"]
    assert deployed == (1, 1)
    for target in cluster["tritons"]:
        assert wait_until(lambda t=target: "1" in _ready(t, ENDPOINT), 120), target
    v1 = demo.lightgbm_regressor(rounds=10)
    for frontend in cluster["frontends"]:  # every worker of each (fresh connections spread over them)
        assert set(_until_all(frontend, v1, "1")) == {"1"}


def _hosts(cluster, version: str = "1") -> int:
    return sum(version in _ready(t, ENDPOINT) for t in cluster["tritons"])


def _explain(stub) -> dict:
    try:  # carried to whichever process leads
        return json.loads(stub.Explain(apb.ExplainAutoscaleRequest(endpoint=ENDPOINT), metadata=ACTOR, timeout=5).explain_json)
    except grpc.RpcError as err:  # while none does
        return {"error": f"{err.code().name}: {err.details()}"}


def test_the_leaders_autoscaler_places_the_endpoint_and_its_standby_goes_on_scaling_after_a_kill_9(cluster, deployed):
    """Autoscaling on the pool of Tritons (server.control.scaling.remote_executor), configured through the
    second frontend while a client asks the first (its load reaches the leader in the frontends' reports):
    bounded to 1 replica the endpoint leaves two Tritons; allowed 3 under a load of 1 request in flight
    against a target of 0.3 per replica, it goes up one step at a time (3 s apart) and is loaded on them
    again. The leader is killed (-9) once its first step up is decided: the standby leads, finishes what
    the placements ask, and takes the second step itself (from the stored config and the load it reads);
    the client sees no error."""
    assert wait_until(lambda: _hosts(cluster) == 3, 120)  # scorer:1 on every Triton (the deploy)
    v1 = demo.lightgbm_regressor(rounds=10)
    url = cluster["database"]
    first, second = cluster["frontends"]
    with grpc.insecure_channel(second) as channel, _steady_load(first, v1) as outcomes:
        scaling = autoscale_pb2_grpc.AutoscaleStub(channel)
        said = lambda: _explain(scaling)  # noqa: E731 - what the leader says, when a wait fails

        def configure(n: int, target: float) -> None:
            config = apb.AutoscaleConfig(min_replicas=1, max_replicas=n, max_step_up=1, up_cooldown_s=3.0, **{**QUICK, "target": target})
            scaling.Configure(apb.ConfigureAutoscaleRequest(endpoint=ENDPOINT, config=config), metadata=ACTOR, timeout=30)

        def ups() -> list[int]:
            return [d["to"] for d in _explain(scaling).get("decisions", []) if d.get("action") == "up"]

        configure(1, 1000.0)
        assert wait_until(lambda: _hosts(cluster) == 1, 60, explain=said)
        leader = _leader_pid(url)
        configure(3, 0.3)
        assert wait_until(lambda: ups() == [2], 30, explain=said)  # the first step; the second waits out the cooldown
        os.kill(leader, signal.SIGKILL)
        assert wait_until(lambda: _leader_pid(url) != leader, 30)
        assert wait_until(lambda: _hosts(cluster) == 3, 90, explain=said)
        assert wait_until(lambda: 3 in ups() and _explain(scaling).get("replicas") == 3, 30, explain=said)  # the new leader's step
        assert psutil.Process(cluster["pid"]).is_running()  # the cluster goes on without the dead replica
    assert outcomes and not [o for o in outcomes if o.startswith("error")], [o for o in outcomes if o.startswith("error")][:3]


def test_scaled_to_zero_on_the_pool_a_request_through_the_frontend_wakes_it_on_one_triton(cluster, deployed):
    """To zero on the pool of Tritons: the endpoint leaves every one of them; a request through the second
    frontend (a frontend never leads) is held there, the leader sees it in that frontend's reports and loads
    the endpoint on one Triton, and the request is answered."""
    v1 = demo.lightgbm_regressor(rounds=10)
    with grpc.insecure_channel(cluster["frontends"][0]) as channel:
        scaling = autoscale_pb2_grpc.AutoscaleStub(channel)
        said = lambda: _explain(scaling)  # noqa: E731 - what the leader says, when a wait fails
        config = apb.AutoscaleConfig(min_replicas=1, max_replicas=1, scale_to_zero_after_s=1.0, cold_start_budget_s=120.0, **QUICK)
        scaling.Configure(apb.ConfigureAutoscaleRequest(endpoint=ENDPOINT, config=config), metadata=ACTOR, timeout=30)
        assert wait_until(lambda: _explain(scaling).get("state") == "asleep" and _hosts(cluster) == 0, 90, explain=said)
        before = len(_explain(scaling)["cold_starts"])
        client = grpcclient.InferenceServerClient(cluster["frontends"][1])
        try:
            inp = grpcclient.InferInput("features", [1, v1.features.shape[1]], "FP32")
            inp.set_data_from_numpy(v1.features[:1].astype("float32"))
            assert client.infer(ENDPOINT, [inp], client_timeout=120).get_response().model_version == "1"
        finally:
            client.close()
        explained = _explain(scaling)
        assert explained["state"] == "serving" and len(explained["cold_starts"]) == before + 1, said()
        assert wait_until(lambda: _hosts(cluster) == 1, 30, explain=said)
        config = apb.AutoscaleConfig(scale_to_zero_after_s=0)
        scaling.Configure(apb.ConfigureAutoscaleRequest(endpoint=ENDPOINT, config=config), metadata=ACTOR, timeout=30)
