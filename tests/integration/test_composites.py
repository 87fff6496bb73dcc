"""Composite endpoints on the real stack: each demo's answer equals the chain computed by hand
(members called one by one through the frontend, operators in numpy), a member failure under each
policy, and a composite registered, deployed, canaried and rolled back as one versioned unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.integration
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

SENTENCES = [b"The goalkeeper saved a penalty in the final minute.", b"A cold front brings snow to the hills tonight.",
             b"The share price rallied after the earnings report."]  # fmt: skip


@pytest.fixture(scope="module")
def client(compose_stack):
    c = grpcclient.InferenceServerClient(compose_stack.grpc)
    yield c
    c.close()


@pytest.fixture(scope="module")
def rows(compose_repository):
    with np.load(compose_repository / "fraud_xgb" / "validation.npz") as npz:
        x = np.ascontiguousarray(npz["features"][:24])
    x[:4, 0] = 2.5  # some large amounts for the router
    return x


def infer(client, model, version="", **inputs):
    tensors = []
    for name, array in inputs.items():
        t = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else "FP32")
        t.set_data_from_numpy(array)
        tensors.append(t)
    return client.infer(model, tensors, model_version=version)


def member(client, name, x):
    return infer(client, name, features=x).as_numpy("probability")


def node_counts(stack, composite: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("inferplane_composite_node_requests_total{") and f'composite="{composite}"' in line:
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            out[(labels["node"].strip('"'), labels["code"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


# ---- each demo equals its chain by hand -------------------------------------------------------------


def test_ensemble_is_the_members_averaged(client, rows, compose_stack):
    xgb, lgbm, mlp = (member(client, m, rows) for m in ("fraud_xgb", "fraud_lgbm", "fraud_mlp"))
    answer = infer(client, "fraud_ensemble", features=rows)
    mean = (xgb + lgbm + mlp) / 3
    assert np.allclose(answer.as_numpy("probability"), mean, atol=1e-6)
    assert np.array_equal(answer.as_numpy("is_fraud"), (mean >= 0.5).astype(np.int32))
    assert answer.get_response().model_name == "fraud_ensemble" and answer.get_response().model_version == "1"
    assert 0 < answer.as_numpy("is_fraud").sum() < len(rows)  # the rows are not all one class
    assert node_counts(compose_stack, "fraud_ensemble") == {}  # Triton ran the steps: no frontend hop per node


def test_quorum_composite_is_the_weighted_mean_by_hand(client, rows, compose_stack):
    before = node_counts(compose_stack, "fraud_quorum")
    xgb, lgbm, mlp = (member(client, m, rows) for m in ("fraud_xgb", "fraud_lgbm", "fraud_mlp"))
    answer = infer(client, "fraud_quorum", features=rows).as_numpy("probability")
    assert np.allclose(answer, (2 * xgb + 2 * lgbm + mlp) / 5, atol=1e-6)
    after = node_counts(compose_stack, "fraud_quorum")
    for node in ("xgb", "lgbm", "mlp", "mean"):  # one call per node, each through the pipeline
        assert after[(node, "OK")] - before.get((node, "OK"), 0) == 1


def test_router_sends_each_row_to_its_branch(client, rows, compose_stack):
    before = node_counts(compose_stack, "fraud_router")
    lgbm, mlp = member(client, "fraud_lgbm", rows), member(client, "fraud_mlp", rows)
    answer = infer(client, "fraud_router", features=rows).as_numpy("probability")
    large = rows[:, :1] >= 1.0
    assert 0 < large.sum() < len(rows)
    assert np.allclose(answer, np.where(large, mlp, lgbm), atol=1e-6)
    after = node_counts(compose_stack, "fraud_router")
    assert all(after[(n, "OK")] - before.get((n, "OK"), 0) == 1 for n in ("large", "route", "lgbm", "mlp"))
    only_small = rows[~large[:, 0]]
    infer(client, "fraud_router", features=only_small)
    assert node_counts(compose_stack, "fraud_router")[("mlp", "OK")] == after[("mlp", "OK")]  # no large row: the MLP never ran


def test_text_pipeline_is_embedding_then_classifier(client):
    texts = np.array([[s] for s in SENTENCES], dtype=object)
    embedding = infer(client, "minilm_embeddings", text=texts).as_numpy("embedding")
    logits = infer(client, "topic_classifier", embedding=embedding).as_numpy("logits")
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = e / e.sum(axis=1, keepdims=True)
    for name in ("topic_pipeline", "topic_via_endpoint"):  # one Triton ensemble; the DAG with an embeddings-endpoint node
        answer = infer(client, name, text=texts)
        assert np.allclose(answer.as_numpy("probabilities"), probabilities, atol=1e-5), name
        assert answer.as_numpy("topic").ravel().tolist() == np.argmax(logits, axis=1).tolist() == [0, 1, 2], name


def test_a_composite_is_validated_and_described_like_a_model(client, compose_stack, rows):
    with pytest.raises(InferenceServerException) as info:
        infer(client, "fraud_quorum", features=rows[:, :16])
    assert "INVALID_ARGUMENT" in str(info.value.status()) and "features" in info.value.message()
    metadata = client.get_model_metadata("fraud_router", as_json=True)
    assert metadata["platform"] == "inferplane_composite" and metadata["inputs"][0]["shape"] == ["-1", "32"]
    config = client.get_model_config("fraud_ensemble", as_json=True)["config"]
    assert config["max_batch_size"] == 64 and {o["name"] for o in config["output"]} == {"probability", "is_fraud"}
    body = json.dumps({"inputs": [{"name": "features", "shape": [2, 32], "datatype": "FP32", "data": rows[:2].ravel().tolist()}]}).encode()
    request = urllib.request.Request(f"http://{compose_stack.http}/v2/models/fraud_quorum/infer", body, {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
    assert answer["model_name"] == "fraud_quorum" and len(answer["outputs"][0]["data"]) == 2


# ---- a member failure under each policy --------------------------------------------------------------


def test_member_failure_under_each_policy(client, rows):
    xgb, mlp = member(client, "fraud_xgb", rows), member(client, "fraud_mlp", rows)
    client.unload_model("fraud_lgbm")
    try:
        with pytest.raises(InferenceServerException):  # fail policy (a Triton ensemble): the request fails
            infer(client, "fraud_ensemble", features=rows)
        quorum = infer(client, "fraud_quorum", features=rows).as_numpy("probability")  # 2 of 3 answered: their weighted mean
        assert np.allclose(quorum, (2 * xgb + mlp) / 3, atol=1e-6)
        with pytest.raises(InferenceServerException) as info:  # the router's LightGBM branch is down: its rows fail
            infer(client, "fraud_router", features=rows)
        assert "UNAVAILABLE" in str(info.value.status()) and "node 'lgbm'" in info.value.message()
        client.unload_model("fraud_mlp")
        with pytest.raises(InferenceServerException) as info:  # 1 of 3: below the quorum
            infer(client, "fraud_quorum", features=rows)
        assert "UNAVAILABLE" in str(info.value.status()) and "needs 2 of 3 members; answered ['xgb']" in info.value.message()
    finally:
        client.load_model("fraud_lgbm")
        client.load_model("fraud_mlp")
    client.load_model("fraud_ensemble__v1")  # the ensemble picks its members up again
    assert np.allclose(infer(client, "fraud_quorum", features=rows).as_numpy("probability"),
                       (2 * xgb + 2 * member(client, "fraud_lgbm", rows) + mlp) / 5, atol=1e-6)  # fmt: skip
    assert infer(client, "fraud_ensemble", features=rows).as_numpy("probability").shape == (len(rows), 1)


# ---- one versioned unit: register, deploy, canary, roll back -----------------------------------------


def cli(stack, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, INFERPLANE_DATABASE_URL=f"sqlite:///{stack.workdir}/registry.db",
               INFERPLANE_ARTIFACT_STORE=str(stack.workdir / "artifacts"), INFERPLANE_MODEL_REPOSITORY=str(stack.repository))  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "server.cli.main", *args], capture_output=True, text=True, env=env, timeout=120)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


PAIR = """
name: fraud_pair
inputs: [{name: features, datatype: FP32, dims: [32]}]
nodes:
  - {name: xgb, model: fraud_xgb, inputs: {features: features}}
  - {name: mlp, model: fraud_mlp, inputs: {features: features}}
  - {name: mean, op: average, inputs: [xgb.probability, mlp.probability]}
  - {name: flag, op: threshold, inputs: [mean.output], params: {value: THRESHOLD}}
