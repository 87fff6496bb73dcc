"""Settings, read once in ``main()`` (flags override ``INFERPLANE_*`` environment variables)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INFERPLANE_", extra="forbid")

    host: str = "127.0.0.1"
    grpc_port: int = Field(8001, ge=0, le=65535)
    http_port: int = Field(8000, ge=0, le=65535)
    metrics_port: int = Field(8002, ge=0, le=65535)
    model_repository: Path = Path("var/model_repository")
    # host:port of an external Triton (the production container); unset: start the embedded one
    triton_url: str | None = None
    workdir: Path = Path("var/run")
    # models to load at start: names, or ["*"] for every model in the repository
    models: list[str] = ["*"]
    max_request_bytes: int = Field(64 << 20, ge=1024)
    triton_channels: int = Field(2, ge=1, le=64)
    triton_startup_timeout_s: float = Field(120.0, gt=0)
    shutdown_grace_s: float = Field(5.0, ge=0)
    log_level: str = "INFO"
    # the registry: SQLite file (relative to the working directory) or a PostgreSQL URL
    database_url: str = "sqlite:///var/inferplane.db"
    # content-addressed artifact store: a local folder or any fsspec URL (s3://bucket/prefix, ...)
    artifact_store: str = "var/artifacts"
    # how long a replaced version stays loaded after a deploy/rollback, so rollback needs no reload
    rollback_grace_s: float = Field(300.0, ge=0)
    # load + readiness + warm-up budget of one deploy
    deploy_timeout_s: float = Field(120.0, gt=0)
    # Triton's local response cache (used by models whose config enables it); 0 turns it off
    response_cache_bytes: int = Field(64 << 20, ge=0)
    # how often Triton's per-model statistics (cache hits, queue time) are read into /metrics
    stats_poll_s: float = Field(5.0, gt=0)
    # frontend processes sharing the ports (SO_REUSEPORT); the parent keeps Triton and /metrics
    workers: int = Field(1, ge=1, le=64)
    worker: bool = False  # set on the worker processes themselves
    # ---- tenancy and overload (issue 7) ----
    # API keys required on the data plane; `--auth off` is the development mode (one open tenant)
    auth: bool = True
    key_pepper: SecretStr = SecretStr("")  # HMAC key for API-key hashes; the CLI needs the same one
    auth_refresh_s: float = Field(5.0, gt=0)  # how soon key changes (revocations) take effect
    tenancy_database_url: str | None = None  # unset: INFERPLANE_DATABASE_URL, else sqlite:///var/inferplane.db
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
    breaker_failures: int = Field(5, ge=1)
    breaker_open_s: float = Field(2.0, gt=0)
    usage_flush_s: float = Field(5.0, gt=0)
    # freeze what start-up left alive so garbage collections stay short (server.runtime.gc_pauses)
    gc_freeze: bool = True

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        ports = [p for p in (self.grpc_port, self.http_port, self.metrics_port) if p]
        if len(ports) != len(set(ports)):
            raise ValueError("grpc, http and metrics ports must differ")
        if self.workers > 1 and 0 in (self.grpc_port, self.http_port):
            raise ValueError("with several workers, give fixed --grpc-port and --http-port (they share them)")
        if self.triton_url is None and not self.model_repository.is_dir():
            raise ValueError(f"model repository {self.model_repository} is not a directory (run `inferplane demo build`)")
        return self
