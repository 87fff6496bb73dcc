"""Start and stop the real stack (``inferplane serve`` + embedded Triton) as a subprocess.

Used by the benchmarks and by the test fixtures: ports are picked by the server itself (0) and
read back from its ready line; a process that dies before it is ready fails fast with its log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"inferplane ready grpc=(\S+) metrics=(\S+)(?: http=(\S+))? triton=(?:embedded@)?(\S+)")
START_TIMEOUT_S = 180


@dataclass
class Stack:
    grpc: str  # host:port of the frontend's gRPC
    metrics: str  # host:port of /metrics
    http: str | None  # host:port of the REST bridge, when it runs
    triton: str  # host:port of the embedded Triton's gRPC (for direct comparisons); "in-process": none
    process: subprocess.Popen
    log: Path
    repository: Path
    max_request_bytes: int = 64 << 20

    def triton_pid(self) -> int:
        import psutil

        for child in psutil.Process(self.process.pid).children(recursive=True):
            if child.name() == "tritonserver":
                return child.pid
        raise RuntimeError("no tritonserver child")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_stack(
    repository: Path, workdir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S,
    python: str | None = None, cwd: Path | None = None,
) -> Stack:
    """``python`` / ``cwd``: another checkout's interpreter and root (a benchmark's baseline: the same
    client against the unchanged code); by default this one's."""
    cmd = [
        python or sys.executable, "-m", "server.cli.main", "serve",
        "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
        "--model-repository", str(repository), "--workdir", str(workdir / "run"), *extra,
    ]  # fmt: skip
    return launch(cmd, repository, workdir, env=env, timeout=timeout, cwd=cwd)


def start_control(repository: Path, workdir: Path, database_url: str, triton: str, *extra: str, env: dict[str, str] | None = None,
                  timeout: float = START_TIMEOUT_S) -> Stack:  # fmt: skip
    """One control-plane replica (``inferplane control run``) deploying into the Triton at ``triton``."""
    cmd = [
        sys.executable, "-m", "server.cli.main", "control", "run", "--database-url", database_url, "--triton-url", triton,
        "--model-repository", str(repository), "--workdir", str(workdir / "run"), *extra,
    ]  # fmt: skip
    return launch(cmd, repository, workdir, env=env, timeout=timeout)


def launch(cmd: list[str], repository: Path, workdir: Path, *, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S,
           cwd: Path | None = None) -> Stack:  # fmt: skip
    """Start ``cmd`` (a command that prints the ready line) and read its addresses back."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "frontend.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True, cwd=cwd)
    lines: list[str] = []
    found: dict = {}
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = READY.search(line)
            if m and not found:
                found["m"] = m
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout) or "m" not in found:
        proc.kill()
        raise RuntimeError(f"stack did not become ready:\n{''.join(lines)}\n{log.read_text(errors='replace')[-4000:]}")
    m = found["m"]
    limit = int((env or {}).get("INFERPLANE_MAX_REQUEST_BYTES", 64 << 20))
    return Stack(m.group(1), m.group(2), m.group(3), m.group(4), proc, log, repository, limit)


def stop_stack(stack: Stack) -> int:
    return stop_stacks(stack)[0]


def stop_stacks(*stacks: Stack) -> list[int]:
    """SIGTERM to every stack at once, then each gets 30 s before SIGKILL: their graceful stops (each
    Triton unloading its models, seconds) overlap. The exit codes, in order."""
    for stack in stacks:
        stack.process.send_signal(signal.SIGTERM)
    codes = []
    for stack in stacks:
        try:
            codes.append(stack.process.wait(30))
        except subprocess.TimeoutExpired:
            stack.process.kill()
            codes.append(stack.process.wait(10))
    return codes


