"""Settings, read once in ``main()``: flags > ``INFERPLANE_*`` environment variables > defaults.

The only module that reads the environment. The CLI passes only the flags a user gave
(``Settings(**given)``), so an environment variable is never shadowed by a flag's default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

WORKER_SETTINGS_ENV = "INFERPLANE_WORKER_SETTINGS"  # a worker process's settings, from its parent


def default_data_dir() -> Path:
    """Where the registry database and artifacts live unless told: one place per user, whatever
    the working directory (``$XDG_DATA_HOME/inferplane``, else ``~/.local/share/inferplane``)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "inferplane"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INFERPLANE_", extra="forbid")

    host: str = "127.0.0.1"
    grpc_port: int = Field(8001, ge=0, le=65535)
    http_port: int = Field(8000, ge=0, le=65535)
    metrics_port: int = Field(8002, ge=0, le=65535)
    model_repository: Path = Path("var/model_repository")
    # the repository every Triton reads as the Tritons name it (s3://… on a cluster): what the Triton
    # reconciler reads configs from (server/control/service/reconciler.py); empty: model_repository
    model_repository_url: str = ""
    reconcile_interval_s: float = Field(2.0, gt=0)  # the Triton reconciler's round
    reconcile_drain_s: float = Field(30.0, ge=0)  # a removed version stays loaded this long where it is
    # model-control calls in flight on one Triton; unset: half this host's cores, 1 to Triton's 4 load threads
    # (server/runtime/supervisor.py LOAD_CONCURRENCY): a start's loads and a reconciler round's — on a cluster the leader's cores say nothing of the Tritons': set it
    load_concurrency: int | None = Field(None, ge=1, le=64)
    # host:port of an external Triton (the production container); unset: start the embedded one
    triton_url: str | None = None
    workdir: Path = Path("var/run")
    # models to load at start: names, or ["*"] for every model in the repository
    models: list[str] = ["*"]
    max_request_bytes: int = Field(64 << 20, ge=1024)
    # OpenAI SSE streams: a client that takes no byte for sse_stall_s is disconnected (its generation cancelled
    # and metered); a ": heartbeat" comment goes out after sse_heartbeat_s without an event (0: never)
    sse_stall_s: float = Field(30.0, gt=0)
    sse_heartbeat_s: float = Field(15.0, ge=0)
    triton_channels: int = Field(2, ge=1, le=64)
    # the embedded Triton (no triton_url): "process" — a supervised tritonserver child reached over
    # loopback gRPC (the default: BENCHMARKS.md §2 compares the two); "in-process" — libtritonserver
    # in this process through its C API (server/runtime/inprocess.py; one frontend process)
    triton_mode: Literal["process", "in-process"] = "process"
    triton_startup_timeout_s: float = Field(120.0, gt=0)
    shutdown_grace_s: float = Field(5.0, ge=0)
    log_level: str = "INFO"
    # the registry's and tenancy's data: a SQLite file and the artifact folder under data_dir unless given
    data_dir: Path = Field(default_factory=default_data_dir)
    # the registry: SQLAlchemy URL (unset: sqlite:///DATA_DIR/inferplane.db), e.g. postgresql+psycopg://...
    database_url: str = ""
    # content-addressed artifact store: a local folder or any fsspec URL (unset: DATA_DIR/artifacts)
    artifact_store: str = ""
    # how long a replaced version stays loaded after a deploy/rollback, so rollback needs no reload
    rollback_grace_s: float = Field(300.0, ge=0)
    # the control plane (issue 27): "embedded" — this process (the parent of --workers N) runs the registry,
    # deployer, traffic controller, autoscaler, batch runner and retention behind the leader lease, or stands by
    # while another process holds it; "external" — it runs none of them and carries control RPCs to the leader
    control_plane: Literal["embedded", "external"] = "embedded"
    # the address frontends reach this process's control RPCs at, written in the lease row (unset: host:port
    # of the gRPC port, or of a loopback port of its own in the parent of --workers N)
    control_advertise: str = ""
    # set by `inferplane control run`: a replica that serves no traffic of its own (its autoscaler would see none)
    control_only: bool = False
    control_lease_ttl_s: float = Field(6.0, gt=0)  # SQLite's lease row; PostgreSQL renews its lock's session every ttl/6
    # the leader lease: "database" (PostgreSQL advisory lock / SQLite row) or "kubernetes" (a coordination.k8s.io
    # Lease in the pod's namespace, server.control.service.kube_lease; the database row still names the address)
    control_lease: Literal["database", "kubernetes"] = "database"
    desired_state_poll_s: float = Field(0.02, gt=0)  # SQLite's data_version poll; also the leader's publish pass
    desired_state_reconcile_s: float = Field(1.0, gt=0)  # a full re-read even without a notification
    # load + readiness + warm-up budget of one deploy
    deploy_timeout_s: float = Field(120.0, gt=0)
    # batch jobs (/v1/batches): a worker's lease on a job (a restarted process takes the job over
    # once it lapses), rows in flight per job, how often an idle worker looks for work
    batch_lease_s: float = Field(30.0, gt=0)
    batch_concurrency: int = Field(8, ge=1, le=256)
    batch_row_batch: int = Field(32, ge=1, le=4096)  # rows committed together; cancel/expiry checked between
    batch_poll_s: float = Field(0.5, gt=0)
    # Triton's local response cache (used by models whose config enables it); 0 turns it off
    response_cache_bytes: int = Field(64 << 20, ge=0)
    # how often Triton's per-model statistics (cache hits, queue time) are read into /metrics
    stats_poll_s: float = Field(5.0, gt=0)
    # frontend processes sharing the ports (SO_REUSEPORT); the parent keeps Triton and /metrics
    workers: int = Field(default_factory=lambda: max(1, (os.cpu_count() or 2) // 2), ge=1, le=64)
    worker: bool = False  # set on the worker processes themselves
    # ---- tenancy and overload (issue 7) ----
    # API keys required on the data plane; `--auth off` is the development mode (one open tenant)
    auth: bool = True
    key_pepper: SecretStr = SecretStr("")  # HMAC key for API-key hashes; the CLI needs the same one
    auth_refresh_s: float = Field(5.0, gt=0)  # how soon key changes (revocations) take effect
    tenancy_database_url: str = ""  # unset: the registry's database_url
    # idempotency keys and quota buckets shared by every frontend process (server.tenancy.redis_quotas); unset: per process
    redis_url: str | None = None
    idempotency_ttl_s: float = Field(24 * 3600.0, gt=0)
    # quotas of tenants that have none of their own (and of the open tenant with --auth off)
    quota_rps: float | None = Field(None, gt=0)
    quota_rpm: float | None = Field(None, gt=0)
    quota_tpm: float | None = Field(None, gt=0)
    quota_concurrency: int | None = Field(None, ge=1)
    # admission: requests past the gate per model (unset: from the model's coalescing policy), queue bound
    admission_slots: int | None = Field(None, ge=1)
    admission_queue_delay_s: float | None = Field(None, gt=0)  # unset: two rounds of slots
    admission_max_queue: int = Field(4096, ge=1)
    # overload (batching.overload_policy): the longest a request waits in a model's queue (a model's own
    # config parameter inferplane.queue_ttl_ms wins), standing-queue drops, and per-connection HTTP/2
    # streams (past them a caller's channel holds its requests: the backlog stays in the client)
    queue_ttl_ms: float | None = Field(None, gt=0)
    admission_codel: bool = True
    # unset: grpc's default (no limit). Measured (BENCHMARKS, overload section): grpc's Python client
    # answers streams over the limit with RST_STREAM REFUSED_STREAM (UNAVAILABLE), not by queueing them
    grpc_max_streams_per_connection: int | None = Field(None, ge=1)
    # the most inference requests (gRPC, REST, typed, OpenAI, each ModelStreamInfer message) this process holds
    # at once: past it an arrival is refused before decode with a retry hint (server.dataplane.loop_gate; BENCHMARKS, sections 23-24)
    max_inflight: int | None = Field(256, ge=1)
    # refuse unary requests before decode while the event loop lags (server.dataplane.loop_gate); off by default:
    # on a shared, loaded machine timer lag alone (no backlog) cuts the limit for a few ticks
    loop_admission: bool = False
    breaker_failures: int = Field(5, ge=1)
    breaker_open_s: float = Field(2.0, gt=0)
    usage_flush_s: float = Field(5.0, gt=0)
    # freeze what start-up left alive so garbage collections stay short (server.runtime.gc_pauses)
    gc_freeze: bool = True

    # ---- observability (issue 19; server.dataplane.observe, server.dataplane.tracing, server.control.monitoring.slo|drift|payload_log) ----
    # OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318); unset: no traces at all (no span is ever made)
    otlp_endpoint: str = ""
    # share of requests without a sampled W3C traceparent that are traced (a sampled parent is always followed)
    trace_sample_ratio: float = Field(0.01, ge=0, le=1)
    trace_service_name: str = "inferplane"
    # with an OTLP endpoint, the embedded Triton runs its OpenTelemetry trace mode (only requests that carry
    # the frontend's traceparent are traced there, so its spans join the frontend's traces)
    triton_tracing: bool = True
    # Triton's own Prometheus endpoint (GPU/CPU utilization, memory): the embedded one's by default
    triton_metrics_url: str = ""
    # tenants (and teams) beyond the top N by recent traffic share one "other" label on /metrics
    metrics_top_tenants: int = Field(10, ge=0, le=1000)
    metrics_tenant_refresh_s: float = Field(60.0, gt=0)
    # SLO defaults for endpoints whose config names none (parameters inferplane.slo_availability,
    # inferplane.slo_latency_ms, inferplane.slo_latency_target), and the budget's window
    slo_availability: float = Field(0.999, gt=0, lt=1)
    slo_latency_ms: float = Field(100.0, gt=0)
    slo_latency_target: float = Field(0.99, gt=0, lt=1)
    slo_window_s: float = Field(30 * 86400.0, gt=0)
    slo_step_s: float = Field(60.0, gt=0)  # how often the budget is recomputed from the counters
    status_history_step_s: float = Field(5.0, gt=0)  # the status page's charts: one point per step (120 kept)
    # drift: share of answered requests copied (undecoded) into a bounded ring for the background monitor
    drift_sample_ratio: float = Field(0.01, ge=0, le=1)
    drift_buffer: int = Field(1024, ge=1)  # ring capacity, in requests
    drift_window_rows: int = Field(2000, ge=10)  # live rows per model compared with the reference
    drift_min_rows: int = Field(200, ge=10)  # no statistic before this many live rows
    drift_interval_s: float = Field(30.0, gt=0)
    drift_psi_threshold: float = Field(0.25, gt=0)
    drift_ks_threshold: float = Field(0.2, gt=0, le=1)
    # payload logging: endpoints opt in with inferplane.payload_log_sample in their config; records go here
    # (a local folder of JSONL files, or any fsspec URL), at most this many records / bytes kept
    payload_log_destination: str = ""  # unset: DATA_DIR/payloads
    payload_log_max_records: int = Field(100_000, ge=1)
    payload_log_max_bytes: int = Field(256 << 20, ge=1024)
    payload_log_file_records: int = Field(10_000, ge=1)  # records per file before the next one starts
    payload_log_buffer: int = Field(1024, ge=1)  # queued records; past it a sampled record is dropped and counted
    # ---- the fleet: replicas, autoscaling (issue 17) ----
    # Triton replicas: `triton_url` may list several (a,b,c); `model_groups_file` names the model groups
    # ({group: {service, grpc_port, models}}), each a headless Service whose addresses are its replicas
    model_groups_file: Path | None = None
    local_replicas: int = Field(1, ge=1, le=32)  # embedded: Triton processes at start (more come with autoscaling)
    replica_memory_mb: int = Field(4096, ge=64)  # what one local replica offers for placement
    # failure domains (issue 29: server.control.scaling.isolation): llm = the LLMs in Triton process(es) apart from
    # the tree/ONNX models; each = one Triton per model; none = all in the embedded one
    isolation: str = Field("llm", pattern="^(none|llm|each)$")
    zone: str = ""  # this frontend's zone: its requests prefer replicas in it (--zone), below ...
    zone_file: Path | None = None  # ... or, with no zone given, the zone this file holds (Kubernetes: server.runtime.node_zone)
    zone_spill_outstanding: int = Field(8, ge=1)  # ... this many in flight each; past it they spill to other zones
    local_zones: str = ""  # embedded: the zones local replicas open in, "a,b" (the embedded one is in the first)
    zone_down_grace_s: float = Field(10.0, gt=0)  # embedded: a zone whose replicas stay down this long has its copies placed in the others
    warm_pool: int = Field(0, ge=0, le=16)  # embedded: pre-started empty Tritons a scale-up takes instead of starting one
    # embedded: standbys, "MODEL=N,...": Tritons holding the model loaded, out of rotation; a scale-up of it takes one
    # into rotation (no start, no load) and the pool loads another (server.runtime.local_replicas)
    warm_standby: str = Field("", pattern=r"^\s*([\w.-]+\s*(=\s*\d+\s*)?(,\s*[\w.-]+\s*(=\s*\d+\s*)?)*)?$")
    # spot capacity (server.dataplane.capacity_policy): the local replicas started at once are, in turn, of these
    # capacities ("on_demand,spot": local-0 on demand, local-1 spot, ...; --capacity); replicas opened later are on demand
    local_capacity: str = Field("on_demand", pattern=r"^\s*(on[_-]demand|spot)\s*(,\s*(on[_-]demand|spot)\s*)*$")
    default_model_memory_mb: int = Field(512, ge=1)  # a model without hardware metadata in the registry
    # cost (issue 32): what the replicas are, for the replica ledger the owner view of cost prices
    hardware_class: str = "cpu"  # a class of the price list (deploy/prices/*.yaml): cpu, a100, h100-mig-1g.10gb, ...
    capacity_type: Literal["on_demand", "spot"] = "on_demand"
    replica_ledger_interval_s: float = Field(30.0, gt=0)
    # the feature-store stage (issue 32): redis://… (hashes) or http://… (Feast's feature server); unset: off
    feature_store_url: str = ""
    replica_health_interval_s: float = Field(1.0, gt=0)
    replica_eject_failures: int = Field(3, ge=1)
    replica_eject_s: float = Field(2.0, gt=0)
    replica_wait_s: float = Field(10.0, ge=0)  # a request waits this long for a replica of its model (per endpoint: its cold-start budget)
    replica_retry_lost: bool = True  # retry a unary request whose connection broke under it (see server/dataplane/replicas.py)
    discovery_interval_s: float = Field(5.0, gt=0)  # how often a group's headless Service is resolved again
    # how a model group's Tritons are found: "dns" (the headless Service's addresses, no zones) or
    # "endpointslices" (its EndpointSlices through the Kubernetes API: each pod's zone too, for locality)
    replica_discovery: Literal["dns", "endpointslices"] = "dns"
    # LLM generations across replicas (batching.route_policy): round_robin | least_outstanding | prefix_aware
    # (an endpoint may name its own in its config: parameter inferplane.routing); prefix_aware keeps a
    # prefix key (a hash of the request's first llm_route_prefix_chars characters) on one replica while it
    # holds at most load_factor x the mean streams + load_slack and its engine's KV use is below kv_high
    llm_routing: str = Field("prefix_aware", pattern="^(round_robin|least_outstanding|prefix_aware)$")
    llm_route_prefix_chars: int = Field(512, ge=0)  # 0: no key (prefix_aware is then least_outstanding)
    # a generation whose engine sends nothing for this long is cancelled and reported (0: never; issue 31)
    generation_stall_s: float = Field(60.0, ge=0)
    llm_route_load_factor: float = Field(1.25, ge=1.0)
    llm_route_load_slack: float = Field(1.0, ge=0)
    llm_route_kv_high: float = Field(0.9, gt=0, le=1)
    autoscale: bool = True  # run the autoscaler in the frontend process that owns the control plane
    autoscale_interval_s: float = Field(1.0, gt=0)
    autoscale_executor: str = Field("local", pattern="^(local|kubernetes|none)$")  # local: the Tritons this process has (its children; --triton-url's: placed on)
    autoscale_profile_period_s: float = Field(7 * 24 * 3600.0, gt=0)  # the forecast's season (a week) ...
    autoscale_profile_slot_s: float = Field(3600.0, gt=0)  # ... and its slot (an hour): hour-of-week
    autoscale_lead_s: float | None = Field(None, ge=0)  # unset: the measured time to a warm replica
    weight_cache_dir: Path | None = None  # unset: WORKDIR/weight-cache
    weight_cache_bytes: int = Field(2 << 30, ge=0)
    scale_to_zero_evict: bool = True  # a scaled-to-zero endpoint's artifacts leave the repository for the weight cache
    kubernetes_namespace: str | None = None
    # the service-account folder (token, ca.crt, namespace) the Kubernetes API calls use (server.runtime.kube_api)
    kubernetes_token_dir: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    # `inferplane control run`: the Prometheus the KEDA ScaledObjects query (unset: the frontend's own samples)
    prometheus_url: str | None = None

    # ---- security and privacy (issue 23: server.tenancy.tls, server.dataplane.safety, server.control.registry.envelope|retention) ----
    # TLS on every port (gRPC, REST/OpenAI, /metrics) from a PEM certificate chain and its unencrypted key;
    # both files are watched and a changed pair is served to new connections without a restart
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # mTLS: client certificates are required on every port and verified against this PEM CA bundle; a
    # certificate whose SPIFFE ID (SAN URI) or subject is bound to a tenant (`inferplane tenants bind`)
    # authenticates like that tenant's API key
    tls_client_ca: Path | None = None
    tls_reload_s: float = Field(5.0, gt=0)  # how often the certificate files are checked for changes
    # a plaintext gRPC port that serves grpc.health.v1 only (kubelet's gRPC probes speak no TLS); unset: none
    health_port: int | None = Field(None, ge=0, le=65535)
    # the frontend -> remote Triton channel (--triton-url): TLS with this CA bundle (unset: the system's),
    # a client certificate for Triton's mutual TLS, and the name Triton's certificate is checked against
    triton_tls: bool = False  # implied by any triton_tls_* file
    triton_tls_ca: Path | None = None
    triton_tls_cert: Path | None = None
    triton_tls_key: Path | None = None
    triton_tls_server_name: str = ""
    # the CLIs' and the control plane's gRPC channel to a frontend that serves TLS: its CA bundle (setting
    # it turns TLS on), a client certificate when it requires mTLS, the name its certificate is checked against
    client_tls_ca: Path | None = None
    client_tls_cert: Path | None = None
    client_tls_key: Path | None = None
    client_tls_server_name: str = ""
    # safety filters: endpoint name (or "*") -> policy JSON (server.dataplane.safety); an endpoint's own
    # inferplane.safety config parameter wins over these
    safety: dict[str, dict] = {}
    safety_audit_flush_s: float = Field(2.0, gt=0)  # filter decisions go to the audit log in batches
    # encryption at rest (payload logs, shadow records, batch files): AES-256-GCM envelopes under a key
    # encryption key: base64 of 32 bytes, or "id:base64,id2:base64" (the first one encrypts; the others
    # still decrypt), or a KMS-style key file {"primary": "id", "keys": {"id": "base64", ...}}
    encryption_key: SecretStr = SecretStr("")
    encryption_key_file: Path | None = None
    # artifacts stored sealed too (still named by the sha256 of their plaintext, which signatures sign)
    encrypt_artifacts: bool = False
    # retention per kind of stored data, in days (absent: kept until deleted); a background job enforces it
    # (signal_reports / shadow_reports: the rows every process reports to the leader; a live shadow's are kept)
    retention_days: dict[str, float] = {"payload_logs": 30.0, "shadow_records": 30.0, "batch_files": 30.0, "signal_reports": 1.0, "shadow_reports": 30.0}
    retention_interval_s: float = Field(3600.0, gt=0)
    # shadow records: the requests, primary and shadow answers of shadow copies that disagreed (a folder or
    # fsspec URL; unset: DATA_DIR/shadow_records); at most this many per shadow in each process
    shadow_record_destination: str = ""
    shadow_record_max: int = Field(1000, ge=0)

    # an API key the CLIs send to a running frontend (deploy, rollback, traffic, keys over gRPC)
    api_key: SecretStr = SecretStr("")
    # where the CLIs find the running frontend's gRPC port
    url: str = "127.0.0.1:8001"

    @property
    def metrics_dir(self) -> Path | None:
        """With several frontend processes, each writes its metrics here and the parent sums them
        (prometheus-client's multiprocess mode, which needs the folder in its environment variable
        before it is imported: ``inferplane serve`` sets it)."""
        return self.workdir.resolve() / "metrics" if self.workers > 1 or self.worker else None

    @property
    def tenancy_url(self) -> str:
        return self.tenancy_database_url or self.database_url

    @classmethod
    def for_worker(cls) -> "Settings":
        """A worker process's settings, handed over by its parent (``server.runtime.workers``)."""
        return cls(**json.loads(os.environ.pop(WORKER_SETTINGS_ENV)))

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'inferplane.db'}"
        if not self.payload_log_destination:
            self.payload_log_destination = str(self.data_dir / "payloads")
        if not self.artifact_store:
            self.artifact_store = str(self.data_dir / "artifacts")
        if not self.shadow_record_destination:
            self.shadow_record_destination = str(self.data_dir / "shadow_records")
        if not self.zone and self.zone_file is not None:
            try:
                self.zone = self.zone_file.read_text().strip()
            except OSError as err:
                raise ValueError(f"zone_file {self.zone_file} cannot be read: {err}") from None
        self._check_security()
        ports = [p for p in (self.grpc_port, self.http_port, self.metrics_port, self.health_port) if p]
        if len(ports) != len(set(ports)):
            raise ValueError("grpc, http, metrics and health ports must differ")
        if self.triton_mode == "in-process" and not self.triton_url and self.workers > 1:
            raise ValueError("triton_mode in-process runs Triton inside the one frontend process: use --workers 1")
        if self.workers > 1 and 0 in (self.grpc_port, self.http_port):
            raise ValueError("with several workers, give fixed --grpc-port and --http-port (they share them)")
        if self.autoscale_period_slots() is None:
            raise ValueError("autoscale_profile_period_s must be a whole multiple of autoscale_profile_slot_s")
        return self

    def _check_security(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key (or neither)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if (self.triton_tls_cert is None) != (self.triton_tls_key is None):
            raise ValueError("give both triton_tls_cert and triton_tls_key (or neither)")
        if (self.client_tls_cert is None) != (self.client_tls_key is None):
            raise ValueError("give both client_tls_cert and client_tls_key (or neither)")
        if self.triton_tls_ca or self.triton_tls_cert:
            self.triton_tls = True
        for kind, days in self.retention_days.items():
            if not days > 0:
                raise ValueError(f"retention_days[{kind!r}] must be > 0 days, got {days!r}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None
    def autoscale_period_slots(self) -> int | None:
        slots = self.autoscale_profile_period_s / self.autoscale_profile_slot_s
        return round(slots) if abs(slots - round(slots)) < 1e-9 and round(slots) >= 1 else None

    @property
    def zones(self) -> tuple[str, ...]:
        return tuple(z.strip() for z in self.local_zones.split(",") if z.strip())

    @property
    def triton_urls(self) -> list[str]:
        """``triton_url`` as a list (several replicas: ``host1:8001,host2:8001``)."""
        return [u.strip() for u in (self.triton_url or "").split(",") if u.strip()]
