"""Prometheus metrics of the frontend: requests by model, version and status, latency, in-flight.

Label children are cached per (model, version, code) so the hot path does one dict lookup and
one increment, not a label resolution. Tenant and team labels are bounded: only the top N by recent
traffic keep their name (``server.dataplane.observe.TopLabels``), the rest share ``other``.
Every name defined here is listed by :func:`exported_names` (the Grafana dashboard and the rules
file are checked against it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

# Set (by `serve --workers N`, before prometheus_client is imported) when several processes
# write metrics to files in this folder; the parent's /metrics sums them.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
UNKNOWN_MODEL_LABEL = "_unknown"  # every model name a caller sends that is not served here
OTHER_LABEL = "other"  # every tenant / team outside the top N

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

LATENCY_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)
# token-level SLIs of a generation (issue 31); the SLO thresholds (TTFT 0.2 / 0.5 s, ITL 0.03 / 0.08 s)
# are bucket bounds, so server.control.monitoring.token_slo counts them exactly
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.2, 0.5, 1.0, 2.0)
TOKENS_PER_SECOND_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, multiprocess: bool = False):
        self.registry = registry or CollectorRegistry()
        self.multiprocess = multiprocess
        self.requests = self._counter(
            "inferplane_requests",
            "Inference requests answered, by model, version and status code.",
            ("model", "version", "code"),
        )
        self.latency = self._histogram(
            "inferplane_request_duration_seconds",
            "Time from request arrival to answer in the frontend, by model.",
            ("model",), LATENCY_BUCKETS,
        )
        self.inflight = self._gauge("inferplane_inflight_requests", "Inference requests being served now, by model.", ("model",), mode="livesum")
        self.triton_up = self._gauge("inferplane_triton_up", "1 while the Triton behind this frontend is serving.")
        self.triton_restarts = self._counter("inferplane_triton_restarts", "Times the embedded Triton was restarted.")
        self.cache_hits = self._gauge(
            "inferplane_response_cache_hits",
            "Triton response-cache hits, by model (read from Triton's statistics).",
            ("model",),
        )
        self.cache_misses = self._gauge(
            "inferplane_response_cache_misses",
            "Triton response-cache misses, by model (read from Triton's statistics).",
            ("model",),
        )
        self.cache_hit_ratio = self._gauge("inferplane_response_cache_hit_ratio", "Share of cache lookups that hit, by model.", ("model",))
        self.triton_queue_seconds = self._gauge(
            "inferplane_triton_queue_seconds",
            "Mean time a request waited in Triton's queue since the last reading, by model.",
            ("model",),
        )
        self.gc_pause = self._histogram(
            "inferplane_gc_pause_seconds",
            "Garbage-collector pauses of the frontend process, by generation.",
            ("generation",),
            (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
        )
        self.admissions = self._counter(
            "inferplane_admissions",
            "Requests past the quota, by model and how the model's fair queue took them: direct (a free "
            "slot), queued (waited for one), refused (queue full), shed (deadline could not be met), "
            "batch (a batch job's row, given a slot real-time traffic left).",
            ("model", "path"),
        )
        self.queue_depth = self._gauge(
            "inferplane_queue_depth",
            "Requests waiting in the frontend's fair queue for a model's slot, by model.",
            ("model",), mode="livesum",
        )
        # ---- issue 19: tenants, batching, Triton's statistics and devices, SLOs, drift, payloads ----
        self.tenant_requests = self._counter(
            "inferplane_tenant_requests",
            "Inference requests answered, by model, version, tenant (top N, the rest 'other') and status code.",
            ("model", "version", "tenant", "code"),
        )
        self.tenant_latency = self._histogram(
            "inferplane_tenant_request_duration_seconds",
            "Time from arrival to answer in the frontend, by model, version and tenant (top N, the rest 'other').",
            ("model", "version", "tenant"), LATENCY_BUCKETS,
        )
        self.generation_stalls = self._counter(
            "inferplane_generation_stalls",
            "Generations cancelled because their engine sent nothing for generation_stall_s, by model.",
            ("model",),
        )
        self.time_to_first_token = self._histogram(
            "inferplane_time_to_first_token_seconds",
            "Generations: from arrival at the frontend to the first generated token, by model, version and tenant (top N).",
            ("model", "version", "tenant"), TTFT_BUCKETS,
        )
        self.inter_token_latency = self._histogram(
            "inferplane_inter_token_latency_seconds",
            "Generations: time between generated tokens (a chunk of n tokens g seconds after the one before: one "
            "observation of g/n), by model, version and tenant (top N).",
            ("model", "version", "tenant"), ITL_BUCKETS,
        )
        self.tokens_per_second = self._histogram(
            "inferplane_generation_tokens_per_second",
            "Generations: completion tokens per second from the first token to the last, one observation per "
            "generation of two tokens or more, by model, version and tenant (top N).",
            ("model", "version", "tenant"), TOKENS_PER_SECOND_BUCKETS,
        )
        self.compute_seconds = self._counter(
            "inferplane_compute_seconds",
            "Backend compute seconds (dispatch to answer; an LLM's engine time) by model and team (top N, "
            "the rest 'other'): what chargeback prices.",
            ("model", "team"),
        )
        self.queue_wait = self._histogram(
            "inferplane_queue_wait_seconds",
            "Time a request waited in the frontend's fair queue for a slot, by model (only requests that waited: "
            "the rest are inferplane_admissions_total{path=\"direct\"}).",
            ("model",), LATENCY_BUCKETS,
        )
        self.batch_rows = self._histogram(
            "inferplane_batch_rows",
            "Rows per Triton call the frontend made, by model (coalesced calls carry many requests' rows).",
            ("model",), BATCH_BUCKETS,
        )
        self.batch_requests = self._histogram(
            "inferplane_batch_requests",
            "Caller requests per Triton call, by model (1 without coalescing).",
            ("model",), BATCH_BUCKETS,
        )
        self.triton_count = self._gauge(
            "inferplane_triton_stat_count",
            "Triton's cumulative counts from its statistics API, by model and kind: inference (rows), "
            "execution (batches run), success, fail, cache_hit, cache_miss.",
            ("model", "kind"),
        )
        self.triton_seconds = self._gauge(
            "inferplane_triton_stat_seconds",
            "Triton's cumulative time from its statistics API, by model and phase: queue, compute_input, "
            "compute_infer, compute_output, success.",
            ("model", "phase"),
        )
        self.triton_compute_seconds = self._gauge(
            "inferplane_triton_compute_seconds",
            "Mean compute time (input + infer + output) of a Triton request since the last reading, by model.",
            ("model",),
        )
        self.triton_batch_size = self._gauge(
            "inferplane_triton_batch_size",
            "Mean rows per Triton execution since the last reading, by model (Triton's own batcher included).",
            ("model",),
        )
        self.gpu_utilization = self._gauge(
            "inferplane_gpu_utilization",
            "GPU utilization (0-1) Triton reports, by GPU (absent where Triton sees no GPU).",
            ("gpu",),
        )
        self.gpu_memory_used = self._gauge("inferplane_gpu_memory_used_bytes", "GPU memory in use, by GPU (Triton's report).", ("gpu",))
        self.gpu_memory_total = self._gauge("inferplane_gpu_memory_total_bytes", "GPU memory, by GPU (Triton's report).", ("gpu",))
        self.gpu_power = self._gauge("inferplane_gpu_power_watts", "GPU power draw, by GPU (Triton's report).", ("gpu",))
        self.triton_cpu_utilization = self._gauge(
            "inferplane_triton_cpu_utilization",
            "CPU utilization (0-1) of Triton's host, as Triton reports it.",
        )
        self.triton_memory_used = self._gauge("inferplane_triton_memory_used_bytes", "Host memory in use, as Triton reports it.")
        self.triton_memory_total = self._gauge("inferplane_triton_memory_total_bytes", "Host memory, as Triton reports it.")
        self.slo_objective = self._gauge(
            "inferplane_slo_objective",
            "The endpoint's objective: share of good requests (availability: not a server error; latency: "
            "answered within the threshold), by model and slo.",
            ("model", "slo"),
        )
        self.slo_latency_threshold = self._gauge(
            "inferplane_slo_latency_threshold_seconds",
            "The endpoint's latency SLO threshold, by model.",
            ("model",),
        )
        self.slo_good_ratio = self._gauge(
            "inferplane_slo_good_ratio",
            "Share of good requests over the SLO window (what the frontend counted since it started, at most the window), by model and slo.",
            ("model", "slo"),
        )
        self.slo_budget_remaining = self._gauge(
            "inferplane_slo_error_budget_remaining",
            "Share of the error budget left over the SLO window (1: untouched, 0: spent, below 0: overspent), by model and slo.",
            ("model", "slo"),
        )
        self.drift_psi = self._gauge(
            "inferplane_drift_psi",
            "Population stability index of a feature's live distribution against the validation set, by model and feature.",
            ("model", "feature"),
        )
        self.drift_ks = self._gauge(
            "inferplane_drift_ks",
            "Kolmogorov-Smirnov statistic of a feature's live distribution against the validation set, by model and feature.",
            ("model", "feature"),
        )
        self.drift_rows = self._gauge("inferplane_drift_live_rows", "Live rows in the drift window, by model.", ("model",))
        self.drift_sampled = self._counter("inferplane_drift_sampled", "Requests copied into the drift ring, by model.", ("model",))
        self.payload_logged = self._counter("inferplane_payload_logged", "Payload records written, by model.", ("model",))
        self.payload_dropped = self._counter(
            "inferplane_payload_dropped",
            "Sampled payload records dropped (the writer's queue was full, or the write failed), by model.",
            ("model",),
        )
        self.traces_sampled = self._counter("inferplane_traces_sampled", "Requests traced (spans exported), by kind.", ("kind",))
        self._counted: dict[tuple[str, str, str], object] = {}
        self._admitted: dict[tuple[str, str], object] = {}
        self._per_model: dict[str, tuple[object, object]] = {}
        self._waited: dict[str, object] = {}

    # ---- declaring a metric: each one registers in this registry ----

    def _counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def _gauge(self, name: str, documentation: str, labels: tuple[str, ...] = (), *, mode: str = "max") -> Gauge:
        """A gauge; ``mode`` is what /metrics shows of it under ``--workers N``: the workers' max (a reading
        every process takes alike) or ``livesum`` (what each live process holds, added up)."""
        return Gauge(name, documentation, labels, registry=self.registry, multiprocess_mode=mode)

    def _histogram(self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def model(self, model: str):
        """(latency child, inflight child) for a model, cached."""
        pair = self._per_model.get(model)
        if pair is None:
            pair = self._per_model[model] = (self.latency.labels(model), self.inflight.labels(model))
        return pair

    def count(self, model: str, version: str, code: str) -> None:
        key = (model, version, code)
        child = self._counted.get(key)
        if child is None:
            child = self._counted[key] = self.requests.labels(model, version, code)
        child.inc()

    def admitted(self, model: str, path: str) -> None:
        key = (model, path)
        child = self._admitted.get(key)
        if child is None:
            child = self._admitted[key] = self.admissions.labels(model, path)
        child.inc()

    def waited(self, model: str, seconds: float) -> None:
        """A request waited ``seconds`` in the model's fair queue (the slow path only)."""
        child = self._waited.get(model)
        if child is None:
            child = self._waited[model] = self.queue_wait.labels(model)
        child.observe(seconds)

    def names(self) -> list[str]:
        """Every metric name this registry exports (histograms with their _bucket/_sum/_count, counters with _total)."""
        return exported_names(self.registry)

    def render(self) -> bytes:
        """This process's metrics, or all processes' summed when running multiprocess."""
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


def exported_names(registry: CollectorRegistry) -> list[str]:
    """The sample names a registry's metrics appear under on /metrics."""
    names: set[str] = set()
    for collector in list(registry._collector_to_names):  # noqa: SLF001 - the registry's own index
        for family in collector.describe() if hasattr(collector, "describe") else collector.collect():
            if family.type == "histogram":
                names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
            elif family.type == "counter":
                names.update((f"{family.name}_total", f"{family.name}_created"))
            else:
                names.add(family.name)
    return sorted(names)
