"""A small transformer-like ONNX block for the INT4 recipe (no transformer ONNX model is registered yet).

One encoder layer on ``[batch, seq, d_model]``: LayerNorm -> single-head self-attention (Q/K/V
projections, Q·Kᵀ/√d, Softmax, ·V, output projection) -> residual -> LayerNorm -> FFN (MatMul,
Relu, MatMul) -> residual. Every weight MatMul has K = ``d_model`` or ``ffn``, multiples of the
INT4 block size. Random weights with a fixed seed: same bytes every run.
"""

from __future__ import annotations

import numpy as np

NAME = "tiny_transformer"
SEQ, D_MODEL, FFN = 8, 64, 256
OPSET = 17


def transformer_block_onnx(seed: int = 7, seq: int = SEQ, d_model: int = D_MODEL, ffn: int = FFN) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    inits = [w("Wq", d_model, d_model), w("Wk", d_model, d_model), w("Wv", d_model, d_model), w("Wo", d_model, d_model),
             w("W1", d_model, ffn), w("W2", ffn, d_model)]  # fmt: skip
    for ln in ("ln1", "ln2"):
        inits += [numpy_helper.from_array(np.ones(d_model, np.float32), f"{ln}_g"), numpy_helper.from_array(np.zeros(d_model, np.float32), f"{ln}_b")]
    inits.append(numpy_helper.from_array(np.array(1.0 / np.sqrt(d_model), np.float32), "scale"))
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1_g", "ln1_b"], ["h"], axis=-1, name="ln1"),
        n("MatMul", ["h", "Wq"], ["q"], name="q_proj"),
        n("MatMul", ["h", "Wk"], ["k"], name="k_proj"),
        n("MatMul", ["h", "Wv"], ["v"], name="v_proj"),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="k_t"),
        n("MatMul", ["q", "kt"], ["scores_raw"], name="qk"),
        n("Mul", ["scores_raw", "scale"], ["scores"], name="scale_scores"),
        n("Softmax", ["scores"], ["attn"], axis=-1, name="softmax"),
        n("MatMul", ["attn", "v"], ["ctx"], name="attn_v"),
        n("MatMul", ["ctx", "Wo"], ["o"], name="o_proj"),
        n("Add", ["x", "o"], ["r1"], name="residual1"),
        n("LayerNormalization", ["r1", "ln2_g", "ln2_b"], ["h2"], axis=-1, name="ln2"),
        n("MatMul", ["h2", "W1"], ["f1"], name="ffn_up"),
        n("Relu", ["f1"], ["f1r"], name="ffn_act"),
        n("MatMul", ["f1r", "W2"], ["f2"], name="ffn_down"),
        n("Add", ["r1", "f2"], ["y"], name="residual2"),
    ]
    graph = helper.make_graph(
        nodes, NAME,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, d_model])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, d_model])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="inferplane")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def signature(seq: int = SEQ, d_model: int = D_MODEL) -> dict:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [seq, d_model]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [seq, d_model]}],
        "max_batch_size": 64,
    }


def rows(n: int = 64, seed: int = 11, seq: int = SEQ, d_model: int = D_MODEL) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, seq, d_model)).astype(np.float32)


