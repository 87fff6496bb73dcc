"""The accuracy gate (pure): task inference, thresholds and their overrides, verdicts."""

from __future__ import annotations

import numpy as np
import pytest

from optimizer import gate


def _probs(rng, n=200, k=10):
    logits = rng.standard_normal((n, k)) * 3
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def test_infer_task_from_outputs_and_tags():
    rng = np.random.default_rng(0)
    assert gate.infer_task(_probs(rng)) == "classification"
    assert gate.infer_task(rng.uniform(0, 1, (50, 1))) == "binary"
    assert gate.infer_task(rng.normal(0, 100, (50, 1))) == "regression"
    assert gate.infer_task(rng.normal(0, 1, (50, 384)), output_name="embedding") == "embedding"
    assert gate.infer_task(rng.normal(0, 1, (50, 1)), {"gate.task": "embedding"}) == "embedding"
    with pytest.raises(ValueError, match="unknown task"):
        gate.infer_task(rng.normal(0, 1, (5, 1)), {"task": "ranking"})


def test_thresholds_defaults_overrides_and_typos():
    th = gate.thresholds_for("classification", {"gate.min_top1_agreement": "0.995"}, {"max_abs_error": "0.1"})
    assert th["min_top1_agreement"] == 0.995 and th["max_abs_error"] == 0.1 and th["max_accuracy_drop"] == 0.01
    assert gate.thresholds_for("regression", {"max_rel_error": "none"})["max_rel_error"] is None
    with pytest.raises(ValueError, match="unknown threshold 'min_cosine' for a regression model"):
        gate.thresholds_for("regression", {"min_cosine": "0.9"})
    assert gate.tag_overrides({"gate.max_rel_error": "0.1", "seed": "3"}) == {"gate.max_rel_error": "0.1"}


def test_classification_agreement_and_accuracy_delta():
    rng = np.random.default_rng(1)
    parent = _probs(rng)
    labels = parent.argmax(axis=1)
    same = gate.evaluate(parent, parent + 1e-4, "classification", labels=labels)
    assert same.passed and same.metrics["top1_agreement"] == 1.0 and same.metrics["accuracy_delta"] == 0.0
    flipped = parent.copy()
    flipped[:20] = np.roll(flipped[:20], 1, axis=1)  # 10 % of rows change their top-1
    result = gate.evaluate(parent, flipped, "classification", labels=labels)
    assert not result.passed
    assert result.metrics["top1_agreement"] == pytest.approx(0.9)
    assert any("top1_agreement" in f for f in result.failures) and any("accuracy fell" in f for f in result.failures)
    assert "top1 90.0%" in result.summary() and "violated" in result.report()


def test_impossible_tolerance_rejects_a_nearly_identical_candidate():
    rng = np.random.default_rng(2)
    parent = rng.normal(0, 10, (100, 1)).astype(np.float32)
    candidate = parent + 1e-6
    assert gate.evaluate(parent, candidate, "regression").passed
    strict = gate.thresholds_for("regression", {"max_abs_error": "0"})
    result = gate.evaluate(parent, candidate, "regression", strict)
    assert not result.passed and result.failures == (f"max_abs_error {result.metrics['max_abs_error']:.6g} > max_abs_error 0",)


def test_regression_is_relative_to_the_output_spread():
    rng = np.random.default_rng(3)
    big = rng.normal(0, 1000, (100, 1))
    assert gate.evaluate(big, big + 0.5, "regression").passed  # 0.5 on a spread of ~1000
    small = rng.normal(0, 1, (100, 1))
    result = gate.evaluate(small, small + 0.5, "regression")
    assert not result.passed and result.metrics["max_rel_error"] > 0.01


def test_binary_and_embedding_and_bad_outputs():
    rng = np.random.default_rng(4)
    p = rng.uniform(0, 1, (100, 1))
    assert gate.evaluate(p, p + 1e-7, "binary").passed
    assert not gate.evaluate(p, 1 - p, "binary").passed
    e = rng.normal(0, 1, (50, 32))
    assert gate.evaluate(e, e * 2.0, "embedding").metrics["min_cosine"] == pytest.approx(1.0)
    assert not gate.evaluate(e, e + rng.normal(0, 1, e.shape), "embedding").passed
    nan = p.copy()
    nan[3] = np.nan
    assert not gate.evaluate(p, nan, "binary").passed
    assert "shape" in gate.evaluate(p, p[:10], "binary").failures[0]
