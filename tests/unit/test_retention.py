"""Retention and erasure (``server.control.registry.retention``) on real SQLite and real record folders, and the
``inferplane data`` commands (key rotation, rewrap, purge) on them."""

from __future__ import annotations

import asyncio
import json
import time

import sqlalchemy as sa
from typer.testing import CliRunner

from server.control.registry import retention
from server.control.registry.audit_buffer import AuditWriter
from server.control.registry.envelope import KeyRing, new_key, seal_line
from server.control.registry.records import RecordFiles
from server.settings import Settings

DAY = 86400.0


def _settings(tmp_path, **extra) -> Settings:
    return Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path}/platform.db", **extra)


def _write(settings, keys, kind: str, records: list[dict]) -> RecordFiles:
    destination, prefix = {"payload_logs": (settings.payload_log_destination, "payloads-"), "shadow_records": (settings.shadow_record_destination, "shadow-")}[kind]
    files = RecordFiles(destination, prefix, keys)
    files.append([seal_line(keys, r) for r in records], f"{prefix}0001.jsonl")
    return files


def _audit(settings) -> list[dict]:
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text("select actor, action, target, outcome, detail from audit_log order by id"))]
    finally:
        engine.dispose()


def test_a_pass_deletes_what_is_older_than_each_kinds_retention_and_audits_it(tmp_path):
    now = time.time()
    keys = KeyRing.parse(new_key())
    s = _settings(tmp_path, retention_days={"payload_logs": 7, "audit": 30})
    payloads = _write(s, keys, "payload_logs", [
        {"ts": now - 8 * DAY, "tenant": "a", "text": "old"}, {"ts": now - 1 * DAY, "tenant": "a", "text": "new"},
    ])  # fmt: skip
    shadows = _write(s, keys, "shadow_records", [{"ts": now - 100 * DAY, "tenant": "a", "text": "no retention set"}])
    writer = AuditWriter(s.database_url)
    writer.write_many([{"at": now - 40 * DAY, "actor": "x", "action": "deploy", "target": "m"}, {"at": now, "actor": "y", "action": "deploy", "target": "m"}])
    writer.close()

    seen: list[dict] = []
    results = asyncio.run(retention.RetentionJob(s, seen.append).run_once(keys))

    assert {r.target: r.removed for r in results} == {"audit": 1, "payload_logs": 1}
    assert [r["text"] for r in payloads.read()] == ["new"]
    assert [r["text"] for r in shadows.read()] == ["no retention set"]  # a kind without an entry is kept
    assert [r["actor"] for r in _audit(s)] == ["y"]
    assert {(r["action"], r["target"]) for r in seen} == {("retention.purge", "audit"), ("retention.purge", "payload_logs")}


def test_purge_by_tenant_erases_payloads_and_shadow_records_and_records_the_erasure(tmp_path):
    keys = KeyRing.parse(new_key())
    s = _settings(tmp_path)
    now = time.time()
    payloads = _write(s, keys, "payload_logs", [{"ts": now, "tenant": t, "text": f"from {t}"} for t in ("a", "b", "a")])
    shadows = _write(s, keys, "shadow_records", [{"ts": now, "tenant": "a", "text": "shadow"}])

    counts = retention.purge_tenant(s, "a", "dpo", keys=keys)

    assert counts["payload_logs"] == 2 and counts["shadow_records"] == 1 and counts["usage"] is None
    assert [r["tenant"] for r in payloads.read()] == ["b"]
    assert list(shadows.read()) == []
    (row,) = _audit(s)
    assert (row["actor"], row["action"], row["target"], row["outcome"]) == ("dpo", "data.purge", "tenant:a", "ok")
    assert "payload_logs=2" in row["detail"] and "from a" not in row["detail"]


def test_the_data_commands_rotate_rewrap_and_purge(tmp_path, monkeypatch):
    from server.cli.main import app

    key_file = tmp_path / "keys.json"
    for name, value in {"INFERPLANE_DATA_DIR": str(tmp_path), "INFERPLANE_DATABASE_URL": f"sqlite:///{tmp_path}/p.db", "INFERPLANE_ENCRYPTION_KEY_FILE": str(key_file)}.items():
        monkeypatch.setenv(name, value)
    runner = CliRunner()
    first = runner.invoke(app, ["data", "add-key", "--key-file", str(key_file), "--key-id", "k1"])
    assert first.exit_code == 0, first.output
    s = Settings()
    files = _write(s, KeyRing.from_settings(s), "payload_logs", [{"ts": time.time(), "tenant": "a", "text": "sealed under k1"}])

    second = runner.invoke(app, ["data", "add-key", "--key-file", str(key_file), "--key-id", "k2"])
    assert second.exit_code == 0 and "k2" in second.output
    assert [r["text"] for r in RecordFiles(files.destination, "payloads-", KeyRing.load_file(key_file)).read()] == ["sealed under k1"]

    rewrapped = runner.invoke(app, ["data", "rewrap"])
    assert rewrapped.exit_code == 0, rewrapped.output
    assert json.loads(rewrapped.output) == {"rewrapped": {"payload_logs": 1, "shadow_records": 0}, "primary": "k2"}
    doc = json.loads(key_file.read_text())
    del doc["keys"]["k1"]  # the old key retired: the data is still readable
    key_file.write_text(json.dumps(doc))
    assert [r["text"] for r in RecordFiles(files.destination, "payloads-", KeyRing.load_file(key_file)).read()] == ["sealed under k1"]

    purged = runner.invoke(app, ["data", "purge", "--tenant", "a", "--actor", "dpo"])
    assert purged.exit_code == 0, purged.output
    assert json.loads(purged.output)["deleted"]["payload_logs"] == 1
    assert list(files.read()) == []
