"""Per-endpoint live traffic state: the router the data plane asks, per-arm windows, shadow queues.

The data plane makes one call before a request (:meth:`Router.choose`: the version and arm that
answer it) and one after (:meth:`Router.observe`: per-arm metrics, feedback ids, shadow copy).
An endpoint without a policy costs one dict lookup; with a split it adds one hash (keyed) or a
few additions (smooth round robin). Policy changes replace a whole :class:`Split` in one
assignment on the event loop (the controller, ``server.control.rollout.traffic``, builds them).

Shadow copies go through a bounded queue drained by a few worker tasks that call Triton
directly (no admission slot, no circuit breaker of the primary path); the primary never awaits
them, and a full queue drops the copy and counts it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.dataplane import codecs
from server.dataplane.capacity_policy import SHADOW, TRAFFIC, ShadowPaused
from server.errors import InvalidRequest, ModelNotFound
from server.dataplane.traffic_policy import VERSION_ERROR_CODES, Arm, SmoothWeighted, WindowStats, check_arms, percentile, sticky_arm
from server.dataplane.wire import pin_version
from server.periodic import stop_tasks
from server.protogen.inference import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# on every answer: which version (and arm: stable / canary / an A/B arm; empty without a split) answered
VERSION_HEADER, ARM_HEADER = "x-inferplane-version", "x-inferplane-arm"
MAX_FEEDBACK_IDS = 100_000  # request id -> arm, per split (oldest forgotten first)
MAX_LATENCY_SAMPLES = 20_000  # per arm, reservoir
MAX_OUTCOMES = 200_000  # per arm


def header(ctx, name: str) -> str | None:
    """One header of the call: aiohttp's (case-insensitive mapping) or gRPC metadata (pairs, lower-case)."""
    headers = getattr(ctx, "headers", None)
    if headers is None:
        return None
    get = getattr(headers, "get", None)
    if get is not None:
        return get(name)
    for key, value in headers:
        if key == name:
            return value if isinstance(value, str) else None
    return None


class UnknownRequest(ModelNotFound):
    """A feedback's request id is not (yet) known to the split: the leader waits for the reports that may bring it."""


# ---- metrics ---------------------------------------------------------------------------------


class SlidingWindow:
    """Requests, errors and latencies of the last ``window_s`` seconds in time buckets."""

    def __init__(self, window_s: float, buckets: int = 20, per_bucket: int = 500, clock: Callable[[], float] = time.monotonic):
        self.window_s = float(window_s)
        self.width = self.window_s / buckets
        self.per_bucket = per_bucket
        self.clock = clock
        self._buckets: deque[list] = deque()  # [index, requests, errors, latencies]

    def add(self, latency_s: float, error: bool) -> None:
        index = int(self.clock() / self.width)
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append([index, 0, 0, []])
            oldest = index - int(math.ceil(self.window_s / self.width))
            while self._buckets and self._buckets[0][0] < oldest:
                self._buckets.popleft()
        bucket = self._buckets[-1]
        bucket[1] += 1
        bucket[2] += error
        samples = bucket[3]
        if len(samples) < self.per_bucket:
            samples.append(latency_s)
        else:  # reservoir: every request of the bucket equally likely to be kept
            j = random.randrange(bucket[1])
            if j < self.per_bucket:
                samples[j] = latency_s

    def stats(self) -> WindowStats:
        oldest = int(self.clock() / self.width) - int(math.ceil(self.window_s / self.width)) + 1
        requests = errors = 0
        latencies: list[float] = []
        for index, n, e, samples in self._buckets:
            if index >= oldest:
                requests += n
                errors += e
                latencies.extend(samples)
        mean = sum(latencies) / len(latencies) if latencies else 0.0
        return WindowStats(requests, errors, percentile(latencies, 99.0), mean)

    def clear(self) -> None:
        self._buckets.clear()


