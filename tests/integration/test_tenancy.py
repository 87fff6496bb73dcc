"""Tenancy on the real stack with `--auth on`: keys, the cross-tenant matrix on both transports,
quotas with retry hints, idempotency (Triton's statistics prove one execution), revocation,
deadlines, metering, the Tenancy admin API and the Admin service's authorization."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import queue
import re
import subprocess
import sys

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.rpc import error_details_pb2, status_pb2

from model_repository.layout import load_validation
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc, tenancy_pb2, tenancy_pb2_grpc
from server.tenancy.quota_policy import Quota
from server.tenancy.store import TenancyStore
from tests.conftest import CACHED_MODEL, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

PEPPER = "integration-pepper"
MODELS = ["mlp_classifier", "fraud_xgboost", "lightgbm_regressor", CACHED_MODEL]
GRANTS = {"alpha": ["mlp_classifier", "fraud_xgboost"], "beta": ["lightgbm_regressor"]}
SVC = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def tenancy(demo_repository, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tenancy")
    url = f"sqlite:///{workdir}/tenancy.db"
    store = TenancyStore(url)
    pepper = PEPPER.encode()
    keys = {name: store.create_key(name, pepper, team=f"team-{name}", models=models)[1] for name, models in GRANTS.items()}
    keys["gamma"] = store.create_key("gamma", pepper, team="team-gamma", models=["*"], model_quotas={"fraud_xgboost": Quota(rpm=5)})[1]
    keys["idem"] = store.create_key("idem", pepper, models=["lightgbm_regressor"])[1]
    keys["revokee_id"], keys["revokee"] = store.create_key("revokee", pepper, models=["*"])
    keys["ops"] = store.create_key("ops", pepper, team="platform", models=["*"], admin=True)[1]
    keys["streamer"] = store.create_key("streamer", pepper, team="team-streamer", models=["lightgbm_regressor"])[1]
    env = {
        "INFERPLANE_DATABASE_URL": url,
        "INFERPLANE_KEY_PEPPER": PEPPER,
        "INFERPLANE_AUTH_REFRESH_S": "0.3",
        "INFERPLANE_USAGE_FLUSH_S": "0.3",
    }
    stack = start_stack(demo_repository, workdir, "--auth", "on", env={**env, "INFERPLANE_AUTH": "on"})
    stack.env = env
    stack.keys = keys
    stack.store = store
    channel = grpc.insecure_channel(stack.grpc)
    stack.channel = channel
    yield stack
    channel.close()
    stop_stack(stack)


# ---- helpers ----------------------------------------------------------------------------------


def _features(repository, model, rows=2):
    return np.ascontiguousarray(load_validation(repository / model)["features"][:rows], dtype=np.float32)


def _infer_request(repository, model, rows=2) -> pb.ModelInferRequest:
    x = _features(repository, model, rows)
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def _auth(key):
    return (("authorization", f"Bearer {key}"),) if key else ()


def _grpc(stack, method, request, key=None, extra=(), timeout=30):
    """(code, message or response bytes, trailing metadata) of one raw gRPC call."""
    call = stack.channel.unary_unary(SVC + method, request_serializer=None, response_deserializer=None)
    try:
        out, c = call.with_call(request.SerializeToString(), metadata=_auth(key) + tuple(extra), timeout=timeout)
        return grpc.StatusCode.OK, out, c.trailing_metadata()
    except grpc.RpcError as err:
        return err.code(), err.details(), err.trailing_metadata()


def _http(stack, method, path, body=None, headers=None):
    host, port = stack.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _rest_infer_body(repository, model, rows=2) -> bytes:
    x = _features(repository, model, rows)
    return json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}).encode()


def _bearer(key):
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---- identity ---------------------------------------------------------------------------------


def test_a_missing_or_wrong_key_is_unauthenticated_on_both_transports(tenancy):
    req = _infer_request(tenancy.repository, "fraud_xgboost")
    for key in (None, "ipk_00000000_nope", "not-a-key"):
        code, message, _ = _grpc(tenancy, "ModelInfer", req, key)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (key, code, message)
        status, _, body = _http(tenancy, "POST", "/v2/models/fraud_xgboost/infer", _rest_infer_body(tenancy.repository, "fraud_xgboost"), _bearer(key))
        assert status == 401 and json.loads(body)["code"] == "UNAUTHENTICATED"
    # x-api-key works as well as a bearer token; health needs no key
    code, _, _ = _grpc(tenancy, "ModelInfer", req, extra=(("x-api-key", tenancy.keys["alpha"]),))
    assert code == grpc.StatusCode.OK
    assert _http(tenancy, "GET", "/v2/health/ready")[0] == 200
    assert _grpc(tenancy, "ServerReady", pb.ServerReadyRequest())[0] == grpc.StatusCode.OK


@pytest.mark.parametrize("tenant", sorted(GRANTS))
@pytest.mark.parametrize("model", MODELS)
def test_cross_tenant_matrix_nothing_ungranted_leaks(tenancy, tenant, model):
    """Every tenant x model x {infer, metadata, ready, config, statistics, index} on gRPC and REST:
    granted works; ungranted answers byte for byte like a model that does not exist."""
    key = tenancy.keys[tenant]
    granted = model in GRANTS[tenant]
    ghost = "no_such_model_x"

    def same_as_unknown(code, message, ghost_code, ghost_message):
        assert code == ghost_code == grpc.StatusCode.NOT_FOUND
        assert message == ghost_message.replace(ghost, model)

    calls = [
        ("ModelInfer", lambda m: _infer_request(tenancy.repository, m) if m != ghost else pb.ModelInferRequest(model_name=m)),
        ("ModelMetadata", lambda m: pb.ModelMetadataRequest(name=m)),
        ("ModelConfig", lambda m: pb.ModelConfigRequest(name=m)),
        ("ModelStatistics", lambda m: pb.ModelStatisticsRequest(name=m)),
    ]
    for method, build in calls:
        code, message, _ = _grpc(tenancy, method, build(model), key)
        if granted:
            assert code == grpc.StatusCode.OK, (method, message)
        else:
            ghost_code, ghost_message, _ = _grpc(tenancy, method, build(ghost), key)
            same_as_unknown(code, message, ghost_code, ghost_message)

    code, raw, _ = _grpc(tenancy, "ModelReady", pb.ModelReadyRequest(name=model), key)
    assert code == grpc.StatusCode.OK and pb.ModelReadyResponse.FromString(raw).ready == granted
    code, raw, _ = _grpc(tenancy, "RepositoryIndex", pb.RepositoryIndexRequest(), key)
    assert {m.name for m in pb.RepositoryIndexResponse.FromString(raw).models} == set(GRANTS[tenant])
    code, raw, _ = _grpc(tenancy, "ModelStatistics", pb.ModelStatisticsRequest(), key)
    assert {m.name for m in pb.ModelStatisticsResponse.FromString(raw).model_stats} <= set(GRANTS[tenant])

    rest = [
        ("POST", f"/v2/models/{{}}/infer", lambda m: _rest_infer_body(tenancy.repository, model)),
        ("GET", "/v2/models/{}", lambda m: None),
        ("GET", "/v2/models/{}/ready", lambda m: None),
        ("GET", "/v2/models/{}/config", lambda m: None),
        ("POST", "/v1/models/{}:predict", lambda m: json.dumps({"instances": _features(tenancy.repository, model).tolist()}).encode()),
    ]
    for method, path, body in rest:
        status, _, answer = _http(tenancy, method, path.format(model), body(model), {**_bearer(key), "Content-Type": "application/json"})
        if granted:
            assert status == 200, (path, answer)
        else:
            g_status, _, g_answer = _http(tenancy, method, path.format(ghost), body(ghost), {**_bearer(key), "Content-Type": "application/json"})
            assert status == g_status == 404, (path, answer)
            assert json.loads(answer) == json.loads(g_answer.replace(ghost.encode(), model.encode()))


def test_loading_models_needs_an_admin_key(tenancy):
    code, _, _ = _grpc(tenancy, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="fraud_xgboost"), tenancy.keys["alpha"])
    assert code == grpc.StatusCode.PERMISSION_DENIED


# ---- quotas -----------------------------------------------------------------------------------


def test_quota_exact_count_and_retry_hint_on_both_transports(tenancy):
    key = tenancy.keys["gamma"]  # fraud_xgboost: 5 requests/min; other models unlimited
    req = _infer_request(tenancy.repository, "fraud_xgboost")
    outcomes = [_grpc(tenancy, "ModelInfer", req, key) for _ in range(8)]
    codes = [c for c, _, _ in outcomes]
    assert codes.count(grpc.StatusCode.OK) == 5 and codes[:5] == [grpc.StatusCode.OK] * 5
    code, message, trailing = outcomes[5]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "5 requests/min" in message
    meta = dict(trailing)
    assert 10.0 <= float(meta["retry-after"]) <= 12.0  # one request refills in 12 s
    rich = status_pb2.Status.FromString(meta["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert any(d.Unpack(info) for d in rich.details) and info.retry_delay.seconds >= 10
    status, headers, body = _http(tenancy, "POST", "/v2/models/fraud_xgboost/infer", _rest_infer_body(tenancy.repository, "fraud_xgboost"), _bearer(key))
    assert status == 429 and int(headers["Retry-After"]) >= 10 and headers["x-should-retry"] == "true"
    assert json.loads(body)["code"] == "RESOURCE_EXHAUSTED"
    # another model of the same tenant, and another tenant on the same model, are unaffected
    assert _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, "mlp_classifier"), key)[0] == grpc.StatusCode.OK
    assert _grpc(tenancy, "ModelInfer", req, tenancy.keys["alpha"])[0] == grpc.StatusCode.OK


# ---- idempotency ------------------------------------------------------------------------------


def _triton_counts(stack, model):
    ch = grpc.insecure_channel(stack.triton)
    try:
        raw = ch.unary_unary(SVC + "ModelStatistics", request_serializer=None, response_deserializer=None)(
            pb.ModelStatisticsRequest(name=model).SerializeToString(), timeout=10
        )
    finally:
        ch.close()
    stats = pb.ModelStatisticsResponse.FromString(raw).model_stats[0]
    return stats.inference_count, stats.inference_stats.success.count


async def test_concurrent_duplicates_with_one_key_run_the_model_once(tenancy):
    model, rows = "lightgbm_regressor", 3
    req = _infer_request(tenancy.repository, model, rows).SerializeToString()
    before = _triton_counts(tenancy, model)
    metadata = _auth(tenancy.keys["idem"]) + (("idempotency-key", "order-42"),)
    async with grpc.aio.insecure_channel(tenancy.grpc) as ch:
        call = ch.unary_unary(SVC + "ModelInfer", request_serializer=None, response_deserializer=None)
        answers = await asyncio.gather(*(call(req, metadata=metadata, timeout=30) for _ in range(16)))
        assert len(set(answers)) == 1
        again = await call(req, metadata=metadata, timeout=30)  # after it finished: the stored answer
        assert again == answers[0]
        other = _infer_request(tenancy.repository, model, rows + 1).SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(other, metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    after = _triton_counts(tenancy, model)
    assert after[0] - before[0] == rows  # rows inferred once, not 17 times
    assert after[1] - before[1] == 1
    # REST: same key + same body replays; a different body is a 422
    body = _rest_infer_body(tenancy.repository, model)
    headers = {**_bearer(tenancy.keys["idem"]), "Idempotency-Key": "rest-1"}
    s1, _, b1 = _http(tenancy, "POST", f"/v2/models/{model}/infer", body, headers)
    s2, _, b2 = _http(tenancy, "POST", f"/v2/models/{model}/infer", body, headers)
    assert s1 == s2 == 200 and b1 == b2
    s3, _, b3 = _http(tenancy, "POST", f"/v2/models/{model}/infer", _rest_infer_body(tenancy.repository, model, 1), headers)
    assert s3 == 422 and json.loads(b3)["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert _triton_counts(tenancy, model)[1] - after[1] == 1


# ---- deadlines --------------------------------------------------------------------------------


def test_request_timeout_header_and_grpc_deadline(tenancy):
    key = tenancy.keys["alpha"]
    body = _rest_infer_body(tenancy.repository, "mlp_classifier")
    assert _http(tenancy, "POST", "/v2/models/mlp_classifier/infer", body, {**_bearer(key), "x-request-timeout": "5"})[0] == 200
    status, _, answer = _http(tenancy, "POST", "/v2/models/mlp_classifier/infer", body, {**_bearer(key), "x-request-timeout": "soon"})
    assert status == 400 and b"x-request-timeout" in answer
    status, _, answer = _http(tenancy, "POST", "/v2/models/mlp_classifier/infer", body, {**_bearer(key), "x-request-timeout": "0.000001"})
    assert status == 504, answer
    code, _, _ = _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, "mlp_classifier"), key, timeout=0.000001)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


# ---- key lifecycle and metering ---------------------------------------------------------------


def _cli(stack, *args):
    env = dict(os.environ, **stack.env)
    out = subprocess.run([sys.executable, "-m", "server.cli.main", *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_keys_created_and_revoked_by_the_cli_take_effect_on_refresh(tenancy):
    created = json.loads(_cli(tenancy, "keys", "create", "--tenant", "delta", "--model", "fraud_xgboost", "--json"))
    req = _infer_request(tenancy.repository, "fraud_xgboost")
    assert wait_until(lambda: _grpc(tenancy, "ModelInfer", req, created["key"])[0] == grpc.StatusCode.OK, timeout=10)
    _cli(tenancy, "keys", "revoke", created["key_id"])
    assert wait_until(lambda: _grpc(tenancy, "ModelInfer", req, created["key"])[0] == grpc.StatusCode.UNAUTHENTICATED, timeout=10)
    listed = _cli(tenancy, "keys", "list", "--json")
    assert created["key"] not in listed and created["key"] not in tenancy.log.read_text(errors="replace")


def test_answered_requests_are_metered_to_the_database(tenancy):
    key = tenancy.keys["beta"]
    for _ in range(3):
        assert _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, "lightgbm_regressor"), key)[0] == grpc.StatusCode.OK

    def beta_usage():
        rows = {r["tenant"]: r for r in tenancy.store.usage("tenant")}
        return rows.get("beta", {}).get("requests", 0) >= 3 and rows["beta"]

    row = wait_until(beta_usage, timeout=10)
    assert row and row["compute_us"] > 0
    report = json.loads(_cli(tenancy, "usage", "--by", "team", "--since", "1h", "--json"))
    assert any(r["team"] == "team-beta" and r["requests"] >= 3 for r in report)
    # the frontend's replica ledger recorded what its Triton reserves: both views priced, equal totals
    owner = json.loads(_cli(tenancy, "cost", "--by", "owner", "--window", "1h", "--format", "json"))
    assert any(r["endpoint"] == "lightgbm_regressor" and r["replica_s"] > 0 and r["cost_usd"] > 0 for r in owner), owner
    cost = json.loads(_cli(tenancy, "cost", "--by", "caller", "--window", "1h", "--format", "json"))
    assert any(r["team"] == "team-beta" and r["compute_s"] > 0 and r["priced"] and r["cost_usd"] > 0 for r in cost), cost


def test_stream_infer_requests_are_metered_once_each(tenancy):
    model = "lightgbm_regressor"
    x = _features(tenancy.repository, model)
    good = grpcclient.InferInput("features", list(x.shape), "FP32")
    good.set_data_from_numpy(x)
    bad = grpcclient.InferInput("features", [2, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((2, 3), np.float32))
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(tenancy.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers={"authorization": f"Bearer {tenancy.keys['streamer']}"})
    try:
        client.async_stream_infer(model, [good], request_id="s1")
        client.async_stream_infer(model, [bad], request_id="s2")  # refused by validation: never sent, not metered
        client.async_stream_infer(model, [good])  # no id
        client.async_stream_infer(model, [good], request_id="s1")  # an id used twice
        got = [results.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
        client.close()
    assert sum(e is None for _, e in got) == 3, [str(e) for _, e in got]
    # each answer was recorded before the caller saw it: the meter holds all three now

    def streamer_usage():
        row = next((r for r in tenancy.store.usage("tenant_model") if r["tenant"] == "streamer"), None)
        return row if row is not None and row["requests"] >= 3 else None

    row = wait_until(streamer_usage, timeout=10)
    assert row and (row["model"], row["requests"], row["tokens"]) == (model, 3, 0) and row["compute_us"] > 0
    report = json.loads(_cli(tenancy, "usage", "--by", "team", "--since", "1h", "--json"))
    assert [r["requests"] for r in report if r["team"] == "team-streamer"] == [3]


# ---- the Tenancy admin API and Admin authorization (gRPC) ---------------------------------------


def _rpc_code(fn, request, key=None):
    try:
        return grpc.StatusCode.OK, fn(request, metadata=_auth(key), timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details()


def test_an_admin_key_creates_a_granted_key_that_sees_only_its_model(tenancy):
    tenancy_api = tenancy_pb2_grpc.TenancyStub(tenancy.channel)
    admin_api = admin_pb2_grpc.AdminStub(tenancy.channel)
    ops = tenancy.keys["ops"]
    changes = tenancy_pb2.TenantChanges(team="team-t", grants=tenancy_pb2.Grants(models=["mlp_classifier"]))
    created = tenancy_api.CreateKey(tenancy_pb2.CreateKeyRequest(tenant="tenant-t", changes=changes), metadata=_auth(ops), timeout=30)
    assert created.key.startswith(f"ipk_{created.key_id}_") and list(created.tenant.models) == ["mlp_classifier"]
    key = created.key
    # the frontend that minted it serves it at once; it infers its model and nothing else
    assert _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, "mlp_classifier"), key)[0] == grpc.StatusCode.OK
    code, message, _ = _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, "fraud_xgboost"), key)
    assert code == grpc.StatusCode.NOT_FOUND and message == "unknown model 'fraud_xgboost'"
    code, listed = _rpc_code(admin_api.ListModels, admin_pb2.ListModelsRequest(), key)
    assert code == grpc.StatusCode.OK and [m.name for m in listed.models] == ["mlp_classifier"]
    code, listed = _rpc_code(admin_api.ListModels, admin_pb2.ListModelsRequest(), ops)
    assert {m.name for m in listed.models} >= set(MODELS)
    assert _rpc_code(admin_api.ListModels, admin_pb2.ListModelsRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
    # listings never carry keys or hashes
    code, keys = _rpc_code(tenancy_api.ListKeys, tenancy_pb2.ListKeysRequest(tenant="tenant-t"), ops)
    assert [(k.key_id, k.state) for k in keys.keys] == [(created.key_id, "active")]
    assert key.encode() not in keys.SerializeToString() and key not in tenancy.log.read_text(errors="replace")
    # revoked through the API: refused (at once here; elsewhere after a refresh)
    tenancy_api.RevokeKey(tenancy_pb2.RevokeKeyRequest(key_id=created.key_id), metadata=_auth(ops), timeout=30)
    req = _infer_request(tenancy.repository, "mlp_classifier")
    assert wait_until(lambda: _grpc(tenancy, "ModelInfer", req, key)[0] == grpc.StatusCode.UNAUTHENTICATED, timeout=10)
    # every call is in the control plane's audit log, under the admin's tenant and key id
    code, audit = _rpc_code(admin_api.ListAudit, admin_pb2.ListAuditRequest(limit=200), ops)
    actions = {(e.action, e.outcome) for e in audit.entries if e.actor.startswith("ops/")}
    assert {("tenancy.CreateKey", "ok"), ("tenancy.ListKeys", "ok"), ("tenancy.RevokeKey", "ok")} <= actions
    assert all(key not in e.detail for e in audit.entries)


def test_a_non_admin_key_may_not_manage_keys_or_deploy(tenancy):
    tenancy_api = tenancy_pb2_grpc.TenancyStub(tenancy.channel)
    admin_api = admin_pb2_grpc.AdminStub(tenancy.channel)
    alpha = tenancy.keys["alpha"]
    request = tenancy_pb2.CreateKeyRequest(tenant="mallory", changes=tenancy_pb2.TenantChanges(admin=True))
    assert _rpc_code(tenancy_api.CreateKey, request, alpha)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _rpc_code(tenancy_api.CreateKey, request)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert "mallory" not in {t.name for t in tenancy.store.tenants()}
    assert _rpc_code(admin_api.Deploy, admin_pb2.DeployRequest(ref="mlp_classifier:1"), alpha)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _rpc_code(admin_api.Rollback, admin_pb2.RollbackRequest(name="mlp_classifier"), alpha)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert _rpc_code(admin_api.UnloadModel, admin_pb2.UnloadModelRequest(name="fraud_xgboost"), alpha)[0] == grpc.StatusCode.PERMISSION_DENIED
    code, listed = _rpc_code(admin_api.ListModels, admin_pb2.ListModelsRequest(), alpha)
    assert code == grpc.StatusCode.OK and {m.name for m in listed.models} == set(GRANTS["alpha"])
    # an ungranted endpoint reads like one never deployed
    code, message = _rpc_code(admin_api.GetEndpoint, admin_pb2.GetEndpointRequest(name="lightgbm_regressor"), alpha)
    assert code == grpc.StatusCode.NOT_FOUND and message == "endpoint 'lightgbm_regressor' has never been deployed"


# ---- issue 15, class 8: /metrics on the REST port, the CLIs' API key, keys that are not UTF-8 -------


def test_rest_metrics_needs_an_admin_key_and_the_metrics_port_stays_open(tenancy):
    """The REST port faces tenants; its /metrics names every model with its counts (also models
    a tenant was not granted), so it answers only an admin key. The metrics port is unchanged."""
    assert _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, "lightgbm_regressor"), tenancy.keys["beta"])[0] == grpc.StatusCode.OK
    status, _, body = _http(tenancy, "GET", "/metrics")
    assert status == 401 and json.loads(body)["code"] == "UNAUTHENTICATED"
    status, _, body = _http(tenancy, "GET", "/metrics", headers=_bearer(tenancy.keys["alpha"]))
    assert status == 403 and json.loads(body)["code"] == "PERMISSION_DENIED"
    assert b"lightgbm_regressor" not in body  # alpha was not granted it: nothing about it leaks
    status, _, body = _http(tenancy, "GET", "/metrics", headers=_bearer(tenancy.keys["ops"]))
    assert status == 200 and b'model="lightgbm_regressor"' in body
    host, port = tenancy.metrics.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    assert r.status == 200 and b'model="lightgbm_regressor"' in r.read()
    conn.close()


def _cli_result(stack, *args, env=None):
    full = {k: v for k, v in os.environ.items() if k != "INFERPLANE_API_KEY"}
    full.update(stack.env, **(env or {}))
    return subprocess.run([sys.executable, "-m", "server.cli.main", *args], env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", [["endpoints", "list"], ["endpoints", "show", "mlp_classifier"], ["rollback", "mlp_classifier"],
                                     ["deploy", "mlp_classifier:1"], ["traffic", "status", "mlp_classifier"]])  # fmt: skip
def test_the_registry_and_traffic_clis_send_the_api_key(tenancy, command):
    url = ["--url", tenancy.grpc]
    without = _cli_result(tenancy, *command, *url)
    assert without.returncode != 0 and "UNAUTHENTICATED" in without.stderr, without.stderr
    # with the admin key (flag, then environment) the call is authenticated: whatever it answers, not UNAUTHENTICATED
    for result in (
        _cli_result(tenancy, *command, *url, "--api-key", tenancy.keys["ops"]),
        _cli_result(tenancy, *command, *url, env={"INFERPLANE_API_KEY": tenancy.keys["ops"]}),
    ):
        # answered by the server: exit 0, or its own error line (endpoint unknown, nothing to roll back)
        answered = result.returncode == 0 or re.search(r"^error: [A-Z_]+: ", result.stderr, re.M)
        assert answered and "UNAUTHENTICATED" not in result.stderr and "PERMISSION_DENIED" not in result.stderr, result.stderr
    denied = _cli_result(tenancy, *command, *url, "--api-key", tenancy.keys["alpha"])
    if command[0] in ("deploy", "rollback"):
        assert denied.returncode != 0 and "PERMISSION_DENIED" in denied.stderr, denied.stderr


def test_an_api_key_header_that_is_not_utf8_is_unauthenticated_not_a_crash(tenancy):
    import socket

    host, port = tenancy.http.rsplit(":", 1)
    body = _rest_infer_body(tenancy.repository, "lightgbm_regressor")
    for header in (b"x-api-key: \xff\xfe", b"Authorization: Bearer ipk_\xff"):
        request = (b"POST /v2/models/lightgbm_regressor/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + header
                   + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)  # fmt: skip
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(request)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["code"] == "UNAUTHENTICATED"


# ---- typed per-model APIs (issue 21) ----------------------------------------------------------


def test_typed_apis_show_and_answer_only_granted_models(tenancy, tmp_path):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from tests.integration.test_typed import compile_stubs

    status, _, body = _http(tenancy, "GET", "/v1/models/fraud_xgboost/proto", headers=_bearer(tenancy.keys["alpha"]))
    assert status == 200
    messages, _ = compile_stubs(body.decode(), "fraud_xgboost_typed", tmp_path)
    names = [f.name for f in messages.FraudXgboostRequest.DESCRIPTOR.fields]
    good = messages.FraudXgboostRequest(**dict(zip(names, _features(tenancy.repository, "fraud_xgboost", 1)[0].tolist()))).SerializeToString()
    predict = tenancy.channel.unary_unary("/inferplane.models.fraud_xgboost.v1.FraudXgboostService/Predict")

    def call(body, key):
        try:
            predict(body, metadata=_auth(key), timeout=30)
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()

    assert call(good, tenancy.keys["alpha"]) == grpc.StatusCode.OK
    assert call(b"", tenancy.keys["alpha"]) == grpc.StatusCode.INVALID_ARGUMENT  # every field missing
    assert call(b"", None) == grpc.StatusCode.UNAUTHENTICATED
    assert call(b"", tenancy.keys["beta"]) == grpc.StatusCode.NOT_FOUND  # not granted: nothing about its fields
    assert call(good, tenancy.keys["beta"]) == grpc.StatusCode.NOT_FOUND
    assert _http(tenancy, "GET", "/v1/models/fraud_xgboost/proto", headers=_bearer(tenancy.keys["beta"]))[0] == 404
    admin = admin_pb2_grpc.AdminStub(tenancy.channel)
    with pytest.raises(grpc.RpcError) as err:
        admin.GetModelProto(admin_pb2.GetModelProtoRequest(name="fraud_xgboost"), metadata=_auth(tenancy.keys["beta"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        admin.RetireSchema(admin_pb2.RetireSchemaRequest(name="fraud_xgboost", major="v1"), metadata=_auth(tenancy.keys["alpha"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    def listed(key):
        stub = reflection_pb2_grpc.ServerReflectionStub(tenancy.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = stub.ServerReflectionInfo(iter([request]), metadata=_auth(key), timeout=30)
        return {s.name for s in answer.list_services_response.service if s.name.startswith("inferplane.models.")}

    assert listed(tenancy.keys["beta"]) == {"inferplane.models.lightgbm_regressor.v1.LightgbmRegressorService"}
    assert listed(tenancy.keys["alpha"]) == {
        "inferplane.models.fraud_xgboost.v1.FraudXgboostService", "inferplane.models.mlp_classifier.v1.MlpClassifierService",
    }  # fmt: skip
    assert listed(None) == set()


def test_two_tenants_sending_one_idempotency_key_each_get_their_own_answer(tenancy):
    """Keys are scoped by tenant: beta's "shared-order" is not idem's, so beta never receives idem's
    stored answer (a cross-tenant read) nor a refusal for a body idem sent (a cross-tenant probe)."""
    model = "lightgbm_regressor"
    for transport in ("grpc", "rest"):
        key = f"shared-order-{transport}"
        answers = {}
        for tenant, rows in (("idem", 2), ("beta", 3), ("idem", 2)):
            if transport == "grpc":
                code, out, _ = _grpc(tenancy, "ModelInfer", _infer_request(tenancy.repository, model, rows), tenancy.keys[tenant], (("idempotency-key", key),))
                assert code == grpc.StatusCode.OK, out
                answer = pb.ModelInferResponse.FromString(out)
                got = (answer.outputs[0].shape[0], np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).tolist())
            else:
                headers = {**_bearer(tenancy.keys[tenant]), "Idempotency-Key": key, "Content-Type": "application/json"}
                status, _, body = _http(tenancy, "POST", f"/v2/models/{model}/infer", _rest_infer_body(tenancy.repository, model, rows), headers)
                assert status == 200, body
                output = json.loads(body)["outputs"][0]
                got = (output["shape"][0], [float(v) for v in output["data"]])
            assert got[0] == rows, (transport, tenant, got)  # the answer to this tenant's own body
            answers.setdefault(tenant, []).append(got)
        assert answers["idem"][0] == answers["idem"][1]  # within a tenant the key still replays
        assert answers["beta"][0] != answers["idem"][0]
