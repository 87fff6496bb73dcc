"""optimize with the real Triton: parent and candidate profiled together, then the accepted
candidate deployed through the frontend on the endpoint its parent served.

The profile is as short as it can be (one concurrency, half a second, one round): this checks the
plumbing, not the figures (``python -m optimizer.bench`` measures).
"""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from optimizer.pipeline import optimize
from optimizer.profile import ProfileSettings
from server.control.registry.artifacts import ArtifactStore
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.control.registry.registry import Registry
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration

ACTOR = (("x-inferplane-actor", "ci-test"),)


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_profile_register_and_deploy_a_tree_model_compiled_to_onnx(tmp_path):
    bundle = demo.fraud_xgboost(trees=60)
    db, store = f"sqlite:///{tmp_path}/registry.db", tmp_path / "artifacts"
    registry = Registry(db, ArtifactStore(store))
    try:
        signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]}
        parent, _ = registry.register(
            bundle.name, bundle.artifact, signature=signature, filename=bundle.artifact_name,
            validation=_npz(features=bundle.features, expected=bundle.expected),
        )  # fmt: skip
        settings = ProfileSettings(concurrencies=(1,), warmup_s=0.2, duration_s=0.5, rounds=1)
        # the deploy path is what this test is about: a 0.5 s run on a shared CPU decides nothing about
        # speed (the tree-onnx vs native figures are BENCHMARKS.md §4's; the rule is tests/unit/test_optimizer_pipeline.py's)
        report = optimize(registry, parent.ref, ["tree-onnx"], profile_settings=settings, actor="ci-test", keep_slower=True)
    finally:
        registry.close()
    assert report.speed_source == "triton"
    parent_row, cand = report.rows
    for row in (parent_row, cand):
        assert row.profile[1]["throughput_rps"] > 0 and row.profile[1]["errors"] == 0 and row.profile[1]["p99_ms"] > 0
    print("\n" + report.table())
    assert cand.accepted and cand.gate.passed, cand.verdict
    assert cand.registered == f"{bundle.name}:2"

    repository = tmp_path / "model_repository"
    repository.mkdir()
    stack = start_stack(repository, tmp_path / "stack", env={"INFERPLANE_DATABASE_URL": db, "INFERPLANE_ARTIFACT_STORE": str(store)})
    try:
        with grpc.insecure_channel(stack.grpc) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            for version in (1, 2):  # the native XGBoost adapter, then the ONNX one, behind one endpoint
                result = admin.Deploy(admin_pb2.DeployRequest(ref=f"{bundle.name}:{version}"), metadata=ACTOR).result
                assert result.version == version
        client = grpcclient.InferenceServerClient(stack.grpc)
        try:
            inp = grpcclient.InferInput("features", [16, 32], "FP32")
            inp.set_data_from_numpy(bundle.features[:16])
            answer = client.infer(bundle.name, [inp])
        finally:
            client.close()
        assert answer.get_response().model_version == "2"
        np.testing.assert_allclose(answer.as_numpy("probability"), bundle.expected[:16], rtol=1e-4, atol=1e-5)
    finally:
        stop_stack(stack)


def test_embedding_variants_are_profiled_through_the_embedding_adapter(tmp_path):
    """A tiny BERT-like sentence encoder: parent and its INT8 variant, each the embedding adapter +
    tokenizer + its own model.onnx, in one Triton, driven with text requests."""
    import json

    from optimizer import embedding, synthetic

    text = synthetic.tiny_tokenizer_json(embedding.SENTENCES)
    (tmp_path / "tokenizer.json").write_text(text)
    model = embedding.EmbeddingModel("tiny_bert", synthetic.bert_like_onnx(len(json.loads(text)["model"]["vocab"])), tmp_path, max_length=32)
    settings = ProfileSettings(concurrencies=(2,), warmup_s=0.2, duration_s=0.5, rounds=1)
    report = embedding.optimize_embedding(model, ["int8-dynamic"], texts=embedding.SENTENCES[:24], profile_settings=settings)
    assert report.speed_source == "triton"
    parent_row, cand = report.rows
    assert cand.gate.passed, cand.gate.report()
    for row in (parent_row, cand):
        assert row.profile[2]["throughput_rps"] > 0 and row.profile[2]["errors"] == 0 and row.profile[2]["p99_ms"] > 0
    assert cand.verdict.startswith("accepted") and cand.registered is None
    print("\n" + report.table())
