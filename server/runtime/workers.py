"""Multi-process frontend: N worker processes share the gRPC and HTTP ports (SO_REUSEPORT).

The parent keeps the embedded Triton, loads the models and serves the aggregated /metrics
(prometheus multiprocess mode); each worker runs the full frontend on its own event loop against
the parent's Triton and adopts the models it loaded. A worker that dies is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys

from pydantic import SecretStr

from server.settings import WORKER_SETTINGS_ENV, Settings
from server.runtime.supervisor import _die_with_parent

log = logging.getLogger(__name__)

READY_MARK = "inferplane worker ready"


def worker_settings(settings: Settings, triton_target: str, grpc_port: int, http_port: int) -> Settings:
    return settings.model_copy(
        update={"triton_url": triton_target, "grpc_port": grpc_port, "http_port": http_port, "workers": 1, "worker": True}
    )


def settings_json(settings: Settings) -> str:
    """The settings a worker starts with, secrets in clear: ``model_dump_json`` masks them (a
    worker given ``**********`` as the key pepper would refuse every API key)."""
    doc = settings.model_dump(mode="json")
    for name, value in settings:
        if isinstance(value, SecretStr):
            doc[name] = value.get_secret_value()
    return json.dumps(doc)


class WorkerPool:
    def __init__(self, settings: Settings, count: int, *, startup_timeout: float = 60.0, max_backoff: float = 5.0):
        self.settings = settings
        self.count = count
        self.startup_timeout = startup_timeout
        self.max_backoff = max_backoff
        self.processes: list[asyncio.subprocess.Process | None] = [None] * count
        self.restarts = 0
        self._watchers: list[asyncio.Task] = []
        self._stopping = False

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(i) for i in range(self.count)))
        self._watchers = [asyncio.create_task(self._watch(i)) for i in range(self.count)]

    async def _spawn(self, index: int) -> None:
        env = dict(os.environ, **{WORKER_SETTINGS_ENV: settings_json(self.settings)})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.app",
            env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.processes[index] = proc
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.startup_timeout)
        except asyncio.TimeoutError:
            line = b""
        if READY_MARK not in line.decode(errors="replace"):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise RuntimeError(f"worker {index} did not start (exit {proc.returncode}); see the log above")
        asyncio.create_task(_drain(proc.stdout))

    async def _watch(self, index: int) -> None:
        backoff = 0.5
        while not self._stopping:
            proc = self.processes[index]
            code = await proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.warning("worker %d (pid %d) exited with %s; starting it again", index, proc.pid, code)
            _mark_dead(proc.pid)
            while not self._stopping:
                try:
                    await self._spawn(index)
                    backoff = 0.5
                    break
                except (RuntimeError, OSError) as err:
                    log.error("restarting worker %d failed: %s", index, err)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p is not None and p.returncode is None]

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        live = [p for p in self.processes if p is not None and p.returncode is None]
        await stop_processes(live, timeout)
        for proc in live:
            _mark_dead(proc.pid)


async def stop_processes(procs: list[asyncio.subprocess.Process], timeout: float) -> None:
    """SIGTERM to all, then each gets ``timeout`` seconds before SIGKILL."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def _mark_dead(pid: int) -> None:
    """A worker's live gauges leave the parent's sums (the pool always runs multiprocess metrics)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