@dataclass
class ArmTotals:
    """Everything an arm answered since the split started (the A/B report's figures)."""

    requests: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    outcomes: list[float] = field(default_factory=list)

    def add(self, latency_s: float, error: bool) -> None:
        self.requests += 1
        self.errors += error
        self.latency_sum_s += latency_s
        if len(self.latencies) < MAX_LATENCY_SAMPLES:
            self.latencies.append(latency_s)
        else:
            j = random.randrange(self.requests)
            if j < MAX_LATENCY_SAMPLES:
                self.latencies[j] = latency_s


# ---- splits ----------------------------------------------------------------------------------


@dataclass
class Split:
    """How one endpoint's traffic is divided now (canary, blue-green, A/B)."""

    kind: str  # canary | bluegreen | ab
    arms: list[Arm]
    key_header: str = ""  # sticky on this header's value when the call carries it
    salt: str = ""  # the experiment's name: the same key lands differently in different experiments
    window_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    rr: SmoothWeighted = field(init=False)
    windows: dict[str, SlidingWindow] = field(init=False)
    totals: dict[str, ArmTotals] = field(init=False)
    request_arms: OrderedDict = field(init=False)  # request id -> arm name (for feedback)
    # (request id, arm) observed since the ArmReporter last drained it (a process that does not lead: the leader,
    # which answers the Feedback, learns the ids from its reports); bounded like request_arms
    unreported: deque = field(init=False)

    def __post_init__(self) -> None:
        check_arms(self.arms)
        self.rr = SmoothWeighted(self.arms)
        self.windows = {a.name: SlidingWindow(self.window_s, clock=self.clock) for a in self.arms}
        self.totals = {a.name: ArmTotals() for a in self.arms}
        self.request_arms = OrderedDict()
        self.unreported = deque(maxlen=MAX_FEEDBACK_IDS)

    def remember(self, request_id: str, arm: str) -> None:
        """``request_id`` was answered by ``arm`` (its outcome may follow); the oldest id is forgotten past the bound."""
        ids = self.request_arms
        ids[request_id] = arm
        if len(ids) > MAX_FEEDBACK_IDS:
            ids.popitem(last=False)

    def drain_unreported(self) -> dict[str, list[str]]:
        """The ids observed since the last call, per arm, in the order they were answered (then forgotten here)."""
        drained = list(self.unreported)  # in place: a reweighted copy of this split shares the deque
        self.unreported.clear()
        per_arm: dict[str, list[str]] = {}
        for request_id, arm in drained:
            per_arm.setdefault(arm, []).append(request_id)
        return per_arm

    def reweighted(self, weights: dict[str, float]) -> Split:
        """The same split (metrics kept) with new weights: a new round robin, the same hashing."""
        arms = [Arm(a.name, a.version, float(weights.get(a.name, a.weight))) for a in self.arms]
        check_arms(arms)
        other = Split.__new__(Split)
        other.__dict__.update(self.__dict__)
        other.arms = arms
        other.rr = SmoothWeighted(arms)
        return other

    def pick(self, ctx) -> Arm:
        if self.key_header:
            key = header(ctx, self.key_header)
            if key:
                return sticky_arm(key, self.arms, self.salt)
        return self.rr.next()

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)

    def window(self, name: str) -> WindowStats:
        w = self.windows.get(name)
        return w.stats() if w is not None else WindowStats()


# ---- shadow ----------------------------------------------------------------------------------


