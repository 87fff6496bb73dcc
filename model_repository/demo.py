"""The demo repository: three small models trained on synthetic data with fixed seeds.

Same bytes every run (on one machine and library set): fixed seeds, single-threaded training,
no timestamps in any file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from model_repository.config_writer import ServingConfig
from model_repository.layout import ModelBundle, TensorSpec, load_validation, read_metadata, write_model

__all__ = ["build_demo_repository", "load_validation", "read_metadata", "DEMO_MODELS"]

SEED = 20240601
VALIDATION_ROWS = 256
ONNX_OPSET = 17
DEMO_MODELS = ("mlp_classifier", "fraud_xgboost", "lightgbm_regressor")


def _range(x: np.ndarray) -> tuple[float, float]:
    """The data's span rounded outward to whole numbers, with a margin of one."""
    return float(np.floor(x.min()) - 1.0), float(np.ceil(x.max()) + 1.0)


# Feature names of the tabular demos: the fields of their typed gRPC APIs (`inferplane proto NAME`).
# The data is synthetic and standardized (make_classification / make_regression), hence "z-score".
FRAUD_FEATURES = (
    "amount", "amount_vs_card_avg_30d", "amount_vs_merchant_avg_30d", "hour_of_day", "day_of_week",
    "seconds_since_last_txn", "txn_count_1h", "txn_count_24h", "txn_count_7d", "distinct_merchants_24h",
    "distinct_countries_7d", "distance_from_home_km", "distance_from_last_txn_km", "travel_speed_kmh",
    "card_age_days", "account_age_days", "merchant_risk_score", "merchant_fraud_rate_90d", "mcc_risk_score",
    "device_risk_score", "ip_risk_score", "email_domain_age_days", "billing_shipping_distance_km",
    "cvv_failures_24h", "declines_24h", "chargebacks_365d", "card_not_present_ratio_30d",
    "foreign_currency_ratio_30d", "avg_ticket_ratio_7d", "spend_velocity_24h", "password_resets_30d",
    "new_device_logins_7d",
)  # fmt: skip
DELIVERY_FEATURES = (
    "distance_km", "items_in_order", "order_value", "prep_time_estimate", "courier_load", "courier_rating",
    "traffic_index", "rain_mm", "temperature_c", "hour_of_day", "day_of_week", "restaurant_backlog",
    "pickup_wait_estimate", "dropoff_floor", "building_access_score", "zone_density",
)  # fmt: skip


def _features(names, x: np.ndarray, unit: str = "z-score") -> tuple[dict, ...]:
    """One declared feature per column: its name, unit and the column's range (rounded outward)."""
    if len(names) != x.shape[1]:
        raise AssertionError(f"{len(names)} feature names for {x.shape[1]} columns")
    return tuple({"name": n, **({"unit": unit} if unit else {}), "range": list(_range(x[:, j]))} for j, n in enumerate(names))


def _split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = x.astype(np.float32)
    return x[:-VALIDATION_ROWS], y[:-VALIDATION_ROWS], np.ascontiguousarray(x[-VALIDATION_ROWS:])


