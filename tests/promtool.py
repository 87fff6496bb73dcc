"""promtool (Debian's prometheus, provisioned by `make provision`) for the alert-rule tests: `check rules`,
`test rules`, and the same tests run against a copy of the rules with one alert's expression changed (the
tests can fail)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.services import require


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([require("promtool"), *args], capture_output=True, text=True, cwd=cwd)


def rules_test_with_alert_changed(rules: Path, tests: Path, folder: Path, alert: str, edit: Callable[[str], str]) -> subprocess.CompletedProcess:
    """``promtool test rules`` on copies in ``folder`` where ``alert``'s expression is ``edit(expr)``."""
    doc = yaml.safe_load(rules.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = edit(rule["expr"])
    (folder / rules.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(tests, folder / tests.name)
    return promtool("test", "rules", tests.name, cwd=folder)
