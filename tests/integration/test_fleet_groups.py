"""Model groups as on Kubernetes, on real sockets: a frontend that starts no Triton of its own, reads
``INFERPLANE_MODEL_GROUPS_FILE`` and finds the group's replicas by resolving the group's Service
name (here ``localhost``, through the system resolver); it exports the KEDA gauges; and while the
group has no replica serving a model it *holds* the model's requests (the group's queue gauge rises,
which is what brings KEDA's first replica) and answers them once a Triton serving it appears."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import TEST_ENV, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

MODEL = "fraud_xgboost"
READY = re.compile(r"inferplane ready grpc=(\S+) metrics=(\S+) http=(\S+)")


def _frontend(root: Path, groups: dict, triton: str, extra_env: dict | None = None):
    """``inferplane serve`` against external Tritons, with a model groups file."""
    root.mkdir(parents=True, exist_ok=True)
    groups_file = root / "model-groups.json"
    groups_file.write_text(json.dumps(groups))
    env = dict(os.environ, PYTHONUNBUFFERED="1", **TEST_ENV, INFERPLANE_MODEL_GROUPS_FILE=str(groups_file),
               INFERPLANE_DATABASE_URL=f"sqlite:///{root}/registry.db", INFERPLANE_ARTIFACT_STORE=str(root / "artifacts"),
               INFERPLANE_DISCOVERY_INTERVAL_S="0.5", INFERPLANE_REPLICA_HEALTH_INTERVAL_S="0.2", **(extra_env or {}))  # fmt: skip
    log = open(root / "frontend.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli.main", "serve", "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
         "--triton-url", triton, "--workdir", str(root / "run"), "--model", MODEL],
        stdout=subprocess.PIPE, stderr=log, env=env, text=True,
    )  # fmt: skip
    found = {}

    def read():
        for line in proc.stdout:
            m = READY.search(line)
            if m:
                found["m"] = m
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(120)
    if "m" not in found:
        proc.kill()
        raise RuntimeError((root / "frontend.log").read_text()[-3000:])
    proc.grpc, proc.metrics, proc.http, proc.log_file = found["m"].group(1), found["m"].group(2), found["m"].group(3), log
    return proc


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    proc.log_file.close()


def _gauge(metrics: str, name: str, group: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    m = re.search(rf'^{name}{{model_group="{group}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


def _infer(target: str):
    client = grpcclient.InferenceServerClient(target)
    try:
        x = grpcclient.InferInput("features", [1, 32], "FP32")
        x.set_data_from_numpy(np.full((1, 32), 0.25, np.float32))
        return client.infer(MODEL, [x], client_timeout=120).as_numpy("probability")
    finally:
        client.close()


def test_a_group_is_found_through_its_service_name_and_exports_the_keda_gauges(demo_repository, tmp_path):
    backend = start_stack(demo_repository, tmp_path / "backend", "--model", MODEL)  # a Triton serving the group's model
    port = int(backend.triton.rsplit(":", 1)[1])
    front = None
    try:
        groups = {"trees": {"service": "localhost", "grpc_port": port, "models": [MODEL]}}
        front = _frontend(tmp_path / "front", groups, f"localhost:{port}")
        expected = _infer(backend.grpc)
        np.testing.assert_allclose(_infer(front.grpc), expected, rtol=1e-6)
        assert wait_until(lambda: _gauge(front.metrics, "inferplane_group_queue_depth", "trees") == 0.0, 10)
        assert _gauge(front.metrics, "inferplane_group_inflight_requests", "trees") == 0.0
        text = urllib.request.urlopen(f"http://{front.metrics}/metrics", timeout=5).read().decode()
        assert re.search(r'^inferplane_replica_up\{replica="localhost/127\.0\.0\.1:\d+"\} 1\.0$', text, re.MULTILINE), text[-2000:]
    finally:
        if front is not None:
            _stop(front)
        stop_stack(backend)


def test_a_group_at_zero_replicas_holds_requests_until_a_triton_serves_them(demo_repository, tmp_path):
    from server.runtime.supervisor import TritonSupervisor, free_port

    port = free_port()
    groups = {"trees": {"service": "localhost", "grpc_port": port, "models": [MODEL]}}
    front = _frontend(tmp_path / "front", groups, f"localhost:{port}", {"INFERPLANE_REPLICA_WAIT_S": "90"})
    triton = None
    try:
        answers, errors = [], []

        def first():
            try:
                answers.append(_infer(front.grpc))
            except Exception as err:  # noqa: BLE001
                errors.append(str(err))

        held = threading.Thread(target=first)
        held.start()
        # held, not failed: the group's queue gauge says a request waits for a replica of the group
        wait_until(lambda: _gauge(front.metrics, "inferplane_group_queue_depth", "trees") >= 1, 20, explain=lambda: errors)
        assert held.is_alive() and not errors
        # the "pod" comes up: Triton on the group's port, loading the group's model (its entrypoint does that)
        supervisor = TritonSupervisor(demo_repository, tmp_path / "triton", startup_timeout=60)
        supervisor.grpc_port, supervisor.metrics_port = port, free_port()
        triton = subprocess.Popen(supervisor._args(), env=supervisor.install.environment(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        assert wait_until(lambda: _live(f"127.0.0.1:{port}"), 60)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        client.load_model(MODEL)
        client.close()
        held.join(120)
        assert not errors and len(answers) == 1, errors
        assert answers[0].shape == (1, 1)
        assert wait_until(lambda: _gauge(front.metrics, "inferplane_group_queue_depth", "trees") == 0.0, 10)
    finally:
        _stop(front)
        if triton is not None:
            from server.runtime.supervisor import remove_shm_regions

            os.killpg(triton.pid, signal.SIGTERM)
            try:
                triton.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(triton.pid, signal.SIGKILL)
            mine = f"inferplane_{os.getpid()}_0_"  # the regions of the Triton started here
            remove_shm_regions(lambda pid: pid == os.getpid(), match=lambda name: name.startswith(mine))


def _live(target: str) -> bool:
    client = grpcclient.InferenceServerClient(target)
    try:
        return client.is_server_live()
    except Exception:  # noqa: BLE001 - not up yet
        return False
    finally:
        client.close()
        time.sleep(0.05)
