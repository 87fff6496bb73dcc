"""One platform across processes (issue 27), on real processes and sockets: a deploy through any port of
``--workers 2`` and through a second frontend sharing the database reaches every worker of every
frontend (the desired state in the database, watched by each worker; control RPCs carried to the
leader); a second frontend whose control plane is external serves while the leader deploys."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.runtime.supervisor import free_port
from tests.conftest import start_stack, stop_stack
from tests.integration.test_deploy import ACTOR, _bundle_request

pytestmark = pytest.mark.integration

ENDPOINT = "scorer"
CHANNELS = 16  # fresh connections: SO_REUSEPORT spreads them over the workers


@pytest.fixture(scope="module")
def bundles():
    return demo.lightgbm_regressor(rounds=40), demo.lightgbm_regressor(rounds=10)


@pytest.fixture(scope="module")
def two_frontends(demo_repository, tmp_path_factory):
    """Frontend A (control plane embedded, 2 workers, its Triton) and frontend B (control plane external,
    2 workers, A's Triton), one SQLite database."""
    root = tmp_path_factory.mktemp("control")
    repository = root / "model_repository"
    repository.mkdir()
    shutil.copytree(demo_repository / "mlp_classifier", repository / "mlp_classifier")
    env = {
        "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db",
        "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
        "INFERPLANE_ROLLBACK_GRACE_S": "600",
        "INFERPLANE_DEPLOY_TIMEOUT_S": "60",
    }
    two = ("--workers", "2", "--grpc-port", str(free_port()), "--http-port", str(free_port()))
    a = start_stack(repository, root / "a", *two, env=env)
    try:
        b_ports = ("--workers", "2", "--grpc-port", str(free_port()), "--http-port", str(free_port()))
        b = start_stack(repository, root / "b", *b_ports, "--triton-url", a.triton, env={**env, "INFERPLANE_CONTROL_PLANE": "external"})
    except BaseException:
        stop_stack(a)
        raise
    yield a, b
    stop_stack(b)
    stop_stack(a)


def _versions_answered(address: str, bundle, channels: int = CHANNELS) -> list[str]:
    """The version each of ``channels`` fresh connections is answered with ('' for an error)."""
    out = []
    for _ in range(channels):
        client = grpcclient.InferenceServerClient(address)
        try:
            inp = grpcclient.InferInput("features", [1, bundle.features.shape[1]], "FP32")
            inp.set_data_from_numpy(np.ascontiguousarray(bundle.features[:1]))
            out.append(client.infer(ENDPOINT, [inp], client_timeout=10).get_response().model_version)
        except Exception:  # not deployed there yet
            out.append("")
        finally:
            client.close()
    return out


def _until_all(address: str, bundle, version: str, tries: int = 200) -> list[str]:
    """Ask until every connection answers ``version`` (bounded by tries, never by a clock)."""
    answered: list[str] = []
    for _ in range(tries):
        answered = _versions_answered(address, bundle)
        if set(answered) == {version}:
            break
    return answered


def _workers(stack) -> int:
    return sum("server.app" in " ".join(c.cmdline()) for c in psutil.Process(stack.process.pid).children())


def test_deploy_through_any_frontend_reaches_every_worker(two_frontends, bundles):
    a, b = two_frontends
    v1, v2 = bundles
    assert _workers(a) == 2 and _workers(b) == 2
    with grpc.insecure_channel(b.grpc) as channel:  # B has no control plane: it carries these to A's parent
        admin = admin_pb2_grpc.AdminStub(channel)
        assert admin.RegisterModel(_bundle_request(v1), metadata=ACTOR).version.version == 1
        assert admin.RegisterModel(_bundle_request(v2), metadata=ACTOR).version.version == 2
        deployed = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1"), metadata=ACTOR).result
        assert deployed.version == 1
    for stack in (a, b):
        assert set(_until_all(stack.grpc, v1, "1")) == {"1"}
    with grpc.insecure_channel(a.grpc) as channel:  # and through A's workers
        admin = admin_pb2_grpc.AdminStub(channel)
        assert admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:2"), metadata=ACTOR).result.version == 2
        for stack in (a, b):
            assert set(_until_all(stack.grpc, v2, "2")) == {"2"}
        rolled = admin.Rollback(admin_pb2.RollbackRequest(name=ENDPOINT), metadata=ACTOR).result
        assert rolled.version == 1
    for stack in (a, b):
        assert set(_until_all(stack.grpc, v1, "1")) == {"1"}


def test_errors_of_the_leader_come_back_through_a_frontend(two_frontends):
    _, b = two_frontends
    with grpc.insecure_channel(b.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            admin.Deploy(admin_pb2.DeployRequest(ref="no_such_model:1"), metadata=ACTOR)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no_such_model" in err.value.details()
        listed = admin.ListEndpoints(admin_pb2.ListEndpointsRequest())
        assert ENDPOINT in {e.name for e in listed.endpoints}
