"""Traffic management against the real stack (frontend + Triton + registry): canary split and
stickiness, automatic rollback of a failing canary, shadow copies, an A/B report, blue-green.

One stack for the module, started on an empty repository; the endpoint ``ranker`` is deployed
from the registry. Its versions are tiny ONNX linear models (features[4] -> score[1]):

* v1 and v2: different weights (so their answers differ);
* v3 "faulty": v1's weights plus a Gather whose index is ``max(features) > 100`` into a
  one-element constant — it answers its validation rows (small values), so it deploys and warms
  up, but ONNX Runtime raises at execute on production rows with a value above 100.

The tests share the endpoint: the first registers the three versions (the module's ``versions``
fixture) and ends with v2 live; each later test starts from that state (``_v2_live`` deploys it when the
test runs alone or first), so any one of them runs on its own.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inferplane.v1 import admin_pb2
from server.protogen.inferplane.v1 import traffic_pb2 as tpb
from tests.conftest import registry_stack_fixtures, wait_until

pytestmark = pytest.mark.integration

NAME = "ranker"
ACTOR = (("x-inferplane-actor", "ci-traffic"),)
W1, W2 = np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([0.5, -1.0, 2.0, 1.0], np.float32)
SIGNATURE = {"inputs": [{"name": "features", "datatype": "FP32", "dims": [4]}], "outputs": [{"name": "score", "datatype": "FP32", "dims": [1]}]}
VALIDATION = np.linspace(0.0, 1.0, 32, dtype=np.float32).reshape(8, 4)
ROWS = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)  # ordinary traffic
POISON = np.array([[150.0, 1.0, 1.0, 1.0]], np.float32)  # the faulty version fails on these


def _onnx(weights: np.ndarray, faulty: bool = False) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(weights.reshape(4, 1), "W")]
    nodes = [helper.make_node("MatMul", ["features", "W"], ["mm" if faulty else "score"])]
    if faulty:
        inits += [numpy_helper.from_array(np.zeros(1, np.float32), "C"), numpy_helper.from_array(np.array(100.0, np.float32), "LIMIT")]
        nodes += [
            helper.make_node("ReduceMax", ["features"], ["largest"], keepdims=0),
            helper.make_node("Greater", ["largest", "LIMIT"], ["over"]),
            helper.make_node("Cast", ["over"], ["index"], to=TensorProto.INT64),
            helper.make_node("Gather", ["C", "index"], ["zero"], axis=0),  # index 1 is out of bounds: ORT raises
            helper.make_node("Add", ["mm", "zero"], ["score"]),
        ]
    graph = helper.make_graph(
        nodes, "ranker", [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _register(admin, artifact: bytes, weights: np.ndarray, run: str) -> int:
    buffer = io.BytesIO()
    np.savez(buffer, features=VALIDATION, expected=VALIDATION @ weights.reshape(4, 1))
    request = admin_pb2.RegisterModelRequest(
        name=NAME, artifact=artifact, filename="model.onnx", signature_json=json.dumps(SIGNATURE),
        validation_npz=buffer.getvalue(), training_run=run,
    )  # fmt: skip
    return admin.RegisterModel(request, metadata=ACTOR).version.version


SHADOW_KEY = "c2hhZG93LXJlY29yZHMta2V5LTMyLWJ5dGVzLWxvbmc="  # base64 of 32 bytes


def _stack_env(root) -> dict[str, str]:
    return {
        "INFERPLANE_ROLLBACK_GRACE_S": "600", "INFERPLANE_DEPLOY_TIMEOUT_S": "60",
        # shadow disagreements are kept, sealed at rest (issue 23)
        "INFERPLANE_SHADOW_RECORD_DESTINATION": str(root / "shadow_records"), "INFERPLANE_ENCRYPTION_KEY": SHADOW_KEY,
    }  # fmt: skip


traffic_stack, channel, admin, traffic = registry_stack_fixtures("traffic", _stack_env)


@pytest.fixture(scope="module")
def versions(admin) -> tuple[int, int, int]:
    """ranker's versions, registered once for the module: v1 (W1), v2 (W2), v3 (W1, faulty)."""
    return _register(admin, _onnx(W1), W1, "w1"), _register(admin, _onnx(W2), W2, "w2"), _register(admin, _onnx(W1, faulty=True), W1, "w1-faulty")


def _v2_live(admin, versions) -> None:
    """ranker live on v2, as the first test leaves it (deployed here when a test runs alone or first)."""
    try:
        if admin.GetEndpoint(admin_pb2.GetEndpointRequest(name=NAME)).endpoint.live == 2:
            return
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            raise
    assert admin.Deploy(admin_pb2.DeployRequest(ref=f"{NAME}:{versions[1]}"), metadata=ACTOR).result.version == 2


