"""``inferplane dev cluster`` (issue 27) as a user runs it: the command on a fresh PostgreSQL starts three
Tritons on one repository folder, a control-plane replica and a frontend, prints their addresses; a
deploy through the frontend is served, and every Triton has the deployed version ready (the leader
places it on each); SIGINT stops every process it started."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import TEST_ENV, fresh_postgres_database, wait_until
from tests.integration.test_deploy import ACTOR, _bundle_request

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
        env = {**os.environ, **TEST_ENV, "PYTHONUNBUFFERED": "1", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
               "INFERPLANE_RECONCILE_INTERVAL_S": "0.5"}  # fmt: skip
        args = [sys.executable, "-m", "server.cli.main", "dev", "cluster", "--database-url", url, "--redis-url", "",
                "--model-repository", str(repository), "--workdir", str(root / "work"), "--controls", "1", "--frontends", "1",
                "--workers", "1", "--tritons", "3"]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("deploy through any frontend"):
                    break
            assert proc.poll() is None, "".join(lines[-30:])
            text = "".join(lines)
            yield {"tritons": re.findall(r"^triton\d+\s+(\S+)", text, re.M), "frontend": re.search(r"^frontend0 grpc=(\S+)", text, re.M).group(1),
                   "pid": proc.pid, "output": text}  # fmt: skip
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


def test_the_cluster_starts_three_tritons_and_a_deploy_reaches_each(cluster):
    assert len(cluster["tritons"]) == 3 and len(set(cluster["tritons"])) == 3, cluster["output"]
    v1 = demo.lightgbm_regressor(rounds=10)
    import grpc

    with grpc.insecure_channel(cluster["frontend"]) as channel:  # the frontend carries these to the leader
        admin = admin_pb2_grpc.AdminStub(channel)
        assert admin.RegisterModel(_bundle_request(v1), metadata=ACTOR).version.version == 1
        assert admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1"), metadata=ACTOR).result.version == 1
    for target in cluster["tritons"]:
        assert wait_until(lambda t=target: "1" in _ready(t, ENDPOINT), 120), target
