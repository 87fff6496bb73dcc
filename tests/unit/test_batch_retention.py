"""Batch files at rest: sealed in the store when an encryption key is set, erased per tenant, and
aged out by retention — over a real SQLite database and a real store folder (the files' bytes on disk
are read back to check)."""

from __future__ import annotations

import base64
import json

import pytest
from sqlalchemy import func, select

from server import migrations
from server.control.registry import retention
from server.control.batches.batches import BatchFiles, BatchStore, file_store, files_table, rows_table
from server.db import make_engine
from server.errors import ModelNotFound
from server.settings import Settings

EP = "/v2/models/m/infer"


def _settings(tmp_path, **extra) -> Settings:
    key = base64.b64encode(bytes(range(32))).decode()
    return Settings(
        database_url=f"sqlite:///{tmp_path}/registry.db", artifact_store=str(tmp_path / "artifacts"),
        encryption_key=key, model_repository=tmp_path, **extra,
    )  # fmt: skip


def _jsonl(tag: str, n: int = 3) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{tag}{i}", "method": "POST", "url": EP, "body": {"secret": f"{tag}-payload-{i}"}}).encode() + b"\n" for i in range(n))


def _store(settings, clock=None):
    engine = make_engine(settings.database_url)
    migrations.upgrade(engine)
    return BatchStore(engine, file_store(settings), **({"clock": clock} if clock else {})), engine


def _blobs(tmp_path) -> list[bytes]:
    return [p.read_bytes() for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]


def test_batch_files_are_sealed_on_disk_and_read_back_in_the_clear(tmp_path):
    settings = _settings(tmp_path)
    store, engine = _store(settings)
    try:
        data = _jsonl("alpha")
        doc = store.create_file("alpha", "in.jsonl", "batch", data)
        on_disk = _blobs(tmp_path)
        assert on_disk and all(b"alpha-payload" not in blob for blob in on_disk)  # no plaintext at rest
        assert store.file_content("alpha", doc["id"]) == data
    finally:
        engine.dispose()


def test_purge_tenant_erases_its_jobs_and_files_and_keeps_the_others(tmp_path):
    settings = _settings(tmp_path)
    store, engine = _store(settings)
    try:
        mine = store.create_file("alpha", "a.jsonl", "batch", _jsonl("alpha"))
        shared = _jsonl("same")  # the same bytes uploaded by both tenants: one blob
        store.create_file("alpha", "s.jsonl", "batch", shared)
        theirs_shared = store.create_file("beta", "s.jsonl", "batch", shared)
        theirs = store.create_file("beta", "b.jsonl", "batch", _jsonl("beta"))
        job = store.create_batch("alpha", "team", mine["id"], EP, "24h", None)
        counts = retention.purge_tenant(settings, "alpha", actor="test", audit=lambda records: None)
        assert counts["batch_files"] == 2
        assert store.list("alpha")["data"] == []
        with pytest.raises(ModelNotFound):
            store.get_file("alpha", mine["id"])
        with pytest.raises(ModelNotFound):
            store.retrieve("alpha", job["id"])
        # the other tenant keeps its files, including the bytes it shared with the erased tenant
        assert store.file_content("beta", theirs["id"]) == _jsonl("beta")
        assert store.file_content("beta", theirs_shared["id"]) == shared
    finally:
        engine.dispose()


def test_retention_ages_out_finished_jobs_and_old_files_but_not_a_running_job(tmp_path):
    now = [1_000_000.0]
    settings = _settings(tmp_path, retention_days={"batch_files": 1})
    store, engine = _store(settings, clock=lambda: now[0])
    try:
        running_in = store.create_file("alpha", "r.jsonl", "batch", _jsonl("running"))
        running = store.create_batch("alpha", "team", running_in["id"], EP, "24h", None)
        done_in = store.create_file("alpha", "d.jsonl", "batch", _jsonl("done"))
        done = store.create_batch("alpha", "team", done_in["id"], EP, "24h", None)
        store.cancel("alpha", done["id"])
        for owner in ("w1", "w2"):  # workers take the jobs; the cancelled one is finalized cancelled
            job = store.claim(owner, 30.0)
            if job is not None and job.id == done["id"]:
                assert store.finalize(job.id, owner, "cancelled")
        assert store.retrieve("alpha", done["id"])["status"] == "cancelled"
        results = retention.enforce(settings, now=now[0] + 2 * 86400.0)
        assert [r.target for r in results] == ["batch_files"]
        fresh = store.create_file("alpha", "f.jsonl", "batch", _jsonl("fresh"))
        kept = {f["id"] for f in _files(engine)}
        assert running_in["id"] in kept  # a job still running keeps its input
        assert done_in["id"] not in kept and fresh["id"] in kept
        assert store.retrieve("alpha", running["id"])["status"] in ("validating", "in_progress")
    finally:
        engine.dispose()


