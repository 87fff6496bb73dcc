"""A pytest plugin that writes each test's setup, call and teardown time as it ends, one line each
(seconds since the session began, duration, phase, outcome, node id; tab-separated), so a long run
can be read while it runs and a run cut short still tells where its time went. ``--durations``
only prints at the end. Measurement only; the suite asserts nothing with it (TESTING.md, "What CI runs").

    STEPTIMES_OUT=var/steptimes.tsv .venv/bin/python -m pytest -p loadtest.pytest_steptimes ...
"""

from __future__ import annotations

import os
import time

_STARTED = time.monotonic()


def pytest_runtest_logreport(report) -> None:
    out = os.environ.get("STEPTIMES_OUT", "var/steptimes.tsv")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        f.write(f"{time.monotonic() - _STARTED:.1f}\t{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
