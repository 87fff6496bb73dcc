"""Prometheus metrics of the frontend: requests by model, version and status, latency, in-flight.

Label children are cached per (model, version, code) so the hot path does one dict lookup and
one increment, not a label resolution.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

# Set (by `serve --workers N`, before prometheus_client is imported) when several processes
# write metrics to files in this folder; the parent's /metrics sums them.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
UNKNOWN_MODEL_LABEL = "_unknown"  # every model name a caller sends that is not served here

LATENCY_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, multiprocess: bool = False):
        self.registry = registry or CollectorRegistry()
        self.multiprocess = multiprocess
        self.requests = Counter(
            "inferplane_requests",
            "Inference requests answered, by model, version and status code.",
            ("model", "version", "code"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "inferplane_request_duration_seconds",
            "Time from request arrival to answer in the frontend, by model.",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inflight = Gauge(
            "inferplane_inflight_requests",
            "Inference requests being served now, by model.",
            ("model",),
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.triton_up = Gauge(
            "inferplane_triton_up",
            "1 while the Triton behind this frontend is serving.",
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.triton_restarts = Counter(
            "inferplane_triton_restarts", "Times the embedded Triton was restarted.", registry=self.registry
        )
        self.cache_hits = Gauge(
            "inferplane_response_cache_hits",
            "Triton response-cache hits, by model (read from Triton's statistics).",
            ("model",),
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.cache_misses = Gauge(
            "inferplane_response_cache_misses",
            "Triton response-cache misses, by model (read from Triton's statistics).",
            ("model",),
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.cache_hit_ratio = Gauge(
            "inferplane_response_cache_hit_ratio",
            "Share of cache lookups that hit, by model.",
            ("model",),
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.triton_queue_seconds = Gauge(
            "inferplane_triton_queue_seconds",
            "Mean time a request waited in Triton's queue since the last reading, by model.",
            ("model",),
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.gc_pause = Histogram(
            "inferplane_gc_pause_seconds",
            "Garbage-collector pauses of the frontend process, by generation.",
            ("generation",),
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
            registry=self.registry,
        )
        self.admissions = Counter(
            "inferplane_admissions",
            "Requests past the quota, by model and how the model's fair queue took them: direct (a free "
            "slot), queued (waited for one), refused (queue full), shed (deadline could not be met).",
            ("model", "path"),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "inferplane_queue_depth",
            "Requests waiting in the frontend's fair queue for a model's slot, by model.",
            ("model",),
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self._counted: dict[tuple[str, str, str], object] = {}
        self._admitted: dict[tuple[str, str], object] = {}
        self._per_model: dict[str, tuple[object, object]] = {}

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

    def render(self) -> bytes:
        """This process's metrics, or all processes' summed when running multiprocess."""
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
