"""optimize NAME:VERSION against a registry in tmp (no Triton: the profile is switched off here;
tests/integration/test_optimizer.py runs it)."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from model_repository import demo
from optimizer import runtime, synthetic
from optimizer import gate
from optimizer.pipeline import Row, _verdict, optimize
from server.control.registry.artifacts import ArtifactStore
from server.errors import InvalidRequest
from server.control.registry.registry import Registry


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _register(registry, bundle, **extra):
    signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs], "max_batch_size": 64}
    record, _ = registry.register(
        bundle.name, bundle.artifact, signature=signature, filename=bundle.artifact_name,
        validation=_npz(features=bundle.features, expected=bundle.expected), training_run=f"seed-{bundle.seed}",
        dataset_version="synthetic-v1", owner_team="ml", actor="test", **extra,
    )  # fmt: skip
    return record


@pytest.fixture(scope="module")
def bundles():
    return {"mlp": demo.mlp_classifier(), "xgb": demo.fraud_xgboost(trees=60)}


@pytest.fixture
def registry(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path}/registry.db", ArtifactStore(tmp_path / "artifacts"))
    yield reg
    reg.close()


def test_int8_is_registered_with_lineage_recipe_and_metrics_then_idempotent(registry, bundles):
    parent = _register(registry, bundles["mlp"])
    report = optimize(registry, parent.ref, ["int8-dynamic"], profile_settings=None, actor="test")
    row = report.rows[1]
    assert report.task == "classification" and row.accepted and row.created and row.registered == "mlp_classifier:2"
    child = registry.get("mlp_classifier", 2)
    assert child.parent == parent.ref and child.format == "onnx" and child.size_bytes < parent.size_bytes
    assert child.tags["optimizer.recipe"] == "int8-dynamic" and json.loads(child.tags["optimizer.params"])["per_channel"]
    assert child.tags["optimizer.parent_sha256"] == parent.sha256 and "onnxruntime" in json.loads(child.tags["optimizer.tools"])
    assert child.training_run == parent.training_run and child.owner_team == "ml"
    assert child.metrics["gate.top1_agreement"] >= 0.97 and child.metrics["size_ratio"] < 0.5
    assert [r.ref for r in registry.lineage("mlp_classifier", 2)] == ["mlp_classifier:2", "mlp_classifier:1"]
    # the child's validation set holds its own outputs, as computed for deploy's warm-up (8 rows a batch)
    with np.load(io.BytesIO(registry.store.get(child.validation_sha256)), allow_pickle=False) as npz:
        features, expected = npz["features"], npz["expected"]
    warm = runtime.predictor("onnx", registry.read_artifact(child))(features[:8])
    np.testing.assert_array_equal(warm, expected[:8])

    again = optimize(registry, parent.ref, ["int8-dynamic"], profile_settings=None, actor="test")
    assert again.rows[1].sha256 == row.sha256 and again.rows[1].registered == "mlp_classifier:2" and not again.rows[1].created
    assert [v.version for v in registry.list_versions("mlp_classifier")] == [1, 2]


def test_an_impossible_tolerance_rejects_and_registers_nothing(registry, bundles):
    parent = _register(registry, bundles["mlp"])
    report = optimize(registry, parent.ref, ["int8-dynamic", "int8-static"], thresholds={"max_abs_error": "0"}, profile_settings=None, actor="test")
    assert [r.verdict.split(":")[0] for r in report.rows[1:]] == ["rejected", "rejected"]
    assert all("max_abs_error" in r.verdict and r.registered is None for r in report.rows[1:])
    assert [v.version for v in registry.list_versions("mlp_classifier")] == [1]
    audit = registry.audit_log(5, "mlp_classifier")
    assert [(e.action, e.outcome) for e in audit[:2]] == [("optimize", "rejected"), ("optimize", "rejected")]
    assert "rejected" in report.table() and "reference" in report.table()
    # every row has the header's columns: a "|" inside a cell (max|Δp|) is escaped
    assert "max\\|Δp\\|" in report.table()
    assert len({len(re.split(r"(?<!\\)\|", row)) for row in report.table().splitlines()}) == 1
    # per-model thresholds from the parent's tags are applied too
    strict = _register(registry, demo.mlp_classifier(seed=5), tags={"gate.min_top1_agreement": "1.01"})
    tagged = optimize(registry, strict.ref, ["int8-dynamic"], profile_settings=None, register=False)
    assert not tagged.rows[1].gate.passed and "min_top1_agreement 1.01" in tagged.rows[1].verdict


def test_tree_model_compiles_to_onnx_that_agrees_and_is_registered(registry, bundles):
    parent = _register(registry, bundles["xgb"])
    report = optimize(registry, parent.ref, all_=True, profile_settings=None, actor="test", keep_slower=True)  # not a timing test
    rows = {r.label: r for r in report.rows}
    assert report.task == "binary" and report.speed_source == "in-process"
    assert rows["tree-onnx"].accepted and rows["tree-onnx"].gate.metrics["decision_agreement"] == 1.0
    assert rows["tree-onnx"].gate.metrics["max_abs_error"] < 1e-5
    assert rows["tensorrt"].verdict.startswith("skipped: TensorRT has no tree-ensemble layers")
    child = registry.get("fraud_xgboost", 2)
    assert child.format == "onnx" and child.parent == parent.ref and child.metrics["latency.in_process_us"] > 0


def test_a_tree_compiled_to_onnx_that_measured_slower_is_rejected_unless_kept():
    passed = gate.GateResult(task="binary", passed=True, metrics={}, thresholds={})
    parent, fast, slow = Row("parent", local_us=100.0), Row("t", "tree-onnx", local_us=90.0, gate=passed), Row("t", "tree-onnx", local_us=200.0, gate=passed)
    _verdict(parent, fast, None)
    _verdict(parent, slow, None)
    assert fast.verdict == "accepted" and slow.verdict.startswith("rejected: slower than the native model")
    kept = Row("t", "tree-onnx", local_us=200.0, gate=passed)
    _verdict(parent, kept, None, keep_slower=True)
    assert kept.accepted and "slower on this CPU" in kept.verdict


def test_int4_through_the_pipeline_on_a_transformer_block(registry):
    artifact = synthetic.transformer_block_onnx()
    rows = synthetic.rows(32)
    record, _ = registry.register(
        synthetic.NAME, artifact, signature=synthetic.signature(), filename="model.onnx",
        validation=_npz(features=rows), tags={"gate.task": "embedding"},
    )  # fmt: skip
    report = optimize(registry, record.ref, ["int4"], profile_settings=None)
    assert report.task == "embedding" and report.rows[1].accepted, report.table()
    assert registry.get(synthetic.NAME, 2).tags["optimizer.recipe"] == "int4"


def test_refusals(registry, bundles):
    bundle = bundles["mlp"]
    signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]}
    bare, _ = registry.register("bare", bundle.artifact, signature=signature, filename="model.onnx")
    with pytest.raises(InvalidRequest, match="no validation set"):
        optimize(registry, bare.ref, ["graph"], profile_settings=None)
    parent = _register(registry, bundle)
    with pytest.raises(InvalidRequest, match="unknown recipe"):
        optimize(registry, parent.ref, ["int3"], profile_settings=None)
    with pytest.raises(InvalidRequest, match="unknown threshold"):
        optimize(registry, parent.ref, ["graph"], thresholds={"min_cosine": "1"}, profile_settings=None)


def test_cli(tmp_path, bundles, monkeypatch):
    import typer

    from optimizer.cli import mount

    db, store = f"sqlite:///{tmp_path}/r.db", str(tmp_path / "a")
    registry = Registry(db, ArtifactStore(store))
    try:
        _register(registry, bundles["mlp"])
    finally:
        registry.close()
    app = typer.Typer()
    app.command("noop")(lambda: None)
    mount(app)
    args = ["optimize", "mlp_classifier:1", "--int8", "dynamic", "--graph", "--no-profile", "--database-url", db, "--artifact-store", store, "--json", str(tmp_path / "r.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| int8-dynamic → mlp_classifier:3 |" in result.output and "| graph → mlp_classifier:2 |" in result.output
    assert "deploy with `inferplane deploy mlp_classifier:3`" in result.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [r["label"] for r in saved["rows"]] == ["parent", "graph", "int8-dynamic"]
    bad = CliRunner().invoke(app, ["optimize", "mlp_classifier:1", "--int8", "fast", "--database-url", db, "--artifact-store", store])
    assert bad.exit_code != 0 and "dynamic or static" in bad.output
