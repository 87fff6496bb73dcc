"""tests/mutation/mutate.py: a module's mutmut folder counts as measured only once mutmut wrote its
results file; a folder a run left without one (stopped while generating, or a clean run that failed)
must not be scored as 0 mutants at 100 % (how fair_queue and rollout.traffic once read 0, issue 34)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "mutation" / "mutate.py"


@pytest.fixture
def mutate(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mutate_tool", _PATH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mutate_tool", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "WORK", tmp_path)
    return module


def test_a_folder_without_mutmuts_results_file_is_not_measured(mutate, tmp_path):
    module = "batching.fair_queue"
    assert not mutate.measured(module)  # no folder
    (tmp_path / module / "mutants" / "batching").mkdir(parents=True)
    assert not mutate.measured(module)  # a run that stopped before writing its results
    (tmp_path / module / "mutants" / "batching" / "fair_queue.py.meta").write_text("{}")
    assert mutate.measured(module)
    assert not mutate.measured("server.control.rollout.traffic")  # another module's results are not this one's