@dataclass
class ShadowStats:
    sent: int = 0  # copies queued
    dropped: int = 0  # queue full
    errors: int = 0  # the shadow version failed (or could not be reached)
    paused: int = 0  # not sent: the model's spot replicas were away (server.dataplane.capacity_policy)
    compared: int = 0  # both answered
    agreed: int = 0  # every output equal within tolerance
    abs_diff_sum: float = 0.0
    abs_diff_count: int = 0
    latency_deltas: list[float] = field(default_factory=list)  # shadow - primary, seconds
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        deltas = self.latency_deltas
        return {
            "sent": self.sent, "dropped": self.dropped, "errors": self.errors, "paused": self.paused, "compared": self.compared,
            "agreement": self.agreed / self.compared if self.compared else 0.0,
            "mean_abs_diff": self.abs_diff_sum / self.abs_diff_count if self.abs_diff_count else 0.0,
            "latency_delta_mean_ms": (sum(deltas) / len(deltas) * 1000.0) if deltas else 0.0,
            "latency_delta_p50_ms": percentile(deltas, 50.0) * 1000.0,
            "latency_delta_p99_ms": percentile(deltas, 99.0) * 1000.0,
            "last_error": self.last_error,
        }  # fmt: skip


@dataclass
class Shadow:
    version: str
    percent: float = 100.0
    queue_size: int = 256
    rtol: float = 1e-3
    atol: float = 1e-5
    stats: ShadowStats = field(default_factory=ShadowStats)
    # which shadow this is (the traffic policy's id): the desired state carries it to every serving process,
    # and their comparison reports are summed by it (server.control.rollout.shadow_reports)
    key: str = ""
    # shadow records (server.control.rollout.shadow_records): called with each copy whose answers disagreed
    record: Callable[[dict], None] | None = None
    queue: asyncio.Queue = field(init=False)
    tasks: list[asyncio.Task] = field(default_factory=list)
    _credit: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.percent <= 100):
            raise InvalidRequest(f"shadow percent must be in (0, 100], got {self.percent}")
        self.queue = asyncio.Queue(maxsize=self.queue_size)

    def offer(self, raw: bytes, answer: bytes, latency_s: float, tenant: str = "") -> None:
        """Queue a copy (sampled by ``percent``, evenly); never blocks, drops when full."""
        self._credit += self.percent
        if self._credit < 100.0:
            return
        self._credit -= 100.0
        try:
            self.queue.put_nowait((raw, answer, latency_s, tenant))
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return
        self.stats.sent += 1

    def start(self, send: Callable, workers: int = 2, timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._work(send, timeout_s), name=f"shadow-{self.version}-{i}") for i in range(workers)]

    async def stop(self) -> None:
        await stop_tasks(self.tasks)
        self.tasks = []

    async def _work(self, send: Callable, timeout_s: float) -> None:

        TRAFFIC.set(SHADOW)  # this task's calls are shadow copies: spot replicas first, paused while they are away
        while True:
            raw, answer, primary_s, tenant = await self.queue.get()
            started = time.perf_counter()
            try:
                shadow_answer = await send(pin_version(raw, self.version), timeout=timeout_s)
            except asyncio.CancelledError:
                raise
            except ShadowPaused:
                self.stats.paused += 1
                continue
            except Exception as err:  # the shadow version is down or failing: counted, never surfaced
                self.stats.errors += 1
                self.stats.last_error = str(getattr(err, "message", err))[:300]
                continue
            elapsed = time.perf_counter() - started
            try:
                agreed = self._compare(answer, shadow_answer, elapsed - primary_s)
            except Exception as err:  # an unexpected answer shape: count it as a disagreement
                log.debug("shadow comparison failed: %s", err)
                self.stats.compared += 1
                agreed = False
            if not agreed and self.record is not None:
                self._keep(raw, answer, shadow_answer, tenant)

    def _keep(self, raw: bytes, answer: bytes, shadow_answer: bytes, tenant: str) -> None:
        try:
            self.record({
                "ts": time.time(), "tenant": tenant, "version": self.version,
                "request": base64.b64encode(raw).decode(), "primary": base64.b64encode(answer).decode(),
                "shadow": base64.b64encode(shadow_answer).decode(),
            })  # fmt: skip
        except Exception:  # records are bookkeeping: never a reason to stop comparing
            log.exception("recording a shadow disagreement failed")

    def _compare(self, primary: bytes, shadow: bytes, delta_s: float) -> None:
        outputs_a, outputs_b = decode_outputs(primary), decode_outputs(shadow)
        s = self.stats
        s.compared += 1
        if len(s.latency_deltas) < MAX_LATENCY_SAMPLES:
            s.latency_deltas.append(delta_s)
        agreed = set(outputs_a) == set(outputs_b)
        for name, a in outputs_a.items():
            b = outputs_b.get(name)
            if b is None or a.shape != b.shape:
                agreed = False
                continue
            if a.dtype.kind in "fiub" and b.dtype.kind in "fiub":
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                s.abs_diff_sum += float(diff.sum())
                s.abs_diff_count += int(diff.size)
                agreed = agreed and bool(np.all(diff <= self.atol + self.rtol * np.abs(a.astype(np.float64))))
            else:
                agreed = agreed and bool(np.array_equal(a, b))
        s.agreed += agreed
        return agreed