def _mlp_onnx(weights: list[np.ndarray], biases: list[np.ndarray]) -> bytes:
    """MatMul/Add/Relu layers ending in Softmax, dynamic batch dim."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, current = [], [], "features"
    for i, (w, b) in enumerate(zip(weights, biases)):
        inits += [numpy_helper.from_array(w.astype(np.float32), f"W{i}"), numpy_helper.from_array(b.astype(np.float32), f"B{i}")]
        nodes += [helper.make_node("MatMul", [current, f"W{i}"], [f"mm{i}"]), helper.make_node("Add", [f"mm{i}", f"B{i}"], [f"z{i}"])]
        current = f"z{i}"
        if i < len(weights) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"h{i}"]))
            current = f"h{i}"
    nodes.append(helper.make_node("Softmax", [current], ["probabilities"], axis=-1))
    graph = helper.make_graph(
        nodes,
        "mlp_classifier",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", weights[0].shape[0]])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", weights[-1].shape[1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)], producer_name="inferplane")
    model.ir_version = 8  # readable by onnxruntime releases older than the onnx package
    onnx.checker.check_model(model)
    return model.SerializeToString()


def mlp_classifier(seed: int = SEED) -> ModelBundle:
    import onnxruntime as ort
    from sklearn.datasets import make_classification
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    x, y = make_classification(
        n_samples=2256, n_features=64, n_informative=32, n_redundant=8, n_classes=10,
        n_clusters_per_class=1, random_state=seed,
    )
    x_train, y_train, rows = _split(x, y)
    clf = MLPClassifier(hidden_layer_sizes=(128,), max_iter=30, batch_size=128, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x_train, y_train)
    artifact = _mlp_onnx(clf.coefs_, clf.intercepts_)
    session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
    expected = session.run(["probabilities"], {"features": rows})[0].astype(np.float32)
    if not np.allclose(expected, clf.predict_proba(rows), rtol=1e-3, atol=1e-5):
        raise AssertionError("the ONNX export disagrees with the sklearn MLP")
    return ModelBundle(
        name="mlp_classifier", framework="onnxruntime", format="onnx", artifact_name="model.onnx",
        artifact=artifact, inputs=(TensorSpec("features", (64,), _range(x), _features([f"f{j}" for j in range(64)], x, "")),),
        outputs=(TensorSpec("probabilities", (10,)),), features=rows, expected=expected, seed=seed,
        extra={"estimator": "sklearn.MLPClassifier(hidden=128)", "classes": 10, "opset": ONNX_OPSET},
    )


def fraud_xgboost(seed: int = SEED, trees: int = 200) -> ModelBundle:
    import xgboost as xgb
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=4256, n_features=32, n_informative=12, weights=[0.95], flip_y=0.01, random_state=seed + 1,
    )
    x_train, y_train, rows = _split(x, y)
    params = {"objective": "binary:logistic", "max_depth": 4, "eta": 0.1, "tree_method": "hist", "nthread": 1, "seed": seed}
    booster = xgb.train(params, xgb.DMatrix(x_train, label=y_train), num_boost_round=trees)
    artifact = bytes(booster.save_raw(raw_format="json"))
    native = xgb.Booster()
    native.load_model(bytearray(artifact))
    expected = native.inplace_predict(rows).astype(np.float32).reshape(-1, 1)
    return ModelBundle(
        name="fraud_xgboost", framework="xgboost", format="xgboost-json", artifact_name="model.json",
        artifact=artifact, inputs=(TensorSpec("features", (32,), _range(x), _features(FRAUD_FEATURES, x)),),
        outputs=(TensorSpec("probability", (1,)),), features=rows, expected=expected, seed=seed + 1,
        extra={"estimator": "xgboost binary:logistic", "trees": trees, "positive_rate": float(y.mean())},
    )


def lightgbm_regressor(seed: int = SEED, rounds: int = 100) -> ModelBundle:
    import lightgbm as lgb
    from sklearn.datasets import make_regression

    x, y = make_regression(n_samples=4256, n_features=16, n_informative=10, noise=5.0, random_state=seed + 2)
    x_train, y_train, rows = _split(x, y)
    params = {
        "objective": "regression", "num_leaves": 31, "learning_rate": 0.1, "num_threads": 1,
        "deterministic": True, "force_row_wise": True, "seed": seed, "verbose": -1,
    }
    booster = lgb.train(params, lgb.Dataset(x_train, label=y_train), num_boost_round=rounds)
    text = booster.model_to_string()
    artifact = text.encode("utf-8")
    native = lgb.Booster(model_str=text)
    expected = native.predict(rows, num_threads=1).astype(np.float32).reshape(-1, 1)
    return ModelBundle(
        name="lightgbm_regressor", framework="lightgbm", format="lightgbm-text", artifact_name="model.txt",
        artifact=artifact, inputs=(TensorSpec("features", (16,), _range(x), _features(DELIVERY_FEATURES, x)),),
        outputs=(TensorSpec("prediction", (1,)),), features=rows, expected=expected, seed=seed + 2,
        extra={"estimator": "lightgbm regression", "rounds": rounds},
    )


def build_demo_repository(out: Path, serving: ServingConfig = ServingConfig()) -> list[str]:
    """Train the demo models and write them into the Triton repository ``out``; return their names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bundles = [mlp_classifier(), fraud_xgboost(), lightgbm_regressor()]
    for bundle in bundles:
        write_model(out, bundle, serving)
    return [b.name for b in bundles]
