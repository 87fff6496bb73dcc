"""Local Triton replicas: extra ``tritonserver`` children beside the embedded one.

Each replica is a :class:`~server.runtime.supervisor.TritonSupervisor` of its own: its own
loopback ports, its own workdir (``WORKDIR/replicas/ID``: backends, log), its own shared-memory
prefix (the supervisor's ``tag``), the same model repository — and, in explicit model control,
only the models the control plane loads on it. Each is restarted by its supervisor when it dies;
the pool reports that (``on_down(id)``, ``on_restart(id, target)``) so the replica set stops
sending it traffic and lets it rejoin. The embedded Triton the frontend starts is adopted as the
first replica.

Warm pool (issue 29, ``INFERPLANE_WARM_POOL=N``): N pre-started, empty Tritons wait beside the
replicas; a replica's start takes one (its id and callbacks are re-pointed to the replica; it has no
model loaded, so the executor loads the replica's models into it as usual) instead of starting a
process, and the pool is refilled in the background.
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
        warm_pool: int = 0,
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
        self.warm_pool = warm_pool
        self.warm: list[TritonSupervisor] = []  # started, empty, no replica yet
        self.from_warm: set[str] = set()  # replicas that took a warm member
        self._warming = 0
        self._warm_started = 0
        self._refills: set[asyncio.Task] = set()

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

    def _supervisor(self, name: str) -> TritonSupervisor:
        return TritonSupervisor(
            self.repository,
            self.workdir / "replicas" / name,
            install=self.install,
            on_down=self.down_handler(name),
            on_restart=self.restart_handler(name),
            startup_timeout=self.startup_timeout,
            response_cache_bytes=self.response_cache_bytes,
            otlp_traces_url=self.otlp_traces_url,
            tag=name.replace("_", "-"),
        )

    def warm_pids(self) -> list[int | None]:
        return [s.pid for s in self.warm]

    async def fill_warm(self) -> None:
        """Start warm members until the pool holds ``warm_pool`` (counting those starting)."""
        while len(self.warm) + self._warming < self.warm_pool:
            self._warming += 1
            self._warm_started += 1
            supervisor = self._supervisor(f"warm-{self._warm_started}")  # its own workdir and shm prefix
            try:
                await supervisor.start()
                self.warm.append(supervisor)
                log.info("warm Triton %s ready at %s", supervisor.workdir.name, supervisor.grpc_target)
            except Exception as err:  # the pool stays short; the next scale-up starts cold
                log.warning("starting a warm Triton failed: %s", err)
                await supervisor.stop()
                break
            finally:
                self._warming -= 1

    def _refill(self) -> None:
        task = asyncio.get_running_loop().create_task(self.fill_warm(), name="warm-pool-refill")
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    def _take_warm(self, replica_id: str) -> TritonSupervisor | None:
        while self.warm:
            supervisor = self.warm.pop(0)
            if supervisor.pid is None:  # died while waiting
                continue
            supervisor.on_down = self.down_handler(replica_id)
            supervisor.on_restart = self.restart_handler(replica_id)
            self.from_warm.add(replica_id)
            self._refill()
            return supervisor
        return None

    async def start(self, replica_id: str) -> str:
        """Start a replica (or take a warm member); returns its gRPC target once its Triton is live
        (no models loaded)."""
        if replica_id in self.supervisors:
            return self.supervisors[replica_id].grpc_target
        loop = asyncio.get_running_loop()
        began = loop.time()
        warm = self._take_warm(replica_id)
        if warm is not None:
            self.supervisors[replica_id] = warm
            self.started_s[replica_id] = loop.time() - began
            log.info("local replica %s took warm Triton %s (pid %s)", replica_id, warm.grpc_target, warm.pid)
            return warm.grpc_target
        supervisor = self._supervisor(replica_id)
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
        for task in list(self._refills):
            task.cancel()
        for replica_id in [r for r in self.supervisors if r not in self.adopted]:
            await self.stop(replica_id)
        warm, self.warm = self.warm, []
        for supervisor in warm:
            await supervisor.stop()
