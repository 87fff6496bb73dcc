"""The Grafana dashboard (``deploy/grafana/inferplane.json``), generated from the metric names the frontend
exports (``server.dataplane.metrics``) and the recording rules of ``server.control.monitoring.slo``; a test checks
that every panel's query names a metric that exists. ``inferplane dashboard --out FILE`` writes it.
"""

from __future__ import annotations

import json

from server.control.monitoring.slo import BUDGET_METRIC, REMAINING_METRIC, SLI_METRIC

# (title, unit, [PromQL targets], legend); $model / $tenant are the dashboard's variables
M = '{model=~"$model"}'
PANELS: list[tuple[str, str, list[str], str]] = [
    ("Request rate by model", "reqps", [f"sum by (model) (rate(inferplane_requests_total{M}[$__rate_interval]))"], "{{model}}"),
    ("Errors by code", "reqps", [f'sum by (model, code) (rate(inferplane_requests_total{{model=~"$model",code!="OK"}}[$__rate_interval]))'], "{{model}} {{code}}"),
    ("Latency p50 / p99", "s", [
        f"histogram_quantile(0.5, sum by (model, le) (rate(inferplane_request_duration_seconds_bucket{M}[$__rate_interval])))",
        f"histogram_quantile(0.99, sum by (model, le) (rate(inferplane_request_duration_seconds_bucket{M}[$__rate_interval])))",
    ], "{{model}}"),
    ("Request rate by tenant (top N, the rest 'other')", "reqps",
     ['sum by (tenant) (rate(inferplane_tenant_requests_total{model=~"$model",tenant=~"$tenant"}[$__rate_interval]))'], "{{tenant}}"),
    ("p99 by tenant", "s",
     ['histogram_quantile(0.99, sum by (tenant, le) (rate(inferplane_tenant_request_duration_seconds_bucket{model=~"$model",tenant=~"$tenant"}[$__rate_interval])))'], "{{tenant}}"),
    ("In flight", "short", [f"sum by (model) (inferplane_inflight_requests{M})"], "{{model}}"),
    ("Fair-queue depth", "short", [f"sum by (model) (inferplane_queue_depth{M})"], "{{model}}"),
    ("Fair-queue wait p99", "s", [f"histogram_quantile(0.99, sum by (model, le) (rate(inferplane_queue_wait_seconds_bucket{M}[$__rate_interval])))"], "{{model}}"),
    ("Admissions by path", "reqps", [f"sum by (model, path) (rate(inferplane_admissions_total{M}[$__rate_interval]))"], "{{model}} {{path}}"),
    ("Rows per Triton call (coalescing ratio)", "short", [
        f"sum by (model) (rate(inferplane_batch_rows_sum{M}[$__rate_interval])) / sum by (model) (rate(inferplane_batch_rows_count{M}[$__rate_interval]))",
        f"sum by (model) (rate(inferplane_batch_requests_sum{M}[$__rate_interval])) / sum by (model) (rate(inferplane_batch_requests_count{M}[$__rate_interval]))",
    ], "{{model}}"),
    ("Batch size distribution (rows per call, p50 / p99)", "short", [
        f"histogram_quantile(0.5, sum by (model, le) (rate(inferplane_batch_rows_bucket{M}[$__rate_interval])))",
        f"histogram_quantile(0.99, sum by (model, le) (rate(inferplane_batch_rows_bucket{M}[$__rate_interval])))",
    ], "{{model}}"),
    ("Triton queue / compute time per request", "s", [
        f"inferplane_triton_queue_seconds{M}", f"inferplane_triton_compute_seconds{M}",
    ], "{{model}}"),
    ("Triton busy (compute seconds per second)", "short",
     ['sum by (model) (rate(inferplane_triton_stat_seconds{model=~"$model",phase=~"compute_.*"}[$__rate_interval]))'], "{{model}}"),
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
    ("Compute seconds by team (chargeback)", "s", [f"sum by (team) (rate(inferplane_compute_seconds_total{M}[$__rate_interval]))"], "{{team}}"),
    ("Payload records logged / dropped", "short", [
        f"sum by (model) (rate(inferplane_payload_logged_total{M}[$__rate_interval]))",
        f"sum by (model) (rate(inferplane_payload_dropped_total{M}[$__rate_interval]))",
    ], "{{model}}"),
    ("Triton up / restarts", "short", ["min(inferplane_triton_up)", "sum(increase(inferplane_triton_restarts_total[1h]))"], ""),
    ("GC pauses p99", "s", ["histogram_quantile(0.99, sum by (generation, le) (rate(inferplane_gc_pause_seconds_bucket[$__rate_interval])))"], "gen {{generation}}"),
    # token-level SLIs of generations (issue 31): the SLOs are TTFT p50 <= 200 ms / p99 <= 500 ms, ITL p50 <= 30 ms / p99 <= 80 ms
    ("Time to first token p50 / p99 (SLO 200 / 500 ms)", "s", [
        f"histogram_quantile({q}, sum by (model, le) (rate(inferplane_time_to_first_token_seconds_bucket[$__rate_interval])))" for q in (0.5, 0.99)
    ], "{{model}}"),
    ("Inter-token latency p50 / p99 (SLO 30 / 80 ms)", "s", [
        f"histogram_quantile({q}, sum by (model, le) (rate(inferplane_inter_token_latency_seconds_bucket[$__rate_interval])))" for q in (0.5, 0.99)
    ], "{{model}}"),
    ("Tokens per second per generation (p50)", "none", [
        "histogram_quantile(0.5, sum by (model, le) (rate(inferplane_generation_tokens_per_second_bucket[$__rate_interval])))"
    ], "{{model}}"),
    ("Token SLO error ratio (1 h) vs budget", "percentunit", [
        "inferplane:token_slo_errors:ratio_rate1h", "inferplane:token_slo_error_budget"
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
