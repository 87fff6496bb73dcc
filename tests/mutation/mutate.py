"""Mutation testing of the modules where a wrong line is a security or correctness incident.

``make mutate`` runs this: for each module of :data:`MODULES`, mutmut (pinned in the ``test`` extra)
mutates that one file and runs only the module's UNIT tests against each mutant. Each module has a
work folder of its own (``var/mutation/<module>/``: a ``pyproject.toml`` that names the module and
its tests, links to the sources), so a rerun only retests what changed. The survivors, with their
diffs, go to ``benchmarks/mutation/report.md`` and ``results.json``; the score per module is printed.

A survivor that cannot change behaviour (an equivalent mutant) is listed in ``equivalent.toml``
beside this file with the reason; it leaves the score's denominator. A listed mutant whose diff no
longer matches (the code moved on) counts as a survivor again until it is looked at anew.

    python tests/mutation/mutate.py                       # every module
    python tests/mutation/mutate.py server.dataplane.validation --min-score 90
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mutmut.configuration import reset_config
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: this checkout's tests/, not another one's
    sys.path.insert(0, str(ROOT))

from tests.mutation.scores import MODULES, source_sha256  # noqa: E402 - after the path

WORK = ROOT / "var" / "mutation"
EQUIVALENT = Path(__file__).with_name("equivalent.toml")
REPORT = ROOT / "benchmarks" / "mutation"

KILLED = {"killed", "timeout", "caught by type check"}
SOURCE_HASH = "source.sha256"  # in a module's work folder: the sha256 of the source its last run mutated


@dataclass
class Survivor:
    name: str
    status: str
    diff: str
    reason: str = ""  # set when the mutant is a listed equivalent


@dataclass
class Score:
    module: str
    total: int = 0
    killed: int = 0
    survivors: list[Survivor] = field(default_factory=list)
    equivalent: list[Survivor] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # listed equivalents whose diff no longer matches
    unchecked: int = 0  # mutants the last run did not get to (interrupted): in no count
    source_sha256: str | None = None  # of the source the last run mutated (None: a folder from before hashes)

    @property
    def counted(self) -> int:
        return self.total - len(self.equivalent) - self.unchecked

    @property
    def percent(self) -> float:
        return 100.0 * self.killed / self.counted if self.counted else 100.0


def changed_lines(diff: str) -> list[str]:
    """The removed and added lines of a unified diff, stripped: what identifies a mutation."""
    return [
        line[0] + line[1:].strip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def load_equivalents(path: Path = EQUIVALENT) -> dict[str, dict]:
    if not path.exists():
        return {}
    return {entry["mutant"]: entry for entry in tomllib.loads(path.read_text()).get("equivalent", [])}


def _workdir(module: str, tests: list[str]) -> Path:
    """The module's own mutmut folder: links to the sources and tests, and a config naming the module."""
    work = WORK / module
    work.mkdir(parents=True, exist_ok=True)
    package = module.split(".")[0]
    for name in (package, "tests"):
        link = work / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    config = {
        "source_paths": [package],
        "only_mutate": [module.replace(".", "/") + ".py"],
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:cacheprovider"],
        "use_git_change_detection": False,
    }
    text = "[tool.mutmut]\n" + _toml(config) + "\n[tool.pytest.ini_options]\n" + _toml(pytest_ini)
    pyproject = work / "pyproject.toml"
    if not pyproject.exists() or pyproject.read_text() != text:
        pyproject.write_text(text)
    return work


