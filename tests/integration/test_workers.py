"""Multi-process frontend: N workers share the ports, all serve, a crashed one comes back; with
Redis their quotas are one set of buckets, without it the log says each worker enforces its own."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.mmap_dict import MmapedDict

from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.quota_policy import Quota
from server.runtime.supervisor import free_port
from server.tenancy.store import TenancyStore
from tests.conftest import start_stack

pytestmark = pytest.mark.integration

MODEL = "fraud_xgboost"
PER_WORKER_WARNING = "quotas and idempotency keys are per worker process"


@pytest.fixture(scope="module")
def two_workers(demo_repository, tmp_path_factory, module_stacks):
    workdir = tmp_path_factory.mktemp("workers")
    stack = start_stack(
        demo_repository, workdir, "--workers", "2", "--model", MODEL,
        "--grpc-port", str(free_port()), "--http-port", str(free_port()),
    )  # fmt: skip
    stack.metrics_dir = workdir / "run" / "metrics"
    yield stack
    module_stacks.append(stack)  # stopped with the module's other stack


def _workers(stack) -> list[int]:
    pids = []
    for child in psutil.Process(stack.process.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "server.app" in " ".join(child.cmdline()):
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


def test_without_redis_the_log_says_quotas_are_per_worker(two_workers):
    assert PER_WORKER_WARNING in two_workers.log.read_text(errors="replace")


# ---- quotas shared through Redis ----------------------------------------------------------------

PEPPER = "workers-pepper"
RPM = 4  # one request refills every 15 s: the test sends its requests well within that
MONTHLY = 5  # requests per calendar month of the tenant 'monthly'


@pytest.fixture(scope="module")
def shared_quotas(demo_repository, tmp_path_factory, redis_url, module_stacks):
    workdir = tmp_path_factory.mktemp("workers_redis")
    url = f"sqlite:///{workdir}/tenancy.db"
    store = TenancyStore(url)
    key = store.create_key("capped", PEPPER.encode(), models=[MODEL], model_quotas={MODEL: Quota(rpm=RPM)})[1]
    monthly = store.create_key("monthly", PEPPER.encode(), models=[MODEL], quota=Quota(requests_month=MONTHLY))[1]
    env = {
        "INFERPLANE_DATABASE_URL": url,
        "INFERPLANE_KEY_PEPPER": PEPPER,
        "INFERPLANE_AUTH": "on",
        "INFERPLANE_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/1",  # a database of its own
    }
    stack = start_stack(
        demo_repository, workdir, "--auth", "on", "--workers", "2", "--model", MODEL,
        "--grpc-port", str(free_port()), "--http-port", str(free_port()), env=env,
    )  # fmt: skip
    stack.metrics_dir = workdir / "run" / "metrics"
    stack.key = key
    stack.monthly_key = monthly
    yield stack
    module_stacks.append(stack)
    store.close()


def _infer_code(stack, key: str) -> grpc.StatusCode:
    """One ModelInfer on a connection of its own (each new connection may land on either worker)."""
    return _infer_with_headers(stack, key)[0]


def _answered_by(stack, pid: int) -> dict[str, float]:
    """Requests a worker answered for MODEL, by status code (from its metrics file)."""
    path = stack.metrics_dir / f"counter_{pid}.db"
    out: dict[str, float] = {}
    if path.exists():
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
            _metric, sample, labels, _help = json.loads(key)
            if sample == "inferplane_requests_total" and labels.get("model") == MODEL:
                out[labels["code"]] = out.get(labels["code"], 0) + value
    return out


def test_a_quota_is_shared_by_the_workers_through_redis(shared_quotas):
    assert PER_WORKER_WARNING not in shared_quotas.log.read_text(errors="replace")
    workers = _workers(shared_quotas)
    assert len(workers) == 2
    codes = [_infer_code(shared_quotas, shared_quotas.key) for _ in range(4 * RPM)]
    assert codes.count(grpc.StatusCode.OK) == RPM, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 3 * RPM
    answered = {pid: _answered_by(shared_quotas, pid) for pid in workers}
    totals = {pid: sum(by_code.values()) for pid, by_code in answered.items()}
    assert all(n > 0 for n in totals.values()), answered  # both workers answered some
    assert sum(by_code.get("OK", 0) for by_code in answered.values()) == RPM
    # each worker enforcing its own rpm would have admitted up to RPM of its share: more than RPM in all
    assert sum(min(n, RPM) for n in totals.values()) > RPM


def _infer_with_headers(stack, key: str) -> tuple[grpc.StatusCode, dict[str, str]]:
    """One ModelInfer on a connection of its own: its status and trailing metadata."""
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 32])
    request.raw_input_contents.append(np.ones((1, 32), np.float32).tobytes())
    with grpc.insecure_channel(stack.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=None)
        try:
            _, rpc = call.with_call(request.SerializeToString(), metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            return grpc.StatusCode.OK, dict(rpc.trailing_metadata())
        except grpc.RpcError as err:
            return err.code(), dict(err.trailing_metadata() or ())


def test_a_monthly_quota_is_one_allowance_for_both_workers_with_the_remainder_in_headers(shared_quotas):
    """Two frontend processes (the workers) share the month's counter in Redis: exactly MONTHLY answers,
    each telling how many are left; the rest are refused with a retry hint at the month's end."""
    before = {pid: _answered_by(shared_quotas, pid).get("OK", 0) for pid in _workers(shared_quotas)}
    results = [_infer_with_headers(shared_quotas, shared_quotas.monthly_key) for _ in range(3 * MONTHLY)]
    ok = [headers for code, headers in results if code == grpc.StatusCode.OK]
    assert len(ok) == MONTHLY, [code for code, _ in results]
    assert sorted(int(h["x-ratelimit-remaining-requests-month"]) for h in ok) == list(range(MONTHLY))
    assert all(0 < int(h["x-ratelimit-reset-month"]) <= 31 * 86400 for h in ok)
    refused = [headers for code, headers in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(refused) == 2 * MONTHLY
    assert all(float(h["retry-after"]) > 60 for h in refused)  # not a per-minute refusal: the month must turn
    after = {pid: _answered_by(shared_quotas, pid).get("OK", 0) for pid in _workers(shared_quotas)}
    served = {pid: after[pid] - before.get(pid, 0) for pid in after}
    assert sum(served.values()) == MONTHLY
