"""Every figure has its output: each result path BENCHMARKS.md names (``benchmarks/...``: a file, a folder
or a glob, in a command's ``--json``/``--out`` or in the prose) is in the tree, and a named folder is not
empty."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"benchmarks/[A-Za-z0-9_.*/-]*[A-Za-z0-9_*/]")


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) for every ``benchmarks/...`` path in ``text``."""
    return [(n, m.group(0).rstrip("/")) for n, line in enumerate(text.splitlines(), 1) for m in PATH.finditer(line)]


def test_the_pattern_finds_paths_in_commands_and_prose():
    text = "`python -m x --json benchmarks/a/b.json`, see benchmarks/c/ and (benchmarks/d.json).\nbenchmarks/e/*.json"
    assert [p for _, p in named_paths(text)] == ["benchmarks/a/b.json", "benchmarks/c", "benchmarks/d.json", "benchmarks/e/*.json"]


def test_every_result_path_benchmarks_md_names_exists():
    named = named_paths((ROOT / "BENCHMARKS.md").read_text())
    assert len(named) > 20  # the pattern still finds them
    missing = []
    for line, path in named:
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found or any(p.is_dir() and not any(p.iterdir()) for p in found):
            missing.append(f"BENCHMARKS.md:{line}: {path}")
    assert not missing, "figures without their committed output:\n" + "\n".join(missing)
