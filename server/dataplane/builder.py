"""The data plane and its collaborators, built once from the settings and passed in (nothing is
replaced after construction)."""

from __future__ import annotations

from batching.coalescer import Coalescer
from batching.fair_queue import AdmissionPolicy
from batching.overload_policy import LoopPolicy, OverloadPolicy
from server.dataplane.circuit_breaker import BreakerPolicy
from server.dataplane.dataplane import DataPlane
from server.dataplane.feature_store import FeatureFetcher, store_for
from server.dataplane.fleet_hooks import FleetHooks
from server.dataplane.idempotency import MemoryIdempotency, RedisIdempotency
from server.dataplane.metrics import Metrics
from server.dataplane.models import ModelTable
from server.dataplane.observe import Observer
from server.dataplane.pipeline import Pipeline
from server.dataplane.routing import Router
from server.settings import Settings
from server.tenancy.monthly_quotas import MemoryMonthlyCounter, MonthlyQuotas, RedisMonthlyCounter
from server.tenancy.identity import Gatekeeper
from server.tenancy.quota_policy import QuotaPolicy
from server.tenancy.redis_quotas import RedisQuotaPolicy
from server.dataplane.safety import SafetyStage, policy_source
from server.dataplane.tracing import Tracing


def build_dataplane(
    settings: Settings, backend, *, metrics: Metrics, gate: Gatekeeper, meter=None, hooks: FleetHooks | None = None, audit=None
) -> DataPlane:
    """``backend``: the Triton this process talks to (``TritonClient``, or a ``ReplicaSet`` of them);
    ``gate`` and ``meter`` from ``server.tenancy.builder``; ``hooks``: what the fleet's control plane
    reads and sets (``server.dataplane.fleet_hooks``); ``audit(record)``: where safety decisions go
    (``server.control.registry.audit_buffer``)."""
    s = settings
    if s.redis_url:  # one set of buckets and keys for every frontend process
        rates, idempotency = RedisQuotaPolicy(s.redis_url), RedisIdempotency(s.redis_url, s.idempotency_ttl_s)
        quotas = MonthlyQuotas(rates, RedisMonthlyCounter(rates.client))
    else:
        quotas, idempotency = MonthlyQuotas(QuotaPolicy(), MemoryMonthlyCounter()), MemoryIdempotency(s.idempotency_ttl_s)
    hooks = hooks if hooks is not None else FleetHooks()
    hooks.usage.meter = meter
    table = ModelTable(wakers=hooks.wakers)
    router = Router({})
    observer = build_observer(s, metrics, backend.target)
    safety = build_safety(s, metrics, audit)  # its classifier calls go through the port that admitted each call
    pipeline = Pipeline(
        gate=gate,
        quotas=quotas,
        router=router,
        metrics=metrics,
        resolve=table.resolve,
        replica=backend.target,
        breaker_policy=BreakerPolicy(s.breaker_failures, s.breaker_open_s),
        admission_policy=AdmissionPolicy(
            max_queue_delay_s=s.admission_queue_delay_s, max_queue=s.admission_max_queue,
            overload=OverloadPolicy(queue_ttl_s=None if s.queue_ttl_ms is None else s.queue_ttl_ms / 1000.0, codel=s.admission_codel),
        ),  # fmt: skip
        admission_slots=s.admission_slots,
        meter=hooks.usage,
        observer=observer,
        safety=safety,
    )
    hooks.queues = pipeline.queues
    # the backend says how a merged batch travels to it (serialized protobuf, or the members' own buffers in process)
    coalescer = Coalescer(backend.send_batch, backend.batch_codec(), on_call=observer.on_batch)
    dataplane = DataPlane(
        backend, metrics=metrics, pipeline=pipeline, table=table, router=router, coalescer=coalescer, idempotency=idempotency,
        prefix_chars=s.llm_route_prefix_chars, stall_s=s.generation_stall_s,
    )  # fmt: skip
    dataplane.loop_gate.policy = LoopPolicy(ceiling=s.max_inflight)  # the process's in-flight bound (server.dataplane.loop_gate)
    if s.feature_store_url:  # the feature-store stage (server.dataplane.feature_store)
        dataplane.features = FeatureFetcher(store_for(s.feature_store_url))
    return dataplane


def build_safety(settings: Settings, metrics: Metrics, audit=None):
    """The safety stage (``server.dataplane.safety``): always built, so an endpoint's own policy
    parameter works without settings; it costs one cached lookup per request of an endpoint without one."""
    return SafetyStage(policy_source(settings.safety), metrics, audit=audit)


def build_observer(settings: Settings, metrics: Metrics, replica: str) -> Observer:
    """Tenant metrics, traces (when an OTLP endpoint is set) and the sampled copies for drift / payload logs."""
    s = settings
    return Observer(
        metrics,
        top_n=s.metrics_top_tenants,
        refresh_s=s.metrics_tenant_refresh_s,
        tracing=Tracing.from_settings(s, metrics),
        replica=replica,
        drift_ratio=s.drift_sample_ratio,
        drift_buffer=s.drift_buffer,
        payload_buffer=s.payload_log_buffer,
    )
