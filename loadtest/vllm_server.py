"""vLLM's own OpenAI server outside Triton, started with the command line and environment the
adapter (``model_repository/adapters/_vllm_core.py``) uses: the "standalone" baseline of the LLM
benchmarks (``loadtest.llm_bench --vllm-standalone``, ``loadtest.llm_spec --draft-layers``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def start(config, model_dir: Path, log_path: Path, extra_argv: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start the server for ``config`` (a ``VLLMConfig``) on ``model_dir``; (process, base URL), not yet healthy."""
    from model_repository.adapters._vllm_core import _free_port, server_command, server_environment

    port = _free_port()
    argv = server_command(config, str(model_dir), port) + list(extra_argv or [])
    proc = subprocess.Popen(argv, env=server_environment(config), stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float = 900) -> None:
    """Return once ``base/health`` answers; raise (with the log's tail) if the server exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM ({base}) exited with {proc.returncode}: {Path(log_path).read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vLLM ({base}) did not come up in {timeout:.0f} s")


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill each server's process group (its engine core and workers with it)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=30)
