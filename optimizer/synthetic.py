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