def _toml(table: dict) -> str:
    """The flat tables written here (strings, numbers, lists of strings) in TOML; json quoting is TOML's."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())


def run_module(module: str, tests: list[str], children: int, survivors_only: bool = False) -> None:
    """One mutmut pass over the module; ``survivors_only``: retest just the mutants the last pass left alive."""
    work = _workdir(module, tests)
    mutmut = Path(sys.executable).with_name("mutmut")
    names: list[str] = []
    if survivors_only and measured(module):
        names = [v.name for v in score_module(module, {}).survivors]
        if not names:
            return
    # the hash of the source this run mutates: results.json records it, the test run's summary
    # compares it with the source of its checkout (stale when they differ; tests/mutation/scores.py)
    (work / SOURCE_HASH).write_text(source_sha256(module, ROOT) + "\n")
    log = work / "mutmut.log"  # mutmut's progress spinner: kept out of the terminal, read it there when a run fails
    with log.open("w") as out:
        done = subprocess.run(["nice", "-n", "10", str(mutmut), "run", "--max-children", str(children), *names], cwd=work, env=_test_env(), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"mutmut failed on {module} (exit {done.returncode}): see {log.relative_to(ROOT)}")


def _test_env() -> dict[str, str]:
    """The environment of the mutants' test runs. mutmut runs a copy of ``tests/`` inside the work
    folder, where ``var/postgres_url`` (written by ``make provision``) is not: its URL is passed on
    as the variable tests/services.py reads first, so the PostgreSQL cases run instead of erroring."""
    env = dict(os.environ)
    url_file = ROOT / "var" / "postgres_url"
    if "INFERPLANE_TEST_POSTGRES_URL" not in env and url_file.exists():
        env["INFERPLANE_TEST_POSTGRES_URL"] = url_file.read_text().strip()
    return env


def measured(module: str) -> bool:
    """Whether the module's mutmut folder holds results: mutmut writes ``mutants/<file>.meta`` once it
    has generated the mutants. A folder without it (a run stopped while generating, or one whose
    clean test run failed) has no results: scoring it would read 0 mutants at 100 %, so it is
    carried or reported "never measured" instead."""
    return (WORK / module / "mutants" / (module.replace(".", "/") + ".py.meta")).exists()


def score_module(module: str, equivalents: dict[str, dict]) -> Score:
    """Read the module's results out of its mutmut folder (mutmut's own reader, run in that folder)."""
    work = WORK / module
    path = Path(module.replace(".", "/") + ".py")
    score = Score(module)
    if (work / SOURCE_HASH).exists():
        score.source_sha256 = (work / SOURCE_HASH).read_text().strip()
    cwd = Path.cwd()
    os.chdir(work)
    try:
        reset_config()
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in sorted(data.exit_code_by_key.items()):
            status = status_by_exit_code[code]
            score.total += 1
            if status == "not checked":
                score.unchecked += 1
                continue
            if status in KILLED:
                score.killed += 1
                continue
            survivor = Survivor(name, status, get_diff_for_mutant(name, path=path))
            listed = equivalents.get(name)
            if listed is not None and changed_lines(survivor.diff) == changed_lines(listed["diff"]):
                survivor.reason = listed["reason"]
                score.equivalent.append(survivor)
            else:
                if listed is not None:
                    score.stale.append(name)
                score.survivors.append(survivor)
    finally:
        os.chdir(cwd)
        reset_config()
    return score


def _entry(s: Score) -> dict:
    return {
        "tests": MODULES[s.module],
        "mutants": s.total,
        "killed": s.killed,
        "equivalent": len(s.equivalent),
        "survived": len(s.survivors),
        "not_checked": s.unchecked,
        "score_percent": round(s.percent, 1),
        "survivors": [{"mutant": v.name, "status": v.status, "diff": v.diff} for v in s.survivors],
        "equivalents": [{"mutant": v.name, "reason": v.reason, "diff": v.diff} for v in s.equivalent],
        "stale_equivalents": s.stale,
        "source_sha256": s.source_sha256,
    }


def write_report(scores: list[Score], out: Path = REPORT) -> dict[str, dict]:
    """Write results.json and report.md: the modules scored now, and, for a configured module with no
    mutmut folder here (not run on this checkout), its entry from the results.json already there,
    marked ``"carried": true`` (a run of one module does not erase the others' last scores)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    now = {s.module: _entry(s) for s in scores}
    results = {}
    for module in MODULES:
        if module in now:
            results[module] = now[module]
        elif module in previous:
            results[module] = {**previous[module], "carried": True}
    path.write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Mutation testing: survivors per module",
        "",
        "Written by `make mutate` (`tests/mutation/mutate.py`, mutmut, unit tests only). Score = killed /",
        "(mutants - equivalent - not checked); an equivalent mutant is listed with the reason it cannot change",
        "behaviour; \"not checked\": the last run was stopped before it got to them (they are in no count).",
        "A module marked *carried* was not run on the checkout that wrote this report: its row is its last",
        "recorded result.",
        "",
        "| module | mutants | killed | equivalent | survived | not checked | score |",
        "|---|---|---|---|---|---|---|",
    ]
    for module, r in results.items():
        carried = " (carried)" if r.get("carried") else ""
        lines.append(
            f"| `{module}`{carried} | {r['mutants']} | {r['killed']} | {r['equivalent']} | {r['survived']} | {r['not_checked']} | {r['score_percent']:.1f} % |"
        )
    for module, r in results.items():
        stale = set(r.get("stale_equivalents", []))
        if r["survivors"]:
            lines += ["", f"## Survivors: `{module}`", ""]
            for v in r["survivors"]:
                note = " (listed as equivalent, but its diff changed: look again)" if v["mutant"] in stale else ""
                lines += [f"### `{v['mutant']}`: {v['status']}{note}", "", "```diff", v["diff"], "```", ""]
        if r["equivalents"]:
            lines += ["", f"## Equivalent: `{module}`", ""]
            for v in r["equivalents"]:
                lines += [f"- `{v['mutant']}`: {v['reason']}", "", "  ```diff", *("  " + d for d in changed_lines(v["diff"])), "  ```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"dotted names (default: all of {', '.join(MODULES)})")
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--report-only", action="store_true", help="score the last runs without running mutmut")
    parser.add_argument("--survivors", action="store_true", help="retest only the mutants the last run left alive (after adding tests)")
    parser.add_argument("--min-score", type=float, default=0.0, help="exit 1 when a module scores below this percent")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"not a configured module: {', '.join(unknown)}")
    modules = args.modules or list(MODULES)
    equivalents = load_equivalents()
    for module in modules:
        if not args.report_only:
            print(f"== {module} ({' '.join(MODULES[module])})", flush=True)
            run_module(module, MODULES[module], args.children, args.survivors)
    ran = [m for m in MODULES if measured(m)]
    scores = [score_module(m, equivalents) for m in ran]
    results = write_report(scores)
    print(f"\n{'module':40} {'mutants':>8} {'killed':>7} {'equiv':>6} {'survived':>9} {'unchecked':>10} {'score':>7}")
    for module, r in results.items():
        carried = "  (carried: not run here)" if r.get("carried") else ""
        print(f"{module:40} {r['mutants']:8} {r['killed']:7} {r['equivalent']:6} {r['survived']:9} {r['not_checked']:10} {r['score_percent']:6.1f}%{carried}")
    print(f"\nreport: {(REPORT / 'report.md').relative_to(ROOT)}")
    missing = [m for m in modules if m not in results]
    if missing:
        print(f"never measured: {', '.join(missing)}")
    low = [m for m in modules if m not in results or results[m]["score_percent"] < args.min_score]
    if low:
        print(f"below {args.min_score:.0f} %: {', '.join(low)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
