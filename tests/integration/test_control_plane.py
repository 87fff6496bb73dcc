"""One platform across processes (issue 27), on real processes and sockets: a deploy through any port of
``--workers 2`` and through a second frontend sharing the database reaches every worker of every
frontend (the desired state in the database, watched by each worker; control RPCs carried to the
leader); a second frontend whose control plane is external serves while the leader deploys; a shadow
started through one frontend copies the requests of every frontend's workers, and the comparisons of
all of them are summed in the report read through any frontend; a failing 10 % canary is rolled back on
the outcomes of both frontends' workers summed in the leader (neither frontend's alone reaches its minimum
sample); an A/B caller key gets one arm on every worker of both frontends; ``kill -9`` of the leading
control-plane replica (two replicas on PostgreSQL) fails no data-plane request, and the standby leads, finishes
the dead leader's batch job (every row once) and leaves its deploy whole. (``kill -9`` of a frontend:
tests/integration/test_frontend_kill.py, a pair of its own.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from typing import NamedTuple

import grpc
import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from model_repository import demo
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.protogen.inferplane.v1 import traffic_pb2 as tpb
from server.protogen.inferplane.v1 import traffic_pb2_grpc
from loadtest.bench_control import deploy_retrying
from loadtest.paced_model import FEATURES as PACED_FEATURES
from loadtest.paced_model import NAME as PACED
from loadtest.paced_model import build_paced_model
from loadtest.stack import Stack, start_control
from server.control.service.leader import lease_row
from server.db import make_engine
from server.control.batches.batches import TERMINAL
from sqlalchemy import text
from tests.conftest import TEST_ENV, fresh_postgres_database, start_stack, stop_stack, start_two_frontends, wait_until
from tests.integration.test_batches import _client, _lines, _oip_body, _submit
from server.dataplane.traffic_policy import Arm, sticky_arm
from tests.integration.test_deploy import ACTOR, _bundle_request
from tests.integration.test_typed_deploy import _bundle as typed_bundle
from tests.integration.test_traffic import NAME as RANKER, POISON, ROWS, W1, W2, _infer, _onnx, _policy, _register

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH_ROW_MS = 150  # the paced model's pause per row (control_pair)
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
        "INFERPLANE_SHADOW_RECORD_DESTINATION": str(root / "shadow_records"),  # one folder for both, as a bucket would be
    }
    with start_two_frontends(repository, root, env) as pair:
        yield pair


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


def _deployed(admin, bundles) -> None:
    """scorer:1 live with scorer:2 registered (what the first test leaves; done here when a test runs alone or first)."""
    if ENDPOINT not in {e.name for e in admin.ListEndpoints(admin_pb2.ListEndpointsRequest()).endpoints}:
        for bundle in bundles:
            admin.RegisterModel(_bundle_request(bundle), metadata=ACTOR)
        assert admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1"), metadata=ACTOR).result.version == 1


def _settled(traffic, tries: int = 40):
    """The shadow report once two reads a report interval apart agree (every worker's report is in)."""
    last = None
    for _ in range(tries):
        r = traffic.ShadowReport(tpb.ShadowReportRequest(name=ENDPOINT))
        if last is not None and (r.sent, r.compared, r.errors) == (last.sent, last.compared, last.errors):
            return r
        last = r
        threading.Event().wait(1.5)  # a wait for the reports (each process writes its counts every second)
    return last


def test_traffic_through_frontend_b_is_shadowed_and_counted_in_the_report_read_through_a(two_frontends, bundles):
    a, b = two_frontends
    v1, _ = bundles
    with grpc.insecure_channel(b.grpc) as to_b, grpc.insecure_channel(a.grpc) as to_a:
        _deployed(admin_pb2_grpc.AdminStub(to_b), bundles)
        assert set(_until_all(b.grpc, v1, "1")) == {"1"}
        started = traffic_pb2_grpc.TrafficStub(to_b).SetShadow(tpb.SetShadowRequest(name=ENDPOINT, version=2, percent=100), metadata=ACTOR)
        assert started.policy.shadow_version == "2"
        report_a = traffic_pb2_grpc.TrafficStub(to_a)
        # until B's workers copy (the shadow reaches them through the desired state): only B gets requests
        for _ in range(200):
            answered = _versions_answered(b.grpc, v1)
            assert set(answered) == {"1"}  # the primary answers, never the shadow
            if report_a.ShadowReport(tpb.ShadowReportRequest(name=ENDPOINT)).compared >= 2 * CHANNELS:
                break
        before = _settled(report_a)
        assert before.version == "2" and before.compared >= 2 * CHANNELS and before.errors == 0
        # every worker of B copies now: each of these requests is counted once in the report A reads
        answered = _versions_answered(b.grpc, v1, channels=40)
        assert answered == ["1"] * 40
        after = before
        for _ in range(100):
            after = report_a.ShadowReport(tpb.ShadowReportRequest(name=ENDPOINT))
            if after.compared >= before.compared + 40:
                break
            threading.Event().wait(0.1)
        assert (after.sent - before.sent, after.compared - before.compared, after.dropped, after.errors) == (40, 40, 0, 0)
        assert after.agreement < 1.0 and after.mean_abs_diff > 0.0  # 40 rounds against 10: the answers differ
        # B's workers keep their disagreements (shadow records): files named by the writing process
        records = b.log.parent.parent / "shadow_records"
        b_workers = {str(c.pid) for c in psutil.Process(b.process.pid).children()}
        kept: list[dict] = []
        for _ in range(50):
            kept = [json.loads(line) for path in records.glob("shadow-*.jsonl") if path.stem.rsplit("-", 1)[-1] in b_workers
                    for line in path.read_text().splitlines()]  # fmt: skip
            if kept:
                break
            threading.Event().wait(0.2)  # a wait for the records' flush (every second)
        assert kept and {r["model"] for r in kept} == {ENDPOINT} and {r["version"] for r in kept} == {"2"}
        stopped = traffic_pb2_grpc.TrafficStub(to_b).SetShadow(tpb.SetShadowRequest(name=ENDPOINT, percent=0), metadata=ACTOR)
        assert stopped.policy.shadow_version == ""
        assert report_a.ShadowReport(tpb.ShadowReportRequest(name=ENDPOINT)).compared >= after.compared  # readable after the end


def test_errors_of_the_leader_come_back_through_a_frontend(two_frontends, bundles):
    _, b = two_frontends
    with grpc.insecure_channel(b.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        _deployed(admin, bundles)  # the listing below names scorer, also when this test runs alone
        with pytest.raises(grpc.RpcError) as err:
            admin.Deploy(admin_pb2.DeployRequest(ref="no_such_model:1"), metadata=ACTOR)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no_such_model" in err.value.details()
        listed = admin.ListEndpoints(admin_pb2.ListEndpointsRequest())
        assert ENDPOINT in {e.name for e in listed.endpoints}


# ---- typed APIs across processes: every worker serves the leader's schemas --------------------------------------

TYPED = "inferplane.models.payments.v{}.PaymentsService"


def _typed_listed(address: str, channels: int = CHANNELS) -> list[set[str]]:
    """The payments typed services each of ``channels`` fresh connections lists through server reflection."""
    out = []
    for _ in range(channels):
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
            out.append({s.name for s in answer.list_services_response.service if ".payments." in s.name})
    return out


def _until_listed(address: str, wanted: set[str], tries: int = 100) -> list[set[str]]:
    """Ask until every connection lists ``wanted`` (bounded by tries: each process reads the schemas every second)."""
    listed: list[set[str]] = []
    for _ in range(tries):
        listed = _typed_listed(address)
        if all(s == wanted for s in listed):
            break
        threading.Event().wait(0.2)
    return listed


def test_a_breaking_deploy_and_a_retirement_reach_the_typed_apis_of_every_worker_of_both_frontends(two_frontends):
    """The leader (A's parent) writes v2 beside v1 at a breaking deploy; each worker of A and of B (which never
    lead and have no registry) lists both, answers the REST .proto of v2, and drops v1 once it is retired."""
    a, b = two_frontends
    first, _ = typed_bundle(30)
    breaking, rows = typed_bundle(10, channels=["card_present", "online", "atm", "recurring", "wallet"], amount="amount_usd")
    with grpc.insecure_channel(b.grpc) as channel:  # through B: carried to the leader
        admin = admin_pb2_grpc.AdminStub(channel)
        assert admin.RegisterModel(first, metadata=ACTOR).version.version == 1
        assert admin.RegisterModel(breaking, metadata=ACTOR).version.version == 2
        assert admin.Deploy(admin_pb2.DeployRequest(ref="payments:1"), metadata=ACTOR).result.version == 1
        for stack in (a, b):
            assert all(s == {TYPED.format(1)} for s in _until_listed(stack.grpc, {TYPED.format(1)}))
        note = admin.Deploy(admin_pb2.DeployRequest(ref="payments:2"), metadata=ACTOR).result.message
        assert f"typed API {TYPED.format(2)}: breaking change from v1" in note
        both = {TYPED.format(1), TYPED.format(2)}
        for stack in (a, b):
            assert all(s == both for s in _until_listed(stack.grpc, both))
            for _ in range(4):  # the REST bridge of the workers reads the same catalog
                proto = requests.get(f"http://{stack.http}/v1/models/payments/proto", timeout=30)
                assert proto.status_code == 200 and "package inferplane.models.payments.v2;" in proto.text
                assert "amount_usd" in proto.text
        admin.RetireSchema(admin_pb2.RetireSchemaRequest(name="payments", major="v1"), metadata=ACTOR)
        for stack in (a, b):
            assert all(s == {TYPED.format(2)} for s in _until_listed(stack.grpc, {TYPED.format(2)}))


# ---- canary and A/B across both frontends (the endpoint ranker: test_traffic's tiny ONNX versions) ----------------

CANARY_SAMPLES = 20  # the canary's min_samples: no verdict before the leader's window holds this many
EACH = 12  # canary requests sent through each frontend: under CANARY_SAMPLES alone, over it together
EXPERIMENT_KEYS = [f"caller-{i}" for i in range(20)]


def _ask(address: str, rows=ROWS, user: str | None = None) -> tuple[str, str]:
    """One ranker request on a fresh connection (its own subchannel: SO_REUSEPORT picks the worker):
    (version, arm) of the answer, or ('', the status code's name) when it failed."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            return _infer(channel, rows=rows, user=user)[:2]
        except grpc.RpcError as err:
            return "", err.code().name


def _asked_until(address: str, wanted, rows=ROWS, user: str | None = None, tries: int = 200) -> list[tuple[str, str]]:
    """Ask CHANNELS fresh connections until every answer is in ``wanted`` (bounded by tries): the last round."""
    answered: list[tuple[str, str]] = []
    for _ in range(tries):
        answered = [_ask(address, rows, user) for _ in range(CHANNELS)]
        if set(answered) <= wanted:
            break
    return answered


def _no_split(traffic) -> None:
    """ranker without a split (what a test leaves; ended here when an earlier one failed half-way)."""
    try:
        traffic.Rollback(tpb.TrafficRollbackRequest(name=RANKER), metadata=ACTOR)
    except grpc.RpcError as err:
        if err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
            raise


@pytest.fixture(scope="module")
def rankers(two_frontends):
    """ranker's versions registered through B (v1 W1, v2 W2, v3 W1 faulty on POISON rows), v1 deployed through A."""
    a, b = two_frontends
    with grpc.insecure_channel(b.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        versions = tuple(_register(admin, _onnx(w, faulty), w, run) for w, faulty, run in ((W1, False, "w1"), (W2, False, "w2"), (W1, True, "w1-faulty")))
    assert versions == (1, 2, 3)
    with grpc.insecure_channel(a.grpc) as channel:
        assert admin_pb2_grpc.AdminStub(channel).Deploy(admin_pb2.DeployRequest(ref=f"{RANKER}:1"), metadata=ACTOR).result.version == 1
    return versions


def _window(policy, arm: str) -> tuple[int, int]:
    return next(((a.window_requests, a.window_errors) for a in policy.arms if a.name == arm), (0, 0))


def _poison_until(address: str, failures: int, traffic, tries: int = 600) -> list[tuple[str, str]]:
    """POISON rows through fresh connections of ``address`` until ``failures`` of them failed (only the
    faulty canary fails on them) or the canary is no longer active (looked up every 10 requests)."""
    answers: list[tuple[str, str]] = []
    for i in range(tries):
        answers.append(_ask(address, rows=POISON))
        if sum(v == "" for v, _ in answers) >= failures or (i % 10 == 9 and _policy(traffic).status != "active"):
            break
    return answers


def test_a_failing_canary_is_rolled_back_on_the_outcomes_of_both_frontends(two_frontends, rankers):
    """10 % canary, min_samples 20: A's 12 failed canary requests alone leave it waiting in the leader, B's
    12 more roll it back; afterwards every worker of both frontends answers from the old version, unsplit."""
    a, b = two_frontends
    with grpc.insecure_channel(a.grpc) as to_a:
        traffic = traffic_pb2_grpc.TrafficStub(to_a)
        admin = admin_pb2_grpc.AdminStub(to_a)
        _no_split(traffic)
        for stack in (a, b):  # v1 live everywhere before the canary
            assert set(_asked_until(stack.grpc, {("1", "")})) == {("1", "")}
        request = tpb.SetCanaryRequest(
            name=RANKER, version=3, percent=10, steps=[10, 50], interval_s=600, window_s=600,
            thresholds=tpb.CanaryThresholds(min_samples=CANARY_SAMPLES, max_error_rate=0.05),
        )  # fmt: skip
        assert traffic.SetCanary(request, metadata=ACTOR).policy.status == "active"
        through_a = _poison_until(a.grpc, EACH, traffic)
        assert set(through_a) <= {("1", "stable"), ("1", ""), ("", "INTERNAL")}  # stable answers; only the canary fails
        assert sum(v == "" for v, _ in through_a) == EACH
        policy = _policy(traffic)
        for _ in range(100):  # until the leader has A's workers' reports and has analysed them
            policy = _policy(traffic)
            if f"{EACH} of {CANARY_SAMPLES} canary samples" in policy.verdict:
                break
            threading.Event().wait(0.1)  # a wait for the reports (each worker writes its outcomes every second)
        assert (policy.status, _window(policy, "canary")) == ("active", (EACH, EACH)), policy
        assert policy.verdict.startswith(f"wait: {EACH} of {CANARY_SAMPLES} canary samples"), policy.verdict
        through_b = _poison_until(b.grpc, EACH, traffic)
        assert set(through_b) <= {("1", "stable"), ("1", ""), ("", "INTERNAL")}
        b_failed = sum(v == "" for v, _ in through_b)
        for _ in range(100):
            policy = _policy(traffic)
            if policy.status != "active":
                break
            threading.Event().wait(0.1)
        assert policy.status == "rolled_back", policy
        assert CANARY_SAMPLES - EACH <= b_failed <= EACH  # the rollback needed B's outcomes
        entry = wait_until(  # the policy's status is written before its audit entry
            lambda: next((e for e in admin.ListAudit(admin_pb2.ListAuditRequest(target=RANKER, limit=10), metadata=ACTOR).entries
                          if e.action == "canary.rollback"), None), 10,
        )  # fmt: skip
        assert (entry.outcome, entry.actor, entry.target) == ("rolled_back", "traffic-controller", f"{RANKER}:3")
        counted = int(float(re.search(r"canary_requests=(\S+)", entry.detail).group(1)))
        assert CANARY_SAMPLES <= counted <= EACH + b_failed, entry.detail  # A's and B's, summed
    for stack in (a, b):  # every worker of both: the old version, no split (POISON would fail on the canary)
        assert set(_asked_until(stack.grpc, {("1", "")}, rows=POISON)) == {("1", "")}


def _experiment_everywhere(traffic, stacks, experiment: str, arms, expected) -> None:
    """Start an A/B experiment of the ranker (keyed by ``x-user-id``) through ``traffic`` and wait until every
    worker of ``stacks`` answers from its arms (they read it from the desired state)."""
    _no_split(traffic)
    started = traffic.SetExperiment(
        tpb.SetExperimentRequest(name=RANKER, experiment=experiment, key_header="x-user-id",
                                 arms=[tpb.ExperimentArm(name=n, version=v, weight=w) for n, v, w in arms]),
        metadata=ACTOR,
    ).policy  # fmt: skip
    assert (started.kind, started.status) == ("ab", "active")
    for stack in stacks:
        assert set(_asked_until(stack.grpc, expected, user=EXPERIMENT_KEYS[0])) <= expected


def test_an_ab_caller_key_gets_the_same_arm_on_every_worker_of_both_frontends(two_frontends, rankers):
    a, b = two_frontends
    arms = [("control", 1, 50), ("treatment", 2, 50)]
    expected = {("1", "control"), ("2", "treatment")}
    with grpc.insecure_channel(b.grpc) as to_b:
        traffic = traffic_pb2_grpc.TrafficStub(to_b)
        _experiment_everywhere(traffic, (a, b), "arms-across", arms, expected)
        try:
            assigned = {}
            for key in EXPERIMENT_KEYS:
                answers = {_ask(stack.grpc, user=key) for stack in (a, b) for _ in range(CHANNELS // 2)}
                assert len(answers) == 1 and answers <= expected, (key, answers)  # one arm, on every worker of both
                assigned[key] = answers.pop()
            assert set(assigned.values()) == expected  # both arms occur
            # the pure function of (key, experiment) every frontend computes
            split = [Arm(n, str(v), float(w)) for n, v, w in arms]
            assert {k: sticky_arm(k, split, "arms-across").name for k in EXPERIMENT_KEYS} == {k: arm for k, (_, arm) in assigned.items()}
        finally:
            _no_split(traffic)


FEEDBACK_EACH = 8  # requests answered through each frontend, then their outcomes


def _ask_with_id(address: str, request_id: str, user: str) -> tuple[str, str]:
    """One ranker request named ``request_id`` on a fresh connection (SO_REUSEPORT picks the worker): (version, arm)."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        return _infer(channel, user=user, request_id=request_id)[:2]


def test_ab_feedback_for_requests_any_worker_of_either_frontend_answered(two_frontends, rankers):
    """Requests answered by the workers of B and of A (no process that serves leads), their outcomes sent at once
    after, each through A or through B: every one is taken with the arm its answer named (the leader waits for the
    answering worker's report of the id), and the A/B report read through either frontend counts them per arm."""
    a, b = two_frontends
    arms = [("control", 1, 50), ("treatment", 2, 50)]
    expected = {("1", "control"), ("2", "treatment")}
    with grpc.insecure_channel(a.grpc) as to_a, grpc.insecure_channel(b.grpc) as to_b:
        through = {"a": traffic_pb2_grpc.TrafficStub(to_a), "b": traffic_pb2_grpc.TrafficStub(to_b)}
        _experiment_everywhere(through["a"], (a, b), "feedback-across", arms, expected)
        try:
            answered = {}  # request id -> (arm the answer named, the frontend its outcome goes through)
            for i in range(FEEDBACK_EACH):
                for asked, told in (("b", "a"), ("a", "b"), ("b", "b"), ("a", "a")) if i % 2 else (("b", "b"), ("a", "a"), ("b", "a"), ("a", "b")):
                    request_id = f"fb-{asked}{told}-{i}"
                    version, arm = _ask_with_id((a if asked == "a" else b).grpc, request_id, user=f"fb-user-{request_id}")
                    assert (version, arm) in expected
                    answered[request_id] = (arm, told)
            assert {arm for arm, _ in answered.values()} == {"control", "treatment"}
            calls = {request_id: through[told].Feedback.future(tpb.FeedbackRequest(name=RANKER, request_id=request_id, value=1.0 if arm == "treatment" else 0.0), timeout=30)
                     for request_id, (arm, told) in answered.items()}  # fmt: skip
            taken = {}
            for request_id, call in calls.items():
                try:
                    taken[request_id] = call.result().arm
                except grpc.RpcError as err:
                    taken[request_id] = err.code().name
            assert taken == {request_id: arm for request_id, (arm, _) in answered.items()}
            per_arm = {name: sum(arm == name for arm, _ in answered.values()) for name in ("control", "treatment")}
            for traffic in through.values():
                report = {arm.name: arm for arm in traffic.AbReport(tpb.AbReportRequest(name=RANKER)).arms}
                assert {name: arm.outcomes for name, arm in report.items()} == per_arm
                assert (report["control"].outcome_mean, report["treatment"].outcome_mean) == (0.0, 1.0)
            with pytest.raises(grpc.RpcError) as again:  # one outcome per request
                through["b"].Feedback(tpb.FeedbackRequest(name=RANKER, request_id=next(iter(answered)), value=1.0), timeout=30)
            assert again.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            _no_split(through["a"])


class ControlPair(NamedTuple):
    f: Stack
    replicas: list[Stack]  # c1, c2 (a replica started again takes its place)
    url: str
    start: Callable[[str], Stack]


def _both_running(pair: ControlPair) -> ControlPair:
    """Both replicas up (a test before may have killed one: it starts again, and stands by)."""
    for i, stack in enumerate(pair.replicas):
        if stack.process.poll() is not None:
            pair.replicas[i] = pair.start(f"c{i + 1}")
    return pair


@pytest.fixture(scope="module")
def control_pair(demo_repository, tmp_path_factory):
    """Frontend F (external control plane, its own Triton) and two control-plane replicas deploying into
    F's Triton, on PostgreSQL when the test server is configured (the advisory lock), else SQLite (the lease row);
    ``start(name)`` starts a replica again on its folder (``_both_running``)."""
    root = tmp_path_factory.mktemp("failover")
    repository = root / "model_repository"
    repository.mkdir()
    shutil.copytree(demo_repository / "mlp_classifier", repository / "mlp_classifier")
    # the batch job's model: its rows take a fixed pause each (not CPU), so the job outlasts a deploy on any machine
    build_paced_model(repository, service_ms=BATCH_ROW_MS, instances=2)
    with fresh_postgres_database() as pg:
        url = pg or f"sqlite:///{root}/registry.db"
        env = {
            "INFERPLANE_DATABASE_URL": url, "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
            "INFERPLANE_DEPLOY_TIMEOUT_S": "60", "INFERPLANE_CONTROL_LEASE_TTL_S": "3",
            # a batch job's rows two at a time, its lease lapsing 2 s after its worker died
            "INFERPLANE_BATCH_LEASE_S": "2", "INFERPLANE_BATCH_CONCURRENCY": "2", "INFERPLANE_BATCH_ROW_BATCH": "2",
        }  # fmt: skip
        f = start_stack(repository, root / "f", env={**env, "INFERPLANE_CONTROL_PLANE": "external"})
        replicas = []

        def start(name: str):
            return start_control(repository, root / name, url, f.triton, env={**TEST_ENV, **env})

        try:
            for name in ("c1", "c2"):  # one after the other: the first migrates the empty database
                replicas.append(start(name))
            yield ControlPair(f, replicas, url, start)
        finally:
            for stack in replicas:
                if stack.process.poll() is None:
                    stop_stack(stack)
            stop_stack(f)


def _leader_pid(url: str) -> int:
    engine = make_engine(url)
    try:
        row = lease_row(engine)
    finally:
        engine.dispose()
    return int(row["holder"].split("/")[1])


@contextlib.contextmanager
def _steady_load(address: str, bundle):
    """One client asking ``address`` without a pause while the block runs: the outcomes, each a version or
    'error: …' (the caller asserts there is none)."""
    stop = threading.Event()
    outcomes: list[str] = []

    def load():
        client = grpcclient.InferenceServerClient(address)
        inp = grpcclient.InferInput("features", [1, bundle.features.shape[1]], "FP32")
        inp.set_data_from_numpy(np.ascontiguousarray(bundle.features[:1]))
        try:
            while not stop.is_set():
                try:
                    outcomes.append(client.infer(ENDPOINT, [inp], client_timeout=10).get_response().model_version)
                except Exception as exc:  # counted by the caller: must stay 0
                    outcomes.append(f"error: {exc}")
        finally:
            client.close()

    thread = threading.Thread(target=load)
    thread.start()
    try:
        yield outcomes
    finally:
        stop.set()
        thread.join(30)


BATCH_ROWS = 200  # two at a time, BATCH_ROW_MS each: >= 15 s of pauses, so the kill (after a deploy's load and warm-up) lands mid-job


def _rows_by_state(url: str, job_id: str) -> dict[str, int]:
    """The job's rows in the database, counted by state; and who held the job's lease (None: nobody)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            counts = dict(conn.execute(text("SELECT state, COUNT(*) FROM batch_rows WHERE job_id = :j GROUP BY state"), {"j": job_id}).all())
            owner = conn.execute(text("SELECT lease_owner FROM batch_jobs WHERE id = :j"), {"j": job_id}).scalar_one()
    finally:
        engine.dispose()
    return {**counts, "lease_owner": owner}


def _live(admin) -> int:
    """The registry's live version of the endpoint, read through a frontend (which carries it to the leader; right
    after a failover, a call the dead leader's address refuses goes to the new one: server/transports/grpc/forward.py)."""
    listed = admin.ListEndpoints(admin_pb2.ListEndpointsRequest()).endpoints
    return next(e.live for e in listed if e.name == ENDPOINT)


def _recorded(url: str, version: int) -> bool:
    """Whether the registry has recorded ``ENDPOINT:version`` deployed (the deploy's last write before its publication)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text("SELECT COUNT(*) FROM deployments d JOIN model_versions v ON d.model_version_id = v.id"
                                          " WHERE d.endpoint = :e AND v.version = :v"), {"e": ENDPOINT, "v": version}).scalar_one())  # fmt: skip
    finally:
        engine.dispose()


def _ended(client, job_id: str):
    job = client.batches.retrieve(job_id)
    return job if job.status in TERMINAL else None


def test_kill_9_of_the_leader_mid_batch_and_mid_deploy_resumes_the_job_once_and_leaves_the_deploy_whole(control_pair, bundles):
    """The leader is killed while it runs a batch job (its rows two at a time) and a deploy of a new version that it
    has loaded, warmed and recorded live in the registry but maybe not yet published: the standby leads within
    10 s, takes the job over once the dead worker's lease on it lapses and ends it with every row exactly once;
    the deploy is live everywhere (registry and every answer) or nowhere — the standby knew only the versions the
    desired state had named, so taking the lead it reads Triton again (Deployer.start) — and deploying it again
    through the new leader completes it; no data-plane request fails meanwhile."""
    f, replicas, url, _ = _both_running(control_pair)
    v1, _ = bundles
    with grpc.insecure_channel(f.grpc) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        _deployed(admin, bundles)
        old = _live(admin)
        new = admin.RegisterModel(_bundle_request(demo.lightgbm_regressor(rounds=25)), metadata=ACTOR).version.version
    assert set(_until_all(f.grpc, v1, str(old))) == {str(old)}
    leader = _leader_pid(url)
    by_pid = {r.process.pid: r for r in replicas}
    (standby,) = [r for pid, r in by_pid.items() if pid != leader]
    client = _client(standby)  # the batch API of the replica that survives (jobs live in the database)
    row = np.ones(PACED_FEATURES, np.float32)
    job = _submit(client, f"/v2/models/{PACED}/infer", [_oip_body(row * i) for i in range(BATCH_ROWS)])
    wait_until(lambda: _rows_by_state(url, job.id).get("done", 0) > 0, timeout=120)  # the leader works on it
    with _steady_load(f.grpc, v1) as outcomes, grpc.insecure_channel(f.grpc) as channel:
        deploying = admin_pb2_grpc.AdminStub(channel).Deploy.future(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:{new}"), metadata=ACTOR, timeout=120)
        wait_until(lambda: _recorded(url, new), timeout=60, interval=0.001)  # loaded, warmed, recorded live: its publication is next
        os.kill(leader, signal.SIGKILL)
        by_pid[leader].process.wait(30)
        at_kill = _rows_by_state(url, job.id)
        wait_until(lambda: _leader_pid(url) == standby.process.pid, timeout=10)
        try:
            answered = str(deploying.result().result.version)
        except grpc.RpcError as err:  # the leader died under it
            answered = err.code().name
        live = _live(admin_pb2_grpc.AdminStub(channel))
        assert live in (old, new) and answered in (str(new), "UNAVAILABLE"), (live, answered)
        assert answered != str(new) or live == new  # a deploy that answered ok is live
        assert set(_until_all(f.grpc, v1, str(live))) == {str(live)}  # every answer is the registry's live version
        ended = wait_until(lambda: _ended(client, job.id), timeout=120)
        assert deploy_retrying(f.grpc, f"{ENDPOINT}:{new}").version == new  # the new leader completes it
        assert set(_until_all(f.grpc, v1, str(new))) == {str(new)}
    assert 0 < at_kill.get("done", 0) < BATCH_ROWS and at_kill["lease_owner"] is not None, at_kill  # mid-job, leased
    assert (ended.status, ended.request_counts.completed, ended.request_counts.failed) == ("completed", BATCH_ROWS, 0)
    out = _lines(client, ended.output_file_id)
    assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(BATCH_ROWS)]  # every row, once, in order
    assert {o["response"]["status_code"] for o in out} == {200}
    assert [o["response"]["body"]["outputs"][0]["data"][0] for o in out] == [PACED_FEATURES * float(i) for i in range(BATCH_ROWS)]  # each row's own answer
    assert _rows_by_state(url, job.id) == {"done": BATCH_ROWS, "lease_owner": None}
    errors = [o for o in outcomes if o.startswith("error")]
    assert outcomes and not errors, errors[:3]
