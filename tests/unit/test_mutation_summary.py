"""The mutation scores in the test run's summary (issue 34): tests/mutation/scores.py reads the
results.json that tests/mutation/mutate.py writes, marks a module stale when its source changed since
it was scored, and names the modules that fail CI (below 90 % or never measured; stale alone does not)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.mutation import scores

_MUTATE = Path(__file__).resolve().parents[1] / "mutation" / "mutate.py"
MODULE = "server.dataplane.circuit_breaker"
OTHER = "batching.autoscale_policy"


@pytest.fixture
def mutate(monkeypatch):
    spec = importlib.util.spec_from_file_location("mutate_tool", _MUTATE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mutate_tool", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def root(tmp_path):
    """A checkout with the two modules' sources."""
    for module, text in ((MODULE, "def trip():\n    return True\n"), (OTHER, "LIMIT = 3\n")):
        path = scores.source_of(module, tmp_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _score(mutate, module, root, killed, total, hashed=True):
    return mutate.Score(module, total=total, killed=killed, source_sha256=scores.source_sha256(module, root) if hashed else None)


def _report(mutate, root, *scored):
    """results.json as mutate.py writes it, in the checkout's benchmarks/mutation/."""
    mutate.write_report(list(scored), out=root / "benchmarks" / "mutation")
    return root / "benchmarks" / "mutation" / "results.json"


def test_results_record_the_hash_of_the_source_scored(mutate, root):
    results = json.loads(_report(mutate, root, _score(mutate, MODULE, root, 95, 100)).read_text())
    assert results[MODULE]["source_sha256"] == scores.source_sha256(MODULE, root)
    assert len(results[MODULE]["source_sha256"]) == 64


def test_an_unchanged_source_keeps_its_score_fresh(mutate, root):
    path = _report(mutate, root, _score(mutate, MODULE, root, 95, 100), _score(mutate, OTHER, root, 9, 10))
    found = scores.standings(path, root, [MODULE, OTHER])
    assert found == [scores.Standing(MODULE, 95.0), scores.Standing(OTHER, 90.0)]
    assert scores.failing(found) == []
    lines = scores.summary_lines(found, ci=True)
    assert len(lines) == 1 and f"{MODULE} 95.0 %" in lines[0] and f"{OTHER} 90.0 %" in lines[0]


def test_a_changed_source_makes_its_score_stale_but_not_failing(mutate, root):
    path = _report(mutate, root, _score(mutate, MODULE, root, 95, 100), _score(mutate, OTHER, root, 10, 10))
    scores.source_of(MODULE, root).write_text("def trip():\n    return False\n")  # one line changed after scoring
    found = scores.standings(path, root, [MODULE, OTHER])
    assert [(s.module, s.stale) for s in found] == [(MODULE, "source changed since scored"), (OTHER, "")]
    assert scores.failing(found) == []  # stale gets a loud line, not a failed run
    stale = [line for line in scores.summary_lines(found, ci=True) if line.startswith("MUTATION SCORE STALE")]
    assert len(stale) == 1 and MODULE in stale[0] and OTHER not in stale[0] and "make mutate" in stale[0]


def test_a_score_without_a_recorded_hash_is_stale(mutate, root):
    path = _report(mutate, root, _score(mutate, MODULE, root, 100, 100, hashed=False))
    assert scores.standings(path, root, [MODULE])[0].stale == "no source hash recorded"


def test_a_deleted_source_is_stale(mutate, root):
    path = _report(mutate, root, _score(mutate, MODULE, root, 100, 100))
    scores.source_of(MODULE, root).unlink()
    assert scores.standings(path, root, [MODULE])[0].stale == "source changed since scored"


def test_below_the_goal_fails_and_ninety_is_enough(mutate, root):
    path = _report(mutate, root, _score(mutate, MODULE, root, 89, 100), _score(mutate, OTHER, root, 90, 100))
    found = scores.standings(path, root, [MODULE, OTHER])
    assert scores.failing(found) == [MODULE]
    below = [line for line in scores.summary_lines(found, ci=True) if line.startswith("MUTATION SCORE BELOW")]
    assert len(below) == 1 and MODULE in below[0] and OTHER not in below[0] and below[0].endswith("(CI: the run fails)")
    assert not scores.summary_lines(found, ci=False)[-1].endswith("(CI: the run fails)")


def test_a_configured_module_never_measured_fails(mutate, root):
    path = _report(mutate, root, _score(mutate, MODULE, root, 100, 100))
    found = scores.standings(path, root, [MODULE, OTHER])
    assert found[1] == scores.Standing(OTHER, None)
    assert scores.failing(found) == [OTHER]
    assert f"{OTHER} never measured" in scores.summary_lines(found, ci=False)[0]


def test_no_results_file_prints_nothing(root):
    # a checkout without results, or the copy of tests/ inside a mutmut work folder
    found = scores.standings(root / "benchmarks" / "mutation" / "results.json", root, [MODULE])
    assert found == [] and scores.summary_lines(found, ci=True) == [] and scores.failing(found) == []


def test_the_committed_results_cover_every_configured_module():
    found = scores.standings()
    assert [s.module for s in found] == list(scores.MODULES)


def test_mutate_scores_the_modules_the_summary_reads(mutate):
    assert mutate.MODULES is scores.MODULES  # one table of modules and their tests
