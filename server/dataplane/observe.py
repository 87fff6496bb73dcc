"""What the pipeline reports about each request beyond its counters: tenant-level metrics with bounded
labels, batch sizes per Triton call, trace spans, and the sampled copies the background monitors read.

One :class:`Observer` per data plane, built once (``server.dataplane.builder``). The pipeline calls
:meth:`Observer.exit` once per request (after its own counters) and the coalescer calls
:meth:`Observer.on_batch` once per Triton call. Both do a few dict lookups and increments on
pre-bound metric children; anything heavier happens elsewhere:

- **drift** (``server.control.monitoring.drift``): a sampled fraction of answered requests of watched models goes,
  undecoded (the parsed request and the answer's bytes), into a bounded ring; the monitor decodes and
  computes in the background. A full ring overwrites its oldest entry.
- **payload logging** (``server.control.monitoring.payload_log``): endpoints that opt in (``inferplane.payload_log_sample``
  in their config) have a sampled fraction of requests queued, undecoded, for the writer; a full queue
  drops the record and counts it (``inferplane_payload_dropped_total``).

Tenant and team labels: the top N by recent traffic keep their name, every other one is ``other``
(:class:`TopLabels`), so a platform with thousands of tenants still exports a bounded set of series.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable

from server.dataplane.metrics import OTHER_LABEL, UNKNOWN_MODEL_LABEL, Metrics

log = logging.getLogger(__name__)

UNAUTHENTICATED = "_unauthenticated"
PAYLOAD_SAMPLE = "inferplane.payload_log_sample"


class TopLabels:
    """Label values for an unbounded set of names: the top ``top_n`` by recent count, others ``other``.

    While fewer than ``top_n`` names hold a label, a new name gets one at once; every ``refresh_s``
    the set becomes the ``top_n`` names with the highest counts (counts halve at each refresh, so
    "recent" has a half-life of one period) and ``on_drop`` hears which names lost theirs.
    """

    def __init__(self, top_n: int, refresh_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic, on_drop=None):
        self.top_n = top_n
        self.refresh_s = refresh_s
        self._clock = clock
        self._labels: dict[str, str] = {}
        self._counts: dict[str, float] = {}
        self._next = clock() + refresh_s
        self._n = 0
        self.on_drop = on_drop

    def label(self, name: str) -> str:
        counts = self._counts
        counts[name] = counts.get(name, 0.0) + 1.0
        self._n += 1
        if self._n >= 256:
            self._n = 0
            if self._clock() >= self._next:
                self.refresh()
        label = self._labels.get(name)
        if label is not None:
            return label
        if len(self._labels) < self.top_n:
            self._labels[name] = name
            return name
        return OTHER_LABEL

    def refresh(self) -> set[str]:
        """Recompute the top set now; returns the names that lost their label."""
        self._next = self._clock() + self.refresh_s
        ranked = sorted(self._counts.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top_n]
        labels = {name: name for name, _ in ranked}
        dropped = set(self._labels) - set(labels)
        self._labels = labels
        self._counts = {k: v / 2 for k, v in self._counts.items() if v >= 1.0}
        if dropped and self.on_drop is not None:
            self.on_drop(dropped)
        return dropped

    @property
    def labelled(self) -> list[str]:
        return sorted(self._labels)


class SampleRing:
    """A bounded buffer of sampled items: ``put`` never blocks; ``overwrite`` rings drop the oldest,
    the others refuse the newest (``put`` returns False)."""

    def __init__(self, capacity: int, *, overwrite: bool = True):
        self.capacity = capacity
        self.overwrite = overwrite
        self._items: deque = deque(maxlen=capacity if overwrite else None)
        self.offered = self.dropped = 0

    def put(self, item) -> bool:
        self.offered += 1
        if not self.overwrite and len(self._items) >= self.capacity:
            self.dropped += 1
            return False
        if self.overwrite and len(self._items) >= self.capacity:
            self.dropped += 1
        self._items.append(item)
        return True

    def drain(self) -> list:
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)


class Sample:
    """One sampled request, undecoded: what the drift monitor and the payload writer read."""

    __slots__ = ("at", "model", "version", "tenant", "team", "key_id", "kind", "code", "request", "answer", "headers", "latency_s")

    def __init__(self, call, latency_s: float):
        principal = call.principal
        self.at = time.time()
        self.model, self.version, self.kind, self.code = call.name, call.version, call.kind, call.code
        self.tenant = principal.tenant.name if principal is not None else ""
        self.team = principal.tenant.team if principal is not None else ""
        self.key_id = principal.key_id if principal is not None else ""
        self.request = call.request  # a ModelInferRequest (raw tensor bytes inside), or None
        self.answer = call.answer  # the answer's bytes, or None
        self.headers = getattr(call.ctx, "headers", None) if call.ctx is not None else None
        self.latency_s = latency_s


class TokenClock:
    """One generation's token timings (issue 31): time to the first token from the call's arrival,
    the gap per token between chunks after it, and at the end the tokens per second from the first
    token to the last. ``tokens(count, now)`` takes the engine's running completion-token count."""

    __slots__ = ("_ttft", "_itl", "_tps", "_started", "_first", "_first_count", "_last", "_count")

    def __init__(self, children: tuple, started: float):
        self._ttft, self._itl, self._tps = children
        self._started = started
        self._first = self._last = None
        self._first_count = self._count = 0

    def tokens(self, count: int, now: float) -> None:
        if count <= self._count:
            return
        if self._first is None:
            self._first, self._first_count = now, count
            self._ttft.observe(max(0.0, now - self._started))
        else:
            self._itl.observe(max(0.0, now - self._last) / (count - self._count))
        self._last, self._count = now, count

    def finish(self) -> None:
        if self._first is not None and self._count > self._first_count and self._last > self._first:
            self._tps.observe((self._count - self._first_count) / (self._last - self._first))


