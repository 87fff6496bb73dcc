"""What a new user meets first, tried as they would: `serve` on a missing or an empty repository,
settings from the environment, the registry in one stable place, `demo build` registering its
models, and listings that say why they are empty."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_repository.composite_demo import FRAUD_MEMBERS, TABULAR_COMPOSITES
from loadtest.stack import start_stack, stop_stack
from server.runtime.supervisor import free_port

pytestmark = pytest.mark.integration


def _cli(*args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli.main", *args],
        env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture
def fresh_env(tmp_path) -> dict[str, str]:
    """A user with nothing set up: their own data dir, auth off, no database URL in the environment."""
    env = {"INFERPLANE_DATA_DIR": str(tmp_path / "data"), "INFERPLANE_AUTH": "off"}
    for key in ("INFERPLANE_DATABASE_URL", "INFERPLANE_ARTIFACT_STORE", "INFERPLANE_TENANCY_DATABASE_URL"):
        env[key] = ""
    return env


def test_serve_on_a_missing_repository_is_one_line(tmp_path, fresh_env):
    out = _cli("serve", "--model-repository", str(tmp_path / "nowhere"), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", env=fresh_env)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model repository") and "inferplane demo build" in lines[0], out.stderr


def test_an_empty_repository_starts_and_settings_come_from_the_environment(tmp_path, fresh_env):
    empty = tmp_path / "repo"
    empty.mkdir()
    port = free_port()
    env = {**fresh_env, "INFERPLANE_GRPC_PORT": str(port)}
    # start_stack passes --grpc-port 0; this stack is started by hand so the environment decides the port
    log = tmp_path / "frontend.log"
    cmd = [sys.executable, "-m", "server.cli.main", "serve", "--model-repository", str(empty), "--http-port", "0",
           "--metrics-port", "0", "--workdir", str(tmp_path / "run")]  # fmt: skip
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, text=True)
    try:
        line = ""
        for line in proc.stdout:
            if line.startswith("inferplane ready"):
                break
        assert line.startswith("inferplane ready"), log.read_text()[-3000:]
        assert f"grpc=127.0.0.1:{port} " in line  # INFERPLANE_GRPC_PORT, not the flag's default
        registry = re.search(r"registry=(\S+)", line).group(1)
        assert registry == f"sqlite:///{tmp_path / 'data' / 'inferplane.db'}"  # in the data dir, whatever the cwd
        listed = _cli("endpoints", "list", "--url", f"127.0.0.1:{port}", env=env)
        assert listed.returncode == 0 and listed.stdout.strip().startswith("no endpoints"), listed.stdout + listed.stderr
    finally:
        proc.terminate()
        proc.wait(30)


def test_demo_build_registers_its_models_where_serve_finds_them(tmp_path, fresh_env):
    other = tmp_path / "elsewhere"
    other.mkdir()
    empty = _cli("models", "list", env=fresh_env, cwd=other)
    assert empty.returncode == 0 and empty.stdout.startswith("no models registered in sqlite:///"), empty.stdout + empty.stderr
    usage = _cli("usage", env=fresh_env, cwd=other)
    assert usage.returncode == 0 and "metered for authenticated tenants only" in usage.stdout, usage.stdout + usage.stderr
    repo = tmp_path / "repo"
    built = _cli("demo", "build", "--out", str(repo), "--no-llm", "--no-smollm2", env=fresh_env, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    registered = next(line for line in built.stdout.splitlines() if line.startswith("registered "))
    assert {"mlp_classifier:1", "fraud_xgboost:1", "lightgbm_regressor:1"} <= set(re.findall(r"\w+:\d+", registered)), built.stdout
    listed = _cli("models", "list", env=fresh_env, cwd=other)  # another folder: the same registry
    names = {line.split("\t")[0] for line in listed.stdout.splitlines()}
    # the tabular demos, and the tabular composites with their members (the text ones need the LLM build)
    assert names == {"mlp_classifier", "fraud_xgboost", "lightgbm_regressor", *FRAUD_MEMBERS, *TABULAR_COMPOSITES}, listed.stdout
    again = _cli("demo", "build", "--out", str(repo), "--no-llm", "--no-smollm2", env=fresh_env, cwd=tmp_path)
    assert "fraud_xgboost:1," in again.stdout and "fraud_xgboost:2" not in again.stdout  # same bytes: the same version
    # a serving frontend lists the served demo models, marked as not deployed through the registry
    stack = start_stack(repo, tmp_path / "stack", env=fresh_env)
    try:
        listed = _cli("endpoints", "list", "--url", stack.grpc, env=fresh_env)
        lines = {line.split("\t")[0]: line for line in listed.stdout.splitlines()}
        assert set(lines) == {"mlp_classifier", "fraud_xgboost", "lightgbm_regressor", *FRAUD_MEMBERS, *TABULAR_COMPOSITES}, listed.stdout
        assert all("not deployed: served from the model repository" in line for line in lines.values())
    finally:
        stop_stack(stack)
