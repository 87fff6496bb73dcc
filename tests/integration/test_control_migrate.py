"""Migrations run exactly once however many processes start together: four ``inferplane control
migrate`` processes released at the same moment (each waits, CLI imported, for one go-file) on an
empty PostgreSQL database and on an empty SQLite file — one migrates, the other three wait on the
migration lock and find the schema at head, all four exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from server import migrations
from server.db import make_engine, normalize_url
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

POSTGRES_ENV = "INFERPLANE_TEST_POSTGRES_URL"
RELEASE = """
import os, sys, time
from server.cli.main import app
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
app(["control", "migrate"])
"""


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_database(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/fresh.db"
        return
    base = os.environ.get(POSTGRES_ENV)
    if not base:
        pytest.skip(f"no PostgreSQL server: set {POSTGRES_ENV} (.ci/run installs and starts one)")
    base = normalize_url(base)
    name = f"inferplane_migrate_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_four_processes_starting_together_migrate_once(empty_database, tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "INFERPLANE_DATABASE_URL": empty_database, "INFERPLANE_DATA_DIR": str(tmp_path / "data")}
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
    engine = make_engine(empty_database)
    try:
        assert migrations.current(engine) == head
    finally:
        engine.dispose()
