"""Session fixtures: the demo model repository and the real stack (frontend + embedded Triton).

The stack is started once per test session as ``inferplane serve`` in a subprocess, on ports it
picks itself (0) and prints on its ready line; the fixture fails fast with the log when the
process dies, and terminates (then kills) it at the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

READY = re.compile(r"inferplane ready grpc=(\S+) metrics=(\S+)(?: http=(\S+))? triton=embedded@(\S+)")
START_TIMEOUT_S = 180
MAX_REQUEST_BYTES = 4 << 20  # the test stack's request size limit (the default is 64 MiB)


@dataclass
class Stack:
    grpc: str  # host:port of the frontend's gRPC
    metrics: str  # host:port of /metrics
    http: str | None  # host:port of the REST bridge, when it runs
    triton: str  # host:port of the embedded Triton's gRPC (for direct comparisons)
    process: subprocess.Popen
    log: Path
    repository: Path
    max_request_bytes: int = MAX_REQUEST_BYTES

    def triton_pid(self) -> int:
        import psutil

        for child in psutil.Process(self.process.pid).children(recursive=True):
            if child.name() == "tritonserver":
                return child.pid
        raise RuntimeError("no tritonserver child")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def demo_repository(tmp_path_factory) -> Path:
    from model_repository.demo import build_demo_repository

    out = tmp_path_factory.mktemp("demo") / "model_repository"
    build_demo_repository(out)
    add_cached_copy(out, "lightgbm_regressor", CACHED_MODEL)
    return out


CACHED_MODEL = "lightgbm_cached"


def add_cached_copy(repository: Path, source: str, name: str) -> None:
    """A copy of a demo model with Triton's response cache enabled in its config."""
    import shutil

    from model_repository.config_writer import read_config, write_config

    shutil.copytree(repository / source, repository / name)
    config = read_config(repository / name)
    config.name = name
    config.response_cache.enable = True
    write_config(config, repository / name)


def start_stack(repository: Path, workdir: Path, *extra: str) -> Stack:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "frontend.log"
    cmd = [
        sys.executable, "-m", "server.cli", "serve",
        "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
        "--model-repository", str(repository), "--workdir", str(workdir / "run"), *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", INFERPLANE_MAX_REQUEST_BYTES=str(MAX_REQUEST_BYTES),
               INFERPLANE_STATS_POLL_S="0.5")
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env, text=True)
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
    if not done.wait(START_TIMEOUT_S) or "m" not in found:
        proc.kill()
        raise RuntimeError(f"stack did not become ready:\n{''.join(lines)}\n{log.read_text(errors='replace')[-4000:]}")
    m = found["m"]
    return Stack(m.group(1), m.group(2), m.group(3), m.group(4), proc, log, repository)


def stop_stack(stack: Stack) -> int:
    stack.process.send_signal(signal.SIGTERM)
    try:
        return stack.process.wait(30)
    except subprocess.TimeoutExpired:
        stack.process.kill()
        return stack.process.wait(10)


@pytest.fixture(scope="session")
def stack(demo_repository, tmp_path_factory):
    s = start_stack(demo_repository, tmp_path_factory.mktemp("stack"))
    yield s
    stop_stack(s)


@pytest.fixture
def grpc_client(stack):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(stack.grpc)
    yield client
    client.close()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
