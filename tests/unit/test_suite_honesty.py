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


# the suite's pollers that hand a timeout back as their last value instead of failing: a statement calling one
# and dropping the value waits, then passes whatever happened
RETURNING_POLLERS = {"poll", "_wait_for", "wait_for", "wait_async", "_until_all", "_settled"}


def dropped_poller_results(tree: ast.Module) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr):
            call = node.value.value if isinstance(node.value, ast.Await) else node.value
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in RETURNING_POLLERS:
                out.append(node.lineno)
    return out


def test_the_dropped_result_finder_sees_plain_and_awaited_calls():
    tree = ast.parse("async def t():\n    poll(f)\n    await _wait_for(r, d)\n    assert await _wait_for(r, d)\n    await asyncio.wait_for(x, 1)\n")
    assert dropped_poller_results(tree) == [2, 3]


def test_no_test_drops_a_pollers_result():
    dropped = [f"{path.relative_to(TESTS)}:{line}" for path, tree in _modules() for line in dropped_poller_results(tree)]
    assert not dropped, f"a poller's result dropped (assert it, or use wait_until, which fails the test): {dropped}"


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


_CLOCKS = {"perf_counter", "monotonic", "time", "clock", "perf_counter_ns", "monotonic_ns"}


def _reads_a_clock_difference(node: ast.AST) -> bool:
    """``node`` holds ``<clock>() - x`` (time.monotonic, perf_counter, time.time, the loadtest's clock)."""
    return any(
        isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub)
        and any(isinstance(c, ast.Call) and (getattr(c.func, "attr", None) or getattr(c.func, "id", None)) in _CLOCKS for c in ast.walk(sub))
        for sub in ast.walk(node)
    )  # fmt: skip


def _a_number(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and ast.unparse(node.func) in {"pytest.approx", "approx"} and node.args:
        node = node.args[0]
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float))


def timed_assertions(tree: ast.Module) -> list[int]:
    """Lines of asserts that compare an elapsed time (a clock difference, or a name assigned one in the same
    function) with a fixed number: what a slower machine fails."""
    lines = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elapsed = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _reads_a_clock_difference(n.value) for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assert):
                continue
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [cmp.left, *cmp.comparators]
                for a, b in zip(sides, sides[1:]):
                    for timed, bound in ((a, b), (b, a)):
                        if _a_number(bound) and ((isinstance(timed, ast.Name) and timed.id in elapsed) or _reads_a_clock_difference(timed)):
                            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_timed_assertion_finder_finds_what_it_should_and_nothing_else():
    timed = ast.parse(
        "def t():\n"
        "    t0 = time.monotonic()\n"
        "    wall_ms = (time.perf_counter() - t0) * 1000\n"
        "    assert wall_ms < 1000\n"
        "    assert clock() - t0 == pytest.approx(1.2, abs=0.3)\n"
        "    assert 1.5 <= time.time() - t0 <= 3.5\n"
    )  # fmt: skip
    assert timed_assertions(timed) == [4, 5, 6]
    honest = ast.parse(
        "def t():\n"
        "    t0 = time.monotonic()\n"
        "    elapsed = time.monotonic() - t0\n"
        "    assert 20.0 - elapsed - 0.05 <= retry <= 20.0\n"  # a bound measured around what it checks
        "    assert stats.ok == 400 and lat['p90'] >= 50\n"
    )  # fmt: skip
    assert timed_assertions(honest) == []


def test_no_test_asserts_an_elapsed_time_against_a_fixed_bound():
    # non-negotiable 4: how long something took is a benchmark's figure (loadtest/, BENCHMARKS.md)
    found = [f"{path.relative_to(TESTS)}:{line}" for path, tree in _modules() for line in timed_assertions(tree)]
    assert not found, found


def test_the_session_keeps_its_data_out_of_the_users_data_dir(session_data_dir):
    import subprocess
    import sys

    from server.settings import Settings, default_data_dir

    assert Settings().data_dir == session_data_dir and session_data_dir != default_data_dir()
    child = subprocess.run([sys.executable, "-c", "from server.settings import Settings; print(Settings().data_dir)"], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == str(session_data_dir), child.stderr  # and every process the suite starts
