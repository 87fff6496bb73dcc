"""The backend contract and the model port, checked statically: mypy (pyproject's ``[tool.mypy]``)
finds TritonClient, ReplicaSet, InProcessTriton and the unit tests' FakeBackend to be
``server.dataplane.backend.Backend``s and the DataPlane to be the ``server.dataplane.port.ModelPort``
its features call (tests/backend_conformance.py); the same check fails for a backend or a port whose
signature drifted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mypy(*files: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *files], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_every_backend_implements_the_protocol():
    result = _mypy()
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_drifted_backend_fails_the_check(tmp_path):
    """What the check would miss if it checked nothing: a ``model_config`` without ``version``, a
    stream without ``report_kv``."""
    drifted = tmp_path / "drifted_backend.py"
    source = (ROOT / "tests/backend_fake.py").read_text()
    source = source.replace("async def model_config(self, name: str, version: str = \"\")", "async def model_config(self, name: str)")
    source = source.replace("def report_kv(self, utilisation: float) -> None:", "def report_kv_gone(self, utilisation: float) -> None:")
    drifted.write_text(source + "\n\nfrom server.dataplane.backend import Backend\n\nchecked: Backend = FakeBackend()\n")
    result = _mypy(str(drifted))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "model_config" in result.stdout and "stream_raw" in result.stdout, result.stdout  # its stream is no BackendStream


DRIFTED_PORT = """
from collections.abc import AsyncIterator

from server.dataplane.port import Answered, Chunk, GenerateParams, ModelPort


class DriftedPort:
    async def infer(self, request, raw=None, timeout=None, ctx=None, count_tokens=None) -> Answered:
        raise NotImplementedError

    async def generate(self, model: str, params: GenerateParams, timeout=None, ctx=None) -> Chunk:
        raise NotImplementedError

    async def engine_stats(self, model: str) -> dict:
        raise NotImplementedError

    async def submit(self, call, request, data, signature) -> bytes:
        raise NotImplementedError

    def resolve_for(self, ctx, name, version=""):
        raise NotImplementedError

    def signature(self, name):
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    def visible(self, ctx, names) -> list[str]:
        raise NotImplementedError


checked: ModelPort = DriftedPort()
"""


def test_a_drifted_port_fails_the_check(tmp_path):
    """A data plane whose ``generate`` answers the whole chunk instead of the stream of them is no
    ``ModelPort``; the same class with the port's ``generate`` is one."""
    drifted = tmp_path / "drifted_port.py"
    drifted.write_text(DRIFTED_PORT)
    result = _mypy(str(drifted))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DriftedPort" in result.stdout and "ModelPort" in result.stdout and "generate" in result.stdout, result.stdout
    kept = tmp_path / "kept_port.py"
    kept.write_text(DRIFTED_PORT.replace("async def generate(self, model: str, params: GenerateParams, timeout=None, ctx=None) -> Chunk:",
                                         "def generate(self, model: str, params: GenerateParams, timeout=None, ctx=None) -> AsyncIterator[Chunk]:"))
    result = _mypy(str(kept))
    assert result.returncode == 0, result.stdout + result.stderr
