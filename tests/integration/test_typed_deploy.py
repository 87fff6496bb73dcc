"""Typed APIs across deploys on the real stack: register -> deploy a model with an enum feature ->
a non-breaking version (an enum label added: same major) -> a breaking one (a feature renamed:
v2 beside v1, both served) -> ``inferplane endpoints retire-schema NAME v1`` -> rollback.

One stack for the module (registry in tmp); the tests run in order and share the endpoint.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import start_stack, stop_stack
from tests.integration.test_typed import _reflect, bad_request, cli, compile_stubs, fetch_proto

pytestmark = pytest.mark.integration

ENDPOINT = "payments"
SERVICE = "inferplane.models.payments.v{}.PaymentsService"
CHANNELS = ["card_present", "online", "atm", "recurring"]


def _bundle(rounds: int, *, channels=CHANNELS, amount="amount"):
    """A LightGBM regressor whose first feature is a categorical channel (tensor values 0..3)."""
    import lightgbm as lgb

    rng = np.random.default_rng(rounds)
    x = rng.normal(size=(800, 4)).astype(np.float32)
    x[:, 0] = np.arange(800) % 4
    x[:, 1] = np.abs(x[:, 1]) * 100
    y = 3 * x[:, 0] + 0.05 * x[:, 1] + x[:, 2] - x[:, 3] + rng.normal(scale=0.1, size=800)
    params = {"objective": "regression", "num_leaves": 15, "num_threads": 1, "deterministic": True, "seed": 1, "verbose": -1}
    booster = lgb.train(params, lgb.Dataset(x, label=y), num_boost_round=rounds)
    text = booster.model_to_string()
    rows = np.ascontiguousarray(x[:16])
    expected = lgb.Booster(model_str=text).predict(rows, num_threads=1).astype(np.float32).reshape(-1, 1)
    features = [{"name": "channel", "enum": list(channels)}, {"name": amount, "unit": "USD", "range": [0, 1000]}, "risk_a", "risk_b"]
    signature = {
        "inputs": [{"name": "features", "datatype": "FP32", "dims": [4], "features": features}],
        "outputs": [{"name": "score", "datatype": "FP32", "dims": [1]}],
    }
    buffer = io.BytesIO()
    np.savez(buffer, features=rows, expected=expected)
    return admin_pb2.RegisterModelRequest(
        name=ENDPOINT, artifact=text.encode(), filename="model.txt", signature_json=json.dumps(signature), validation_npz=buffer.getvalue()
    ), rows


@pytest.fixture(scope="module")
def typed_stack(demo_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("typed_deploy")
    repository = root / "model_repository"
    repository.mkdir()
    shutil.copytree(demo_repository / "lightgbm_regressor", repository / "lightgbm_regressor")
    env = {"INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
           "INFERPLANE_ROLLBACK_GRACE_S": "600", "INFERPLANE_DEPLOY_TIMEOUT_S": "60"}  # fmt: skip
    stack = start_stack(repository, root / "stack", env=env)
    stack.root = root
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def admin(typed_stack):
    channel = grpc.insecure_channel(typed_stack.grpc)
    yield admin_pb2_grpc.AdminStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def state():
    return {}


def _kwargs(messages, kind, row, enum_prefix="CHANNEL_", labels=CHANNELS, amount="amount"):
    enum = messages.DESCRIPTOR.enum_types_by_name["Channel"].values_by_name
    return {"channel": enum[enum_prefix + labels[int(row[0])].upper()].number, amount: float(row[1]), "risk_a": float(row[2]), "risk_b": float(row[3])}


def _oip(stack, rows):
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        x = grpcclient.InferInput("features", list(rows.shape), "FP32")
        x.set_data_from_numpy(rows)
        return client.infer(ENDPOINT, [x]).as_numpy("score").ravel()
    finally:
        client.close()


def _predict(stack, messages, services, rows, **kw):
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = services.PaymentsServiceStub(channel)
        batch = messages.PaymentsBatchRequest(rows=[messages.PaymentsRow(**_kwargs(messages, "PaymentsRow", r, **kw)) for r in rows])
        return np.array([r.score for r in stub.PredictBatch(batch, timeout=30).results], dtype=np.float32)


def test_a_deployed_enum_model_answers_by_label(typed_stack, admin, state, tmp_path_factory):
    request, rows = _bundle(30)
    assert admin.RegisterModel(request).version.version == 1
    result = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1")).result
    assert result.version == 1 and f"typed API {SERVICE.format(1)}" in result.message
    text = fetch_proto(typed_stack.grpc, ENDPOINT)
    assert "CHANNEL_UNSPECIFIED = 0;" in text and "CHANNEL_RECURRING = 4;  // tensor value 3" in text
    messages, services = compile_stubs(text, "payments_v1_typed", tmp_path_factory.mktemp("payments_v1"))
    state["v1"] = messages, services
    np.testing.assert_allclose(_predict(typed_stack, messages, services, rows), _oip(typed_stack, rows), rtol=1e-6)
    with grpc.insecure_channel(typed_stack.grpc) as channel:
        stub = services.PaymentsServiceStub(channel)
        for number, says in ((0, "UNSPECIFIED (0) is not a declared value"), (9, "9 is not a declared value of Channel")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Predict(messages.PaymentsRequest(channel=number, amount=1, risk_a=0, risk_b=0), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in bad_request(err.value)["channel"]
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(messages.PaymentsRequest(channel=1, amount=5000, risk_a=0, risk_b=0), timeout=30)
        assert bad_request(err.value)["amount"] == "5000 USD is outside the declared range [0, 1000]"


def test_a_non_breaking_version_keeps_the_major(typed_stack, admin, state):
    request, rows = _bundle(20, channels=[*CHANNELS, "wallet"])
    assert admin.RegisterModel(request).version.version == 2
    result = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:2")).result
    assert f"typed API {SERVICE.format(1)} v1.1: non-breaking" in result.message and "enum label wallet = 5 added" in result.message
    answer = admin.GetModelProto(admin_pb2.GetModelProtoRequest(name=ENDPOINT))
    assert [(s.major, s.revision, s.model_version) for s in answer.served] == [(1, 1, "2")]
    assert "CHANNEL_WALLET = 5;" in answer.proto
    messages, services = state["v1"]  # the stub compiled from v1 still works against v1.1
    np.testing.assert_allclose(_predict(typed_stack, messages, services, rows), _oip(typed_stack, rows), rtol=1e-6)


def test_a_breaking_version_adds_v2_and_keeps_serving_v1(typed_stack, admin, state, tmp_path_factory):
    request, rows = _bundle(10, channels=[*CHANNELS, "wallet"], amount="amount_usd")
    assert admin.RegisterModel(request).version.version == 3
    result = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:3")).result
    assert f"typed API {SERVICE.format(2)}: breaking change from v1.1" in result.message
    assert "request.amount: field removed" in result.message and f"retire-schema {ENDPOINT} v1" in result.message
    listed = {s.name for s in _reflect(typed_stack, list_services="").list_services_response.service}
    assert {SERVICE.format(1), SERVICE.format(2)} <= listed
    v2 = fetch_proto(typed_stack.grpc, ENDPOINT)
    assert f"package inferplane.models.{ENDPOINT}.v2;" in v2 and "optional float amount_usd = 2;" in v2
    assert fetch_proto(typed_stack.grpc, ENDPOINT, "v1") != v2 and "amount = 2" in fetch_proto(typed_stack.grpc, ENDPOINT, "v1")
    assert fetch_proto(typed_stack.grpc, ENDPOINT, "3") == v2
    messages2, services2 = compile_stubs(v2, "payments_v2_typed", tmp_path_factory.mktemp("payments_v2"))
    state["v2"] = messages2, services2
    expected = _oip(typed_stack, rows)
    np.testing.assert_allclose(_predict(typed_stack, messages2, services2, rows, amount="amount_usd"), expected, rtol=1e-6)
    messages1, services1 = state["v1"]  # old callers keep working until v1 is retired
    np.testing.assert_allclose(_predict(typed_stack, messages1, services1, rows), expected, rtol=1e-6)


def test_retiring_v1_stops_serving_it(typed_stack, state):
    env = dict(os.environ)
    newest = cli("endpoints", "retire-schema", ENDPOINT, "v2", "--url", typed_stack.grpc, env=env)
    assert newest.returncode == 1 and "FAILED_PRECONDITION" in newest.stderr and "newest" in newest.stderr
    retired = cli("endpoints", "retire-schema", ENDPOINT, "v1", "--url", typed_stack.grpc, env=env)
    assert retired.returncode == 0, retired.stderr
    assert f"still served: v2 ({SERVICE.format(2)})" in retired.stdout
    listed = {s.name for s in _reflect(typed_stack, list_services="").list_services_response.service}
    assert SERVICE.format(2) in listed and SERVICE.format(1) not in listed
    messages1, services1 = state["v1"]
    with grpc.insecure_channel(typed_stack.grpc) as channel, pytest.raises(grpc.RpcError) as err:
        services1.PaymentsServiceStub(channel).Predict(messages1.PaymentsRequest(channel=1, amount=1, risk_a=0, risk_b=0), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    gone = cli("proto", ENDPOINT, "--version", "v1", "--url", typed_stack.grpc)
    assert gone.returncode == 1 and "retired" in gone.stderr


def test_rollback_keeps_the_live_schema(typed_stack, admin, state):
    result = admin.Rollback(admin_pb2.RollbackRequest(name=ENDPOINT)).result
    assert result.version == 2
    _, rows = _bundle(20, channels=[*CHANNELS, "wallet"])
    messages2, services2 = state["v2"]  # v2's fields map onto the endpoint's tensor by position
    got = _predict(typed_stack, messages2, services2, rows, amount="amount_usd")
    np.testing.assert_allclose(got, _oip(typed_stack, rows), rtol=1e-6)
    answer = admin.GetModelProto(admin_pb2.GetModelProtoRequest(name=ENDPOINT))
    assert [s.major for s in answer.served] == [2]
