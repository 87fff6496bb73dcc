"""The control plane's own autoscaling loop for a cluster (``inferplane control run``): the same
policy and forecast as the frontend's autoscaler, fed by the fleet-wide load and acting through the
Kubernetes executor on each model group's Triton Deployment.

The load comes from Prometheus (``INFERPLANE_PROMETHEUS_URL``: the sum over every frontend pod of
``inferplane_autoscale_signal``, the series the frontends export) or, without one, from one
frontend's ``Autoscale/Signals`` (one pod's view: right for a single frontend, a lower bound
behind a Service balancing several). Configs are the endpoints' stored ones (the registry's
``endpoint_scaling``), read again every ``reload_s``. Scale to zero sets the group's Deployment to 0;
the frontends hold requests for it (their queue gauge rises) and the next round scales it back.

A group scaled by KEDA must not also be scaled here: pause its ScaledObject
(``autoscaling.keda.sh/paused: "true"``) for the endpoints you autoscale predictively.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp
import grpc

from batching.autoscale_policy import HOLD, Observation, ScalingConfig, SeasonalProfile, decide
from server.control.scaling.autoscaler import EndpointScaler
from server.errors import BackendUnavailable, InferplaneError
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from server.tenancy.tls import frontend_channel

log = logging.getLogger(__name__)

SIGNAL_QUERIES = {
    "inflight": 'sum(inferplane_autoscale_signal{{model="{m}",signal="inflight"}}) + sum(inferplane_autoscale_signal{{model="{m}",signal="queue"}})',
    "queue": 'sum(inferplane_autoscale_signal{{model="{m}",signal="queue"}})',
    "qps": 'sum(inferplane_autoscale_signal{{model="{m}",signal="qps"}})',
    "tokens_per_s": 'sum(inferplane_autoscale_signal{{model="{m}",signal="tokens_per_s"}})',
    "triton_queue_ms": 'max(inferplane_autoscale_signal{{model="{m}",signal="triton_queue_ms"}})',
}


class PrometheusSource:
    """Instant queries against Prometheus's HTTP API (``GET /api/v1/query?query=...``)."""

    def __init__(self, url: str, session=None, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self._session = session
        self.timeout_s = timeout_s

    async def _query(self, query: str) -> float:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(f"{self.url}/api/v1/query", params={"query": query}, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            raise BackendUnavailable(f"Prometheus at {self.url} did not answer: {err}", retry_after_s=5.0) from None
        if body.get("status") != "success":
            raise BackendUnavailable(f"Prometheus refused {query!r}: {body.get('error', body)}", retry_after_s=5.0)
        result = body.get("data", {}).get("result", [])
        if not result:  # no series yet (no frontend served the model): no load
            return 0.0
        return float(result[0]["value"][1])

    async def load(self, model: str, config: ScalingConfig) -> tuple[float, float]:
        """(the config's signal, request rate) for ``model`` summed over the frontends."""
        signal = await self._query(SIGNAL_QUERIES[config.signal].format(m=model))
        qps = signal if config.signal == "qps" else await self._query(SIGNAL_QUERIES["qps"].format(m=model))
        return signal, qps

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class FrontendSource:
    """One frontend's latest samples (``inferplane.v1.Autoscale/Signals`` over gRPC)."""

    def __init__(self, url: str, metadata: tuple = ()):
        self.url = url
        self.metadata = metadata
        self._channel = None
        self._cache: tuple[float, dict] = (0.0, {})

    async def _signals(self) -> dict:
        if time.monotonic() - self._cache[0] < 0.5:
            return self._cache[1]
        if self._channel is None:

            self._channel = frontend_channel(self.url, aio=True)  # TLS / mTLS with INFERPLANE_CLIENT_TLS_*
        stub = autoscale_pb2_grpc.AutoscaleStub(self._channel)
        try:
            answer = await stub.Signals(apb.AutoscaleSignalsRequest(), metadata=self.metadata, timeout=5.0)
        except grpc.aio.AioRpcError as err:
            raise BackendUnavailable(f"frontend {self.url}: {err.code().name}: {err.details()}", retry_after_s=5.0) from None
        self._cache = (time.monotonic(), json.loads(answer.signals_json))
        return self._cache[1]

    async def load(self, model: str, config: ScalingConfig) -> tuple[float, float]:
        sample = (await self._signals()).get(model)
        if sample is None:
            return 0.0, 0.0
        value = sample["inflight"] + sample["queue"] if config.signal == "inflight" else (sample.get(config.signal) or 0.0)
        return float(value), float(sample.get("qps") or 0.0)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class ClusterAutoscaler:
    def __init__(
        self, store, executor, source, *, interval_s: float = 5.0, reload_s: float = 30.0,
        profile_period_s: float = 7 * 24 * 3600.0, profile_slot_s: float = 3600.0, lead_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ):  # fmt: skip
        self.store = store  # server.control.scaling.scaling_store.ScalingStore
        self.executor = executor  # server.control.scaling.executors.KubernetesGroupExecutor
        self.source = source
        self.interval_s, self.reload_s, self.lead_s = interval_s, reload_s, lead_s
        self.profile_period_s, self.profile_slot_s = profile_period_s, profile_slot_s
        self._clock, self._wall = clock, wall
        self.endpoints: dict[str, EndpointScaler] = {}
        self._loaded_at = -float("inf")

    async def reload(self) -> None:
        configs = await asyncio.to_thread(self.store.all)
        for name, data in configs.items():
            try:
                config = ScalingConfig.from_dict(data)
            except (TypeError, ValueError) as err:
                log.error("endpoint %s: stored config ignored: %s", name, err)
                continue
            ep = self.endpoints.get(name)
            if ep is None:
                try:
                    current = await self.executor.read(name)
                except InferplaneError as err:
                    log.error("endpoint %s: %s", name, err.message)
                    continue
                self.endpoints[name] = EndpointScaler(name, config, current, self._clock(), SeasonalProfile(self.profile_period_s, self.profile_slot_s))
            else:
                ep.config = config
        for name in set(self.endpoints) - set(configs):
            del self.endpoints[name]
        self._loaded_at = self._clock()

    async def tick(self) -> list[dict]:
        if self._clock() - self._loaded_at >= self.reload_s:
            await self.reload()
        changes = []
        for name, ep in sorted(self.endpoints.items()):
            try:
                load, qps = await self.source.load(name, ep.config)
            except InferplaneError as err:
                log.warning("endpoint %s: no load reading: %s", name, err.message)
                continue
            wall = self._wall()
            ep.profile.observe(wall, qps)
            if qps > 0.5 and load > 0:
                ep.cost = load / qps if ep.cost is None else 0.9 * ep.cost + 0.1 * load / qps
            ahead = ep.profile.forecast(wall + self.lead_s)
            forecast = None if ahead is None or ep.cost is None else ahead * (1.0 if ep.config.signal == "qps" else ep.cost)
            decision, ep.state = decide(ep.config, ep.state, Observation(self._clock(), load, forecast, demand=False))
            entry = {"t": wall, "action": decision.action, "from": decision.previous, "to": decision.replicas, "reason": decision.reason, "inputs": decision.inputs}
            ep.decisions.append(entry)
            if decision.action == HOLD:
                continue
            try:
                await self.executor.set_replicas(name, decision.replicas)
                changes.append(entry)
                log.info("endpoint %s: %s %d -> %d (%s)", name, decision.action, decision.previous, decision.replicas, decision.reason)
            except InferplaneError as err:
                log.error("endpoint %s: scaling to %d failed: %s", name, decision.replicas, err.message)
                ep.state = replace(ep.state, replicas=decision.previous)
        return changes

    async def run_forever(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # keep the loop alive
                log.exception("control loop round failed")
            await asyncio.sleep(self.interval_s)
