"""Batch jobs' store and worker over a real database (SQLite; PostgreSQL where one is configured): validation, tenant scoping, leases,
each row committed once, resume after a lost worker, cancel and expiry (the row runner is a
function here; the real stack runs rows through the data plane: tests/integration/test_batches.py)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from server import migrations
from server.control.registry.artifacts import ArtifactStore
from server.control.batches.batches import BatchStore, BatchWorker
from server.db import make_engine
from server.errors import Conflict, InvalidRequest, ModelNotFound, Overloaded
from tests.unit.test_batch_jobs import Clock, migrated_sqlite
from tests.unit.test_registry import db_url  # noqa: F401 - the fixture: SQLite, and PostgreSQL where CI has one

EP = "/v2/models/m/infer"


@pytest.fixture
def store(db_url, tmp_path):
    if db_url.startswith("sqlite:///"):  # a copy of a database migrated once (the migrations take a second or more)
        shutil.copyfile(migrated_sqlite(), db_url.removeprefix("sqlite:///"))
    engine = make_engine(db_url)
    if not db_url.startswith("sqlite:///"):
        migrations.upgrade(engine)
    yield BatchStore(engine, ArtifactStore(tmp_path / "artifacts"), clock=Clock())
    engine.dispose()


def _jsonl(n: int, endpoint: str = EP) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": {"x": i}}).encode() + b"\n" for i in range(n))


def _job(store: BatchStore, n: int = 5, tenant: str = "acme", window: str = "24h") -> str:
    f = store.create_file(tenant, "in.jsonl", "batch", _jsonl(n))
    return store.create_batch(tenant, "", f["id"], EP, window, {"k": "v"})["id"]


def _lines(store: BatchStore, tenant: str, file_id: str) -> list[dict]:
    return [json.loads(line) for line in store.file_content(tenant, file_id).splitlines()]


def test_bad_input_files_are_refused_naming_the_line(store):
    bad = _jsonl(2) + b'{"custom_id": "r0", "method": "POST", "url": "/v2/models/m/infer", "body": {}}\n' + b"not json\n"
    f = store.create_file("acme", "bad.jsonl", "batch", bad)
    with pytest.raises(InvalidRequest) as err:
        store.create_batch("acme", "", f["id"], EP, "24h", None)
    fields = [v.field for v in err.value.violations]
    assert fields == ["line 3.custom_id", "line 4"]
    other = store.create_file("acme", "x.jsonl", "batch", _jsonl(1, "/v1/embeddings"))
    with pytest.raises(InvalidRequest, match="url"):
        store.create_batch("acme", "", other["id"], EP, "24h", None)
    with pytest.raises(InvalidRequest, match="endpoint"):
        store.create_batch("acme", "", f["id"], "/v1/images", "24h", None)
    with pytest.raises(InvalidRequest, match="completion_window"):
        store.create_batch("acme", "", f["id"], EP, "tomorrow", None)
    with pytest.raises(InvalidRequest, match="purpose"):
        store.create_file("acme", "x", "fine-tune", b"{}")


def test_another_tenant_sees_nothing(store):
    job = _job(store)
    f = store.retrieve("acme", job)["input_file_id"]
    for call in (lambda: store.retrieve("globex", job), lambda: store.cancel("globex", job), lambda: store.file_content("globex", f)):
        with pytest.raises(ModelNotFound):
            call()
    assert store.list("globex")["data"] == [] and [b["id"] for b in store.list("acme")["data"]] == [job]


def test_rows_commit_once_and_a_second_worker_cannot_take_a_held_lease(store):
    job = _job(store, 4)
    assert store.claim("w1", 30).id == job
    assert store.claim("w2", 30) is None  # held
    status, rows = store.next_rows(job, "w1", 30, 3)
    assert status == "in_progress" and [r.index for r in rows] == [0, 1, 2]
    assert store.commit_rows(job, "w1", 30, [(0, "done", 200, '{"y":0}'), (1, "done", 200, '{"y":1}')]) == 2
    assert store.commit_rows(job, "w1", 30, [(1, "done", 200, '{"y":"again"}')]) == 0  # never twice
    assert store.commit_rows(job, "w2", 30, [(2, "done", 200, "{}")]) == -1  # no lease: nothing committed
    store.clock.now += 31  # w1's lease lapses (killed): w2 takes the job over and sees only what is pending
    assert store.claim("w2", 30).id == job
    assert store.next_rows(job, "w1", 30, 10) is None and store.commit_rows(job, "w1", 30, [(2, "done", 200, "{}")]) == -1
    _, rows = store.next_rows(job, "w2", 30, 10)
    assert [r.index for r in rows] == [2, 3]
    assert store.commit_rows(job, "w2", 30, [(2, "done", 200, '{"y":2}'), (3, "failed", 400, '{"error":{"message":"bad","code":"INVALID_ARGUMENT"}}')]) == 2
    assert store.finalize(job, "w2", "completed")
    doc = store.retrieve("acme", job)
    assert doc["status"] == "completed" and doc["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    out = _lines(store, "acme", doc["output_file_id"])
    assert [(o["custom_id"], o["response"]["body"]["y"]) for o in out] == [("r0", 0), ("r1", 1), ("r2", 2)]
    assert [(e["custom_id"], e["error"]["code"]) for e in _lines(store, "acme", doc["error_file_id"])] == [("r3", "INVALID_ARGUMENT")]
    assert store.claim("w3", 30) is None  # ended jobs are never claimed


async def test_the_worker_resumes_a_job_another_worker_left_and_equals_a_one_shot_run(store):
    async def run_row(endpoint, body, tenant):
        return 200, {"y": body["x"] * 2, "tenant": tenant}

    job = _job(store, 10)
    assert store.claim("dead", 5).id == job  # a worker that takes the job, commits some rows and dies
    _, rows = store.next_rows(job, "dead", 5, 4)
    store.commit_rows(job, "dead", 5, [(r.index, "done", 200, json.dumps({"y": int(r.custom_id[1:]) * 2, "tenant": "acme"})) for r in rows])
    store.clock.now += 6
    worker = BatchWorker(store, run_row, owner="alive", lease_s=5, concurrency=2, row_batch=3)
    await worker.work(store.claim("alive", 5))
    assert worker.rows_done == 6  # only the rows the dead worker left
    doc = store.retrieve("acme", job)
    assert doc["status"] == "completed" and doc["request_counts"]["completed"] == 10
    resumed = _lines(store, "acme", doc["output_file_id"])
    one_shot = _job(store, 10)
    await BatchWorker(store, run_row, owner="fresh").work(store.claim("fresh", 5))
    whole = _lines(store, "acme", store.retrieve("acme", one_shot)["output_file_id"])
    assert [o["custom_id"] for o in resumed] == [f"r{i}" for i in range(10)]
    assert [o["response"]["body"] for o in resumed] == [o["response"]["body"] for o in whole]


async def test_cancel_stops_within_one_row_batch_and_expiry_keeps_completed_rows(store):
    job = _job(store, 9)
    calls = []

    async def run_row(endpoint, body, tenant):
        calls.append(body["x"])
        if len(calls) == 3:
            store.cancel("acme", job)  # arrives while the first row batch runs
        return 200, {"y": body["x"]}

    await BatchWorker(store, run_row, owner="w", concurrency=3, row_batch=3).work(store.claim("w", 30))
    doc = store.retrieve("acme", job)
    assert doc["status"] == "cancelled" and calls == [0, 1, 2] and doc["request_counts"]["completed"] == 3
    assert [e["error"]["code"] for e in _lines(store, "acme", doc["error_file_id"])] == ["batch_cancelled"] * 6
    with pytest.raises(Conflict):
        store.cancel("acme", _finished(store))

    job = _job(store, 6, window="60s")

    async def slow(endpoint, body, tenant):
        store.clock.now += 25  # each row batch (2 rows) takes 50 s of the 60 s window
        return 200, {"y": body["x"]}

    await BatchWorker(store, slow, owner="w", concurrency=2, row_batch=2).work(store.claim("w", 300))
    doc = store.retrieve("acme", job)
    assert doc["status"] == "expired" and doc["request_counts"]["completed"] == 4
    assert [o["custom_id"] for o in _lines(store, "acme", doc["output_file_id"])] == ["r0", "r1", "r2", "r3"]


async def test_a_rows_domain_error_has_the_error_tables_status_and_code(store):
    async def run_row(endpoint, body, tenant):
        raise ModelNotFound(f"unknown model 'm{body['x']}'")

    job = _job(store, 1)
    await BatchWorker(store, run_row, owner="w").work(store.claim("w", 30))
    (line,) = _lines(store, "acme", store.retrieve("acme", job)["error_file_id"])
    assert line["response"]["status_code"] == 404  # not a 500: the caller's model does not exist
    assert line["error"] == {"code": "NOT_FOUND", "message": "unknown model 'm0'"}


def _finished(store: BatchStore) -> str:
    job = _job(store, 1)
    store.claim("f", 30)
    store.commit_rows(job, "f", 30, [(0, "done", 200, "{}")])
    store.finalize(job, "f", "completed")
    return job


async def test_a_row_refused_for_load_stays_pending_and_runs_later(store):
    job = _job(store, 3)
    refused = {1}

    async def run_row(endpoint, body, tenant):
        if body["x"] in refused:
            refused.clear()
            raise Overloaded("busy", retry_after_s=0.01)
        return 200, {"y": body["x"]}

    await BatchWorker(store, run_row, owner="w", concurrency=3, poll_s=0.001).work(store.claim("w", 30))
    doc = store.retrieve("acme", job)
    assert doc["status"] == "completed" and doc["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert [o["custom_id"] for o in _lines(store, "acme", doc["output_file_id"])] == ["r0", "r1", "r2"]


def test_the_cli_progress_line_says_rows_rate_and_eta():
    from server.cli.batch import progress

    assert progress(0, 100, 0.0) == "[" + "." * 30 + "] 0/100 rows  0.0 rows/s  ETA ?"
    assert progress(50, 100, 10.0) == "[" + "#" * 15 + "." * 15 + "] 50/100 rows  5.0 rows/s  ETA 10s"
    assert progress(100, 100, 20.0).endswith("100/100 rows  5.0 rows/s  ETA 0s")


def test_batch_rows_are_metered_apart_from_realtime_through_the_fleet_tap():
    from server.dataplane.fleet_hooks import UsageTap
    from server.tenancy.metering import Meter

    meter = Meter(lambda records: len(records), 60.0)
    tap = UsageTap(meter)
    tap.record("acme", "risk", "m", "1", compute_us=5)
    tap.record("acme", "risk", "m", "1", compute_us=7, traffic_class="batch")
    tap.record("acme", "risk", "m", "1", compute_us=9, traffic_class="batch")
    by_class = {r.traffic_class: (r.requests, r.compute_us) for r in meter.drain()}
    assert by_class == {"realtime": (1, 5), "batch": (2, 16)} and tap.requests["m"] == 3


async def test_a_stopping_worker_gives_its_lease_back_and_leaves_rows_in_flight_pending(store):
    job = _job(store, 6)
    started, never = asyncio.Event(), asyncio.Event()

    async def run_row(endpoint, body, tenant):
        started.set()
        await never.wait()  # in flight when the worker stops
        return 200, {}

    task = asyncio.create_task(BatchWorker(store, run_row, owner="stopping", concurrency=2, poll_s=0.001).run())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.claim("next", 30).id == job  # at once: no lease to wait out
    _, rows = store.next_rows(job, "next", 30, 10)
    assert [r.index for r in rows] == list(range(6))  # nothing in flight was committed
