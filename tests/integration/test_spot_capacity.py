"""Spot reclaim drill (issue 29) on real Tritons with a real batch job running: two local replicas
(``INFERPLANE_LOCAL_CAPACITY=on_demand,spot``: local-0 on demand, local-1 spot), both hosting
fraud_xgboost. Real-time callers (tritonclient) never reach the spot Triton (its own statistics say
so); a batch job's rows go there first; the spot Triton is reclaimed mid-job — SIGTERM (the notice:
Triton answers "Server exiting", the replica set drains it), a notice period, then SIGKILL — and the
job still completes with every row exactly once and answered (the rows in flight re-sent, the rest
taken by the on-demand replica while the spot one is away), the real-time callers at 0 errors, and
the spot replica back serving batch rows after its restart. Timings are not asserted.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc

from tests.conftest import stop_stack, wait_until
from tests.integration.test_failure_domains import FRAUD, WIDTH, Load, replicas, tree_stack
from tests.integration.test_fleet import triton_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENV = {
    "INFERPLANE_LOCAL_REPLICAS": "2", "INFERPLANE_LOCAL_CAPACITY": "on_demand,spot", "INFERPLANE_ISOLATION": "llm",
    "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2", "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.2", "INFERPLANE_WORKERS": "1",
    "INFERPLANE_BATCH_CONCURRENCY": "4",
}  # fmt: skip
OIP = f"/v2/models/{FRAUD}/infer"
ROWS = 1500
NOTICE_S = 1.0  # the reclaim notice period between SIGTERM and SIGKILL
SAFETY_S = 240  # a job that never ends fails the test instead of hanging it (not a timing assertion)


@pytest.fixture(scope="module")
def spot(demo_repository, tmp_path_factory):
    stack = tree_stack(demo_repository, tmp_path_factory.mktemp("spot"), ENV)
    with grpc.insecure_channel(stack.grpc) as channel:  # an autoscaling config (two copies) makes it explainable
        config = apb.AutoscaleConfig(min_replicas=2, max_replicas=2)
        autoscale_pb2_grpc.AutoscaleStub(channel).Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=config))
    yield stack
    stop_stack(stack)


def _by_capacity(stack) -> dict[str, dict]:
    return {r["capacity"]: r for r in replicas(stack)}


def _infer(client) -> None:
    x = grpcclient.InferInput("features", [1, WIDTH[FRAUD]], "FP32")
    x.set_data_from_numpy(np.random.default_rng(3).random((1, WIDTH[FRAUD]), dtype=np.float32))
    client.infer(FRAUD, [x], client_timeout=30)


def _jsonl(n: int) -> bytes:
    rng = np.random.default_rng(11)
    lines = []
    for i in range(n):
        body = {"inputs": [{"name": "features", "shape": [1, WIDTH[FRAUD]], "datatype": "FP32", "data": rng.random(WIDTH[FRAUD]).round(4).tolist()}]}
        lines.append(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": OIP, "body": body}).encode())
    return b"\n".join(lines) + b"\n"


def test_real_time_traffic_never_reaches_the_spot_replica(spot):
    assert wait_until(lambda: all(FRAUD in r["models"] for r in replicas(spot)) and len(replicas(spot)) == 2, 90), replicas(spot)
    hosts = _by_capacity(spot)
    assert set(hosts) == {"on_demand", "spot"} and hosts["on_demand"]["id"] == "local-0"
    spot_before, od_before = triton_rows(hosts["spot"]["target"], FRAUD), triton_rows(hosts["on_demand"]["target"], FRAUD)
    client = grpcclient.InferenceServerClient(spot.grpc)
    try:
        for _ in range(40):
            _infer(client)
    finally:
        client.close()
    # Triton counts a request in its statistics after execute() returns, which can be after its answer reached
    # the caller: wait for the 40th count (the last answer) before reading both replicas
    assert wait_until(lambda: triton_rows(hosts["on_demand"]["target"], FRAUD) >= od_before + 40, 10), triton_rows(hosts["on_demand"]["target"], FRAUD)
    assert triton_rows(hosts["spot"]["target"], FRAUD) == spot_before


def test_a_reclaim_mid_batch_loses_no_row_and_no_real_time_request(spot):
    hosts = _by_capacity(spot)
    victim = hosts["spot"]
    sdk = openai.OpenAI(base_url=f"http://{spot.http}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        f = sdk.files.create(file=("rows.jsonl", io.BytesIO(_jsonl(ROWS))), purpose="batch")
        spot_before = triton_rows(victim["target"], FRAUD)
        with Load(spot, FRAUD) as load:
            job = sdk.batches.create(input_file_id=f.id, endpoint=OIP, completion_window="24h")
            # the rows go to the spot replica first
            assert wait_until(lambda: triton_rows(victim["target"], FRAUD) >= spot_before + 50, 120), sdk.batches.retrieve(job.id)
            done_before = sdk.batches.retrieve(job.id).request_counts.completed
            assert done_before < ROWS, "the job ended before the reclaim: make it longer"
            os.kill(victim["pid"], signal.SIGTERM)  # the reclaim notice
            assert wait_until(lambda: _by_capacity(spot)["spot"]["reclaimed"] >= 1, 30), replicas(spot)  # drained for it
            od_at_notice = triton_rows(hosts["on_demand"]["target"], FRAUD)
            ok_at_notice = load.ok
            time.sleep(NOTICE_S)
            os.kill(victim["pid"], signal.SIGKILL)  # the notice is over
            give_up = time.monotonic() + SAFETY_S
            while (b := sdk.batches.retrieve(job.id)).status not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < give_up, f"batch still {b.status}: {b.request_counts}"
                time.sleep(0.2)
            load.served(20)
        assert b.status == "completed", b
        errors = sdk.files.content(b.error_file_id).content.splitlines()[:3] if b.error_file_id else []
        assert b.request_counts.completed == ROWS and b.request_counts.failed == 0, (b.request_counts, errors)
        lines = [json.loads(x) for x in sdk.files.content(b.output_file_id).content.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"row-{i}" for i in range(ROWS))  # every row exactly once
        assert all(x["response"]["status_code"] == 200 for x in lines)
        assert b.error_file_id is None
        # while the spot replica was away the on-demand one took batch rows (more rows than the real-time calls it answered)
        od_rows = triton_rows(hosts["on_demand"]["target"], FRAUD) - od_at_notice
        assert od_rows > load.ok - ok_at_notice, (od_rows, load.ok - ok_at_notice)
    finally:
        sdk.close()
    assert load.ok > 0 and not load.errors, load.errors[:5]
    # the spot replica came back (restarted by its supervisor, its model reloaded) and serves batch rows again
    assert wait_until(lambda: (r := _by_capacity(spot)["spot"])["pid"] not in (None, victim["pid"]) and r["state"] == "up", 90), replicas(spot)
