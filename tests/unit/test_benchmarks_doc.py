"""Every figure has its output: each result path BENCHMARKS.md names (``benchmarks/...``: a file, a folder
or a glob, in a command's ``--json``/``--out`` or in the prose) is committed, and a named folder holds a
committed file. Committed, not only present: a git-ignored folder a benchmark left here passes on this machine
and fails in CI's clean clone (stop 44's one failure)."""

from __future__ import annotations

import re
import subprocess
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"benchmarks/[A-Za-z0-9_.*/-]*[A-Za-z0-9_*/]")


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) for every ``benchmarks/...`` path in ``text``."""
    return [(n, m.group(0).rstrip("/")) for n, line in enumerate(text.splitlines(), 1) for m in PATH.finditer(line)]


def test_the_pattern_finds_paths_in_commands_and_prose():
    text = "`python -m x --json benchmarks/a/b.json`, see benchmarks/c/ and (benchmarks/d.json).\nbenchmarks/e/*.json"
    assert [p for _, p in named_paths(text)] == ["benchmarks/a/b.json", "benchmarks/c", "benchmarks/d.json", "benchmarks/e/*.json"]


def committed(path: str, tracked: list[str]) -> bool:
    """Whether ``path`` (a file, a folder or a glob) names at least one of the ``tracked`` files."""
    return any(fnmatch(t, path) or t.startswith(path + "/") or fnmatch(t, path + "/*") for t in tracked)


def test_committed_reads_files_folders_and_globs():
    tracked = ["benchmarks/a/b.json", "benchmarks/c/d/e.md"]
    assert committed("benchmarks/a/b.json", tracked) and committed("benchmarks/c", tracked) and committed("benchmarks/c/*/e.md", tracked)
    assert not committed("benchmarks/a/b", tracked) and not committed("benchmarks/kserve/model_repository", tracked)


def test_every_result_path_benchmarks_md_names_exists():
    named = named_paths((ROOT / "BENCHMARKS.md").read_text())
    assert len(named) > 20  # the pattern still finds them
    tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    missing = [f"BENCHMARKS.md:{line}: {path}" for line, path in named if not committed(path, tracked)]
    assert not missing, "figures without their committed output:\n" + "\n".join(missing)