def _infer(channel, rows=ROWS, user: str | None = None, request_id: str = ""):
    """One ModelInfer with the raw stub: (answering version, arm, score) from the answer and its trailing metadata."""
    request = pb.ModelInferRequest(model_name=NAME, id=request_id)
    request.inputs.add(name="features", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.tobytes())
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.ModelInferResponse.FromString,
    )  # fmt: skip
    metadata = (("x-user-id", user),) if user else ()
    response, call_info = call.with_call(request, metadata=metadata, timeout=10)
    trailing = dict(call_info.trailing_metadata() or ())
    assert trailing["x-inferplane-version"] == response.model_version
    score = np.frombuffer(response.raw_output_contents[0], np.float32)
    return response.model_version, trailing["x-inferplane-arm"], score


def _stream_versions(channel, n: int) -> list[str]:
    """``n`` unversioned requests over one ModelStreamInfer call: the version that answered each."""
    def requests():
        for i in range(n):
            request = pb.ModelInferRequest(model_name=NAME, id=f"s{i}")
            request.inputs.add(name="features", datatype="FP32", shape=list(ROWS.shape))
            request.raw_input_contents.append(ROWS.tobytes())
            yield request

    call = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )  # fmt: skip
    responses = list(call(requests(), timeout=30))
    assert not [r.error_message for r in responses if r.error_message]
    return [r.infer_response.model_version for r in responses]


def _policy(traffic):
    return traffic.GetPolicy(tpb.GetPolicyRequest(name=NAME)).policy


def _audit(admin, limit=10):
    return admin.ListAudit(admin_pb2.ListAuditRequest(target=NAME, limit=limit), metadata=ACTOR).entries


