"""The zone drill's figures (``loadtest/zone_drill.py``): per-1-s-window p99 by answer time, the steady
p99 before the kill, and when p99 came (and stayed) back within 2x of it. Pure arithmetic on
timestamps; the drill itself is a benchmark (BENCHMARKS.md), not a test."""

from __future__ import annotations

import pytest

from loadtest.zone_drill import measure, recovery, windows


def test_answers_fall_in_the_window_of_their_answer_time():
    sent, done = [0.0, 0.5, 1.2, 1.0], [0.1, 0.9, 1.3, 2.5]  # 100, 400, 100 ms; the last answered in window 2
    got = windows(sent, done, 0.0, 3.0)
    assert [(w["from_s"], w["answers"]) for w in got] == [(0.0, 2), (1.0, 1), (2.0, 1)]
    assert got[1]["p99_ms"] == pytest.approx(100.0) and got[2]["p99_ms"] == pytest.approx(1500.0)
    assert windows([], [], 0.0, 2.0) == [{"from_s": 0.0, "answers": 0, "p99_ms": None}, {"from_s": 1.0, "answers": 0, "p99_ms": None}]


def test_recovery_is_the_end_of_the_first_window_within_twice_steady_and_of_the_last_excursion():
    after = [{"p99_ms": v} for v in (900.0, None, 19.0, 45.0, 20.0, 10.0)]
    assert recovery(10.0, after) == {"within_2x_s": 3.0, "stays_within_2x_s": 5.0, "worst_p99_ms": 900.0}
    assert recovery(10.0, [{"p99_ms": 20.0}]) == {"within_2x_s": 1.0, "stays_within_2x_s": 1.0, "worst_p99_ms": 20.0}  # 2x is within
    assert recovery(10.0, [{"p99_ms": 20.1}, {"p99_ms": None}]) == {"within_2x_s": None, "stays_within_2x_s": None, "worst_p99_ms": 20.1}


def test_the_steady_p99_is_the_median_of_the_whole_windows_before_the_kill():
    # windows before the kill at t=3.5 (whole ones: [0.5,1.5), [1.5,2.5), [2.5,3.5)): 10, 30, 20 ms; after it: 200, then 15 ms
    sent = [0.6, 1.6, 2.6, 3.6, 4.6]
    done = [0.61, 1.63, 2.62, 3.8, 4.615]
    got = measure(sent, done, began=0.2, killed=3.5, ended=5.6)
    assert got["steady_p99_ms"] == pytest.approx(20.0)
    assert [w["p99_ms"] for w in got["after"]] == [pytest.approx(200.0), pytest.approx(15.0)]
    assert (got["within_2x_s"], got["stays_within_2x_s"]) == (2.0, 2.0)
