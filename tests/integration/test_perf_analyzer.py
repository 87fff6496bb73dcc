"""NVIDIA's perf_analyzer (the real C++ binary) completes a short run through the frontend."""

import pytest

from loadtest.perf_analyzer import run_perf_analyzer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_perf_analyzer_runs_against_the_frontend(stack):
    # a smoke run, not a benchmark: accept whatever variation a noisy 2-core machine shows
    result = run_perf_analyzer(
        f"grpc://{stack.grpc}",
        "fraud_xgboost",
        concurrency_range="2",
        measurement_interval_ms=1000,
        extra_args=["--stability-percentage", "100", "--max-trials", "5"],
        timeout=180,
    )
    assert result["throughput_rps"] > 0
    assert result["latency_ms"]["p99"] >= result["latency_ms"]["p50"] > 0