class _NoClock:
    """A generation's token clock where nothing observes (a pipeline without an Observer)."""

    def tokens(self, count: int, now: float) -> None:
        return None

    def finish(self) -> None:
        return None


NO_CLOCK = _NoClock()


def token_clock(observer, call) -> TokenClock | _NoClock:
    return observer.token_clock(call) if observer is not None else NO_CLOCK


class Observer:
    def __init__(
        self,
        metrics: Metrics,
        *,
        top_n: int = 10,
        refresh_s: float = 60.0,
        tracing=None,  # server.dataplane.tracing.Tracing, or None: no traces
        replica: str = "",
        drift_ratio: float = 0.0,
        drift_buffer: int = 1024,
        payload_buffer: int = 1024,
        rand: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.metrics = metrics
        self.tracing = tracing
        self.replica = replica
        self.tenants = TopLabels(top_n, refresh_s, clock=clock, on_drop=self._tenants_dropped)
        self.teams = TopLabels(top_n, refresh_s, clock=clock, on_drop=self._teams_dropped)
        self.drift_ratio = drift_ratio
        self.drift_models: set[str] = set()  # filled by the drift monitor: models with a reference
        self.drift = SampleRing(drift_buffer, overwrite=True)
        self.payloads = SampleRing(payload_buffer, overwrite=False)
        self._random = rand
        self._counted: dict[tuple, object] = {}
        self._latency: dict[tuple, object] = {}
        self._compute: dict[tuple, object] = {}
        self._tokens: dict[tuple, tuple] = {}  # (model, version, tenant) -> the token histograms' children
        self._batches: dict[str, tuple] = {}
        self._payload_rates: dict[str, tuple] = {}  # model -> (signature it was read from, rate)

    # ---- per generation: token-level SLIs ------------------------------------------------------

    def token_clock(self, call) -> TokenClock:
        principal = call.principal
        tenant = self.tenants.label(principal.tenant.name) if principal is not None else UNAUTHENTICATED
        key = (call.label, call.version, tenant)
        children = self._tokens.get(key)
        if children is None:
            m = self.metrics
            children = self._tokens[key] = (
                m.time_to_first_token.labels(*key), m.inter_token_latency.labels(*key), m.tokens_per_second.labels(*key),
            )  # fmt: skip
        return TokenClock(children, call.started)

    # ---- per request (Pipeline.exit) --------------------------------------------------------

    def exit(self, call, err: BaseException | None, now: float) -> None:
        resolved = call.label != UNKNOWN_MODEL_LABEL
        version = call.version if resolved else ""
        principal = call.principal
        tenant = self.tenants.label(principal.tenant.name) if principal is not None else UNAUTHENTICATED
        key = (call.label, version, tenant, call.code)
        child = self._counted.get(key)
        if child is None:
            child = self._counted[key] = self.metrics.tenant_requests.labels(*key)
        child.inc()
        latency_s = now - call.started
        if call.inflight is not None:  # it got past resolve: its latency counts
            key = (call.label, version, tenant)
            child = self._latency.get(key)
            if child is None:
                child = self._latency[key] = self.metrics.tenant_latency.labels(*key)
            child.observe(latency_s)
        if call.computed and principal is not None:
            compute_s = call.compute_s if call.compute_s is not None else now - call.dispatched_at
            key = (call.label, self.teams.label(principal.tenant.team or principal.tenant.name))
            child = self._compute.get(key)
            if child is None:
                child = self._compute[key] = self.metrics.compute_seconds.labels(*key)
            child.inc(max(0.0, compute_s))
        trace = call.trace
        if trace is not None:
            trace.finish(call, err, self.replica)
        if resolved and call.request is not None:
            self._sample(call, latency_s)

    def _sample(self, call, latency_s: float) -> None:
        rate = self._payload_rate(call)
        if not rate and not (self.drift_ratio and call.name in self.drift_models):
            return
        draw = self._random()
        sample = None
        if draw < self.drift_ratio and call.answer is not None and call.name in self.drift_models:
            sample = Sample(call, latency_s)
            self.drift.put(sample)
            self.metrics.drift_sampled.labels(call.name).inc()
        if rate and self._random() < rate:
            if not self.payloads.put(sample or Sample(call, latency_s)):
                self.metrics.payload_dropped.labels(call.name).inc()

    def _payload_rate(self, call) -> float:
        signature = call.signature
        entry = self._payload_rates.get(call.name)
        if entry is None or entry[0] is not signature:
            rate = 0.0
            if signature is not None:
                try:
                    rate = min(1.0, max(0.0, float(signature.params.get(PAYLOAD_SAMPLE, "0") or 0)))
                except ValueError:
                    rate = 0.0
            entry = self._payload_rates[call.name] = (signature, rate)
        return entry[1]

    # ---- per Triton call (the coalescer's on_call) ----------------------------------------------

    def on_batch(self, requests: list, rows: int):
        try:
            return self._on_batch(requests, rows)
        except Exception:  # observing must never fail a call
            log.exception("observing a Triton call failed")
            return None

    def _on_batch(self, requests: list, rows: int):
        model = requests[0].model_name
        pair = self._batches.get(model)
        if pair is None:
            pair = self._batches[model] = (self.metrics.batch_rows.labels(model), self.metrics.batch_requests.labels(model))
        pair[0].observe(rows)
        pair[1].observe(len(requests))
        tracing = self.tracing
        if tracing is not None and tracing.pending:
            return tracing.on_batch(requests, rows, self.replica)
        return None

    # ---- label housekeeping ---------------------------------------------------------------------

    def _tenants_dropped(self, names: set[str]) -> None:
        for cache, metric, index in ((self._counted, self.metrics.tenant_requests, 2), (self._latency, self.metrics.tenant_latency, 2)):
            for key in [k for k in cache if k[index] in names]:
                del cache[key]
                _remove(metric, key, self.metrics.multiprocess)
        m = self.metrics
        for key in [k for k in self._tokens if k[2] in names]:
            del self._tokens[key]
            for metric in (m.time_to_first_token, m.inter_token_latency, m.tokens_per_second):
                _remove(metric, key, m.multiprocess)

    def _teams_dropped(self, names: set[str]) -> None:
        for key in [k for k in self._compute if k[1] in names]:
            del self._compute[key]
            _remove(self.metrics.compute_seconds, key, self.metrics.multiprocess)


def _remove(metric, key: tuple, multiprocess: bool) -> None:
    """Drop a series whose tenant left the top N (in multiprocess mode the file's last value stays)."""
    if multiprocess:
        return
    try:
        metric.remove(*key)
    except KeyError:
        pass
