"""Local Triton replicas: extra ``tritonserver`` children beside the embedded one.

Each replica is a :class:`~server.runtime.supervisor.TritonSupervisor` of its own: its own
loopback ports, its own workdir (``WORKDIR/replicas/ID``: backends, log), its own shared-memory
prefix (the supervisor's ``tag``), the same model repository — and, in explicit model control,
only the models the control plane loads on it. Each is restarted by its supervisor when it dies;
the pool reports that (``on_down(id)``, ``on_restart(id, target)``) so the replica set stops
sending it traffic and lets it rejoin. The embedded Triton the frontend starts is adopted as the
first replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from server.runtime.supervisor import TritonSupervisor
from server.runtime.triton_install import TritonInstallation

log = logging.getLogger(__name__)


class LocalReplicaPool:
    def __init__(
        self,
        repository: Path,
        workdir: Path,
        *,
        install: TritonInstallation | None = None,
        startup_timeout: float = 120.0,
        response_cache_bytes: int = 64 << 20,
        otlp_traces_url: str | None = None,
        on_down: Callable[[str], None] | None = None,
        on_restart: Callable[[str, str], Awaitable[None]] | None = None,
    ):
        self.repository = Path(repository)
        self.workdir = Path(workdir)
        self._install = install
        self.startup_timeout = startup_timeout
        self.response_cache_bytes = response_cache_bytes
        self.otlp_traces_url = otlp_traces_url  # each replica's Triton traces as the embedded one does
        self.on_down = on_down
        self.on_restart = on_restart
        self.supervisors: dict[str, TritonSupervisor] = {}
        self.adopted: set[str] = set()  # started by someone else (the embedded one): never stopped here
        self.started_s: dict[str, float] = {}  # how long each replica took to become live

    @property
    def install(self) -> TritonInstallation:
        if self._install is None:
            self._install = TritonInstallation.find()
        return self._install

    def adopt(self, replica_id: str, supervisor: TritonSupervisor) -> None:
        """Count an already running supervisor as a replica (the frontend's embedded Triton)."""
        self.supervisors[replica_id] = supervisor
        self.adopted.add(replica_id)

    def ids(self) -> list[str]:
        return list(self.supervisors)

    def target(self, replica_id: str) -> str:
        return self.supervisors[replica_id].grpc_target

    def pid(self, replica_id: str) -> int | None:
        supervisor = self.supervisors.get(replica_id)
        return supervisor.pid if supervisor is not None else None

    def down_handler(self, replica_id: str) -> Callable[[], None]:
        def down() -> None:
            if self.on_down is not None:
                self.on_down(replica_id)

        return down

    def restart_handler(self, replica_id: str) -> Callable[[], Awaitable[None]]:
        async def restarted() -> None:
            if self.on_restart is not None:
                await self.on_restart(replica_id, self.supervisors[replica_id].grpc_target)

        return restarted

    async def start(self, replica_id: str) -> str:
        """Start a replica; returns its gRPC target once its Triton is live (no models loaded)."""
        if replica_id in self.supervisors:
            return self.supervisors[replica_id].grpc_target
        loop = asyncio.get_running_loop()
        began = loop.time()
        supervisor = TritonSupervisor(
            self.repository,
            self.workdir / "replicas" / replica_id,
            install=self.install,
            on_down=self.down_handler(replica_id),
            on_restart=self.restart_handler(replica_id),
            startup_timeout=self.startup_timeout,
            response_cache_bytes=self.response_cache_bytes,
            otlp_traces_url=self.otlp_traces_url,
            tag=replica_id.replace("_", "-"),
        )
        self.supervisors[replica_id] = supervisor
        try:
            await supervisor.start()
        except BaseException:
            self.supervisors.pop(replica_id, None)
            await supervisor.stop()
            raise
        self.started_s[replica_id] = loop.time() - began
        log.info("local replica %s started at %s in %.1fs", replica_id, supervisor.grpc_target, self.started_s[replica_id])
        return supervisor.grpc_target

    async def stop(self, replica_id: str) -> None:
        if replica_id in self.adopted:
            return
        supervisor = self.supervisors.pop(replica_id, None)
        if supervisor is not None:
            await supervisor.stop()
            log.info("local replica %s stopped", replica_id)

    async def stop_all(self) -> None:
        for replica_id in [r for r in self.supervisors if r not in self.adopted]:
            await self.stop(replica_id)