def test_canary_split_is_weighted_sticky_and_promotes(traffic_stack, channel, admin, traffic, versions):
    assert versions == (1, 2, 3)
    admin.Deploy(admin_pb2.DeployRequest(ref=f"{NAME}:1"), metadata=ACTOR)
    assert _infer(channel) == ("1", "", pytest.approx(ROWS @ W1))

    started = traffic.SetCanary(
        tpb.SetCanaryRequest(name=NAME, version=2, percent=20, interval_s=600, window_s=60, key_header="x-user-id"), metadata=ACTOR
    ).policy
    assert (started.kind, started.status, started.live) == ("canary", "active", "1")
    assert [(a.name, a.version, a.weight) for a in started.arms] == [("stable", "1", 80), ("canary", "2", 20)]

    # unkeyed requests: smooth weighted round robin, exactly 20%; each answer names its version and arm
    answers = [_infer(channel) for _ in range(100)]
    assert sum(arm == "canary" for _, arm, _ in answers) == 20
    for version, arm, score in answers:
        assert (version, arm) in {("1", "stable"), ("2", "canary")}
        np.testing.assert_allclose(score, ROWS @ (W1 if version == "1" else W2), rtol=1e-6)
    # keyed requests: sticky per user, 20% of users within tolerance
    first = {f"u{i}": _infer(channel, user=f"u{i}")[1] for i in range(300)}
    share = sum(arm == "canary" for arm in first.values()) / len(first)
    assert abs(share - 0.2) < 4 * (0.2 * 0.8 / 300) ** 0.5, share
    assert all(_infer(channel, user=u)[1] == first[u] for u in list(first)[:40])

    # the REST bridge tells which version answered too
    body = json.dumps({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": ROWS.ravel().tolist()}]}).encode()
    user = next(u for u, arm in first.items() if arm == "canary")
    http = urllib.request.Request(f"http://{traffic_stack.http}/v2/models/{NAME}/infer", body, {"x-user-id": user, "Content-Type": "application/json"})
    with urllib.request.urlopen(http, timeout=10) as reply:
        assert (reply.headers["x-inferplane-version"], reply.headers["x-inferplane-arm"]) == ("2", "canary")

    # ModelStreamInfer requests naming no version follow the split too, and count in its windows
    before = {a.name: a.window_requests for a in _policy(traffic).arms}
    streamed = _stream_versions(channel, 50)
    assert sorted(set(streamed)) == ["1", "2"] and streamed.count("2") == 10  # the same 20% round robin
    after = {a.name: a.window_requests for a in _policy(traffic).arms}
    assert after["canary"] - before["canary"] == 10 and after["stable"] - before["stable"] == 40

    status = _policy(traffic)
    assert {a.name: a.window_requests for a in status.arms}["canary"] >= 20
    assert status.verdict.startswith(("pass", "wait")), status.verdict  # analysed, nothing breached

    promoted = traffic.Promote(tpb.PromoteRequest(name=NAME), metadata=ACTOR).policy
    assert (promoted.live, promoted.status, promoted.kind) == ("2", "promoted", "canary")
    assert {_infer(channel, user=u)[:2] for u in list(first)[:30]} == {("2", "")}
    shown = admin.GetEndpoint(admin_pb2.GetEndpointRequest(name=NAME)).endpoint
    assert (shown.live, shown.previous, list(shown.loaded_versions)) == (2, 1, [1, 2])
    assert [(e.action, e.outcome) for e in _audit(admin, 3)][:2] == [("canary.promote", "ok"), ("deploy", "ok")]
    assert _policy_rows(traffic_stack)[-1] == ("canary", "promoted")


def _policy_rows(stack) -> list[tuple[str, str]]:
    """ranker's traffic policies as the registry database holds them, oldest first: (kind, status)."""
    with sqlite3.connect(stack.env["INFERPLANE_DATABASE_URL"].removeprefix("sqlite:///")) as db:
        return db.execute("SELECT kind, status FROM traffic_policies WHERE endpoint = ? ORDER BY id", (NAME,)).fetchall()


def test_a_failing_canary_is_rolled_back_automatically(traffic_stack, channel, admin, traffic, versions):
    _v2_live(admin, versions)
    policies_before = len(_policy_rows(traffic_stack))
    request = tpb.SetCanaryRequest(
        name=NAME, version=3, percent=10, steps=[10, 50], interval_s=60, window_s=30,
        thresholds=tpb.CanaryThresholds(min_samples=10, max_error_rate=0.05),
    )  # fmt: skip
    traffic.SetCanary(request, metadata=ACTOR)
    assert _infer(channel, rows=VALIDATION[:1])[0] in {"2", "3"}  # v3 answers ordinary rows
    failures, deadline = [], time.monotonic() + 20
    while _policy(traffic).status != "rolled_back" and time.monotonic() < deadline:
        for _ in range(20):
            try:
                version, arm, _ = _infer(channel, rows=POISON)
                assert (version, arm) in {("2", "stable"), ("2", "")}  # stable, or back on it after the rollback
            except grpc.RpcError as err:
                failures.append(err)
    policy = _policy(traffic)
    assert policy.status == "rolled_back", policy
    assert 10 <= len(failures) < 120, len(failures)  # rolled back within a tick or two of the minimum sample count
    assert {f.code() for f in failures} == {grpc.StatusCode.INTERNAL}
    # back on stable: every request answers, from v2
    assert {_infer(channel, rows=POISON)[:2] for _ in range(50)} == {("2", "")}
    entry = next(e for e in _audit(admin) if e.action == "canary.rollback")
    assert (entry.outcome, entry.actor, entry.target) == ("rolled_back", "traffic-controller", f"{NAME}:3")
    assert "canary error rate" in entry.detail and "canary_requests=" in entry.detail and "stable_error_rate=0" in entry.detail
    assert _policy_rows(traffic_stack)[policies_before:] == [("canary", "rolled_back")]  # this canary's row, and only it


def test_shadow_never_changes_answers_and_survives_a_failing_shadow(channel, admin, traffic, traffic_stack, versions):
    _v2_live(admin, versions)
    traffic.SetShadow(tpb.SetShadowRequest(name=NAME, version=1, percent=100), metadata=ACTOR)
    rows = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    for i in range(30):
        version, arm, score = _infer(channel, rows=rows[i % 10 : i % 10 + 1])
        assert (version, arm) == ("2", "")
        np.testing.assert_allclose(score, rows[i % 10] @ W2, rtol=1e-5)
    expected_diff = float(np.mean([abs(rows[i % 10] @ (W1 - W2)) for i in range(30)]))

    def report():
        return traffic.ShadowReport(tpb.ShadowReportRequest(name=NAME))

    deadline = time.monotonic() + 10
    while report().compared < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = report()
    assert (r.version, r.sent, r.dropped, r.errors, r.compared) == ("1", 30, 0, 0, 30)
    assert r.agreement == 0.0 and r.mean_abs_diff == pytest.approx(expected_diff, rel=1e-4)
    assert r.latency_delta_p50_ms != 0.0
    _check_shadow_records(traffic_stack, rows)

    # a failing shadow (v3 raises on these rows): the primary keeps answering, the failures are counted
    traffic.SetShadow(tpb.SetShadowRequest(name=NAME, version=3, percent=50), metadata=ACTOR)
    for _ in range(40):
        version, _, score = _infer(channel, rows=POISON)
        assert version == "2"
        np.testing.assert_allclose(score, POISON @ W2, rtol=1e-6)
    deadline = time.monotonic() + 10
    while report().errors < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = report()
    assert (r.version, r.sent, r.errors, r.compared) == ("3", 20, 20, 0) and "Gather" in r.last_error
    stopped = traffic.SetShadow(tpb.SetShadowRequest(name=NAME, percent=0), metadata=ACTOR).policy
    assert stopped.shadow_version == ""
    assert report().errors == 20  # the last shadow's report stays readable


def _check_shadow_records(stack, rows):
    """Each disagreement is kept (request, both answers), sealed on disk, readable with the key."""
    import base64

    from server.control.registry.envelope import KeyRing
    from server.control.registry.records import RecordFiles

    files = RecordFiles(str(stack.root / "shadow_records"), "shadow-", KeyRing.parse(SHADOW_KEY))
    assert wait_until(lambda: len(list(files.read())) >= 30, timeout=10)
    records = list(files.read())
    assert len(records) == 30 and {r["version"] for r in records} == {"1"}
    sent = {pb.ModelInferRequest.FromString(base64.b64decode(r["request"])).raw_input_contents[0] for r in records}
    assert sent <= {rows[i : i + 1].tobytes() for i in range(10)}
    on_disk = b"".join(p.read_bytes() for p in (stack.root / "shadow_records").glob("shadow-*.jsonl"))
    assert b'"request"' not in on_disk and b'"enc"' in on_disk


def _run_experiment(channel, traffic, experiment, arms, rates, seed, users=300):
    traffic.SetExperiment(
        tpb.SetExperimentRequest(name=NAME, experiment=experiment, key_header="x-user-id",
                                 arms=[tpb.ExperimentArm(name=n, version=v, weight=w) for n, v, w in arms]),
        metadata=ACTOR,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    for i in range(users):
        request_id = f"{experiment}-{i}"
        _, arm, _ = _infer(channel, user=f"{experiment}-user-{i}", request_id=request_id)
        converted = float(rng.random() < rates[arm])
        assert traffic.Feedback(tpb.FeedbackRequest(name=NAME, request_id=request_id, value=converted)).arm == arm
    report = traffic.AbReport(tpb.AbReportRequest(name=NAME))
    traffic.Rollback(tpb.TrafficRollbackRequest(name=NAME), metadata=ACTOR)
    return report


def test_ab_report_detects_a_planted_difference_and_not_an_a_a_test(traffic_stack, channel, admin, traffic, versions):
    _v2_live(admin, versions)
    planted = _run_experiment(channel, traffic, "ab", [("control", 2, 50), ("treatment", 1, 50)], {"control": 0.2, "treatment": 0.45}, 1)
    arms = {a.name: a for a in planted.arms}
    assert arms["control"].requests + arms["treatment"].requests == 300
    assert abs(arms["treatment"].requests - 150) < 4 * (300 * 0.25) ** 0.5
    assert (arms["control"].version, arms["treatment"].version) == ("2", "1")
    outcome = next(c for c in planted.comparisons if c.metric == "outcome")
    assert (outcome.test, outcome.significant) == ("two_proportion_z", True) and outcome.ci_low > 0, outcome
    assert outcome.ci_low < arms["treatment"].outcome_mean - arms["control"].outcome_mean < outcome.ci_high

    same = _run_experiment(channel, traffic, "aa", [("a", 2, 50), ("b", 2, 50)], {"a": 0.3, "b": 0.3}, 2)
    outcome = next(c for c in same.comparisons if c.metric == "outcome")
    assert not outcome.significant and outcome.ci_low < 0 < outcome.ci_high, outcome

    env = dict(os.environ, **traffic_stack.env)
    cli = subprocess.run([sys.executable, "-m", "server.cli.main", "ab", "report", NAME, "--url", traffic_stack.grpc],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "experiment aa" in cli.stdout and "b vs a [outcome, two_proportion_z]" in cli.stdout and "not significant" in cli.stdout


def test_blue_green_stages_green_then_switches_at_once(channel, admin, traffic, versions):
    _v2_live(admin, versions)
    staged = traffic.SetBlueGreen(tpb.SetBlueGreenRequest(name=NAME, version=1), metadata=ACTOR).policy
    assert (staged.kind, staged.green, staged.live) == ("bluegreen", "1", "2")
    assert {_infer(channel)[0] for _ in range(20)} == {"2"}  # green takes no traffic before the switch
    switched = traffic.Switch(tpb.SwitchRequest(name=NAME), metadata=ACTOR).policy
    assert (switched.live, switched.status) == ("1", "switched")
    assert {_infer(channel)[0] for _ in range(20)} == {"1"}
    shown = admin.GetEndpoint(admin_pb2.GetEndpointRequest(name=NAME)).endpoint
    assert shown.live == 1 and 2 in shown.ready_versions  # blue stays warm for the grace period
    with pytest.raises(grpc.RpcError) as err:
        traffic.Switch(tpb.SwitchRequest(name=NAME), metadata=ACTOR)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
