"""The Grafana dashboard (``deploy/grafana/inferplane.json``), generated from the metric names the frontend
exports (``server.dataplane.metrics``) and the recording rules of ``server.control.monitoring.slo``; a test checks
that every panel's query names a metric that exists. ``inferplane dashboard --out FILE`` writes it.
"""

from __future__ import annotations

import json

from server.control.monitoring.slo import BUDGET_METRIC, REMAINING_METRIC, SLI_METRIC

# (title, unit, [PromQL targets], legend); $model / $tenant are the dashboard's variables
M = '{model=~"$model"}'
T = '{model=~"$model",tenant=~"$tenant"}'
QUANTILES = (0.5, 0.99)


def _rate(series: str, by: str = "model", selector: str = M) -> str:
    """Per second, summed by the ``by`` labels: a counter's ``..._total`` or a histogram's ``_sum`` / ``_count``."""
    return f"sum by ({by}) (rate({series}{selector}[$__rate_interval]))"


def _quantile(q: float, histogram: str, by: str = "model", selector: str = M) -> str:
    """The ``q`` quantile of a histogram (its name without ``_bucket``) per the ``by`` labels."""
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{selector}[$__rate_interval])))"


def _mean(histogram: str) -> str:
    """A histogram's mean observation per model over the rate interval."""
    return f"{_rate(histogram + '_sum')} / {_rate(histogram + '_count')}"


PANELS: list[tuple[str, str, list[str], str]] = [
    ("Request rate by model", "reqps", [_rate("inferplane_requests_total")], "{{model}}"),
    ("Errors by code", "reqps", [_rate("inferplane_requests_total", "model, code", '{model=~"$model",code!="OK"}')], "{{model}} {{code}}"),
    ("Latency p50 / p99", "s", [_quantile(q, "inferplane_request_duration_seconds") for q in QUANTILES], "{{model}}"),
    ("Request rate by tenant (top N, the rest 'other')", "reqps", [_rate("inferplane_tenant_requests_total", "tenant", T)], "{{tenant}}"),
    ("p99 by tenant", "s", [_quantile(0.99, "inferplane_tenant_request_duration_seconds", "tenant", T)], "{{tenant}}"),
    ("In flight", "short", [f"sum by (model) (inferplane_inflight_requests{M})"], "{{model}}"),
    ("Fair-queue depth", "short", [f"sum by (model) (inferplane_queue_depth{M})"], "{{model}}"),
    ("Fair-queue wait p99", "s", [_quantile(0.99, "inferplane_queue_wait_seconds")], "{{model}}"),
    ("Admissions by path", "reqps", [_rate("inferplane_admissions_total", "model, path")], "{{model}} {{path}}"),
    ("Rows per Triton call (coalescing ratio)", "short", [_mean("inferplane_batch_rows"), _mean("inferplane_batch_requests")], "{{model}}"),
    ("Batch size distribution (rows per call, p50 / p99)", "short", [_quantile(q, "inferplane_batch_rows") for q in QUANTILES], "{{model}}"),
    ("Triton queue / compute time per request", "s", [
        f"inferplane_triton_queue_seconds{M}", f"inferplane_triton_compute_seconds{M}",
    ], "{{model}}"),
    ("Triton busy (compute seconds per second)", "short",
     [_rate("inferplane_triton_stat_seconds", selector='{model=~"$model",phase=~"compute_.*"}')], "{{model}}"),
    ("Triton batch size (its own batcher included)", "short", [f"inferplane_triton_batch_size{M}"], "{{model}}"),
    ("Response cache hit ratio", "percentunit", [f"inferplane_response_cache_hit_ratio{M}"], "{{model}}"),
    ("GPU utilization", "percentunit", ["inferplane_gpu_utilization"], "{{gpu}}"),
    ("GPU memory", "bytes", ["inferplane_gpu_memory_used_bytes", "inferplane_gpu_memory_total_bytes"], "{{gpu}}"),
    ("Triton host CPU / memory", "percentunit", ["inferplane_triton_cpu_utilization", "inferplane_triton_memory_used_bytes / inferplane_triton_memory_total_bytes"], ""),
    ("SLO error budget left (frontend)", "percentunit", [f"inferplane_slo_error_budget_remaining{M}"], "{{model}} {{slo}}"),
    ("SLO error budget left (30 d, Prometheus)", "percentunit", [f"{REMAINING_METRIC}{M}"], "{{model}} {{slo}}"),
    ("SLO burn rate (1 h)", "short", [f"{SLI_METRIC.format(window='1h')}{M} / on (model, slo) {BUDGET_METRIC}"], "{{model}} {{slo}}"),
    ("Drift: worst PSI per model", "short", [f"max by (model) (inferplane_drift_psi{M})"], "{{model}}"),
    ("Drift: worst KS per model", "short", [f"max by (model) (inferplane_drift_ks{M})"], "{{model}}"),
    ("Compute seconds by team (chargeback)", "s", [_rate("inferplane_compute_seconds_total", "team")], "{{team}}"),
    ("Payload records logged / dropped", "short", [_rate("inferplane_payload_logged_total"), _rate("inferplane_payload_dropped_total")], "{{model}}"),
    ("Triton up / restarts", "short", ["min(inferplane_triton_up)", "sum(increase(inferplane_triton_restarts_total[1h]))"], ""),
    ("GC pauses p99", "s", [_quantile(0.99, "inferplane_gc_pause_seconds", "generation", "")], "gen {{generation}}"),
    # token-level SLIs of generations (issue 31): the SLOs are TTFT p50 <= 200 ms / p99 <= 500 ms, ITL p50 <= 30 ms / p99 <= 80 ms
    ("Time to first token p50 / p99 (SLO 200 / 500 ms)", "s", [_quantile(q, "inferplane_time_to_first_token_seconds") for q in QUANTILES], "{{model}}"),
    ("Inter-token latency p50 / p99 (SLO 30 / 80 ms)", "s", [_quantile(q, "inferplane_inter_token_latency_seconds") for q in QUANTILES], "{{model}}"),
    ("Tokens per second per generation (p50)", "none", [_quantile(0.5, "inferplane_generation_tokens_per_second")], "{{model}}"),
    # the ratio is recorded per model; the budget per SLO only (no model label: a selector would hide it)
    ("Token SLO error ratio (1 h) vs budget", "percentunit", [
        f"inferplane:token_slo_errors:ratio_rate1h{M}", "inferplane:token_slo_error_budget"
    ], "{{model}} {{slo}}"),
]  # fmt: skip


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets, legend) in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend} for j, expr in enumerate(targets)],
        })  # fmt: skip
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
        {"name": "model", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": "label_values(inferplane_requests_total, model)", "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2},
        {"name": "tenant", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": "label_values(inferplane_tenant_requests_total, tenant)", "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2},
    ]  # fmt: skip
    return {
        "uid": "inferplane",
        "title": "inferplane",
        "description": "Generated by `inferplane dashboard` (server/control/monitoring/dashboard.py); do not edit by hand.",
        "tags": ["inferplane"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": variables},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
