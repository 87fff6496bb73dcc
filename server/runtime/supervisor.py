"""The embedded Triton as a supervised child process.

Starts ``tritonserver`` from the nvidia-pytriton wheel on loopback ports it picks (explicit model
control, no auto-complete), waits until it is live, restarts it with backoff when it dies (then
calls ``on_restart`` so the models that were loaded are loaded again), and stops it cleanly: no
orphan processes (the child dies with its parent), no leftover ``/dev/shm`` regions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from server.dataplane.triton_client import TritonClient
from server.runtime.triton_install import TritonInstallation

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
MODEL_LOAD_THREADS = 4  # Triton loads this many models at once (the reconciler keeps as many load calls in flight)
# One Triton's model-control calls in flight at once (a start's loads, a reconciler round's): up to Triton's load
# threads, but no more than half this host's cores — on the 2-core machine four Python-backend stubs starting
# together made a late Triton slower (BENCHMARKS §18: 4 models 18.8–21.7 s concurrent vs 12.4–12.9 s one at a
# time), so there it stays 1 unless INFERPLANE_LOAD_CONCURRENCY says otherwise.
LOAD_CONCURRENCY = max(1, min(MODEL_LOAD_THREADS, (os.cpu_count() or 1) // 2))
LIVE_POLL_MS = 100  # a starting tritonserver's port is tried this often (its channel's reconnect backoff)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonStartError(RuntimeError):
    pass


FIRST_BACKOFF_S = 0.25


def restart_wait(lived_s: float, restarted_before: bool, backoff: float, stable_s: float, max_backoff: float) -> tuple[float, float]:
    """(seconds to wait before restarting a Triton that died, the backoff after). A death after a
    stable run (or the first one) restarts at once and starts the backoff over; one within
    ``stable_s`` of its restart (a model that crashes it on every load) waits, doubling each time."""
    if not restarted_before or lived_s >= stable_s:
        return 0.0, FIRST_BACKOFF_S
    return backoff, min(backoff * 2, max_backoff)


class TritonSupervisor:
    """Owns one tritonserver process at a time; ``state`` is starting|ready|restarting|stopped."""

    def __init__(
        self,
        repository: Path,
        workdir: Path,
        *,
        install: TritonInstallation | None = None,
        on_restart: Callable[[], Awaitable[None]] | None = None,
        on_down: Callable[[], None] | None = None,
        startup_timeout: float = 60.0,
        max_backoff: float = 8.0,
        stable_s: float = 10.0,
        extra_args: list[str] | None = None,
        response_cache_bytes: int = 64 << 20,
        otlp_traces_url: str | None = None,
        trace_service_name: str = "triton",
        tag: str = "",
    ):
        self.repository = Path(repository).resolve()
        # several Tritons in one process (local replicas) keep their shared-memory regions apart by tag
        if tag and not tag.replace("-", "").isalnum():
            raise ValueError(f"a supervisor tag is letters, digits and '-' (got {tag!r})")
        self.tag = f"{tag}-" if tag else ""
        self.workdir = Path(workdir).resolve()
        self.install = install or TritonInstallation.find()
        self.on_restart = on_restart
        self.on_down = on_down
        self.startup_timeout = startup_timeout
        self.max_backoff = max_backoff
        self.stable_s = stable_s  # a Triton that dies sooner after its restart is in a crash loop: its restarts back off
        self.extra_args = list(extra_args or [])
        self.response_cache_bytes = response_cache_bytes
        self.otlp_traces_url = otlp_traces_url
        self.trace_service_name = trace_service_name
        self.state = "stopped"
        self.restarts = 0
        self.grpc_port = 0
        self.metrics_port = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._monitor: asyncio.Task | None = None
        self._stopping = False
        self._generation = 0
        self._live_at = 0.0  # when the current process became live
        self._backends = self.install.prepare_backends(self.workdir)
        self.log_path = self.workdir / "triton.log"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    def _shm_prefix(self) -> str:
        return f"inferplane_{os.getpid()}_{self.tag}{self._generation}_"

    def _args(self) -> list[str]:
        return [
            str(self.install.binary),
            f"--model-repository={self.repository}",
            "--model-control-mode=explicit",
            "--disable-auto-complete-config",
            f"--model-load-thread-count={MODEL_LOAD_THREADS}",  # concurrent loads (the reconciler's LOAD_CONCURRENCY)
            f"--backend-directory={self._backends}",
            f"--cache-directory={self.install.caches}",
            "--allow-http=false",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix()}",
            "--exit-timeout-secs=5",
            # without a cache config, a model's `response_cache { enable: true }` silently does nothing
            *([f"--cache-config=local,size={self.response_cache_bytes}"] if self.response_cache_bytes else []),
            "--strict-readiness=false",
            *trace_args(self.otlp_traces_url, self.trace_service_name),
            *self.extra_args,
        ]

    async def start(self) -> None:
        # model processes and regions left by a frontend that was killed before it could clean up
        kill_stale_stubs(_is_dead)
        remove_shm_regions(_is_dead)
        self._stopping = False
        self.state = "starting"
        if not self.grpc_port:
            self.grpc_port, self.metrics_port = free_port(), free_port()
        await self._spawn()
        self.state = "ready"
        self._monitor = asyncio.create_task(self._watch(), name="triton-supervisor")

    async def _spawn(self) -> None:
        self._generation += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._args(),
                env=self.install.environment(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfile,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop Triton
            )
        finally:
            logfile.close()
        await self._wait_live()

    async def _wait_live(self) -> None:
        # tries every 100 ms on loopback: with the default backoff (growing to 1 s) the refused tries
        # while tritonserver starts put the try that finds it live up to ~0.6 s after it opened its port
        client = TritonClient(self.grpc_target, max_reconnect_backoff_ms=LIVE_POLL_MS)
        client.connect()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self._proc.returncode is not None:
                    raise TritonStartError(f"tritonserver exited with {self._proc.returncode} while starting:\n{self.log_tail()}")
                if await client.server_live(timeout=0.5):
                    self._live_at = time.monotonic()
                    return
                await asyncio.sleep(0.05)
            raise TritonStartError(f"tritonserver not live after {self.startup_timeout}s:\n{self.log_tail()}")
        finally:
            await client.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def _watch(self) -> None:
        backoff = FIRST_BACKOFF_S
        while not self._stopping:
            code = await self._proc.wait()
            if self._stopping:
                return
            lived = time.monotonic() - self._live_at
            wait, backoff = restart_wait(lived, self.restarts > 0, backoff, self.stable_s, self.max_backoff)
            self.state = "restarting"
            self.restarts += 1
            _kill_group(self._proc.pid)  # its Python-backend stubs do not die with it
            log.warning("tritonserver exited with %s after %.1fs live; restarting (restart #%d)%s", code, lived, self.restarts,
                        f" in {wait:.2f}s: it died again soon after its last restart" if wait else "")  # fmt: skip
            if self.on_down:
                self.on_down()
            self._cleanup_shm()
            if wait:
                await asyncio.sleep(wait)
            while not self._stopping:
                try:
                    await self._spawn()
                    break
                except (TritonStartError, OSError) as err:
                    log.error("restarting tritonserver failed: %s", err)
                    await self._kill()
                    self.grpc_port, self.metrics_port = free_port(), free_port()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff)
            if self._stopping:
                return
            if self.on_restart:
                try:
                    await self.on_restart()
                except Exception:  # the supervisor must outlive a failed reload
                    log.exception("reloading models after a restart failed")
            self.state = "ready"

    async def _kill(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.state = "stopped"
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                await self._kill()
        if proc is not None:
            _kill_group(proc.pid)
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        self._cleanup_shm()

    def _cleanup_shm(self) -> None:
        """Remove the shared-memory regions this supervisor's Tritons created (all generations; not
        those of another supervisor in this process, told apart by their tag)."""
        mine = re.compile(rf"^inferplane_{os.getpid()}_{re.escape(self.tag)}\d+_")
        remove_shm_regions(lambda pid: pid == os.getpid(), match=mine.match)


def trace_args(otlp_traces_url: str | None, service_name: str = "triton") -> list[str]:
    """Triton's OpenTelemetry trace mode, exporting to ``otlp_traces_url`` (OTLP/HTTP, the only
    exporter Triton 2.51 has). ``rate=0``: Triton samples nothing on its own and traces exactly the
    requests that carry a propagated ``traceparent`` (the frontend sends one only for the requests it
    traces), so Triton's spans are children of the frontend's Triton-call span."""
    if not otlp_traces_url:
        return []
    return [
        "--trace-config=mode=opentelemetry",
        "--trace-config=rate=0",
        "--trace-config=count=-1",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=opentelemetry,url={otlp_traces_url}",
        f"--trace-config=opentelemetry,resource=service.name={service_name}",
        "--trace-config=opentelemetry,bsp_schedule_delay=500",
    ]


def remove_shm_regions(owned: Callable[[int], bool], shm: Path = Path("/dev/shm"), match: Callable[[str], object] | None = None) -> list[str]:
    """Unlink ``inferplane_<pid>_*`` regions whose owner pid ``owned(pid)`` selects (and, when
    given, whose name ``match`` accepts)."""
    removed = []
    if not shm.is_dir():
        return removed
    for region in shm.glob("inferplane_*_*"):
        pid = region.name.split("_")[1]
        if pid.isdigit() and owned(int(pid)) and (match is None or match(region.name)):
            with contextlib.suppress(OSError):
                region.unlink()
                removed.append(region.name)
    return removed


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a Triton's process group (it runs in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def kill_stale_stubs(owned: Callable[[int], bool], proc: Path = Path("/proc")) -> list[int]:
    """SIGKILL Python-backend stubs whose shm prefix ``inferplane_<pid>_`` names an owner ``owned(pid)``.

    A frontend killed with SIGKILL takes its Triton along (PDEATHSIG), but Triton's stub
    processes survive it; the next supervisor to start finds them by their command line.
    """
    killed = []
    for entry in proc.glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"triton_python_backend_stub"):
            continue
        for arg in argv[1:]:
            if arg.startswith(b"inferplane_"):
                owner = arg.split(b"_")[1]
                if owner.isdigit() and owned(int(owner)):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(int(entry.name), signal.SIGKILL)
                        killed.append(int(entry.name))
                break
    return killed


def _is_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
