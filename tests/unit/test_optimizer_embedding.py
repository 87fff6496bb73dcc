"""The embedding path of the optimizer (``optimizer/embedding.py``) on a tiny BERT-like sentence encoder:
recipes on a three-input token graph, the cosine gate on the stored sentences, the adapter-based
Triton repository and text requests (no Triton here: tests/integration/test_optimizer.py runs it)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from model_repository.layout import ADAPTERS_DIR
from optimizer import embedding, synthetic
from server.dataplane.codecs import deserialize_bytes
from server.protogen.inference import grpc_service_pb2 as pb


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bert")
    text = synthetic.tiny_tokenizer_json(embedding.SENTENCES)
    (folder / "tokenizer.json").write_text(text)
    vocab = len(json.loads(text)["model"]["vocab"])
    return embedding.EmbeddingModel("tiny_bert", synthetic.bert_like_onnx(vocab), folder, max_length=32)


def test_feeds_are_tokenized_like_the_adapter(tiny):
    feeds = embedding.encode(tiny, embedding.SENTENCES)
    assert len(feeds) == -(-len(embedding.SENTENCES) // 8)
    first = feeds[0]
    assert set(first) == set(embedding.INPUTS) and all(v.dtype == np.int64 for v in first.values())
    assert (first["input_ids"][:, 0] == 2).all()  # [CLS]
    lengths = first["attention_mask"].sum(axis=1)
    assert first["input_ids"].shape[1] == lengths.max() <= tiny.max_length  # padded to the longest row, truncated
    assert (first["input_ids"][first["attention_mask"] == 0] == 0).all()  # [PAD]
    out = embedding.predict(tiny.onnx, feeds)
    assert out.shape == (len(embedding.SENTENCES), synthetic.D_MODEL)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


def test_every_recipe_runs_on_the_token_graph_and_is_gated_on_cosine(tiny):
    report = embedding.optimize_embedding(tiny, all_=True, profile_settings=None)
    rows = {r.label: r for r in report.rows}
    assert list(rows) == ["parent", "graph", "fp16", "int8-dynamic", "int8-static", "int4", "tensorrt"]
    assert report.task == "embedding" and report.thresholds == {"min_cosine": 0.99, "min_mean_cosine": 0.995}
    assert rows["parent"].gate.metrics["min_cosine"] == pytest.approx(1.0)
    assert rows["graph"].gate.passed and rows["graph"].gate.metrics["min_cosine"] > 0.9999
    assert rows["fp16"].params.get("casts_retargeted", 0) >= 1  # the attention-mask Cast now casts to float16
    assert rows["fp16"].gate.passed and rows["fp16"].target == "gpu"
    assert rows["int8-static"].params["calibration_rows"] == len(embedding.SENTENCES)
    ops = {n.op_type for n in onnx.ModelProto.FromString(rows["int4"].artifact).graph.node}
    assert "MatMulNBits" in ops and rows["int4"].params["matmuls"] == 6
    assert rows["tensorrt"].verdict.startswith("skipped")
    for row in report.rows[1:]:
        if row.gate is None:
            continue
        assert row.size_bytes < len(tiny.onnx) * 1.1 and row.gate.metrics["rows"] == len(embedding.SENTENCES)
        assert row.verdict.startswith("accepted") == row.gate.passed, (row.label, row.verdict, row.gate.report())
        if row.gate.passed:
            assert row.local_us is not None and row.local_us > 0
    assert report.speed_source == "in-process"
    table = report.table()
    assert table.count("\n") == 1 + len(report.rows) and "cos min" in table
    # a stricter gate rejects what the default accepted, with the reason in the verdict
    strict = embedding.optimize_embedding(tiny, ["int4"], thresholds={"min_cosine": 0.99999}, profile_settings=None)
    assert strict.rows[1].verdict.startswith("rejected: outside the accuracy gate (min_cosine")


def test_profile_repository_is_the_embedding_adapter_with_each_graph(tiny, tmp_path):
    other = tiny.onnx + b""  # a second variant: same bytes are fine, the names differ
    names = embedding.write_repository(tmp_path, tiny, [("parent", tiny.onnx), ("int4", other)])
    assert names == {"parent": "opt0_parent", "int4": "opt1_int4"}
    for name in names.values():
        version = tmp_path / name / "1"
        assert (version / "model.py").read_bytes() == (ADAPTERS_DIR / "embedding_runtime.py").read_bytes()
        assert (version / "tokenizer.json").is_file() and (version / "model.onnx").read_bytes() == tiny.onnx
        config = (tmp_path / name / "config.pbtxt").read_text()
        assert tiny.sha256 in config and 'string_value: "32"' in config and "TYPE_STRING" in config
    pool = embedding.text_pool("opt0_parent", embedding.SENTENCES[:3], batch=2)
    requests = [pb.ModelInferRequest.FromString(b) for b in pool]
    assert len(requests) == 2 and requests[0].inputs[0].datatype == "BYTES" and list(requests[0].inputs[0].shape) == [2, 1]
    assert [t.decode() for t in deserialize_bytes(requests[1].raw_input_contents[0])] == [embedding.SENTENCES[2], embedding.SENTENCES[0]]


def test_validation_set_round_trip(tiny, tmp_path):
    expected = embedding.predict(tiny.onnx, embedding.encode(tiny, embedding.SENTENCES))
    path = embedding.save_validation(tmp_path / "sentences.npz", embedding.SENTENCES, expected)
    texts, back = embedding.load_validation(path)
    assert texts == embedding.SENTENCES and np.array_equal(back, expected)
