"""Triton's own numbers into the frontend's /metrics: its statistics API (per model: counts, queue and
compute time) and its Prometheus endpoint (GPU utilization, memory and power where it sees GPUs; CPU
and host memory).

Both are read by the background poll of the process that owns Triton (``server.app``), never on the
request path. Statistics are cumulative in Triton; they are exported as they are
(``inferplane_triton_stat_count`` / ``inferplane_triton_stat_seconds``, for ``rate()``) and as means
since the previous reading (``inferplane_triton_queue_seconds``, ``…_compute_seconds``,
``…_batch_size``).
"""

from __future__ import annotations

from server.dataplane.metrics import Metrics
from prometheus_client.parser import text_string_to_metric_families

_COUNTS = ("inference", "execution", "success", "fail", "cache_hit", "cache_miss")
_PHASES = ("queue", "compute_input", "compute_infer", "compute_output", "success")

# Triton metric name -> (our gauge attribute, scale)
_DEVICE = {
    "nv_gpu_utilization": ("gpu_utilization", 1.0),
    "nv_gpu_memory_used_bytes": ("gpu_memory_used", 1.0),
    "nv_gpu_memory_total_bytes": ("gpu_memory_total", 1.0),
    "nv_gpu_power_usage": ("gpu_power", 1.0),
}
_HOST = {
    "nv_cpu_utilization": "triton_cpu_utilization",
    "nv_cpu_memory_used_bytes": "triton_memory_used",
    "nv_cpu_memory_total_bytes": "triton_memory_total",
}


def readings(stats) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """Per model (summed over its versions): ({kind: count}, {phase: nanoseconds}) from one
    ``ModelStatisticsResponse``."""
    out: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    for model in stats.model_stats:
        counts, ns = out.setdefault(model.name, ({k: 0 for k in _COUNTS}, {p: 0 for p in _PHASES}))
        inference = model.inference_stats
        counts["inference"] += model.inference_count
        counts["execution"] += model.execution_count
        counts["success"] += inference.success.count
        counts["fail"] += inference.fail.count
        counts["cache_hit"] += inference.cache_hit.count
        counts["cache_miss"] += inference.cache_miss.count
        for phase in _PHASES:
            ns[phase] += getattr(inference, phase).ns
    return out


def export_statistics(metrics: Metrics, stats, served: set[str], previous: dict) -> dict:
    """Set the statistics gauges of the models in ``served``; returns this reading (pass it back next time)."""
    now = readings(stats)
    for name, (counts, ns) in now.items():
        if name not in served:
            continue
        for kind, value in counts.items():
            metrics.triton_count.labels(name, kind).set(value)
        for phase, value in ns.items():
            metrics.triton_seconds.labels(name, phase).set(value / 1e9)
        before = previous.get(name)
        if before is None:
            continue
        requests = counts["success"] - before[0]["success"]
        if requests > 0:
            compute = sum(ns[p] - before[1][p] for p in ("compute_input", "compute_infer", "compute_output"))
            metrics.triton_compute_seconds.labels(name).set(compute / requests / 1e9)
        executions = counts["execution"] - before[0]["execution"]
        if executions > 0:
            metrics.triton_batch_size.labels(name).set((counts["inference"] - before[0]["inference"]) / executions)
    return now


def export_devices(metrics: Metrics, text: str) -> dict[str, float]:
    """GPU and host figures from Triton's Prometheus text into our gauges; returns what was found
    (``name{gpu}`` -> value), empty where Triton reports none."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _DEVICE:
                attr, scale = _DEVICE[sample.name]
                gpu = sample.labels.get("gpu_uuid") or sample.labels.get("gpu") or "0"
                getattr(metrics, attr).labels(gpu).set(sample.value * scale)
                found[f"{sample.name}{{{gpu}}}"] = sample.value
            elif sample.name in _HOST:
                getattr(metrics, _HOST[sample.name]).set(sample.value)
                found[sample.name] = sample.value
    return found
