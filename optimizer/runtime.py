"""Run an artifact in this process the way its Triton adapter does (same library calls).

Used by the accuracy gate (parent and candidate outputs on the validation rows), by the
candidate's own validation set (so ``inferplane deploy``'s warm-up check reproduces it), and as
a cheap in-process latency estimate when the Triton profile is skipped.

Rows go through in chunks of ``CHUNK`` (the deployer's warm-up batch): a dynamically quantized
graph computes its activation scale over the whole batch, so its outputs depend on the batch
they were computed in; fixed chunks make those outputs reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from server.control.registry import safe_formats

CHUNK = 8  # server.control.rollout.deployer.WARMUP_ROWS


def onnx_session(artifact: bytes, threads: int = 1):
    """An ONNX Runtime CPU session configured as the adapters run it (sequential, ``threads`` intra-op)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    return ort.InferenceSession(artifact, sess_options=options, providers=["CPUExecutionProvider"])


def predictor(fmt: str, artifact: bytes, threads: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """A function rows -> outputs for ``artifact`` (ONNX Runtime CPU, XGBoost, LightGBM, TensorRT)."""
    if fmt == safe_formats.ONNX:
        session = onnx_session(artifact, threads)
        graph_input, graph_output = session.get_inputs()[0].name, session.get_outputs()[0].name
        return lambda rows: session.run([graph_output], {graph_input: rows})[0]
    if fmt in (safe_formats.XGBOOST_JSON, safe_formats.XGBOOST_UBJ):
        import xgboost as xgb

        booster = xgb.Booster()
        booster.load_model(bytearray(artifact))
        booster.set_param({"nthread": threads})
        return lambda rows: booster.inplace_predict(rows, validate_features=False)
    if fmt == safe_formats.LIGHTGBM_TEXT:
        import lightgbm as lgb

        booster = lgb.Booster(model_str=artifact.decode("utf-8"))
        return lambda rows: booster.predict(rows, num_threads=threads)
    if fmt == safe_formats.TENSORRT_PLAN:
        from optimizer.tensorrt import plan_predictor

        return plan_predictor(artifact)
    raise ValueError(f"no in-process runtime for format {fmt!r}")


def predict(fmt: str, artifact: bytes, rows: np.ndarray, output_dims: Sequence[int], chunk: int = CHUNK) -> np.ndarray:
    """Outputs for ``rows`` as FP32 ``[N, *output_dims]``, computed ``chunk`` rows at a time."""
    run = predictor(fmt, artifact)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    pieces = [np.asarray(run(rows[i : i + chunk]), dtype=np.float32) for i in range(0, len(rows), chunk)]
    out = np.concatenate(pieces, axis=0) if pieces else np.zeros((0, *output_dims), np.float32)
    return out.reshape(len(rows), *output_dims)


def local_latency_us(fmt: str, artifact: bytes, rows: np.ndarray, batch: int = 1, calls: int = 200) -> float:
    """Median in-process latency (µs) of one ``batch``-row call: the fallback speed estimate."""
    run = predictor(fmt, artifact)
    x = np.ascontiguousarray(rows[:batch], dtype=np.float32)
    return median_call_us(lambda: run(x), warmup=10, calls=calls)


def median_call_us(call: Callable[[], object], *, warmup: int, calls: int) -> float:
    """Median wall time (µs) of ``call()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6)
