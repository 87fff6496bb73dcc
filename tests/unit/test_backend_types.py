"""The backend contract, checked statically: mypy (pyproject's ``[tool.mypy]``) finds TritonClient,
ReplicaSet, InProcessTriton and the unit tests' FakeBackend to be ``server.dataplane.backend.Backend``s
(tests/backend_conformance.py), and the same check fails for a backend whose signature drifted."""

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