outputs: {probability: mean.output, is_fraud: flag.output}
"""


def test_register_deploy_canary_and_roll_back_as_one_unit(compose_stack, client, rows, tmp_path):
    url = ("--url", compose_stack.grpc)
    cli(compose_stack, "models", "register", "fraud_xgb", "--from-model-dir", str(compose_stack.repository / "fraud_xgb"))
    for version, threshold in ((1, "0.5"), (2, "0.0")):
        spec = tmp_path / f"pair{version}.yaml"
        spec.write_text(PAIR.replace("THRESHOLD", threshold))
        out = cli(compose_stack, "compose", "register", str(spec)).stdout
        assert f"registered fraud_pair:{version} (ensemble" in out, out
    explained = cli(compose_stack, "compose", "explain", "fraud_pair:2").stdout
    assert "runs as one Triton ensemble" in explained and "fraud_pair__v2__flag" in explained
    lineage = cli(compose_stack, "compose", "lineage", "fraud_pair:2").stdout
    assert "fraud_xgb:1" in lineage and "xgboost-json" in lineage and "fraud_mlp:1" in lineage and "not registered" in lineage

    cli(compose_stack, "deploy", "fraud_pair:1", *url)
    mean = (member(client, "fraud_xgb", rows) + member(client, "fraud_mlp", rows)) / 2
    one = infer(client, "fraud_pair", features=rows)
    assert one.get_response().model_version == "1" and np.array_equal(one.as_numpy("is_fraud"), (mean >= 0.5).astype(np.int32))
    cli(compose_stack, "deploy", "fraud_pair:2", *url)
    two = infer(client, "fraud_pair", features=rows)
    assert two.get_response().model_version == "2" and np.array_equal(two.as_numpy("is_fraud"), (mean >= 0.0).astype(np.int32))
    assert two.as_numpy("is_fraud").sum() > one.as_numpy("is_fraud").sum()
    rolled = cli(compose_stack, "rollback", "fraud_pair", *url).stdout
    assert "fraud_pair:1" in rolled
    assert infer(client, "fraud_pair", features=rows).get_response().model_version == "1"

    cli(compose_stack, "canary", "fraud_pair:2", "--percent", "50", "--interval", "10m", *url)
    seen = {infer(client, "fraud_pair", features=rows[:1]).get_response().model_version for _ in range(40)}
    assert seen == {"1", "2"}  # both composite versions answer under the split
    cli(compose_stack, "traffic", "rollback", "fraud_pair", *url)
    assert {infer(client, "fraud_pair", features=rows[:1]).get_response().model_version for _ in range(10)} == {"1"}
    assert infer(client, "fraud_pair", version="2", features=rows[:1]).get_response().model_version == "2"  # still installed


GATE = """
name: fraud_gate
inputs: [{name: features, datatype: FP32, dims: [32]}]
nodes:
  - {name: large, op: threshold, inputs: [features], params: {value: 1.0, column: 0}}
  - {name: mlp, model: fraud_mlp, inputs: {features: features}}
  - {name: route, router: {key: large.output, routes: {"1": mlp}}}
outputs: {probability: route.probability}
"""


def test_a_deployed_router_without_a_branch_for_a_row_names_it(compose_stack, client, rows, tmp_path):
    spec = tmp_path / "gate.yaml"
    spec.write_text(GATE)
    cli(compose_stack, "compose", "register", str(spec))
    explained = cli(compose_stack, "compose", "explain", "fraud_gate:1").stdout
    assert "the frontend's DAG executor" in explained and "a routing decision" in explained
    cli(compose_stack, "deploy", "fraud_gate:1", "--url", compose_stack.grpc)
    large = rows[rows[:, 0] >= 1.0]
    assert np.allclose(infer(client, "fraud_gate", features=large).as_numpy("probability"), member(client, "fraud_mlp", large), atol=1e-6)
    with pytest.raises(InferenceServerException) as info:
        infer(client, "fraud_gate", features=rows)
    assert "INVALID_ARGUMENT" in str(info.value.status()) and "router 'route' has no branch for '0'" in info.value.message()
    refused = cli(compose_stack, "compose", "register", str(spec.with_name("missing.yaml")), check=False)
    assert refused.returncode != 0
