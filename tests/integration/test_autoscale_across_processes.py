"""Autoscaling across processes (issue 27), on real processes and sockets: frontend A (``--workers 2``: the
control plane, its autoscaler and the embedded Triton in the parent, which serves no request) and
frontend B (``--workers 2``, control plane external, A's Triton), one database. The load the workers of
both frontends serve reaches the leader's autoscaler (signal_reports); an endpoint scaled to zero holds
its first requests on whichever frontend and worker receives them, the leader wakes it once, and they
are answered."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import tritonclient.grpc as grpcclient

from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from tests.conftest import start_two_frontends, wait_until
from tests.integration.test_fleet import FAST, LGBM, QUICK, Load, infer, triton_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHANNELS = 8  # fresh connections per frontend: SO_REUSEPORT spreads them over its workers


@pytest.fixture(scope="module")
def frontends(demo_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("autoscale-cluster")
    repository = root / "model_repository"
    shutil.copytree(demo_repository / LGBM, repository / LGBM)
    env = {**FAST, "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts")}
    with start_two_frontends(repository, root, env) as pair:
        yield pair


class Leader:
    """The autoscaling API, asked through a frontend's worker (carried to the leader)."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = autoscale_pb2_grpc.AutoscaleStub(self.channel)

    def configure(self, endpoint: str, **fields) -> dict:
        return json.loads(self.stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=endpoint, config=apb.AutoscaleConfig(**fields))).endpoints_json[0])

    def explain(self, endpoint: str) -> dict:
        return json.loads(self.stub.Explain(apb.ExplainAutoscaleRequest(endpoint=endpoint)).explain_json)


@pytest.fixture(scope="module")
def leader(frontends):
    a, _ = frontends
    api = Leader(a.grpc)
    yield api
    api.channel.close()


def test_the_load_of_the_other_frontends_workers_reaches_the_leaders_autoscaler(frontends, leader):
    _, b = frontends
    leader.configure(LGBM, min_replicas=1, max_replicas=1)
    assert leader.explain(LGBM)["state"] == "serving"
    with Load(b, LGBM, threads=4) as load:  # only B's workers serve it; A's parent (the leader) serves nothing
        wait_until(lambda: load.ok >= 20, 60, explain=lambda: load.errors[:3])

        def seen():
            signals = leader.explain(LGBM)["signals"]
            return signals and signals[-1]["qps"] > 0 and signals[-1]["inflight"] > 0

        wait_until(seen, 60, explain=lambda: leader.explain(LGBM)["signals"][-3:])
    assert not load.errors, load.errors[:3]


def test_a_scaled_to_zero_endpoint_wakes_for_first_requests_on_every_frontend(frontends, leader):
    a, b = frontends
    leader.configure(LGBM, min_replicas=1, max_replicas=1, scale_to_zero_after_s=1.0, cold_start_budget_s=120.0, **QUICK)
    wait_until(lambda: leader.explain(LGBM)["state"] == "asleep", 60, explain=lambda: leader.explain(LGBM)["decisions"][-3:])
    assert wait_until(lambda: not triton_ready(a.triton, LGBM), 30)  # unloaded from the Triton both frontends use
    before = len(leader.explain(LGBM)["cold_starts"])
    results, errors = [], []
    lock = threading.Lock()

    def first_request(address: str):
        client = grpcclient.InferenceServerClient(address)  # a fresh connection: any worker of that frontend
        try:
            answer = infer(client, LGBM).as_numpy("prediction")
            with lock:
                results.append(answer.tobytes())
        except Exception as err:  # noqa: BLE001 - every failure counts
            with lock:
                errors.append(str(err)[:300])
        finally:
            client.close()

    callers = [threading.Thread(target=first_request, args=(stack.grpc,)) for stack in (b, a) for _ in range(CHANNELS)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(180)
    assert not errors and len(results) == 2 * CHANNELS, errors[:3]
    assert len(set(results)) == 1  # the same input, the same answer
    explained = leader.explain(LGBM)
    assert len(explained["cold_starts"]) == before + 1, explained["cold_starts"]  # one load for every frontend's requests
    assert explained["state"] == "serving"
    leader.configure(LGBM, scale_to_zero_after_s=0)


def test_past_the_cold_start_budget_a_frontend_that_does_not_lead_answers_503_and_the_wake_goes_on(frontends, leader):
    a, b = frontends
    leader.configure(LGBM, min_replicas=1, max_replicas=1, scale_to_zero_after_s=1.0, cold_start_budget_s=0.001, **QUICK)
    wait_until(lambda: leader.explain(LGBM)["state"] == "asleep", 60, explain=lambda: leader.explain(LGBM)["decisions"][-3:])
    assert wait_until(lambda: not triton_ready(a.triton, LGBM), 30)
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}).encode()
    request = urllib.request.Request(f"http://{b.http}/v2/models/{LGBM}/infer", data=body, headers={"Content-Type": "application/json"})
    try:  # B's worker holds it for the leader's cold-start budget, not for its own replica wait
        urllib.request.urlopen(request, timeout=30)
        pytest.fail(f"answered while asleep; the leader's last decisions: {leader.explain(LGBM)['decisions'][-6:]}")
    except urllib.error.HTTPError as refused:
        assert refused.code == 503 and int(refused.headers["Retry-After"]) >= 1
        error = json.loads(refused.read())
    assert error["code"] == "MODEL_NOT_READY" and "cold-start budget" in error["error"], error

    def answered():
        try:
            return urllib.request.urlopen(request, timeout=30).status == 200
        except urllib.error.HTTPError:
            return False

    assert wait_until(answered, 90)  # the refused caller's demand stayed reported: the leader loaded it
    leader.configure(LGBM, scale_to_zero_after_s=0)