# ---- a tiny BERT-like sentence encoder (the embedding path's tests) -----------------------------

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def tiny_tokenizer_json(texts, max_words: int = 1000) -> str:
    """A word-level BERT-style tokenizer (lowercase, [CLS] ... [SEP], [PAD]) over the words of ``texts``, as JSON."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    words = sorted({w for t in texts for w, _ in pre_tokenizers.BertPreTokenizer().pre_tokenize_str(t.lower())})[:max_words]
    vocab = {tok: i for i, tok in enumerate([*BERT_SPECIALS, *words])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok.to_str()


def bert_like_onnx(vocab: int, seed: int = 5, d_model: int = D_MODEL, ffn: int = FFN // 2, max_positions: int = 512) -> bytes:
    """One BERT encoder layer + masked mean pooling + L2 norm: ``input_ids``/``attention_mask``/``token_type_ids`` -> ``embedding``.

    The same interface as ``model_repository/embeddings.py``'s MiniLM export, small enough for unit
    tests (int64 ``[batch, sequence]`` inputs, FP32 ``[batch, d_model]`` output, K multiples of 32).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def t(name: str, arr) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(arr), name)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return t(name, (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    inits = [
        t("word_emb", (rng.standard_normal((vocab, d_model)) * 0.5).astype(np.float32)),
        t("pos_emb", (rng.standard_normal((max_positions, d_model)) * 0.1).astype(np.float32)),
        t("type_emb", (rng.standard_normal((2, d_model)) * 0.1).astype(np.float32)),
        w("Wq", d_model, d_model), w("Wk", d_model, d_model), w("Wv", d_model, d_model), w("Wo", d_model, d_model),
        w("W1", d_model, ffn), w("W2", ffn, d_model),
        t("bq", np.zeros(d_model, np.float32)), t("b1", np.zeros(ffn, np.float32)),
        t("scale", np.array(1.0 / np.sqrt(d_model), np.float32)), t("one", np.array(1.0, np.float32)),
        t("neg", np.array(-10000.0, np.float32)), t("eps", np.array(1e-9, np.float32)), t("eps_n", np.array(1e-12, np.float32)),
        t("i0", np.array(0, np.int64)), t("i1", np.array(1, np.int64)), t("ax1", np.array([1], np.int64)),
        t("ax_last", np.array([-1], np.int64)), t("half", np.array(0.5, np.float32)), t("sqrt2", np.array(np.sqrt(2.0), np.float32)),
    ]  # fmt: skip
    for ln in ("ln0", "ln1", "ln2"):
        inits += [t(f"{ln}_g", np.ones(d_model, np.float32)), t(f"{ln}_b", np.zeros(d_model, np.float32))]
    n = helper.make_node
    nodes = [
        n("Gather", ["word_emb", "input_ids"], ["we"], name="word_embeddings"),
        n("Gather", ["type_emb", "token_type_ids"], ["te"], name="type_embeddings"),
        n("Shape", ["input_ids"], ["ids_shape"], name="ids_shape"),
        n("Gather", ["ids_shape", "i1"], ["seq_len"], axis=0, name="seq_len"),
        n("Range", ["i0", "seq_len", "i1"], ["positions"], name="positions"),
        n("Gather", ["pos_emb", "positions"], ["pe"], name="position_embeddings"),
        n("Add", ["we", "te"], ["e1"], name="add_type"),
        n("Add", ["e1", "pe"], ["e2"], name="add_position"),
        n("LayerNormalization", ["e2", "ln0_g", "ln0_b"], ["h"], axis=-1, name="ln0"),
        n("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="mask_float"),
        n("Unsqueeze", ["maskf", "ax1"], ["mask_b1s"], name="mask_unsqueeze"),
        n("Sub", ["one", "mask_b1s"], ["inv_mask"], name="inv_mask"),
        n("Mul", ["inv_mask", "neg"], ["mask_bias"], name="mask_bias"),
        n("MatMul", ["h", "Wq"], ["q0"], name="q_proj"),
        n("Add", ["q0", "bq"], ["q"], name="q_bias"),
        n("MatMul", ["h", "Wk"], ["k"], name="k_proj"),
        n("MatMul", ["h", "Wv"], ["v"], name="v_proj"),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="k_t"),
        n("MatMul", ["q", "kt"], ["scores_raw"], name="qk"),
        n("Mul", ["scores_raw", "scale"], ["scores_scaled"], name="scale_scores"),
        n("Add", ["scores_scaled", "mask_bias"], ["scores"], name="mask_scores"),
        n("Softmax", ["scores"], ["attn"], axis=-1, name="softmax"),
        n("MatMul", ["attn", "v"], ["ctx"], name="attn_v"),
        n("MatMul", ["ctx", "Wo"], ["o"], name="o_proj"),
        n("Add", ["h", "o"], ["r1"], name="residual1"),
        n("LayerNormalization", ["r1", "ln1_g", "ln1_b"], ["h1"], axis=-1, name="ln1"),
        n("MatMul", ["h1", "W1"], ["f0"], name="ffn_up"),
        n("Add", ["f0", "b1"], ["f1"], name="ffn_bias"),
        n("Div", ["f1", "sqrt2"], ["g0"], name="gelu_div"),  # exact GELU, as BERT exports it
        n("Erf", ["g0"], ["g1"], name="gelu_erf"),
        n("Add", ["g1", "one"], ["g2"], name="gelu_add"),
        n("Mul", ["f1", "g2"], ["g3"], name="gelu_mul"),
        n("Mul", ["g3", "half"], ["f1a"], name="gelu_half"),
        n("MatMul", ["f1a", "W2"], ["f2"], name="ffn_down"),
        n("Add", ["h1", "f2"], ["r2"], name="residual2"),
        n("LayerNormalization", ["r2", "ln2_g", "ln2_b"], ["hidden"], axis=-1, name="ln2"),
        n("Unsqueeze", ["maskf", "ax_last"], ["mask_bs1"], name="pool_mask"),
        n("Mul", ["hidden", "mask_bs1"], ["masked"], name="pool_masked"),
        n("ReduceSum", ["masked", "ax1"], ["summed"], keepdims=0, name="pool_sum"),
        n("ReduceSum", ["mask_bs1", "ax1"], ["counts0"], keepdims=0, name="pool_count"),
        n("Max", ["counts0", "eps"], ["counts"], name="pool_clamp"),
        n("Div", ["summed", "counts"], ["pooled"], name="pool_mean"),
        n("ReduceL2", ["pooled", "ax_last"], ["norm0"], keepdims=1, name="l2"),
        n("Max", ["norm0", "eps_n"], ["norm"], name="l2_clamp"),
        n("Div", ["pooled", "norm"], ["embedding"], name="normalize"),
    ]
    ids = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"]) for name in ("input_ids", "attention_mask", "token_type_ids")]
    graph = helper.make_graph(nodes, "tiny_bert", ids, [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", d_model])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="inferplane")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()
