"""The built-in operators of composite endpoints, as numpy functions over whole batches.

Copied beside ``composite_operator.py`` (the Triton Python-backend adapter) into each operator
model's version directory; imports nothing but numpy, so the tests run it without Triton. Every
operator takes its inputs as ``{position: array [rows, ...]}`` — an aggregator under a quorum
policy gets only the members that answered — and its parameters as a dict.

=============== ============================================== ===================================
operator        inputs                                         output
=============== ============================================== ===================================
concat          one or more [rows, k_i] of one dtype            [rows, sum k_i] of that dtype
argmax          one [rows, k]                                   INT32 [rows, 1] (first maximum)
threshold       one [rows, k]; ``value`` (0.5), ``column``      INT32 [rows, k] (or [rows, 1] of
                                                                ``column``): 1 where x >= value
softmax         one [rows, k]                                   FP32 [rows, k] along the last axis
average         one or more [rows, ...] of one shape            FP32 mean of those present
majority_vote   one or more [rows, ...] of one shape            INT32 per element the most common
                                                                value (a tie: the smallest)
weighted_sum    one or more [rows, ...]; ``weights`` (one per   FP32 sum of w_i * x_i over those
                input, default 1), ``normalize`` (false)       present (normalize: / sum of w_i)
=============== ============================================== ===================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

OPERATORS = ("concat", "argmax", "threshold", "softmax", "average", "majority_vote", "weighted_sum")
# operators that combine several members' answers: the ones a quorum policy may sit on
AGGREGATORS = ("average", "majority_vote", "weighted_sum")
OUTPUT = "output"


class OperatorError(ValueError):
    """The operator cannot run on these inputs (the caller's or the composition's mistake)."""


def input_name(position: int) -> str:
    return f"in{position}"


def _present(inputs: Mapping[int, np.ndarray]) -> list[tuple[int, np.ndarray]]:
    if not inputs:
        raise OperatorError("no inputs")
    return sorted(inputs.items())


def _same_shape(items: list[tuple[int, np.ndarray]], op: str) -> None:
    shapes = {a.shape for _, a in items}
    if len(shapes) > 1:
        raise OperatorError(f"{op}: inputs must have one shape, got {sorted(shapes)}")


def concat(inputs, params):
    items = _present(inputs)
    rows = {a.shape[0] for _, a in items}
    if len(rows) > 1:
        raise OperatorError(f"concat: inputs have different row counts {sorted(rows)}")
    return np.concatenate([a.reshape(a.shape[0], -1) for _, a in items], axis=1)


def argmax(inputs, params):
    (_, x), *rest = _present(inputs)
    if rest:
        raise OperatorError("argmax takes one input")
    return np.argmax(x.reshape(x.shape[0], -1), axis=1).astype(np.int32).reshape(-1, 1)


def threshold(inputs, params):
    (_, x), *rest = _present(inputs)
    if rest:
        raise OperatorError("threshold takes one input")
    value = float(params.get("value", 0.5))
    column = params.get("column")
    if column is not None:
        x = x.reshape(x.shape[0], -1)
        column = int(column)
        if not 0 <= column < x.shape[1]:
            raise OperatorError(f"threshold: column {column} is outside 0..{x.shape[1] - 1}")
        x = x[:, column : column + 1]
    return (x >= value).astype(np.int32)


def softmax(inputs, params):
    (_, x), *rest = _present(inputs)
    if rest:
        raise OperatorError("softmax takes one input")
    z = x.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)


def average(inputs, params):
    items = _present(inputs)
    _same_shape(items, "average")
    return np.mean(np.stack([a.astype(np.float64) for _, a in items]), axis=0).astype(np.float32)


def majority_vote(inputs, params):
    items = _present(inputs)
    _same_shape(items, "majority_vote")
    votes = np.stack([a for _, a in items]).astype(np.int64)  # [members, rows, ...]
    values = np.unique(votes)  # sorted: on a tie argmax picks the smallest value
    counts = np.stack([(votes == v).sum(axis=0) for v in values])  # [values, rows, ...]
    return values[np.argmax(counts, axis=0)].astype(np.int32)


def weighted_sum(inputs, params):
    items = _present(inputs)
    _same_shape(items, "weighted_sum")
    weights = params.get("weights")
    if weights is None:
        weights = [1.0] * (max(p for p, _ in items) + 1)
    weights = [float(w) for w in weights]
    if max(p for p, _ in items) >= len(weights):
        raise OperatorError(f"weighted_sum: {len(weights)} weights for input position {max(p for p, _ in items)}")
    total = sum(weights[p] * a.astype(np.float64) for p, a in items)
    if params.get("normalize"):
        norm = sum(weights[p] for p, _ in items)
        if norm == 0:
            raise OperatorError("weighted_sum: the weights of the inputs present sum to 0")
        total = total / norm
    return np.asarray(total, dtype=np.float32)


FUNCTIONS = {
    "concat": concat,
    "argmax": argmax,
    "threshold": threshold,
    "softmax": softmax,
    "average": average,
    "majority_vote": majority_vote,
    "weighted_sum": weighted_sum,
}


def run(op: str, inputs: Mapping[int, np.ndarray], params: Mapping[str, Any]) -> np.ndarray:
    """One operator over one request's inputs (by position)."""
    function = FUNCTIONS.get(op)
    if function is None:
        raise OperatorError(f"unknown operator {op!r} (one of {', '.join(OPERATORS)})")
    return function(inputs, params)
