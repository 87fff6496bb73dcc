"""Register -> deploy -> infer -> deploy v2 -> rollback against the real stack (frontend + Triton).

One stack for the module, on a copy of the demo's ``mlp_classifier`` (model A, loaded at start);
the endpoint ``scorer`` (model B) is deployed from the registry, whose database and artifact store
live in tmp (``INFERPLANE_DATABASE_URL`` / ``INFERPLANE_ARTIFACT_STORE`` passed to the process).
The tests run in order and share the endpoint's state: v1 and v2 registered, v1 live after the
first test.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from model_repository.config_writer import read_config
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration

ENDPOINT = "scorer"
ACTOR = (("x-inferplane-actor", "ci-test"),)


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _bundle_request(bundle, name=ENDPOINT, **extra) -> admin_pb2.RegisterModelRequest:
    signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]}
    return admin_pb2.RegisterModelRequest(
        name=name, artifact=bundle.artifact, filename=bundle.artifact_name, signature_json=json.dumps(signature),
        validation_npz=_npz(features=bundle.features, expected=bundle.expected), training_run=f"seed-{bundle.seed}",
        dataset_version="synthetic-regression-v1", metrics={k: float(v) for k, v in bundle.extra.items() if k == "rounds"}, owner_team="ml",
        **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bundles():
    # v1 and v2 of the same regressor (different rounds: different predictions, same signature)
    return demo.lightgbm_regressor(rounds=40), demo.lightgbm_regressor(rounds=10)


@pytest.fixture(scope="module")
def deploy_stack(demo_repository, tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    repository = root / "model_repository"
    repository.mkdir()
    shutil.copytree(demo_repository / "mlp_classifier", repository / "mlp_classifier")
    env = {
        "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db",
        "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
        "INFERPLANE_ROLLBACK_GRACE_S": "600",
        "INFERPLANE_DEPLOY_TIMEOUT_S": "60",
    }
    stack = start_stack(repository, root / "stack", env=env)
    stack.env = env
    stack.root = root
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def admin(deploy_stack):
    channel = grpc.insecure_channel(deploy_stack.grpc)
    yield admin_pb2_grpc.AdminStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def client(deploy_stack):
    c = grpcclient.InferenceServerClient(deploy_stack.grpc)
    yield c
    c.close()


def _infer(client, bundle, version="", rows=4, model=ENDPOINT):
    features = bundle.features[:rows]
    inp = grpcclient.InferInput("features", list(features.shape), "FP32")
    inp.set_data_from_numpy(features)
    result = client.infer(model, [inp], model_version=version)
    out = bundle.outputs[0].name
    return result.get_response().model_version, result.as_numpy(out)


def _cli(stack, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, **stack.env)
    return subprocess.run([sys.executable, "-m", "server.cli.main", *args], capture_output=True, text=True, env=env, timeout=60)


def test_register_deploy_infer_then_rollback(deploy_stack, admin, client, bundles):
    v1, v2 = bundles
    first = admin.RegisterModel(_bundle_request(v1), metadata=ACTOR)
    assert first.created and first.version.version == 1 and first.version.format == "lightgbm-text"
    again = admin.RegisterModel(_bundle_request(v1), metadata=ACTOR)
    assert not again.created and again.version.version == 1 and again.version.sha256 == first.version.sha256
    second = admin.RegisterModel(_bundle_request(v2, parent=f"{ENDPOINT}:1"), metadata=ACTOR)
    assert second.created and second.version.version == 2

    deployed = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:1"), metadata=ACTOR).result
    assert deployed.version == 1 and deployed.reloaded
    version, out = _infer(client, v1)
    assert version == "1"
    np.testing.assert_allclose(out, v1.expected[:4], rtol=1e-4, atol=1e-5)

    serving = admin_pb2.ServingOptions(instances=1, max_batch=32, has_max_batch=True)
    deployed = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:2", serving=serving), metadata=ACTOR).result
    assert deployed.version == 2 and deployed.previous == 1 and list(deployed.loaded_versions) == [1, 2]
    version, out = _infer(client, v2)
    assert version == "2"
    np.testing.assert_allclose(out, v2.expected[:4], rtol=1e-4, atol=1e-5)
    pinned, out = _infer(client, v1, version="1")  # callers may still pin the old version during the grace period
    assert pinned == "1"

    # a switch, not a reload (how long a switch takes between loaded versions: BENCHMARKS.md §17)
    rolled = admin.Rollback(admin_pb2.RollbackRequest(name=ENDPOINT), metadata=ACTOR).result
    assert rolled.version == 1 and not rolled.reloaded and rolled.switch_ms > 0
    answered = {_infer(client, v1, rows=1)[0] for _ in range(50)}
    assert answered == {"1"}  # after the switch returns, the retired version answers nothing
    _, out = _infer(client, v1)
    np.testing.assert_allclose(out, v1.expected[:4], rtol=1e-4, atol=1e-5)

    shown = admin.GetEndpoint(admin_pb2.GetEndpointRequest(name=ENDPOINT)).endpoint
    assert (shown.live, shown.routed, list(shown.loaded_versions)) == (1, "1", [1, 2])
    assert [(h.version, h.state) for h in shown.history] == [(2, "rolled_back"), (1, "active")]
    assert json.loads(shown.serving_json)["max_batch"] == 32

    lineage = admin.GetLineage(admin_pb2.GetLineageRequest(name=ENDPOINT, version=2)).chain
    assert [f"{v.name}:{v.version}" for v in lineage] == [f"{ENDPOINT}:2", f"{ENDPOINT}:1"]
    audit = admin.ListAudit(admin_pb2.ListAuditRequest(target=ENDPOINT, limit=10)).entries
    assert [(e.action, e.outcome, e.actor) for e in audit[:3]] == [
        ("rollback", "ok", "ci-test"), ("deploy", "ok", "ci-test"), ("deploy", "ok", "ci-test"),
    ]  # fmt: skip

    listed = _cli(deploy_stack, "endpoints", "list", "--url", deploy_stack.grpc)
    assert listed.returncode == 0, listed.stderr
    assert f"{ENDPOINT}\tlive=1\tprevious=-\trouted=1" in listed.stdout
    lineage_cli = _cli(deploy_stack, "models", "lineage", f"{ENDPOINT}:2")
    assert lineage_cli.returncode == 0 and f"└─ {ENDPOINT}:1" in lineage_cli.stdout, lineage_cli.stderr


def test_pickles_are_refused_over_the_admin_api(admin):
    import pickle

    request = admin_pb2.RegisterModelRequest(
        name=ENDPOINT, artifact=pickle.dumps({"weights": [1, 2]}), filename="model.pt",
        signature_json=json.dumps({"inputs": [{"name": "x", "dims": [1]}], "outputs": [{"name": "y", "dims": [1]}]}),
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        admin.RegisterModel(request, metadata=ACTOR)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pickle" in err.value.details() and "safetensors" in err.value.details()


def test_failed_deploy_and_rollback_never_disturb_another_model(deploy_stack, admin, client, bundles):
    """Model A takes traffic while B is deployed, fails a deploy and is rolled back: every A request succeeds."""
    v1, v2 = bundles
    a_rows = demo.load_validation(deploy_stack.repository / "mlp_classifier")
    broken = v1.artifact.replace(b"tree_sizes=", b"tree_sizes=x", 1) + b"\nnot a tree\n"
    bad = admin.RegisterModel(
        admin_pb2.RegisterModelRequest(
            name=ENDPOINT, artifact=broken, filename="model.txt", signature_json=_bundle_request(v1).signature_json,
        ),
        metadata=ACTOR,
    ).version  # fmt: skip
    stop = threading.Event()
    results = {"A": [], "B": []}

    def hammer(model, call):
        c = grpcclient.InferenceServerClient(deploy_stack.grpc)
        try:
            while not stop.is_set():
                try:
                    results[model].append(call(c))
                except Exception as exc:  # recorded, asserted below
                    results[model].append(exc)
        finally:
            c.close()

    def call_a(c):
        inp = grpcclient.InferInput("features", [2, 64], "FP32")
        inp.set_data_from_numpy(a_rows["features"][:2])
        out = c.infer("mlp_classifier", [inp]).as_numpy("probabilities")
        np.testing.assert_allclose(out, a_rows["expected"][:2], rtol=1e-4, atol=1e-5)
        return "ok"

    threads = [
        threading.Thread(target=hammer, args=("A", call_a)),
        threading.Thread(target=hammer, args=("B", lambda c: _infer(c, v1, rows=1)[0])),
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        switched = admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:2"), metadata=ACTOR).result
        assert switched.version == 2 and not switched.reloaded  # still loaded: only traffic moved
        with pytest.raises(grpc.RpcError) as err:
            admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:{bad.version}"), metadata=ACTOR)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert f"{ENDPOINT}:2 keeps serving" in err.value.details(), err.value.details()
        assert _infer(client, v2)[0] == "2"
        rolled = admin.Rollback(admin_pb2.RollbackRequest(name=ENDPOINT), metadata=ACTOR).result
        assert rolled.version == 1 and not rolled.reloaded
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    a_failures = [r for r in results["A"] if r != "ok"]
    b_failures = [r for r in results["B"] if not isinstance(r, str)]
    assert len(results["A"]) > 20 and not a_failures, a_failures[:3]
    assert len(results["B"]) > 20 and not b_failures, b_failures[:3]
    assert set(results["B"]) <= {"1", "2"}
    audit = admin.ListAudit(admin_pb2.ListAuditRequest(target=ENDPOINT, limit=3)).entries
    assert [(e.action, e.outcome) for e in audit] == [("rollback", "ok"), ("deploy", "failed"), ("deploy", "ok")]


def test_tampered_artifacts_are_refused(deploy_stack, admin, client, bundles):
    v1, _ = bundles
    third = admin.RegisterModel(_bundle_request(demo.lightgbm_regressor(rounds=20)), metadata=ACTOR).version
    # in the artifact store: refused before anything reaches Triton
    blob = deploy_stack.root / "artifacts" / "sha256" / third.sha256[:2] / third.sha256
    original = blob.read_bytes()
    blob.write_bytes(original.replace(b"tree", b"TREE", 1))
    with pytest.raises(grpc.RpcError) as err:
        admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:{third.version}"), metadata=ACTOR)
    assert err.value.code() == grpc.StatusCode.ABORTED and "tampered" in err.value.details()
    blob.write_bytes(original)
    # in Triton's repository: the adapter checks the registry's digest when the version (re)loads
    live_file = deploy_stack.repository / ENDPOINT / "1" / "model.txt"
    good = live_file.read_bytes()
    live_file.write_bytes(good.replace(b"tree", b"TREE", 1))
    try:
        with pytest.raises(grpc.RpcError) as err:
            admin.Deploy(admin_pb2.DeployRequest(ref=f"{ENDPOINT}:{third.version}"), metadata=ACTOR)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "sha256" in err.value.details() and "refusing to load" in err.value.details(), err.value.details()
    finally:
        live_file.write_bytes(good)
    version, out = _infer(client, v1)  # the loaded v1 kept serving throughout
    assert version == "1"
    np.testing.assert_allclose(out, v1.expected[:4], rtol=1e-4, atol=1e-5)
    shown = admin.GetEndpoint(admin_pb2.GetEndpointRequest(name=ENDPOINT)).endpoint
    assert list(shown.ready_versions) == [1, 2] and list(shown.loaded_versions) == [1, 2]  # failed loads dropped nothing
    assert not (deploy_stack.repository / ENDPOINT / str(third.version)).exists()


def test_a_ubj_booster_registers_and_deploys_with_threads_and_coalescing_flags(deploy_stack, admin, client):
    """XGBoost's binary UBJ format deploys like its JSON one; the CLI's serving flags reach the config
    Triton loads (adapter threads, the frontend's coalescing) and the endpoint's recorded serving."""
    import xgboost as xgb

    from model_repository.config_writer import read_config

    bundle = demo.fraud_xgboost(trees=20)
    booster = xgb.Booster()
    booster.load_model(bytearray(bundle.artifact))
    ubj = bytes(booster.save_raw("ubj"))
    request = _bundle_request(bundle, name="fraud_ubj")
    request.artifact, request.filename = ubj, "model.ubj"
    version = admin.RegisterModel(request, metadata=ACTOR).version
    assert version.format == "xgboost-ubj"
    out = _cli(deploy_stack, "deploy", f"fraud_ubj:{version.version}", "--url", deploy_stack.grpc, "--threads", "2",
               "--no-coalesce", "--coalesce-window-us", "300")  # fmt: skip
    assert out.returncode == 0, out.stderr
    config = read_config(deploy_stack.repository / "fraud_ubj")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert (params["threads"], params["inferplane.coalesce"], params["inferplane.coalesce_window_us"]) == ("2", "false", "300")
    _, probability = _infer(client, bundle, model="fraud_ubj")
    np.testing.assert_allclose(probability, bundle.expected[:4], rtol=1e-5, atol=1e-6)  # the JSON model's answers
    serving = json.loads(admin.GetEndpoint(admin_pb2.GetEndpointRequest(name="fraud_ubj")).endpoint.serving_json)
    assert (serving["threads"], serving["coalesce"], serving["coalesce_window_us"]) == (2, False, 300)


def test_a_validation_set_that_names_no_tensor_is_refused_at_registration(admin, bundles):
    v1, _ = bundles
    request = _bundle_request(v1, name="mislabelled")
    request.validation_npz = _npz(inputs=v1.features, expected=v1.expected)  # "inputs" is no tensor of the model
    with pytest.raises(grpc.RpcError) as err:
        admin.RegisterModel(request, metadata=ACTOR)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "validation['inputs']" in err.value.details() and "features" in err.value.details()
    request.validation_npz = _npz(features=v1.features[:, :3], expected=v1.expected)  # wrong row shape
    with pytest.raises(grpc.RpcError) as err:
        admin.RegisterModel(request, metadata=ACTOR)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rows of shape [3]" in err.value.details()


def _stream(request: admin_pb2.RegisterModelRequest, chunk: int):
    """RegisterModelStream's messages: the registration, then the artifact in ``chunk``-byte pieces."""
    artifact = request.artifact
    header = admin_pb2.RegisterModelRequest()
    header.CopyFrom(request)
    header.ClearField("artifact")
    yield admin_pb2.RegisterModelChunk(header=header)
    for start in range(0, len(artifact), chunk):
        yield admin_pb2.RegisterModelChunk(data=artifact[start : start + chunk])


def test_an_onnx_model_streamed_in_chunks_registers_deploys_and_serves_with_the_configs_providers(deploy_stack, admin, client):
    bundle = demo.mlp_classifier(seed=7)
    request = _bundle_request(bundle, name="streamed_mlp")
    response = admin.RegisterModelStream(_stream(request, chunk=1000), timeout=60)
    assert response.created and response.version.sha256 == hashlib.sha256(bundle.artifact).hexdigest()
    assert response.version.size_bytes == len(bundle.artifact) and response.version.format == "onnx"
    again = admin.RegisterModelStream(_stream(request, chunk=4096), timeout=60)  # same bytes, other chunks: same version
    assert not again.created and again.version.version == response.version.version
    admin.Deploy(admin_pb2.DeployRequest(ref="streamed_mlp:1"), timeout=120)
    config = read_config(deploy_stack.root / "model_repository" / "streamed_mlp")
    assert config.backend == "python" and config.parameters["providers"].string_value == "CPUExecutionProvider"
    version, out = _infer(client, bundle, model="streamed_mlp")
    assert version == "1" and np.allclose(out, bundle.expected[:4], rtol=1e-4, atol=1e-5)


def test_a_stream_without_a_header_is_refused(admin):
    with pytest.raises(grpc.RpcError) as caught:
        admin.RegisterModelStream(iter([admin_pb2.RegisterModelChunk(data=b"tree\n")]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in caught.value.details()


def test_a_tensorrt_plan_is_refused_at_deploy_naming_the_backend_no_triton_here_has(admin):
    signature = {"inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}], "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}]}
    plan = b"ftrt" + bytes(range(256)) * 16
    request = admin_pb2.RegisterModelRequest(name="a_plan", artifact=plan, filename="model.plan", signature_json=json.dumps(signature),
                                             hardware_json=json.dumps({"gpus": 1}))  # fmt: skip
    assert admin.RegisterModelStream(_stream(request, chunk=512), timeout=30).version.format == "tensorrt-plan"
    with pytest.raises(grpc.RpcError) as caught:
        admin.Deploy(admin_pb2.DeployRequest(ref="a_plan:1"), timeout=30)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tensorrt-plan needs Triton's 'tensorrt' backend" in caught.value.details() and "python" in caught.value.details()
