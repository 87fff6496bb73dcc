"""The committed mutation scores, read without mutmut: what the test run's summary prints.

``tests/mutation/mutate.py`` scores each module of :data:`MODULES` and records in
``benchmarks/mutation/results.json`` its score and the sha256 of the source it mutated. The summary of
every test run (``tests/conftest.py``) reads that file, no mutmut run: a module's committed score, and
**stale** when its source no longer has the recorded hash (changed since it was measured, or measured
before hashes were recorded). Under CI a module below :data:`MIN_SCORE`, or never measured, fails the
run; a stale one gets a loud line only (TESTING.md, "The score in the test run's summary").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "mutation" / "results.json"
MIN_SCORE = 90.0

# module -> its unit test files (the fast net: the integration suite is the second one)
MODULES: dict[str, list[str]] = {
    "server.tenancy.identity": ["tests/unit/test_tenancy.py", "tests/unit/test_identity_policy.py"],
    "server.tenancy.quota_policy": ["tests/unit/test_quota_policy.py", "tests/unit/test_tenancy.py"],
    "server.dataplane.validation": ["tests/unit/test_validation.py", "tests/unit/test_validation_fast_path.py"],
    "server.control.registry.safe_formats": ["tests/unit/test_safe_formats.py"],
    "server.dataplane.idempotency": ["tests/unit/test_idempotency.py"],
    # fair_queue: test_overload_policy.py's fair-queue cases are its queue TTL and standing-queue behaviour
    "batching.fair_queue": ["tests/unit/test_fair_queue.py", "tests/unit/test_fair_queue_batch.py", "tests/unit/test_fair_queue_refusals.py", "tests/unit/test_overload_policy.py"],
    "server.dataplane.circuit_breaker": ["tests/unit/test_circuit_breaker.py"],
    "batching.autoscale_policy": ["tests/unit/test_autoscale_policy.py"],
    "server.dataplane.traffic_policy": ["tests/unit/test_traffic_policy.py"],
    "server.control.rollout.traffic": ["tests/unit/test_traffic_policy.py", "tests/unit/test_traffic_controller.py"],
    # batches: its SQLite cases only ("-k"): the PostgreSQL ones run the same statements, and a fresh
    # database each (seconds) for every mutant would not fit a pass (CI runs them in the unit suite)
    "server.control.batches.batches": ["tests/unit/test_batch_jobs.py", "tests/unit/test_batch_store.py", "tests/unit/test_batch_retention.py", "-k", "not postgresql"],
    "server.control.scaling.placement": ["tests/unit/test_placement.py", "tests/unit/test_failure_domains.py", "tests/unit/test_placement_mutants.py"],
    "server.control.scaling.remote_executor": ["tests/unit/test_remote_executor.py"],
}


def source_of(module: str, root: Path = ROOT) -> Path:
    return root / (module.replace(".", "/") + ".py")


def source_sha256(module: str, root: Path = ROOT) -> str | None:
    """The sha256 of the module's source as it is now; None when the file is gone."""
    path = source_of(module, root)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@dataclass(frozen=True)
class Standing:
    module: str
    score: float | None  # the committed score_percent; None: never measured
    stale: str = ""  # why the committed score may not be this source's ("" when it is)

    @property
    def below(self) -> bool:
        return self.score is None or self.score < MIN_SCORE


def standings(results_path: Path = RESULTS, root: Path = ROOT, modules=MODULES) -> list[Standing]:
    """Each configured module's committed score and whether its source changed since; [] without a
    results file (a checkout that has none, or the copy of ``tests/`` inside a mutmut work folder)."""
    if not results_path.exists():
        return []
    results = json.loads(results_path.read_text())
    out = []
    for module in modules:
        entry = results.get(module)
        if entry is None:
            out.append(Standing(module, None))
            continue
        recorded, now = entry.get("source_sha256"), source_sha256(module, root)
        if recorded is None:
            stale = "no source hash recorded"
        elif recorded != now:
            stale = "source changed since scored"
        else:
            stale = ""
        out.append(Standing(module, float(entry["score_percent"]), stale))
    return out


def summary_lines(found: list[Standing], ci: bool) -> list[str]:
    """The test run's summary lines: every score on one line, then the stale and the failing ones."""
    if not found:
        return []
    scores = ", ".join(f"{s.module} {s.score:.1f} %" if s.score is not None else f"{s.module} never measured" for s in found)
    lines = [f"mutation scores (committed, {RESULTS.relative_to(ROOT)}): {scores}"]
    stale = [s for s in found if s.stale]
    if stale:
        reasons = dict.fromkeys(s.stale for s in stale)
        named = "; ".join(f"{why}: {', '.join(s.module for s in stale if s.stale == why)}" for why in reasons)
        lines.append(f"MUTATION SCORE STALE, re-score with make mutate MUTATE_ARGS=\"<module>\" before stopping: {named}")
    below = [s.module for s in found if s.below]
    if below:
        lines.append(f"MUTATION SCORE BELOW {MIN_SCORE:.0f} % or never measured: {', '.join(below)}" + (" (CI: the run fails)" if ci else ""))
    return lines


def failing(found: list[Standing]) -> list[str]:
    """The modules that fail a CI run: below the goal or never measured (stale alone does not)."""
    return [s.module for s in found if s.below]
