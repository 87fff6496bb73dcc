"""Significance tests for A/B reports, with confidence intervals (pure; scipy for distributions).

* :func:`two_proportion_z` — binary outcomes (conversion, click): pooled z statistic, Wald CI of
  the difference ``p_b - p_a``.
* :func:`welch_t` — continuous outcomes, unequal variances: Welch-Satterthwaite degrees of
  freedom, CI of ``mean_b - mean_a``.
* :func:`mann_whitney` — continuous outcomes without a normality assumption: U test (two-sided,
  normal approximation with tie correction via scipy), Hodges-Lehmann shift ``b - a`` and its
  distribution-free CI from the order statistics of the pairwise differences.

Every test returns a :class:`Significance`; ``effect`` and the CI are always "b minus a".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

MAX_PAIRS = 1_000_000  # Hodges-Lehmann: pairwise differences beyond this are subsampled (fixed seed)


@dataclass(frozen=True)
class Significance:
    test: str
    statistic: float
    p_value: float
    effect: float  # b - a (difference of proportions / means / Hodges-Lehmann shift)
    ci_low: float
    ci_high: float
    confidence: float
    significant: bool
    n_a: int
    n_b: int

    def as_dict(self) -> dict:
        return asdict(self)


def _nan_result(test: str, n_a: int, n_b: int, confidence: float) -> Significance:
    nan = float("nan")
    return Significance(test, nan, 1.0, nan, nan, nan, confidence, False, n_a, n_b)


def two_proportion_z(success_a: int, n_a: int, success_b: int, n_b: int, alpha: float = 0.05) -> Significance:
    """Two-sided z-test of ``p_a == p_b``; CI of ``p_b - p_a`` (unpooled standard error)."""
    confidence = 1.0 - alpha
    if n_a <= 0 or n_b <= 0:
        return _nan_result("two_proportion_z", n_a, n_b, confidence)
    p_a, p_b = success_a / n_a, success_b / n_b
    pooled = (success_a + success_b) / (n_a + n_b)
    se_pooled = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    diff = p_b - p_a
    if se_pooled == 0:
        z, p = 0.0, 1.0
    else:
        z = diff / se_pooled
        p = float(2 * stats.norm.sf(abs(z)))
    se = math.sqrt(p_a * (1 - p_a) / n_a + p_b * (1 - p_b) / n_b)
    half = float(stats.norm.isf(alpha / 2)) * se
    return Significance("two_proportion_z", z, p, diff, diff - half, diff + half, confidence, p < alpha, n_a, n_b)


def welch_t(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> Significance:
    """Welch's unequal-variance t-test; CI of ``mean(b) - mean(a)``."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    confidence = 1.0 - alpha
    if len(x) < 2 or len(y) < 2:
        return _nan_result("welch_t", len(x), len(y), confidence)
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    diff = float(y.mean() - x.mean())
    se = math.sqrt(va + vb)
    if se == 0:
        return Significance("welch_t", 0.0 if diff == 0 else math.copysign(math.inf, diff), 1.0 if diff == 0 else 0.0,
                          diff, diff, diff, confidence, diff != 0, len(x), len(y))  # fmt: skip
    df = (va + vb) ** 2 / (va**2 / (len(x) - 1) + vb**2 / (len(y) - 1))
    t = diff / se
    p = float(2 * stats.t.sf(abs(t), df))
    half = float(stats.t.isf(alpha / 2, df)) * se
    return Significance("welch_t", t, p, diff, diff - half, diff + half, confidence, p < alpha, len(x), len(y))


def mann_whitney(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> Significance:
    """Mann-Whitney U (two-sided); effect: Hodges-Lehmann shift ``b - a`` with its CI."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    confidence = 1.0 - alpha
    if len(x) < 1 or len(y) < 1:
        return _nan_result("mann_whitney", len(x), len(y), confidence)
    result = stats.mannwhitneyu(y, x, alternative="two-sided", method="asymptotic")
    u, p = float(result.statistic), float(result.pvalue)
    n1, n2 = len(x), len(y)
    if n1 * n2 <= MAX_PAIRS:
        diffs = np.sort((y[None, :] - x[:, None]).ravel())
    else:
        rng = np.random.default_rng(0)
        diffs = np.sort(rng.choice(y, MAX_PAIRS) - rng.choice(x, MAX_PAIRS))
    shift = float(np.median(diffs))
    # the k-th smallest and largest pairwise differences bound the shift (normal approximation of U)
    z = float(stats.norm.isf(alpha / 2))
    k = int(math.floor(n1 * n2 / 2 - z * math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)))
    k = max(0, min(k, n1 * n2 - 1))
    scale = len(diffs) / (n1 * n2)
    lo_i = min(len(diffs) - 1, int(k * scale))
    hi_i = max(0, len(diffs) - 1 - int(k * scale))
    return Significance("mann_whitney", u, p, shift, float(diffs[lo_i]), float(diffs[hi_i]), confidence, p < alpha, n1, n2)


def is_binary(values: Sequence[float]) -> bool:
    return len(values) > 0 and all(v in (0.0, 1.0) for v in values)


def compare_outcomes(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> list[Significance]:
    """The tests that fit the outcomes: the z-test for 0/1 outcomes, Welch and Mann-Whitney otherwise."""
    if is_binary(a) and is_binary(b):
        return [two_proportion_z(int(sum(a)), len(a), int(sum(b)), len(b), alpha)]
    return [welch_t(a, b, alpha), mann_whitney(a, b, alpha)]
