"""Load signals per model, sampled every second: a short in-memory series and gauges on /metrics.

Per model: requests **in flight** (past the fair queue's gate: in the coalescer or at a replica),
the frontend **queue** (waiting in the fair queue, plus requests held for a replica or for a
scaled-to-zero model to load) and its estimated **wait** (queue x service time / slots), **QPS**
(requests admitted per second), **tokens/s** (LLM prompt + completion tokens metered per second),
Triton's own **queue** and **compute** time per request (its statistics API, read from every
replica every ``stats_every`` samples), and the replicas serving it. The autoscaler reads the
series; the gauges are what KEDA and dashboards read:

* ``inferplane_autoscale_signal{model,signal}`` — the latest sample;
* ``inferplane_group_queue_depth{model_group}`` / ``inferplane_group_inflight_requests{model_group}``
  — the same summed over a model group's models (the KEDA ScaledObjects' query);
* ``inferplane_replica_up{replica}``, ``inferplane_replica_outstanding{replica}`` — each member.

All gauges sum over frontend worker processes (``livesum``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client import Gauge

from server.dataplane.replicas import UP, ReplicaSet
from server.errors import InferplaneError
from server.protogen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_GROUP = "local"


@dataclass
class Sample:
    t: float
    inflight: float = 0.0
    queue: float = 0.0
    wait_ms: float = 0.0
    qps: float = 0.0
    tokens_per_s: float = 0.0
    triton_queue_ms: float | None = None
    triton_compute_ms: float | None = None
    replicas: int = 0

    def signal(self, name: str) -> float:
        if name == "inflight":  # everything the endpoint holds: in flight and waiting for it
            return self.inflight + self.queue
        if name == "queue":
            return self.queue
        if name == "triton_queue_ms":
            return self.triton_queue_ms or 0.0
        return float(getattr(self, name))

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class SignalSampler:
    def __init__(
        self,
        hooks,  # server.dataplane.fleet_hooks.FleetHooks
        replicas: ReplicaSet | None,
        *,
        registry=None,  # prometheus CollectorRegistry (the frontend's Metrics.registry)
        group_of: Callable[[str], str | None] = lambda model: DEFAULT_GROUP,
        clock: Callable[[], float] = time.monotonic,
        history: int = 600,
        stats_every: int = 5,
    ):
        self.hooks = hooks
        self.replicas = replicas
        self.group_of = group_of
        self._clock = clock
        self.history = history
        self.stats_every = stats_every
        self.series: dict[str, deque[Sample]] = {}
        self._last: dict[str, tuple[float, int, int]] = {}  # model -> (t, admitted, tokens)
        self._triton: dict[tuple[str, str], tuple[int, int, int]] = {}  # (member, model) -> (count, queue ns, compute ns)
        self._triton_means: dict[str, tuple[float | None, float | None]] = {}
        self._rounds = 0
        self._groups_seen: set[str] = set()
        self._replicas_seen: set[str] = set()
        kw = {"registry": registry}
        self.signal_gauge = Gauge("inferplane_autoscale_signal", "The autoscaler's latest load sample per model and signal.", ("model", "signal"), multiprocess_mode="livesum", **kw)
        self.group_queue = Gauge(
            "inferplane_group_queue_depth",
            "Requests waiting in the frontends for a model group: in its models' fair queues, or held for a replica / a scaled-to-zero load.",
            ("model_group",), multiprocess_mode="livesum", **kw,
        )  # fmt: skip
        self.group_inflight = Gauge(
            "inferplane_group_inflight_requests",
            "Requests admitted to a model group's models and not yet answered (in the coalescer or at a replica).",
            ("model_group",), multiprocess_mode="livesum", **kw,
        )  # fmt: skip
        self.replica_up = Gauge("inferplane_replica_up", "1 while a Triton replica takes traffic.", ("replica",), multiprocess_mode="max", **kw)
        self.replica_outstanding = Gauge("inferplane_replica_outstanding", "Calls in flight to a Triton replica.", ("replica",), multiprocess_mode="livesum", **kw)

    def latest(self, model: str) -> Sample | None:
        series = self.series.get(model)
        return series[-1] if series else None

    def held(self, model: str) -> int:
        waker = self.hooks.wakers.get(model)
        held = getattr(waker, "waiting", 0) if waker is not None else 0
        if self.replicas is not None:
            held += self.replicas.waiting.get(model, 0)
        return held

    def models(self) -> list[str]:
        return sorted(set(self.hooks.queues) | set(self.hooks.wakers) | set(self.series))

    async def sample(self) -> dict[str, Sample]:
        now = self._clock()
        self._rounds += 1
        if self.replicas is not None and (self._rounds - 1) % self.stats_every == 0:
            await self._read_triton()
        samples: dict[str, Sample] = {}
        groups_queue: dict[str, float] = {}
        groups_inflight: dict[str, float] = {}
        for model in self.models():
            queue = self.hooks.queues.get(model)
            inflight = float(queue.inflight) if queue is not None else 0.0
            waiting = float(queue.size) if queue is not None else 0.0
            held = float(self.held(model))
            admitted = queue.admitted if queue is not None else 0
            tokens = self.hooks.usage.tokens.get(model, 0)
            last = self._last.get(model)
            qps = tokens_per_s = 0.0
            if last is not None and now > last[0]:
                span = now - last[0]
                qps = max(0.0, (admitted - last[1]) / span) if admitted >= last[1] else 0.0
                tokens_per_s = max(0.0, (tokens - last[2]) / span)
            self._last[model] = (now, admitted, tokens)
            wait_ms = 0.0
            if queue is not None and queue.service_s and waiting:
                wait_ms = waiting * queue.service_s / max(1, queue.policy.slots) * 1000.0
            tq, tc = self._triton_means.get(model, (None, None))
            serving = self.replicas.hosting_count(model) if self.replicas is not None else 1
            s = Sample(now, inflight, waiting + held, wait_ms, qps, tokens_per_s, tq, tc, serving)
            samples[model] = s
            series = self.series.get(model)
            if series is None:
                series = self.series[model] = deque(maxlen=self.history)
            series.append(s)
            for name in ("inflight", "queue", "qps", "tokens_per_s"):
                self.signal_gauge.labels(model, name).set(getattr(s, name))
            self.signal_gauge.labels(model, "wait_ms").set(wait_ms)
            if tq is not None:
                self.signal_gauge.labels(model, "triton_queue_ms").set(tq)
                self.signal_gauge.labels(model, "triton_compute_ms").set(tc or 0.0)
            group = self.group_of(model) or DEFAULT_GROUP
            groups_queue[group] = groups_queue.get(group, 0.0) + s.queue
            groups_inflight[group] = groups_inflight.get(group, 0.0) + inflight
        for group in set(groups_queue) | self._groups_seen:
            self.group_queue.labels(group).set(groups_queue.get(group, 0.0))
            self.group_inflight.labels(group).set(groups_inflight.get(group, 0.0))
        self._groups_seen |= set(groups_queue)
        self._export_replicas()
        return samples

    def _export_replicas(self) -> None:
        if self.replicas is None:
            return
        now = self._clock()
        present = set()
        for member in self.replicas.members():
            present.add(member.id)
            self.replica_up.labels(member.id).set(1 if member.state == UP and now >= member.ejected_until else 0)
            self.replica_outstanding.labels(member.id).set(member.outstanding)
        for gone in self._replicas_seen - present:  # departed pods: drop their series
            for gauge in (self.replica_up, self.replica_outstanding):
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
        self._replicas_seen = present

    async def _read_triton(self) -> None:
        """Mean Triton queue and compute time per request since the last reading, over every replica."""
        totals: dict[str, list[int]] = {}
        ask = pb.ModelStatisticsRequest().SerializeToString()
        for member in self.replicas.members():
            if member.state != UP:
                continue
            try:
                raw = await member.client.unary_raw("ModelStatistics", ask, timeout=2.0)
            except InferplaneError:
                continue
            per_model: dict[str, list[int]] = {}
            for stats in pb.ModelStatisticsResponse.FromString(raw).model_stats:
                acc = per_model.setdefault(stats.name, [0, 0, 0])
                acc[0] += stats.inference_stats.success.count
                acc[1] += stats.inference_stats.queue.ns
                acc[2] += stats.inference_stats.compute_infer.ns
            for model, (count, queue_ns, compute_ns) in per_model.items():
                before = self._triton.get((member.id, model), (0, 0, 0))
                self._triton[(member.id, model)] = (count, queue_ns, compute_ns)
                if count >= before[0]:
                    acc = totals.setdefault(model, [0, 0, 0])
                    acc[0] += count - before[0]
                    acc[1] += queue_ns - before[1]
                    acc[2] += compute_ns - before[2]
        for model, (count, queue_ns, compute_ns) in totals.items():
            if count > 0:
                self._triton_means[model] = (queue_ns / count / 1e6, compute_ns / count / 1e6)

    def forget(self, model: str) -> None:
        self.series.pop(model, None)
        self._last.pop(model, None)
