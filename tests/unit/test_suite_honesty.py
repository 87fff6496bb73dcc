"""The suite's own honesty: a waiting step fails when what it waits for never happens, no poller's result
is dropped, no test skips on a timing, and every real service of tests/services.py has a suite that
needs it (so the run's summary, and CI, can tell whether it ran)."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

from tests.conftest import poll, wait_until
from tests.services import SERVICES

TESTS = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def _modules() -> tuple[tuple[Path, ast.Module], ...]:
    return tuple((path, ast.parse(path.read_text(), str(path))) for path in sorted(TESTS.rglob("*.py")))


def test_wait_until_fails_the_test_when_it_never_happens_and_returns_the_value_when_it_does():
    with pytest.raises(AssertionError, match=r"not true within 0\.05 s: .*lambda: \[\].*last value \[\]\); the state seen"):
        wait_until(lambda: [], timeout=0.05, interval=0.01, explain=lambda: "the state seen")
    seen = iter([0, None, {"ready": 1}])
    assert wait_until(lambda: next(seen), timeout=5, interval=0.001) == {"ready": 1}
    assert poll(lambda: 0, timeout=0.02, interval=0.01) == 0  # poll hands a timeout back to its caller


def test_no_test_drops_a_pollers_result():
    dropped = [
        f"{path.relative_to(TESTS)}:{node.lineno}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "poll"
    ]
    assert not dropped, f"poll()'s result dropped (use wait_until, which fails the test): {dropped}"


def test_no_test_skips_on_a_timing():
    # measurements belong to loadtest/ benchmarks (BENCHMARKS.md); a test asserts behaviour
    timed = [
        f"{path.relative_to(TESTS)}:{node.lineno}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "skip"
        and any(word in ast.unparse(node).lower() for word in ("slower", "faster", "too slow", "timing", " ms", "latency"))
    ]  # fmt: skip
    assert not timed, timed


def test_every_real_service_has_a_suite_that_needs_it():
    marked = {
        node.args[0].value
        for _, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("mark.service") and node.args and isinstance(node.args[0], ast.Constant)
    }
    uses_redis = any("redis_url" in {a.arg for a in node.args.args} for _, tree in _modules() for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"))
    assert marked | ({"redis"} if uses_redis else set()) == set(SERVICES), sorted(marked)
