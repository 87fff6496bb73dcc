"""Composite endpoints without Triton: the spec and its errors, the type check, where each demo
runs and why, the compiled configs (written, then parsed), plans, and the built-in operators."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_repository import composite_demo
from model_repository.adapters import _composite_ops as ops
from model_repository.config_writer import read_config, to_text
from server.control.composition.composition import Member, TensorType, parse_spec, type_check
from server.control.composition.composition_compiler import DAG, ENSEMBLE, compile_spec, read_plans, write_compiled
from server.dataplane.composite import Plan, composite_signature, _label
from server.errors import InvalidRequest, ModelNotFound


def _member(name, inputs, outputs, max_batch=64, kind="model", decoupled=False):
    return Member(name, 1, {k: TensorType(*v) for k, v in inputs.items()}, {k: TensorType(*v) for k, v in outputs.items()}, max_batch, kind=kind, decoupled=decoupled)


MEMBERS = {
    "fraud_xgb": _member("fraud_xgb", {"features": ("FP32", (32,))}, {"probability": ("FP32", (1,))}),
    "fraud_lgbm": _member("fraud_lgbm", {"features": ("FP32", (32,))}, {"probability": ("FP32", (1,))}, max_batch=32),
    "fraud_mlp": _member("fraud_mlp", {"features": ("FP32", (32,))}, {"probability": ("FP32", (1,))}),
    "minilm_embeddings": _member("minilm_embeddings", {"text": ("BYTES", (1,))}, {"embedding": ("FP32", (384,)), "tokens": ("INT32", (1,))}, kind="embedding"),
    "topic_classifier": _member("topic_classifier", {"embedding": ("FP32", (384,))}, {"logits": ("FP32", (3,))}),
    "no_batch": _member("no_batch", {"features": ("FP32", (32,))}, {"probability": ("FP32", (1,))}, max_batch=0),
    "tiny_llama": _member("tiny_llama", {"text_input": ("BYTES", (1,))}, {"text_output": ("BYTES", (1,)), "info": ("BYTES", (1,))}, kind="llm", decoupled=True),
}


def lookup(name, version):
    if name not in MEMBERS:
        raise ModelNotFound(f"no model {name!r}")
    return MEMBERS[name]


BASE = {
    "name": "c",
    "inputs": [{"name": "features", "datatype": "FP32", "dims": [32]}],
    "nodes": [
        {"name": "a", "model": "fraud_xgb", "inputs": {"features": "features"}},
        {"name": "b", "model": "fraud_lgbm", "inputs": {"features": "features"}},
        {"name": "mean", "op": "average", "inputs": ["a.probability", "b.probability"]},
    ],
    "outputs": {"score": "mean.output"},
}


def _spec(**changes):
    doc = json.loads(json.dumps(BASE))
    doc.update(changes)
    return doc


# ---- the demos ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, mode, frontend_nodes",
    [
        ("fraud_ensemble", ENSEMBLE, []),
        ("fraud_quorum", DAG, ["mean"]),
        ("fraud_router", DAG, ["route"]),
        ("topic_pipeline", ENSEMBLE, []),
        ("topic_via_endpoint", DAG, ["embed"]),
    ],
)
def test_each_demo_runs_where_it_should_and_says_why(name, mode, frontend_nodes):
    compiled = compile_spec(parse_spec(composite_demo.spec_text(name)), 1, lookup)
    assert compiled.mode == mode
    assert [p.node for p in compiled.placements if p.runs == "frontend"] == frontend_nodes
    if mode == DAG:
        assert all(any(n in r for n in frontend_nodes) for r in compiled.reasons)
        assert "triton_model" not in compiled.plan
    else:
        assert {p.runs for p in compiled.placements} == {"triton ensemble step"}
        assert compiled.plan["triton_model"] == f"{name}__v1"
    explained = compiled.explain()
    assert explained["mode"] == mode and len(explained["nodes"]) == len(compiled.placements)


def test_derived_signature_and_batch_limit():
    compiled = compile_spec(parse_spec(composite_demo.spec_text("fraud_ensemble")), 3, lookup)
    assert compiled.signature == {
        "inputs": [{"name": "features", "datatype": "FP32", "dims": [32]}],
        "outputs": [{"name": "probability", "datatype": "FP32", "dims": [1]}, {"name": "is_fraud", "datatype": "INT32", "dims": [1]}],
        "max_batch_size": 32,  # fraud_lgbm batches 32 at most
    }
    topic = compile_spec(parse_spec(composite_demo.spec_text("topic_pipeline")), 1, lookup).signature
    assert topic["outputs"] == [{"name": "probabilities", "datatype": "FP32", "dims": [3]}, {"name": "topic", "datatype": "INT32", "dims": [1]}]


def test_ensemble_config_written_then_parsed(tmp_path):
    compiled = compile_spec(parse_spec(composite_demo.spec_text("fraud_ensemble")), 2, lookup)
    written = write_compiled(compiled, tmp_path)
    assert written == ["fraud_ensemble__v2__flag", "fraud_ensemble__v2__mean", "fraud_ensemble__v2"]  # operators load first
    ensemble = read_config(tmp_path / "fraud_ensemble__v2")
    assert ensemble == compiled.configs["fraud_ensemble__v2"] and ensemble.platform == "ensemble"
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["fraud_xgb", "fraud_lgbm", "fraud_mlp", "fraud_ensemble__v2__mean", "fraud_ensemble__v2__flag"]
    assert dict(steps[3].input_map) == {"in0": "xgb__probability", "in1": "lgbm__probability", "in2": "mlp__probability"}
    assert dict(steps[3].output_map) == {"output": "probability"} and dict(steps[4].output_map) == {"output": "is_fraud"}
    assert steps[0].model_version == 1
    assert "ensemble_scheduling {" in to_text(ensemble)
    mean = read_config(tmp_path / "fraud_ensemble__v2__mean")
    assert mean.backend == "python" and mean.parameters["op"].string_value == "average"
    assert [i.name for i in mean.input] == ["in0", "in1", "in2"] and not any(i.optional for i in mean.input)
    assert (tmp_path / "fraud_ensemble__v2__mean" / "1" / "model.py").is_file()
    assert (tmp_path / "fraud_ensemble__v2__mean" / "1" / "_composite_ops.py").is_file()
    assert not any((tmp_path / "fraud_ensemble__v2").glob("1/*"))  # an ensemble's version folder is empty
    # the plan round-trips and gives the signature the data plane serves
    plans = read_plans(tmp_path, "fraud_ensemble")
    plan = Plan.from_json(plans["2"])
    signature = composite_signature({"2": plan})
    assert signature.max_batch_size == 32 and signature.versions == frozenset({"2"}) and signature.coalesce.enabled
    assert set(signature.outputs) == {"probability", "is_fraud"}


def test_quorum_operators_take_optional_inputs(tmp_path):
    compiled = compile_spec(parse_spec(composite_demo.spec_text("fraud_quorum")), 1, lookup)
    write_compiled(compiled, tmp_path)
    config = read_config(tmp_path / "fraud_quorum__v1__mean")
    assert all(i.optional for i in config.input)
    node = Plan.from_json(compiled.plan).node("mean")
    assert node.on_failure == "ignore" and node.quorum == 2 and node.inputs == {"in0": "xgb.probability", "in1": "lgbm.probability", "in2": "mlp.probability"}


def test_plans_of_several_versions_share_one_file(tmp_path):
    for version in (1, 2):
        write_compiled(compile_spec(parse_spec(composite_demo.spec_text("fraud_router")), version, lookup), tmp_path)
    assert sorted(read_plans(tmp_path, "fraud_router")) == ["1", "2"]
    from server.dataplane.composite import read_plan_files

    assert sorted((p.name, p.version) for p in read_plan_files(tmp_path)) == [("fraud_router", "1"), ("fraud_router", "2")]


# ---- mistakes, each named --------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"nodes": [{"name": "a", "model": "fraud_xgb", "inputs": {"features": "nope.x"}}]}, "names no node 'nope'"),
        ({"nodes": [{"name": "a", "model": "fraud_xgb", "inputs": {"features": "feature"}}]}, "is not a composite input"),
        ({"outputs": {"score": "features"}}, "an output comes from a node"),
        ({"nodes": [*BASE["nodes"], {"name": "c", "model": "fraud_mlp", "inputs": {"features": "features"}}]}, "nothing reads the outputs of ['c']"),
        ({"nodes": [{"name": "a", "op": "softmax", "inputs": ["b.output"]}, {"name": "b", "op": "softmax", "inputs": ["a.output"]}], "outputs": {"s": "a.output"}}, "cycle"),
        ({"nodes": [*BASE["nodes"][:2], {"name": "mean", "op": "softmax", "inputs": ["a.probability"], "on_failure": "ignore"}]}, "aggregating operator"),
        ({"nodes": [*BASE["nodes"][:2], {"name": "mean", "op": "average", "inputs": ["a.probability", "b.probability"], "on_failure": "ignore", "quorum": 3}]}, "quorum 3 is more than the 2 inputs"),
        ({"nodes": [*BASE["nodes"][:2], {"name": "mean", "op": "weighted_sum", "inputs": ["a.probability", "b.probability"], "params": {"weights": [1]}}]}, "weights must be 2 numbers"),
        ({"nodes": [*BASE["nodes"][:2], {"name": "mean", "op": "average", "inputs": ["a.probability", "b.probability"], "params": {"value": 1}}]}, "takes no parameter"),
        ({"nodes": [{"name": "a", "sql": "select 1"}]}, "a node needs one of model, op, router, endpoint"),
        ({"name": "bad__name"}, "no '__'"),
        ({"nodes": [*BASE["nodes"], {"name": "a", "model": "fraud_mlp", "inputs": {"features": "features"}}]}, "unique"),
    ],
)
def test_spec_mistakes_are_named(changes, fragment):
    with pytest.raises(InvalidRequest) as info:
        parse_spec(_spec(**changes))
    assert fragment in info.value.message, info.value.message


@pytest.mark.parametrize(
    "nodes, outputs, fragment",
    [
        ([{"name": "a", "model": "fraud_xgb", "inputs": {"x": "features"}}], {"s": "a.probability"}, "has no input 'x'"),
        ([{"name": "a", "model": "topic_classifier", "inputs": {"embedding": "features"}}], {"s": "a.logits"}, "takes FP32[384]"),
        ([{"name": "a", "model": "no_batch", "inputs": {"features": "features"}}], {"s": "a.probability"}, "does not batch"),
        ([{"name": "a", "model": "fraud_xgb", "inputs": {"features": "features"}}], {"s": "a.score"}, "has no output 'score'"),
        ([{"name": "a", "model": "fraud_xgb", "inputs": {"features": "features"}}, {"name": "v", "op": "majority_vote", "inputs": ["a.probability"]}],
         {"s": "v.output"}, "majority_vote needs integer labels"),
        ([{"name": "a", "model": "tiny_llama", "inputs": {"text_input": "features"}}], {"s": "a.text_output"}, "use an endpoint node"),
        ([{"name": "a", "endpoint": "embeddings", "model": "fraud_xgb", "inputs": {"input": "features"}}], {"s": "a.embedding"}, "reads text, BYTES[1]"),
        ([{"name": "a", "model": "missing_model", "inputs": {"features": "features"}}], {"s": "a.probability"}, "no model 'missing_model'"),
    ],
)
def test_type_mistakes_are_named(nodes, outputs, fragment):
    with pytest.raises((InvalidRequest, ModelNotFound)) as info:
        type_check(parse_spec(_spec(nodes=nodes, outputs=outputs)), lookup)
    assert fragment in info.value.message, info.value.message


def test_router_rules():
    router = {
        "name": "r", "inputs": [{"name": "features", "dims": [32]}],
        "nodes": [
            {"name": "k", "op": "threshold", "inputs": ["features"], "params": {"column": 0}},
            {"name": "a", "model": "fraud_xgb", "inputs": {"features": "features"}},
            {"name": "b", "model": "fraud_mlp", "inputs": {"features": "features"}},
            {"name": "route", "router": {"key": "k.output", "routes": {"0": "a", "1": "b"}}},
        ],
        "outputs": {"p": "route.probability"},
    }  # fmt: skip
    typed = type_check(parse_spec(router), lookup)
    assert typed.gated == {"a": "route", "b": "route"} and typed.tensors["route.probability"] == TensorType("FP32", (1,))
    leaking = json.loads(json.dumps(router))
    leaking["outputs"] = {"p": "route.probability", "q": "a.probability"}
    with pytest.raises(InvalidRequest, match="is a branch of router 'route'"):
        parse_spec(leaking)
    nested = json.loads(json.dumps(router))
    nested["nodes"].append({"name": "r2", "router": {"key": "k.output", "routes": {"0": "route"}}})
    with pytest.raises(InvalidRequest, match="is a router"):
        parse_spec(nested)


def test_canonical_bytes_ignore_layout():
    a = parse_spec(composite_demo.spec_text("fraud_ensemble"))
    b = parse_spec(json.dumps(json.loads(a.canonical())))
    assert a.canonical() == b.canonical()


def test_router_labels():
    assert [_label(v) for v in (np.int32(1), np.float32(0.0), np.float32(2.5), np.bool_(True), b"de")] == ["1", "0", "2.5", "1", "de"]


# ---- the operators -------------------------------------------------------------------------------


def test_operators():
    a = np.array([[0.2, 0.8], [0.9, 0.1]], np.float32)
    b = np.array([[0.4, 0.6], [0.5, 0.5]], np.float32)
    assert np.array_equal(ops.run("concat", {0: a, 1: b}, {}), np.hstack([a, b]))
    assert np.array_equal(ops.run("argmax", {0: a}, {}), [[1], [0]])
    assert np.array_equal(ops.run("threshold", {0: a}, {"value": 0.5}), [[0, 1], [1, 0]])
    assert np.array_equal(ops.run("threshold", {0: a}, {"value": 0.5, "column": 1}), [[1], [0]])
    soft = ops.run("softmax", {0: a}, {})
    assert np.allclose(soft.sum(axis=1), 1) and np.allclose(soft, np.exp(a) / np.exp(a).sum(axis=1, keepdims=True))
    assert np.allclose(ops.run("average", {0: a, 1: b}, {}), (a + b) / 2)
    assert np.allclose(ops.run("weighted_sum", {0: a, 1: b}, {"weights": [3, 1]}), 3 * a + b)
    assert np.allclose(ops.run("weighted_sum", {1: b}, {"weights": [3, 1], "normalize": True}), b)  # only member 1 answered
    assert np.allclose(ops.run("weighted_sum", {0: a, 2: b}, {"weights": [2, 5, 1], "normalize": True}), (2 * a + b) / 3)
    votes = {0: np.array([[1], [2], [0]]), 1: np.array([[1], [0], [2]]), 2: np.array([[3], [0], [1]])}
    assert np.array_equal(ops.run("majority_vote", votes, {}), [[1], [0], [0]])  # row 2 ties three ways: the smallest
    for op, inputs, fragment in [
        ("average", {0: a, 1: a[:, :1]}, "one shape"),
        ("argmax", {0: a, 1: b}, "one input"),
        ("threshold", {0: a}, "outside"),
        ("nope", {0: a}, "unknown operator"),
    ]:
        with pytest.raises(ops.OperatorError, match=fragment):
            ops.run(op, inputs, {"column": 5} if op == "threshold" else {})


def test_demo_spec_files_are_the_ones_the_demo_builds():
    names = {p.stem for p in composite_demo.SPECS_DIR.glob("*.yaml")}
    assert names == set(composite_demo.TABULAR_COMPOSITES) | set(composite_demo.TEXT_COMPOSITES)
