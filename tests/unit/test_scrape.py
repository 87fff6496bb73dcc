"""server.control.monitoring.scrape: a /metrics text per served model, read by the SLO budgets and right-sizing."""

from __future__ import annotations

from server.control.monitoring import scrape, slo
from server.control.planning import rightsizing

# lines of one model that differ by a label (summed per model), and a name no model is served under
TEXT = """\
inferplane_requests_total{model="m",code="OK",worker="1"} 60
inferplane_requests_total{model="m",code="OK",worker="2"} 40
inferplane_requests_total{model="_unknown",code="NOT_FOUND"} 7
inferplane_batch_rows_sum{model="m"} 300
inferplane_batch_rows_count{model="m"} 100
inferplane_request_duration_seconds_bucket{model="m",le="0.1",worker="1"} 50
inferplane_request_duration_seconds_bucket{model="m",le="0.1",worker="2"} 30
inferplane_request_duration_seconds_bucket{model="m",le="+Inf",worker="1"} 60
inferplane_request_duration_seconds_bucket{model="m",le="+Inf",worker="2"} 40
inferplane_request_duration_seconds_bucket{model="_unknown",le="+Inf"} 7
"""


def test_samples_of_served_models_and_their_latency_histogram_summed():
    seen: list[tuple[str, str]] = []
    histograms = scrape.per_model(TEXT, lambda model, s: seen.append((model, s.name)))
    assert {model for model, _ in seen} == {"m"}  # the unknown name is no model
    assert len(seen) == 8
    assert histograms == {"m": ((0.1, 80.0), (float("inf"), 100.0))}


def test_slo_counts_and_rightsizing_readings_read_the_same_histogram():
    counts, readings = slo.read_counts(TEXT)["m"], rightsizing.readings(TEXT)["m"]
    assert counts.total == 100 and counts.fast(0.1) == 80
    assert (readings.requests, readings.rows, readings.calls) == (100, 300, 100)
    assert readings.buckets == counts.buckets
