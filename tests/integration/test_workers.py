"""Multi-process frontend: N workers share the ports, all serve, a crashed one comes back."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.mmap_dict import MmapedDict

from server.supervisor import free_port
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration

MODEL = "fraud_xgboost"


@pytest.fixture(scope="module")
def two_workers(demo_repository, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("workers")
    stack = start_stack(
        demo_repository, workdir, "--workers", "2", "--model", MODEL,
        "--grpc-port", str(free_port()), "--http-port", str(free_port()),
    )  # fmt: skip
    stack.metrics_dir = workdir / "run" / "metrics"
    yield stack
    stop_stack(stack)


def _workers(stack) -> list[int]:
    pids = []
    for child in psutil.Process(stack.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "server.workers" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:  # exited between listing and reading: not a live worker
            continue
    return pids


def _infer_fresh_connection(stack) -> float:
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        inp = grpcclient.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(np.ones((1, 32), np.float32))
        return float(client.infer(MODEL, [inp], client_timeout=10).as_numpy("probability")[0, 0])
    finally:
        client.close()


def _served_by(stack, pid: int) -> float:
    path = stack.metrics_dir / f"counter_{pid}.db"
    if not path.exists():
        return 0.0
    return sum(
        value for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)) if "inferplane_requests_total" in key
    )


def test_all_workers_serve_and_metrics_are_summed(two_workers):
    import urllib.request

    workers = _workers(two_workers)
    assert len(workers) == 2
    answers = {_infer_fresh_connection(two_workers) for _ in range(60)}
    assert len(answers) == 1  # same model, same answer, whichever worker
    served = {pid: _served_by(two_workers, pid) for pid in workers}
    assert all(n > 0 for n in served.values()), served
    text = urllib.request.urlopen(f"http://{two_workers.metrics}/metrics", timeout=10).read().decode()
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inferplane_requests_total{") and f'model="{MODEL}"' in line
    )
    assert total >= 60


def test_a_crashed_worker_is_restarted(two_workers):
    victim = _workers(two_workers)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        workers = _workers(two_workers)
        if len(workers) == 2 and victim not in workers:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"worker not restarted: {_workers(two_workers)}")
    for _ in range(20):
        _infer_fresh_connection(two_workers)
