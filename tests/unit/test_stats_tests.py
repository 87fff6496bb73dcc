"""Significance tests of the A/B report: against scipy and closed forms, planted differences found,
A/A tests not flagged more often than alpha, confidence intervals that cover."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from server.control.rollout.stats_tests import compare_outcomes, is_binary, mann_whitney, two_proportion_z, welch_t


def test_two_proportion_z_against_the_closed_form():
    r = two_proportion_z(45, 100, 60, 100)
    pooled = 105 / 200
    z = 0.15 / math.sqrt(pooled * (1 - pooled) * (2 / 100))
    assert r.statistic == pytest.approx(z) and r.p_value == pytest.approx(2 * stats.norm.sf(z))
    assert r.effect == pytest.approx(0.15) and r.significant and r.p_value == pytest.approx(0.0337, abs=1e-3)
    half = 1.959964 * math.sqrt(0.45 * 0.55 / 100 + 0.6 * 0.4 / 100)
    assert (r.ci_low, r.ci_high) == (pytest.approx(0.15 - half, abs=1e-5), pytest.approx(0.15 + half, abs=1e-5))


def test_degenerate_inputs_never_flag():
    assert not two_proportion_z(0, 0, 1, 10).significant
    assert two_proportion_z(0, 50, 0, 50).p_value == 1.0  # no variance at all
    assert not welch_t([1.0], [2.0]).significant
    assert not mann_whitney([], [1.0]).significant


def test_welch_and_mann_whitney_agree_with_scipy():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, 80), rng.normal(0.4, 2, 120)
    w = welch_t(a, b)
    ref = stats.ttest_ind(b, a, equal_var=False)
    assert w.statistic == pytest.approx(ref.statistic) and w.p_value == pytest.approx(ref.pvalue)
    assert w.effect == pytest.approx(b.mean() - a.mean()) and w.ci_low < w.effect < w.ci_high
    m = mann_whitney(a, b)
    ref = stats.mannwhitneyu(b, a, alternative="two-sided", method="asymptotic")
    assert m.statistic == pytest.approx(ref.statistic) and m.p_value == pytest.approx(ref.pvalue)


def test_hodges_lehmann_shift_and_its_interval():
    rng = np.random.default_rng(2)
    a = rng.exponential(1.0, 300)
    b = rng.exponential(1.0, 300) + 2.0
    m = mann_whitney(a, b)
    assert m.effect == pytest.approx(2.0, abs=0.25) and m.ci_low < 2.0 < m.ci_high and m.significant


def test_planted_differences_are_detected():
    rng = np.random.default_rng(3)
    conv_a, conv_b = rng.random(3000) < 0.10, rng.random(3000) < 0.14
    (z,) = compare_outcomes(conv_a.astype(float), conv_b.astype(float))
    assert z.test == "two_proportion_z" and z.significant and z.ci_low > 0
    a, b = rng.normal(10, 3, 500), rng.normal(10.8, 3, 500)
    welch, mw = compare_outcomes(a, b)
    assert (welch.test, mw.test) == ("welch_t", "mann_whitney") and welch.significant and mw.significant
    assert welch.ci_low < 0.8 < welch.ci_high


@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_a_a_tests_are_flagged_at_about_alpha(kind):
    rng = np.random.default_rng(4)
    flagged, covered, runs = 0, 0, 300
    for _ in range(runs):
        if kind == "binary":
            a, b = (rng.random(400) < 0.2).astype(float), (rng.random(400) < 0.2).astype(float)
        else:
            a, b = rng.lognormal(0, 1, 200), rng.lognormal(0, 1, 200)
        results = compare_outcomes(a, b)
        flagged += results[0].significant
        covered += results[0].ci_low <= 0 <= results[0].ci_high
    assert flagged / runs < 0.10  # alpha 0.05, with room for chance
    assert covered / runs > 0.90


def test_is_binary():
    assert is_binary([0.0, 1.0, 1.0]) and not is_binary([0.0, 0.5]) and not is_binary([])


@pytest.mark.parametrize("alpha", [1e-300, 1e-20, 0.05])
def test_every_test_gives_a_finite_interval_for_any_alpha_in_0_1(alpha):
    """``ab_report`` accepts any alpha in (0, 1): the interval's quantile is taken from the upper tail
    (1 - 1e-300/2 is 1.0 in floating point, where the normal quantile is infinite)."""
    rng = np.random.default_rng(4)
    conv_a, conv_b = rng.random(400) < 0.10, rng.random(400) < 0.30
    a, b = rng.normal(10, 3, 60), rng.normal(14, 3, 60)
    for result in (*compare_outcomes(conv_a.astype(float), conv_b.astype(float), alpha), *compare_outcomes(a, b, alpha)):
        assert math.isfinite(result.ci_low) and math.isfinite(result.ci_high) and result.ci_low <= result.effect <= result.ci_high, result
    wide, narrow = welch_t(a, b, alpha=alpha), welch_t(a, b, alpha=0.5)
    assert wide.ci_high - wide.ci_low >= narrow.ci_high - narrow.ci_low
