"""Settings, read once in ``main()`` (flags override ``INFERPLANE_*`` environment variables)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
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
    # Triton's local response cache (used by models whose config enables it); 0 turns it off
    response_cache_bytes: int = Field(64 << 20, ge=0)
    # how often Triton's per-model statistics (cache hits, queue time) are read into /metrics
    stats_poll_s: float = Field(5.0, gt=0)
    # frontend processes sharing the ports (SO_REUSEPORT); the parent keeps Triton and /metrics
    workers: int = Field(1, ge=1, le=64)
    worker: bool = False  # set on the worker processes themselves

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
