"""Reading a frontend's /metrics text per model (the SLO budgets' counts, right-sizing's readings):
every sample labelled with a model this frontend serves, and that model's request-latency histogram,
summed over the lines of all workers.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from server.dataplane.metrics import UNKNOWN_MODEL_LABEL

LATENCY_BUCKET = "inferplane_request_duration_seconds_bucket"


def per_model(text: str, add: Callable[[str, Sample], None]) -> dict[str, tuple[tuple[float, float], ...]]:
    """``add(model, sample)`` for every sample of ``text`` that names a served model (the latency buckets
    too); returns each model's latency histogram: ``((le, cumulative count), ...)``, by ``le``."""
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            model = s.labels.get("model")
            if model in (None, UNKNOWN_MODEL_LABEL):
                continue
            add(model, s)
            if s.name == LATENCY_BUCKET:
                per, le = buckets.setdefault(model, {}), float(s.labels["le"])
                per[le] = per.get(le, 0.0) + s.value
    return {model: tuple(sorted(per.items())) for model, per in buckets.items()}
