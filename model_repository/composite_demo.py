"""Members of the composite demos, trained on synthetic data with fixed seeds, and their specs.

* Three fraud models on one shared feature set (the 32 ``FRAUD_FEATURES`` of ``fraud_xgboost``,
  a new synthetic sample): ``fraud_xgb`` (XGBoost JSON), ``fraud_lgbm`` (LightGBM text) and
  ``fraud_mlp`` (an sklearn MLP exported to ONNX, sigmoid output) — each ``features`` FP32[32] ->
  ``probability`` FP32[1], so an ensemble can average or vote over them.
* ``topic_classifier``: a linear classifier (ONNX, ``embedding`` FP32[384] -> ``logits`` FP32[3])
  trained on the MiniLM embeddings of synthetic labelled sentences (sports, weather, finance),
  computed by the very ONNX graph and tokenizer ``minilm_embeddings`` serves.

The composite specs live beside this module (``composites/*.yaml``); ``inferplane demo build``
compiles them into the repository (``server.control.composition.composition_compiler``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from model_repository.demo import FRAUD_FEATURES, SEED, _features, _range, _split
from model_repository.layout import ModelBundle, TensorSpec, write_model

SPECS_DIR = Path(__file__).resolve().parent / "composites"
FRAUD_MEMBERS = ("fraud_xgb", "fraud_lgbm", "fraud_mlp")
TOPICS = ("sports", "weather", "finance")
TOPIC_MODEL = "topic_classifier"
# composites whose members are all tabular (built without the LLM extras) and the ones needing MiniLM
TABULAR_COMPOSITES = ("fraud_ensemble", "fraud_quorum", "fraud_router")
TEXT_COMPOSITES = ("topic_pipeline", "topic_via_endpoint")
ONNX_OPSET = 17


def fraud_dataset(seed: int = SEED + 11):
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=4256, n_features=32, n_informative=12, weights=[0.9], flip_y=0.01, class_sep=1.2, random_state=seed,
    )  # fmt: skip
    return x, y


def _onnx(nodes, inits, inputs, outputs, name: str) -> bytes:
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)], producer_name="inferplane")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _dense_onnx(weights, biases, input_name: str, output_name: str, final: str | None, name: str) -> bytes:
    """MatMul/Add layers (Relu between them), then ``final`` (Sigmoid, Softmax or none); dynamic batch."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, current = [], [], input_name
    for i, (w, b) in enumerate(zip(weights, biases)):
        inits += [numpy_helper.from_array(np.asarray(w, np.float32), f"W{i}"), numpy_helper.from_array(np.asarray(b, np.float32).reshape(-1), f"B{i}")]
        nodes += [helper.make_node("MatMul", [current, f"W{i}"], [f"mm{i}"]), helper.make_node("Add", [f"mm{i}", f"B{i}"], [f"z{i}"])]
        current = f"z{i}"
        if i < len(weights) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"h{i}"]))
            current = f"h{i}"
    if final is None:
        nodes.append(helper.make_node("Identity", [current], [output_name]))
    else:
        nodes.append(helper.make_node(final, [current], [output_name]))
    width_in, width_out = np.asarray(weights[0]).shape[0], np.asarray(weights[-1]).shape[1]
    return _onnx(
        nodes, inits,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", width_in])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", width_out])], name,
    )  # fmt: skip


