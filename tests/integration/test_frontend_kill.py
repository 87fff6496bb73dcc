"""``kill -9`` of one frontend under load (issue 27): two frontends on one database (A: control plane in its
parent, 2 workers, its Triton; B: control plane external, 2 workers, A's Triton), load on both; B's parent and
workers get SIGKILL. What B had in flight and what is sent to it afterwards fails, and its client retries
on A; A answers every request sent to it, during and after the kill, and still deploys (the new version
reaches all of A's workers). Its own pair of frontends: the module's kill would break any other test of
``tests/integration/test_control_plane.py``'s pair."""

from __future__ import annotations

import shutil
import signal
import threading

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import start_two_frontends, wait_until
from tests.integration.test_control_plane import ENDPOINT, _until_all, _workers
from tests.integration.test_deploy import ACTOR, _bundle_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOADERS = 2  # load threads per frontend, each on its own connection (SO_REUSEPORT: spread over the workers)


@pytest.fixture(scope="module")
def pair(demo_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend_kill")
    repository = root / "model_repository"
    repository.mkdir()
    shutil.copytree(demo_repository / "mlp_classifier", repository / "mlp_classifier")
    env = {
        "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
        "INFERPLANE_ROLLBACK_GRACE_S": "600", "INFERPLANE_DEPLOY_TIMEOUT_S": "60",
    }  # fmt: skip
    with start_two_frontends(repository, root, env) as stacks:
        yield stacks


class Loader(threading.Thread):
    """Requests one after another on one connection to ``address``; each failed one is retried once on a
    fresh connection to ``fallback`` (what a client with both frontends' addresses does). ``outcomes``: per
    request, the version that answered it first, or 'error: …', then the retry's version or 'retry error: …'."""

    def __init__(self, address: str, bundle, stop: threading.Event, fallback: str | None = None):
        super().__init__(daemon=True)
        self.address, self.fallback, self.stop = address, fallback, stop
        self.inputs = [grpcclient.InferInput("features", [1, bundle.features.shape[1]], "FP32")]
        self.inputs[0].set_data_from_numpy(np.ascontiguousarray(bundle.features[:1]))
        self.outcomes: list[tuple[str, str]] = []

    def _once(self, client) -> str:
        try:
            return client.infer(ENDPOINT, self.inputs, client_timeout=10).get_response().model_version
        except Exception as exc:  # counted by the test
            return f"error: {exc}"

    def run(self) -> None:
        client = grpcclient.InferenceServerClient(self.address)
        try:
            while not self.stop.is_set():
                first = self._once(client)
                retried = ""
                if first.startswith("error") and self.fallback is not None:
                    self.stop.wait(0.05)  # a client's retry backoff
                    retry = grpcclient.InferenceServerClient(self.fallback)
                    try:
                        retried = self._once(retry)
                    finally:
                        retry.close()
                self.outcomes.append((first, retried))
        finally:
            client.close()


def _kill_9(stack) -> list[psutil.Process]:
    """SIGKILL to the frontend's parent, then to each of its processes (its workers die with it anyway:
    PDEATHSIG); returns them once every one is gone."""
    children = psutil.Process(stack.process.pid).children(recursive=True)
    stack.process.send_signal(signal.SIGKILL)
    for child in children:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:  # gone with its parent already
            pass
    assert stack.process.wait(30) == -signal.SIGKILL
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, alive
    return children


def test_kill_9_of_one_frontend_fails_only_its_requests_and_the_other_serves_and_deploys(pair):
    a, b = pair
    v1, v2 = demo.lightgbm_regressor(rounds=40), demo.lightgbm_regressor(rounds=10)
    assert _workers(a) == 2 and _workers(b) == 2
    with grpc.insecure_channel(a.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        assert [admin.RegisterModel(_bundle_request(v), metadata=ACTOR).version.version for v in (v1, v2)] == [1, 2]
        assert admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1"), metadata=ACTOR).result.version == 1
    for stack in (a, b):
        assert set(_until_all(stack.grpc, v1, "1")) == {"1"}
    stop = threading.Event()
    on_a = [Loader(a.grpc, v1, stop) for _ in range(LOADERS)]
    on_b = [Loader(b.grpc, v1, stop, fallback=a.grpc) for _ in range(LOADERS)]
    for loader in on_a + on_b:
        loader.start()
    try:
        wait_until(lambda: all(len(x.outcomes) >= 20 for x in on_a + on_b), timeout=60)  # load on both
        before_kill = [len(x.outcomes) for x in on_a + on_b]
        workers = {p.pid for p in psutil.Process(b.process.pid).children() if "server.app" in " ".join(p.cmdline())}
        killed = _kill_9(b)
        assert len(workers) == 2 and workers <= {p.pid for p in killed}  # B's parent and its 2 workers
        wait_until(lambda: all(any(first.startswith("error") for first, _ in x.outcomes) for x in on_b), timeout=60)
        with grpc.insecure_channel(a.grpc) as channel:  # A still deploys: its control plane did not need B
            admin = admin_pb2_grpc.AdminStub(channel)
            assert admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:2"), metadata=ACTOR).result.version == 2
        assert set(_until_all(a.grpc, v2, "2")) == {"2"}  # on every worker of A
        after_kill = [len(x.outcomes) for x in on_a]
        wait_until(lambda: all(len(x.outcomes) >= n + 20 for x, n in zip(on_a, after_kill)), timeout=60)  # A serves on
    finally:
        stop.set()
        for loader in on_a + on_b:
            loader.join(30)
    served_by_a = [first for x in on_a for first, _ in x.outcomes]
    errors = [o for o in served_by_a if o.startswith("error")]
    assert served_by_a and not errors, errors[:3]  # A: every request answered, during and after the kill
    assert set(served_by_a) == {"1", "2"}  # A's loaders saw the deploy
    for loader, n in zip(on_b, before_kill[LOADERS:]):
        assert [first for first, _ in loader.outcomes[:n]] == ["1"] * n  # B served until the kill
        failed = [(first, retried) for first, retried in loader.outcomes if first.startswith("error")]
        assert failed and all(retried in {"1", "2"} for _, retried in failed), failed[:3]  # each retried on A, answered
