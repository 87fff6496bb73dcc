"""Recipes on the demo models and a small transformer-like graph, checked by the gate in-process."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from model_repository import demo
from optimizer import gate, recipes, runtime, synthetic, tensorrt
from server.control.registry import safe_formats


def _source(bundle, **kw) -> recipes.Source:
    signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]}
    return recipes.Source(bundle.name, bundle.format, bundle.artifact, signature, calibration=bundle.features, **kw)


@pytest.fixture(scope="module")
def mlp():
    return demo.mlp_classifier()


def _check(source: recipes.Source, cand: recipes.Candidate, task: str, rows: np.ndarray) -> gate.GateResult:
    parent = runtime.predict(source.format, source.artifact, rows, source.output_dims)
    out = runtime.predict(cand.format, cand.artifact, rows, source.output_dims)
    return gate.evaluate(parent, out, task)


@pytest.mark.parametrize("recipe", ["int8-dynamic", "int8-static"])
def test_int8_of_the_demo_mlp_passes_the_gate_and_is_smaller(mlp, recipe):
    source = _source(mlp)
    cand = recipes.apply(recipe, source)
    assert cand.format == "onnx" and len(cand.artifact) < 0.5 * len(mlp.artifact)
    ops = {n.op_type for n in onnx.ModelProto.FromString(cand.artifact).graph.node}
    assert ops & ({"MatMulInteger", "DynamicQuantizeLinear"} if recipe == "int8-dynamic" else {"QuantizeLinear", "DequantizeLinear"})
    result = _check(source, cand, "classification", mlp.features)
    assert result.passed, result.report()
    assert result.metrics["top1_agreement"] >= 0.97
    assert recipes.apply(recipe, source).sha256 == cand.sha256  # deterministic: same input, same bytes
    if recipe == "int8-static":
        assert cand.params["calibration_rows"] == len(mlp.features) and cand.params["per_channel"]


def test_graph_and_fp16_keep_outputs_and_float32_io(mlp):
    source = _source(mlp)
    optimized = recipes.apply("graph", source)
    assert _check(source, optimized, "classification", mlp.features).metrics["max_abs_error"] < 1e-5
    half = recipes.apply("fp16", source)
    model = onnx.ModelProto.FromString(half.artifact)
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    assert half.target == "gpu" and len(half.artifact) < 0.6 * len(mlp.artifact)
    assert _check(source, half, "classification", mlp.features).passed


@pytest.mark.parametrize("make", [lambda: demo.fraud_xgboost(trees=60), lambda: demo.lightgbm_regressor(rounds=40)], ids=["xgboost", "lightgbm"])
def test_tree_models_compile_to_onnx_that_agrees_on_the_validation_set(make):
    bundle = make()
    source = _source(bundle)
    cand = recipes.apply("tree-onnx", source)
    assert cand.format == "onnx"
    model = onnx.ModelProto.FromString(cand.artifact)
    assert [o.name for o in model.graph.output] == [bundle.outputs[0].name]
    assert any(n.op_type.startswith("TreeEnsemble") for n in model.graph.node)
    out = runtime.predict(cand.format, cand.artifact, bundle.features, source.output_dims)
    np.testing.assert_allclose(out, bundle.expected, rtol=1e-4, atol=1e-4)  # the framework's own outputs
    task = gate.infer_task(bundle.expected)
    assert task == ("binary" if bundle.format.startswith("xgboost") else "regression")
    assert gate.evaluate(bundle.expected, out, task).passed
    assert recipes.apply("tree-onnx", source).sha256 == cand.sha256


def test_int4_weight_only_on_a_transformer_like_graph():
    artifact = synthetic.transformer_block_onnx()
    rows = synthetic.rows(32)
    source = recipes.Source(synthetic.NAME, "onnx", artifact, synthetic.signature(), calibration=rows)
    assert recipes.is_transformer(artifact)
    chosen, skipped = recipes.select([], True, "onnx", artifact)
    assert "int4" in chosen and not skipped
    cand = recipes.apply("int4", source)
    model = onnx.ModelProto.FromString(cand.artifact)
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 6  # every weight MatMul, none of the activation ones
    assert len(cand.artifact) < 0.25 * len(artifact)
    result = _check(source, cand, "embedding", rows)
    assert result.passed, result.report()


def test_int4_and_all_on_a_plain_mlp(mlp):
    chosen, skipped = recipes.select([], True, "onnx", mlp.artifact)
    assert "int4" not in chosen and "transformer" in skipped["int4"]
    assert recipes.select(["int4"], True, "onnx", mlp.artifact)[0].count("int4") == 1
    tiny = recipes.Source("m", "onnx", mlp.artifact, _source(mlp).signature)
    with pytest.raises(recipes.Skipped, match="multiple of 256"):
        recipes.int4(tiny, block_size=256)  # the MLP's weights have K = 64 and 128


def test_skips_say_why():
    with pytest.raises(recipes.Skipped, match="applies to ONNX graphs, not lightgbm-text"):
        recipes.apply("int8-dynamic", recipes.Source("m", "lightgbm-text", b"tree\n", {"inputs": [{}], "outputs": [{}]}))
    with pytest.raises(recipes.Skipped, match="no tree-ensemble layers"):
        recipes.apply("tensorrt", recipes.Source("m", "xgboost-json", b"{}", {"inputs": [{}], "outputs": [{}]}))


def _mlp_source() -> recipes.Source:
    rng = np.random.default_rng(3)
    artifact = demo._mlp_onnx([rng.standard_normal((4, 8)), rng.standard_normal((8, 2))], [np.zeros(8), np.zeros(2)])
    return recipes.Source("m", "onnx", artifact, {"inputs": [{"name": "features", "dims": [4]}], "outputs": [{"name": "probabilities", "dims": [2]}]})


def test_tensorrt_where_it_cannot_build_skips_with_the_reason(monkeypatch):
    # every machine runs this path (a CPU machine has the reason on its own; a GPU one is told it): a clear
    # reason, never a silent no-op
    monkeypatch.setattr(tensorrt, "unavailable", lambda: "no NVIDIA GPU on this machine (no /dev/nvidia* device)")
    with pytest.raises(recipes.Skipped) as err:
        recipes.apply("tensorrt", _mlp_source())
    assert err.value.reason == "no NVIDIA GPU on this machine (no /dev/nvidia* device)"


@pytest.mark.gpu
@pytest.mark.skipif(bool(tensorrt.unavailable()), reason="TensorRT cannot build a plan here (the path above covers it)")
def test_tensorrt_builds_a_plan_that_answers_like_its_onnx_parent():
    source = _mlp_source()
    cand = recipes.apply("tensorrt", source)
    assert cand.format == safe_formats.TENSORRT_PLAN and cand.target == "gpu" and cand.params["max_batch"] == source.max_batch
    rows = np.random.default_rng(4).standard_normal((16, 4)).astype(np.float32)
    expected = ort.InferenceSession(source.artifact, providers=["CPUExecutionProvider"]).run(None, {"features": rows})[0]
    np.testing.assert_allclose(tensorrt.plan_predictor(cand.artifact)(rows), expected, rtol=2e-2, atol=2e-3)  # fp16 layers