def fraud_members(seed: int = SEED) -> list[ModelBundle]:
    import lightgbm as lgb
    import onnxruntime as ort
    import xgboost as xgb
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    x, y = fraud_dataset()
    x_train, y_train, rows = _split(x, y)
    spec = (TensorSpec("features", (32,), _range(x), _features(FRAUD_FEATURES, x)),)
    out = (TensorSpec("probability", (1,)),)

    params = {"objective": "binary:logistic", "max_depth": 4, "eta": 0.15, "tree_method": "hist", "nthread": 1, "seed": seed}
    booster = xgb.train(params, xgb.DMatrix(x_train, label=y_train), num_boost_round=80)
    xgb_artifact = bytes(booster.save_raw(raw_format="json"))
    native = xgb.Booster()
    native.load_model(bytearray(xgb_artifact))
    xgb_expected = native.inplace_predict(rows).astype(np.float32).reshape(-1, 1)

    lgb_params = {
        "objective": "binary", "num_leaves": 15, "learning_rate": 0.1, "num_threads": 1,
        "deterministic": True, "force_row_wise": True, "seed": seed, "verbose": -1,
    }  # fmt: skip
    lgb_text = lgb.train(lgb_params, lgb.Dataset(x_train, label=y_train), num_boost_round=60).model_to_string()
    lgb_expected = lgb.Booster(model_str=lgb_text).predict(rows, num_threads=1).astype(np.float32).reshape(-1, 1)

    mlp = MLPClassifier(hidden_layer_sizes=(32,), max_iter=40, batch_size=128, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        mlp.fit(x_train, y_train)
    mlp_artifact = _dense_onnx(mlp.coefs_, mlp.intercepts_, "features", "probability", "Sigmoid", "fraud_mlp")
    session = ort.InferenceSession(mlp_artifact, providers=["CPUExecutionProvider"])
    mlp_expected = session.run(["probability"], {"features": rows})[0].astype(np.float32)
    if not np.allclose(mlp_expected[:, 0], mlp.predict_proba(rows)[:, 1], rtol=1e-3, atol=1e-5):
        raise AssertionError("the ONNX export disagrees with the sklearn MLP")
    common = {"inputs": spec, "outputs": out, "features": rows, "seed": seed + 11}
    return [
        ModelBundle(name="fraud_xgb", framework="xgboost", format="xgboost-json", artifact_name="model.json",
                    artifact=xgb_artifact, expected=xgb_expected, extra={"estimator": "xgboost binary:logistic", "trees": 80, "shared_features": "fraud"}, **common),
        ModelBundle(name="fraud_lgbm", framework="lightgbm", format="lightgbm-text", artifact_name="model.txt",
                    artifact=lgb_text.encode(), expected=lgb_expected, extra={"estimator": "lightgbm binary", "rounds": 60, "shared_features": "fraud"}, **common),
        ModelBundle(name="fraud_mlp", framework="onnxruntime", format="onnx", artifact_name="model.onnx",
                    artifact=mlp_artifact, expected=mlp_expected, extra={"estimator": "sklearn.MLPClassifier(hidden=32), sigmoid", "shared_features": "fraud"}, **common),
    ]  # fmt: skip


# ---- the topic classifier on MiniLM embeddings ------------------------------------------------

_SUBJECTS = {
    "sports": ["the striker", "our goalkeeper", "the home team", "the tennis champion", "the marathon runner", "the coach", "the basketball squad", "the cyclist"],
    "weather": ["the forecast", "a cold front", "the afternoon sky", "heavy rain", "the storm", "a heat wave", "morning fog", "the snowfall"],
    "finance": ["the central bank", "the stock market", "our quarterly revenue", "the bond yield", "the exchange rate", "the investment fund", "inflation", "the share price"],
}
_PREDICATES = {
    "sports": ["scored twice in the final", "won the championship match", "trained hard before the game", "was transferred to a rival club", "broke the league record", "lost on penalties", "celebrated the victory with fans", "qualified for the tournament"],
    "weather": ["brings showers by evening", "will clear up over the weekend", "dropped temperatures below freezing", "flooded several streets", "is expected to turn sunny", "delayed flights at the airport", "kept the humidity high", "covered the hills in white"],
    "finance": ["raised interest rates again", "fell sharply after the earnings report", "beat analyst expectations", "climbed to a record high", "slowed amid uncertainty", "attracted new investors", "weighed on consumer spending", "rallied before the close"],
}


def topic_sentences(seed: int = SEED) -> tuple[list[str], np.ndarray]:
    """Every subject x predicate sentence of each topic (192), shuffled with a fixed seed."""
    texts, labels = [], []
    for label, topic in enumerate(TOPICS):
        for subject in _SUBJECTS[topic]:
            for predicate in _PREDICATES[topic]:
                texts.append(f"{subject[0].upper()}{subject[1:]} {predicate}.")
                labels.append(label)
    order = np.random.default_rng(seed).permutation(len(texts))
    return [texts[i] for i in order], np.asarray(labels, dtype=np.int64)[order]


def embed_with_served_model(embedding_dir: Path, texts: list[str]) -> np.ndarray:
    """Embeddings exactly as ``minilm_embeddings`` computes them: its tokenizer and ONNX graph."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    version_dir = Path(embedding_dir) / "1"
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    tokenizer.enable_truncation(256)
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]") or 0, pad_token="[PAD]")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(version_dir / "model.onnx"), sess_options=options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    out = []
    for start in range(0, len(texts), 64):
        encoded = tokenizer.encode_batch(texts[start : start + 64])
        feed = {
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
        }
        out.append(session.run(["embedding"], {k: v for k, v in feed.items() if k in names})[0])
    return np.concatenate(out).astype(np.float32)


def topic_classifier(embedding_dir: Path, seed: int = SEED) -> ModelBundle:
    from sklearn.linear_model import LogisticRegression

    texts, labels = topic_sentences(seed)
    x = embed_with_served_model(embedding_dir, texts)
    clf = LogisticRegression(max_iter=500, C=4.0, random_state=seed)
    clf.fit(x, labels)
    weights, bias = clf.coef_.T.astype(np.float32), clf.intercept_.astype(np.float32)
    artifact = _dense_onnx([weights], [bias], "embedding", "logits", None, TOPIC_MODEL)
    rows = np.ascontiguousarray(x[:64])
    expected = (rows @ weights + bias).astype(np.float32)
    accuracy = float((clf.predict(x) == labels).mean())
    if accuracy < 0.9:
        raise AssertionError(f"the topic classifier fits its training sentences poorly ({accuracy:.2f})")
    return ModelBundle(
        name=TOPIC_MODEL, framework="onnxruntime", format="onnx", artifact_name="model.onnx", artifact=artifact,
        inputs=(TensorSpec("embedding", (x.shape[1],)),), outputs=(TensorSpec("logits", (len(TOPICS),)),),
        features=rows, expected=expected, seed=seed,
        extra={"estimator": "sklearn.LogisticRegression on minilm_embeddings", "classes": ",".join(TOPICS), "train_accuracy": round(accuracy, 4), "sentences": len(texts)},
    )  # fmt: skip


def build_members(out: Path, *, text: bool) -> list[str]:
    """Write the fraud members (and, with ``text``, the topic classifier, which needs
    ``out/minilm_embeddings`` built first); return their names."""
    from model_repository.config_writer import ServingConfig

    names = []
    for bundle in fraud_members():
        write_model(out, bundle, ServingConfig())
        names.append(bundle.name)
    if text:
        write_model(out, topic_classifier(Path(out) / "minilm_embeddings"), ServingConfig())
        names.append(TOPIC_MODEL)
    return names


def spec_text(name: str) -> str:
    return (SPECS_DIR / f"{name}.yaml").read_text(encoding="utf-8")
