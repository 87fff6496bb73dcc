"""Migrations run exactly once however many processes start together: four ``inferplane control
migrate`` processes released at the same moment (each waits, CLI imported, for one go-file) on an
empty PostgreSQL database and on an empty SQLite file — one migrates, the other three wait on the
migration lock and find the schema at head, all four exit 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server import migrations
from server.db import make_engine
from tests.conftest import wait_until
from tests.unit.test_registry import db_url  # noqa: F401 - a fixture: an empty SQLite file, an empty PostgreSQL database

pytestmark = pytest.mark.integration

RELEASE = """
import os, sys, time
from server.cli.main import app
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
app(["control", "migrate"])
"""


def test_four_processes_starting_together_migrate_once(db_url, tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "INFERPLANE_DATABASE_URL": db_url, "INFERPLANE_DATA_DIR": str(tmp_path / "data")}
    ready = [tmp_path / f"ready-{i}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", RELEASE, str(go), str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ready]
    try:
        assert wait_until(lambda: all(r.exists() or p.poll() is not None for r, p in zip(ready, procs)), 120)
        go.touch()  # every process is past its imports and polling: released at once
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-2000:] for _, err in results]
    lines = [out.strip() for out, _ in results]
    head = migrations.head()
    assert sum(line.endswith(f"from empty to {head}") for line in lines) == 1, lines
    assert sum(line.endswith(f"already at {head}") for line in lines) == 3, lines
    engine = make_engine(db_url)
    try:
        assert migrations.current(engine) == head
    finally:
        engine.dispose()