def decode_outputs(raw: bytes) -> dict[str, np.ndarray]:
    response = pb.ModelInferResponse.FromString(raw)
    return {
        out.name: codecs.to_numpy(response.raw_output_contents[i], out.datatype, list(out.shape))
        for i, out in enumerate(response.outputs)
        if i < len(response.raw_output_contents)
    }


# ---- the router ------------------------------------------------------------------------------


class Router:
    """What the data plane asks: which version answers, and what happened (per arm, shadow)."""

    def __init__(self, routes: dict[str, str], clock: Callable[[], float] = time.monotonic):
        self.routes = routes  # the deployer's endpoint -> live version (the DataPlane's dict)
        self.clock = clock
        self.splits: dict[str, Split] = {}
        self.shadows: dict[str, Shadow] = {}
        # a process that does not lead (server.control.rollout.arm_reports.ArmReporter): each request id is also
        # kept for the reports, so the leader can take its Feedback; the leader itself keeps none twice
        self.report_ids = False

    def choose(self, name: str, ctx) -> tuple[str, str]:
        """(version, arm) for a request naming no version; ('', '') when nothing pins one (Triton's latest)."""
        split = self.splits.get(name)
        if split is None:
            return self.routes.get(name, ""), ""
        arm = split.pick(ctx)
        return arm.version, arm.name

    def observe(self, name: str, arm: str, code: str, latency_s: float, request, raw: bytes | None, answer: bytes | None, ctx) -> None:
        """After the answer: the arm's metrics, the request id for feedback, a shadow copy."""
        if arm:
            split = self.splits.get(name)
            if split is not None and arm in split.windows:
                if code == "OK" or code in VERSION_ERROR_CODES:
                    error = code != "OK"
                    split.windows[arm].add(latency_s, error)
                    split.totals[arm].add(latency_s, error)
                request_id = (request.id if request is not None else "") or header(ctx, REQUEST_ID_HEADER)
                if request_id:
                    split.remember(request_id, arm)
                    if self.report_ids:
                        split.unreported.append((request_id, arm))
        if answer is not None and raw is not None:
            shadow = self.shadows.get(name)
            if shadow is not None:
                principal = getattr(ctx, "principal", None)
                shadow.offer(raw, answer, latency_s, principal.name if principal is not None else "")

    def feedback(self, name: str, request_id: str, value: float) -> str:
        """Record an outcome for the request ``request_id`` answered by ``name``; returns its arm."""
        if not math.isfinite(value):
            raise InvalidRequest(f"an outcome must be a finite number, got {value}")
        split = self.splits.get(name)
        if split is None:
            raise ModelNotFound(f"endpoint '{name}' has no traffic split (start an experiment first)")
        arm = split.request_arms.pop(request_id, None)  # one outcome per request
        if arm is None:
            raise UnknownRequest(f"no request '{request_id}' of endpoint '{name}' is known to its current split")
        outcomes = split.totals[arm].outcomes
        if len(outcomes) < MAX_OUTCOMES:
            outcomes.append(float(value))
        return arm

    def arms_of(self, name: str) -> Sequence[Arm]:
        split = self.splits.get(name)
        return split.arms if split is not None else ()