def _files(engine) -> list[dict]:
    with engine.connect() as conn:
        return [{"id": r.id} for r in conn.execute(select(files_table.c.id))]


def _job_at(store, tenant: str, tag: str, created: float, end: str | None = None) -> tuple[dict, dict]:
    """A file and a job on it made at ``created``; ``end``: the job is then finalized that way."""
    store.clock = lambda: created
    f = store.create_file(tenant, f"{tag}.jsonl", "batch", _jsonl(tag, 1))
    job = store.create_batch(tenant, "", f["id"], EP, "24h", None)
    if end is not None:
        assert store.claim(tag, 30).id == job["id"]
        store.finalize(job["id"], tag, end)
    return f, job


def test_purge_before_drops_what_ended_before_the_cutoff_and_nothing_at_or_after_it(tmp_path):
    settings = _settings(tmp_path)
    store, engine = _store(settings)
    try:
        cutoff = 10_000.0
        old_in, old_done = _job_at(store, "alpha", "old", cutoff - 1, end="completed")
        edge_in, edge_done = _job_at(store, "alpha", "edge", cutoff, end="cancelled")
        live_in, live = _job_at(store, "alpha", "live", cutoff - 5000)  # still running: keeps its old input
        other_in, other = _job_at(store, "beta", "other", cutoff + 1)
        stray = store.create_file("alpha", "stray.jsonl", "batch", _jsonl("old", 1))  # the same bytes as old_in: one blob
        blobs = len(_blobs(tmp_path))
        assert BatchFiles(settings).purge_before(cutoff) == 2  # old_in and old's output file
        for gone in (lambda: store.retrieve("alpha", old_done["id"]), lambda: store.get_file("alpha", old_in["id"])):
            with pytest.raises(ModelNotFound):
                gone()
        assert store.retrieve("alpha", edge_done["id"])["status"] == "cancelled" and store.get_file("alpha", edge_in["id"])
        assert store.retrieve("alpha", live["id"])["request_counts"]["total"] == 1 and store.get_file("alpha", live_in["id"])
        assert store.claim("w", 30).id == live["id"] and [r.index for r in store.next_rows(live["id"], "w", 30, 10)[1]] == [0]  # kept jobs keep their rows
        assert store.file_content("alpha", stray["id"]) == _jsonl("old", 1)  # a blob another file names stays
        assert len(_blobs(tmp_path)) == blobs - 1  # old's output blob, named by no one now, left the store
        assert store.file_content("beta", other_in["id"])
    finally:
        engine.dispose()


def test_purging_a_tenant_takes_its_running_jobs_and_their_inputs_too(tmp_path):
    settings = _settings(tmp_path)
    store, engine = _store(settings)
    try:
        live_in, live = _job_at(store, "alpha", "live", 1000.0)
        kept_in, kept = _job_at(store, "beta", "kept", 1000.0)
        assert BatchFiles(settings).purge_tenant("alpha") == 1
        with pytest.raises(ModelNotFound):
            store.get_file("alpha", live_in["id"])
        assert _blobs(tmp_path) and store.claim("w", 30).id == kept["id"]
        assert [r.index for r in store.next_rows(kept["id"], "w", 30, 10)[1]] == [0]
        with engine.connect() as conn:  # the erased jobs' rows (their request bodies) are gone from the table too
            assert conn.execute(select(func.count()).select_from(rows_table).where(rows_table.c.job_id == live["id"])).scalar_one() == 0
    finally:
        engine.dispose()
