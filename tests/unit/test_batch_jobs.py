"""Batch jobs as a caller and a worker see them (``server.control.batches.batches``), over a real
SQLite database: what each file and job document says, which input a job refuses and how the refusal
names the line, the listing's order and pages, cancel, the lease's exact boundaries, what a row's
answer becomes in the output and error files, and the worker's loop (the mutation pass of batches.py:
each test states a behaviour a wrong line there would change). Commits, resume and expiry over
SQLite and PostgreSQL: tests/unit/test_batch_store.py."""

from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import event, insert, select, update

from server import migrations
from server.control.batches import batches
from server.control.batches.batches import BatchStore, BatchWorker, jobs_table, parse_rows
from server.control.registry.artifacts import ArtifactStore
from server.db import make_engine
from server.errors import BackendUnavailable, Conflict, InvalidRequest, ModelNotFound, ModelNotReady, Overloaded

EP = "/v2/models/m/infer"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


_TEMPLATE: list[Path] = []


def migrated_sqlite() -> Path:
    """A SQLite database file at the migrations' head, made once per process (the migrations take a
    second or more; a test copies the file). Kept for the process, so the mutation pass's runs reuse it."""
    if not _TEMPLATE or not _TEMPLATE[0].exists():
        folder = Path(tempfile.mkdtemp(prefix="inferplane-batches-"))
        atexit.register(shutil.rmtree, folder, True)
        engine = make_engine(f"sqlite:///{folder}/template.db")
        migrations.upgrade(engine)
        engine.dispose()
        _TEMPLATE[:] = [folder / "template.db"]
    return _TEMPLATE[0]


@pytest.fixture
def store(tmp_path):
    shutil.copyfile(migrated_sqlite(), tmp_path / "batches.db")
    engine = make_engine(f"sqlite:///{tmp_path}/batches.db")
    yield BatchStore(engine, ArtifactStore(tmp_path / "artifacts"), clock=Clock())
    engine.dispose()


def _line(i: int, endpoint: str = EP, **fields) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": {"x": i}, **fields}


def _jsonl(docs) -> bytes:
    return b"".join(json.dumps(d).encode() + b"\n" for d in docs)


def _job(store: BatchStore, n: int = 3, tenant: str = "acme", window: str = "24h", endpoint: str = EP, metadata=None) -> str:
    f = store.create_file(tenant, "in.jsonl", "batch", _jsonl(_line(i, endpoint) for i in range(n)))
    return store.create_batch(tenant, "team", f["id"], endpoint, window, metadata)["id"]


def _refusal(call) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        call()
    return err.value


def _fields(err: InvalidRequest) -> list[tuple[str, str]]:
    return [(v.field, v.description) for v in err.violations]


def _lines(store: BatchStore, tenant: str, file_id: str) -> list[dict]:
    return [json.loads(line) for line in store.file_content(tenant, file_id).splitlines()]


# ---- files ------------------------------------------------------------------------------------------


def test_a_file_reads_back_as_the_document_its_upload_answered(store):
    data = _jsonl([_line(0)])
    store.clock.now = 1234.9
    doc = store.create_file("acme", "in.jsonl", "batch", data)
    assert doc["id"].startswith("file-") and len(doc["id"]) == 37
    assert {k: v for k, v in doc.items() if k != "id"} == {
        "object": "file", "bytes": len(data), "created_at": 1234, "filename": "in.jsonl", "purpose": "batch", "status": "processed"
    }
    assert store.get_file("acme", doc["id"]) == doc
    assert store.file_content("acme", doc["id"]) == data
    assert store.create_file("acme", "in.jsonl", "batch", data)["id"] != doc["id"]  # one id per upload, even of the same bytes


def test_a_file_without_a_name_is_upload_jsonl_and_a_long_name_is_cut_at_255(store):
    assert store.create_file("acme", "", "batch", b"{}")["filename"] == "upload.jsonl"
    assert store.create_file("acme", None, "batch", b"{}")["filename"] == "upload.jsonl"
    long = store.create_file("acme", "n" * 300, "batch", b"{}")
    assert long["filename"] == "n" * 255 and store.get_file("acme", long["id"])["filename"] == "n" * 255


def test_another_tenants_file_is_unknown_naming_the_file_id(store):
    doc = store.create_file("acme", "in.jsonl", "batch", b"{}")
    for call in (lambda: store.get_file("globex", doc["id"]), lambda: store.file_content("globex", doc["id"])):
        with pytest.raises(ModelNotFound) as err:
            call()
        assert [(v.field, v.description) for v in err.value.violations] == [("file_id", "unknown")]
        assert doc["id"] in err.value.message
    with pytest.raises(ModelNotFound):
        store.create_batch("globex", "", doc["id"], EP, "24h", None)
    with pytest.raises(InvalidRequest) as err:
        store.create_file("acme", "x", "fine-tune", b"{}")
    assert _fields(err.value) == [("purpose", "must be batch")]


# ---- what a job refuses -------------------------------------------------------------------------------


@pytest.mark.parametrize("window, seconds", [("30s", 30), ("90m", 5400), ("24h", 86400), ("168h", 604800), ("1s", 1)])
def test_a_completion_window_is_a_number_and_a_unit_and_sets_the_expiry(store, window, seconds):
    job = store.retrieve("acme", _job(store, window=window))
    assert job["completion_window"] == window and job["expires_at"] == 1000 + seconds and job["created_at"] == 1000


@pytest.mark.parametrize("window, description", [
    ("169h", "at most 168h"), ("10081m", "at most 168h"), ("0h", "must be like '24h'"), ("24d", "must be like '24h'"),
    ("24", "must be like '24h'"), ("1000000s", "must be like '24h'"), (" 24h", "must be like '24h'"), ("24h ", "must be like '24h'"), (24, "must be like '24h'"),
])  # fmt: skip
def test_a_bad_completion_window_is_refused_naming_the_field(store, window, description):
    f = store.create_file("acme", "in.jsonl", "batch", _jsonl([_line(0)]))
    err = _refusal(lambda: store.create_batch("acme", "", f["id"], EP, window, None))
    assert _fields(err) == [("completion_window", description)]
    assert err.message.startswith("completion_window")


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/embeddings", "/v1/completions", "/v2/models/m/infer", "/v2/models/m.v2_x-y/versions/12/infer"])
def test_every_batch_endpoint_is_accepted(store, endpoint):
    assert store.retrieve("acme", _job(store, endpoint=endpoint))["endpoint"] == endpoint


@pytest.mark.parametrize("endpoint", ["/v1/images", "/v2/models/m/versions/0/infer", "/v2/models/-m/infer", "/v2/models/m/infer/x", "x/v1/embeddings", None, 7])
def test_another_endpoint_is_refused_naming_the_field(store, endpoint):
    f = store.create_file("acme", "in.jsonl", "batch", _jsonl([_line(0)]))
    err = _refusal(lambda: store.create_batch("acme", "", f["id"], endpoint, "24h", None))
    assert _fields(err) == [("endpoint", "not a batch endpoint")]
    assert "/v1/chat/completions, /v1/embeddings, /v1/completions" in err.message


def test_each_bad_line_is_named_with_what_is_wrong(store):
    lines = [
        json.dumps(_line(0)), "", "not json", "[1, 2]", json.dumps({**_line(4), "custom_id": ""}),
        json.dumps({**_line(5), "custom_id": "r0"}), json.dumps({**_line(6), "method": "GET"}),
        json.dumps({**_line(7), "url": "/v1/embeddings"}), json.dumps({**_line(8), "body": [1]}),
        json.dumps({**_line(9), "custom_id": "c" * 513}), json.dumps({**_line(10), "custom_id": 10}),
    ]  # fmt: skip
    err = _refusal(lambda: parse_rows("\n".join(lines).encode(), EP))
    assert _fields(err) == [
        ("line 3", "is not valid JSON"),
        ("line 4", "must be a JSON object"),
        ("line 5.custom_id", "must be a non-empty string of up to 512 characters"),
        ("line 6.custom_id", "'r0' is not unique in the file"),
        ("line 7.method", "must be POST"),
        ("line 8.url", f"must be the batch's endpoint {EP}"),
        ("line 9.body", "must be a JSON object"),
        ("line 10.custom_id", "must be a non-empty string of up to 512 characters"),
        ("line 11.custom_id", "must be a non-empty string of up to 512 characters"),
    ]
    assert err.message == "the input file has bad lines: line 3 is not valid JSON"


def test_a_line_missing_its_fields_names_each_and_a_deep_line_is_not_json():
    err = _refusal(lambda: parse_rows(b"{}\n" + b"[" * 100_000 + b"\n", EP))
    assert _fields(err) == [
        ("line 1.custom_id", "must be a non-empty string of up to 512 characters"),
        ("line 1.url", f"must be the batch's endpoint {EP}"),
        ("line 1.body", "must be a JSON object"),
        ("line 2", "is not valid JSON"),
    ]


def test_a_good_line_is_kept_with_its_compact_body_and_method_defaults_to_post():
    rows = parse_rows(_jsonl([{"custom_id": "a" * 512, "url": EP, "body": {"x": [1, 2], "y": "z"}}, _line(1)]), EP)
    assert rows == [("a" * 512, '{"x":[1,2],"y":"z"}'), ("r1", '{"x":1}')]


def test_bad_lines_are_named_up_to_twenty_then_the_file_is_not_read_further():
    err = _refusal(lambda: parse_rows(b"not json\n" * 30, EP))
    assert [v.field for v in err.violations] == [f"line {n}" for n in range(1, 21)]
    two_each = _refusal(lambda: parse_rows(b"".join(json.dumps({"url": EP, "custom_id": ""}).encode() + b"\n" for _ in range(15)), EP))
    assert len(two_each.violations) == 20  # two a line: the tenth line reaches 20 and is the last one read


def test_a_file_not_utf8_empty_or_too_long_is_refused_naming_the_input_file(monkeypatch):
    assert _fields(_refusal(lambda: parse_rows(b"\xff\xfe", EP))) == [("input_file_id", "not UTF-8")]
    assert _fields(_refusal(lambda: parse_rows(b"\n  \n", EP))) == [("input_file_id", "empty")]
    monkeypatch.setattr(batches, "MAX_ROWS", 3)  # the limit itself (50,000) is a constant; this is its comparison
    assert len(parse_rows(_jsonl(_line(i) for i in range(3)), EP)) == 3
    err = _refusal(lambda: parse_rows(_jsonl(_line(i) for i in range(4)), EP))
    assert _fields(err) == [("input_file_id", "too many lines")] and err.message == "the input file has 4 requests; at most 3"


def test_a_job_needs_an_input_file_of_purpose_batch(store):
    for missing in (None, "", 7):
        err = _refusal(lambda: store.create_batch("acme", "", missing, EP, "24h", None))
        assert _fields(err) == [("input_file_id", "required")]
    job = _job(store, 1)
    store.claim("w", 30)
    store.commit_rows(job, "w", 30, [(0, "done", 200, "{}")])
    store.finalize(job, "w", "completed")
    output = store.retrieve("acme", job)["output_file_id"]
    err = _refusal(lambda: store.create_batch("acme", "", output, EP, "24h", None))
    assert _fields(err) == [("input_file_id", "not a batch input file")] and "batch_output" in err.message


@pytest.mark.parametrize("metadata", [{}, {"k": "v"}, {f"k{i}": "v" for i in range(16)}, {"k" * 64: "v" * 512}])
def test_metadata_of_up_to_16_short_string_pairs_is_kept(store, metadata):
    assert store.retrieve("acme", _job(store, metadata=metadata))["metadata"] == metadata


@pytest.mark.parametrize("metadata", [[], "k=v", {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, {"k": "v", "n": None}])
def test_metadata_of_another_shape_is_refused(store, metadata):
    f = store.create_file("acme", "in.jsonl", "batch", _jsonl([_line(0)]))
    err = _refusal(lambda: store.create_batch("acme", "", f["id"], EP, "24h", metadata))
    assert _fields(err) == [("metadata", "bad shape")]


# ---- the job document, the listing, cancel --------------------------------------------------------------


def test_a_new_job_reads_back_whole(store):
    f = store.create_file("acme", "in.jsonl", "batch", _jsonl(_line(i) for i in range(3)))
    store.clock.now = 1000.7
    doc = store.create_batch("acme", "", f["id"], EP, "90m", {"k": "v"})
    assert doc["id"].startswith("batch_") and len(doc["id"]) == 38
    assert doc == {
        "id": doc["id"], "object": "batch", "endpoint": EP, "errors": None, "input_file_id": f["id"], "completion_window": "90m",
        "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": 1000, "expires_at": 1000 + 5400,
        "in_progress_at": None, "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": None, "request_counts": {"total": 3, "completed": 0, "failed": 0}, "metadata": {"k": "v"},
    }  # fmt: skip


def test_a_running_jobs_counts_are_its_rows_so_far(store):
    job = _job(store, 4)
    store.claim("w", 30)
    store.commit_rows(job, "w", 30, [(0, "done", 200, "{}"), (1, "failed", 400, "{}"), (2, "done", 200, "{}")])
    assert store.retrieve("acme", job)["request_counts"] == {"total": 4, "completed": 2, "failed": 1}


def test_the_listing_is_newest_first_in_pages(store):
    jobs = []
    for t in (1000, 1001, 1001, 1002):
        store.clock.now = t
        jobs.append(_job(store, 1))
    newest = [jobs[3], *sorted(jobs[1:3], reverse=True), jobs[0]]  # a tie on created_at: the greater id first
    page = store.list("acme", limit=2)
    assert [d["id"] for d in page["data"]] == newest[:2] and page["object"] == "list"
    assert (page["first_id"], page["last_id"], page["has_more"]) == (newest[0], newest[1], True)
    rest = store.list("acme", after=page["last_id"], limit=2)
    assert [d["id"] for d in rest["data"]] == newest[2:] and rest["has_more"] is False
    assert [d["id"] for d in store.list("acme", after=newest[2])["data"]] == newest[3:]
    assert store.list("acme", after=newest[3]) == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    assert [d["id"] for d in store.list("acme", limit=4)["data"]] == newest and not store.list("acme", limit=4)["has_more"]
    assert [d["id"] for d in store.list("acme")["data"]] == newest  # the default page holds 20
    assert store.list("acme", limit=0)["data"][0]["id"] == newest[0] and len(store.list("acme", limit=-5)["data"]) == 1
    assert store.list("acme", limit=1)["data"][0] == store.retrieve("acme", newest[0])
    with pytest.raises(ModelNotFound):
        store.list("globex", after=jobs[0])


def test_a_page_holds_at_most_100(store):
    first = store.retrieve("acme", _job(store, 1))
    with store.engine.begin() as conn:  # 101 more jobs like it, in one statement (a create_batch each takes seconds here)
        row = dict(conn.execute(select(jobs_table).where(jobs_table.c.id == first["id"])).mappings().one())
        conn.execute(insert(jobs_table), [{**row, "id": f"batch_{i:032x}"} for i in range(101)])
    page = store.list("acme", limit=1000)
    assert len(page["data"]) == 100 and page["has_more"] is True
    assert len(store.list("acme")["data"]) == 20 and store.list("acme")["has_more"] is True  # the default page
    assert len(store.list("acme", limit=101)["data"]) == 100


def test_jobs_made_in_the_same_second_list_greatest_id_first_whatever_order_they_were_stored_in(store):
    first = store.retrieve("acme", _job(store, 1))
    stored = [f"batch_{i:032x}" for i in (3, 0, 5, 1, 4, 2)]  # neither ascending nor descending by id
    with store.engine.begin() as conn:
        row = dict(conn.execute(select(jobs_table).where(jobs_table.c.id == first["id"])).mappings().one())
        conn.execute(insert(jobs_table), [{**row, "id": i} for i in stored])
        # a later job with the least id and an earlier one with the greatest: time orders, not the id
        conn.execute(insert(jobs_table), [{**row, "id": "batch_" + "0" * 31 + "a", "created_at": row["created_at"] + 1},
                                          {**row, "id": "batch_" + "f" * 32, "created_at": row["created_at"] - 1}])  # fmt: skip
    newest = ["batch_" + "0" * 31 + "a", *sorted([first["id"], *stored], reverse=True), "batch_" + "f" * 32]
    assert [d["id"] for d in store.list("acme")["data"]] == newest
    pages, after = [], None
    for _ in range(len(newest)):  # bounded: a listing whose pages never end fails here instead of hanging
        page = store.list("acme", after=after, limit=2)
        pages += [d["id"] for d in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == newest and not page["has_more"]


def test_cancel_marks_the_job_cancelling_once_and_a_finished_job_refuses(store):
    job = _job(store)
    store.clock.now = 1010.5
    doc = store.cancel("acme", job)
    assert doc["status"] == "cancelling" and doc["cancelling_at"] == 1010
    store.clock.now = 1020
    assert store.cancel("acme", job) == doc  # cancelling again changes nothing
    store.claim("w", 30)
    store.finalize(job, "w", "cancelled")
    assert store.cancel("acme", job)["status"] == "cancelled"  # a cancelled job answers as it is
    for outcome in ("completed", "failed", "expired"):
        other = _job(store)
        store.claim(outcome, 30)
        store.finalize(other, outcome, outcome)
        with pytest.raises(Conflict) as err:
            store.cancel("acme", other)
        assert err.value.message == f"batch '{other}' is already {outcome}"
    with pytest.raises(ModelNotFound) as err:
        store.cancel("globex", job)
    assert [(v.field, v.description) for v in err.value.violations] == [("batch_id", "unknown")]


# ---- leases ----------------------------------------------------------------------------------------------


def test_claim_takes_the_oldest_job_and_starts_it(store):
    store.clock.now = 1000
    first = _job(store, 1, tenant="globex", window="1h", endpoint="/v1/embeddings")
    store.clock.now = 1001
    second = _job(store, 1)
    store.clock.now = 1002.5
    job = store.claim("w1", 30)
    assert (job.id, job.tenant, job.endpoint, job.status, job.expires_at) == (first, "globex", "/v1/embeddings", "in_progress", 4600.0)
    doc = store.retrieve("globex", first)
    assert doc["status"] == "in_progress" and doc["in_progress_at"] == 1002
    assert store.claim("w2", 30).id == second
    assert store.claim("w3", 30) is None


def test_a_claim_reaches_an_active_job_behind_five_older_finished_ones(store):
    """Finished jobs whose leases lapsed are no candidates: a job queued behind five of them is claimed."""
    store.clock.now = 1000
    older = {_job(store, 1) for _ in range(5)}
    store.clock.now = 1001
    waiting = _job(store, 1)
    store.clock.now = 1002
    for _ in range(5):
        job = store.claim("w0", 30)
        assert job.id in older and store.finalize(job.id, "w0", "cancelled")
    store.clock.now = 2000  # every lease has lapsed
    assert store.claim("w1", 30).id == waiting


def test_a_lease_holds_until_its_end_and_the_holder_may_claim_again(store):
    job = _job(store)
    assert store.claim("w1", 30).id == job  # lease until 1030
    store.clock.now = 1030
    assert store.claim("w2", 30) is None  # not lapsed yet at its very end
    assert store.claim("w1", 30).id == job  # its holder takes it again (a restarted worker with the same name)
    store.clock.now = 1060.5
    assert store.claim("w2", 30).id == job


def test_reading_rows_renews_the_lease_for_its_length(store):
    job = _job(store)
    store.claim("w1", 30)
    store.clock.now = 1020
    assert store.next_rows(job, "w1", 50, 10) is not None  # lease until 1070
    store.clock.now = 1069
    assert store.claim("w2", 30) is None
    assert store.commit_rows(job, "w1", 100, []) == 0  # a commit renews too: until 1169
    store.clock.now = 1168
    assert store.claim("w2", 30) is None
    store.clock.now = 1170
    assert store.claim("w2", 30).id == job
    assert store.next_rows(job, "w1", 30, 10) is None


def test_a_claimed_cancelling_job_says_so(store):
    job = _job(store)
    store.cancel("acme", job)
    assert store.claim("w", 30).status == "cancelling"
    status, rows = store.next_rows(job, "w", 30, 2)
    assert status == "cancelling" and [(r.index, r.custom_id, r.body) for r in rows] == [(0, "r0", '{"x":0}'), (1, "r1", '{"x":1}')]


def test_release_frees_the_lease_at_once_only_for_its_holder(store):
    job = _job(store)
    store.claim("w1", 300)
    store.release(job, "w2")  # not its lease: nothing changes
    assert store.claim("w2", 30) is None
    store.release(job, "w1")
    assert store.claim("w2", 30).id == job


# ---- the output and error files ----------------------------------------------------------------------------


def test_the_output_and_error_files_hold_each_row_once_in_row_order(store):
    job = _job(store, 5)
    store.claim("w", 30)
    store.commit_rows(job, "w", 30, [
        (0, "done", 200, '{"y":0}'),
        (1, "failed", 422, '{"error":{"message":"bad x","code":"INVALID_ARGUMENT"}}'),
        (2, "failed", 500, '{"error":"boom"}'),
        (3, "failed", 502, '["not","an","object"]'),
        (4, "done", 201, '{"y":4}'),
    ])  # fmt: skip
    store.clock.now = 1500.5
    assert store.finalize(job, "w", "completed")
    doc = store.retrieve("acme", job)
    rid = f"batch_req_{job[6:]}_"
    assert (doc["status"], doc["completed_at"], doc["finalizing_at"], doc["expired_at"]) == ("completed", 1500, 1500, None)
    assert doc["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    assert _lines(store, "acme", doc["output_file_id"]) == [
        {"id": rid + "0", "custom_id": "r0", "response": {"status_code": 200, "request_id": rid + "0", "body": {"y": 0}}, "error": None},
        {"id": rid + "4", "custom_id": "r4", "response": {"status_code": 201, "request_id": rid + "4", "body": {"y": 4}}, "error": None},
    ]
    errors = _lines(store, "acme", doc["error_file_id"])
    assert [e["id"] for e in errors] == [rid + "1", rid + "2", rid + "3"]
    assert [e["response"] for e in errors] == [
        {"status_code": 422, "request_id": rid + "1", "body": {"error": {"message": "bad x", "code": "INVALID_ARGUMENT"}}},
        {"status_code": 500, "request_id": rid + "2", "body": {"error": "boom"}},
        {"status_code": 502, "request_id": rid + "3", "body": ["not", "an", "object"]},
    ]
    assert [e["error"] for e in errors] == [
        {"code": "INVALID_ARGUMENT", "message": "bad x"}, {"code": None, "message": "boom"}, {"code": None, "message": "None"}
    ]
    out = store.get_file("acme", doc["output_file_id"])
    assert (out["filename"], out["purpose"], out["created_at"]) == (f"{job}_output.jsonl", "batch_output", 1500)
    err = store.get_file("acme", doc["error_file_id"])
    assert (err["filename"], err["purpose"]) == (f"{job}_error.jsonl", "batch_output")  # OpenAI's purpose for both files
    raw = store.file_content("acme", doc["output_file_id"])
    assert raw.endswith(b"\n") and b'"error":null}\n' in raw and b", " not in raw  # compact JSONL, one row a line
    assert not store.finalize(job, "w", "completed")  # an ended job is not ended again


def test_an_expired_job_keeps_its_done_rows_and_names_the_rest(store):
    job = _job(store, 3)
    store.claim("w", 30)
    store.commit_rows(job, "w", 30, [(0, "done", 200, "{}"), (1, "failed", 400, '{"error":{"message":"no","code":"X"}}')])
    store.clock.now = 2000
    assert store.finalize(job, "w", "expired")
    doc = store.retrieve("acme", job)
    assert (doc["status"], doc["expired_at"], doc["completed_at"]) == ("expired", 2000, None)
    assert doc["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = _lines(store, "acme", doc["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("r1", "X"), ("r2", "batch_expired")]
    assert errors[1]["response"] is None and errors[1]["error"]["message"] == "the batch was expired before this request ran"
    assert errors[1]["id"] == f"batch_req_{job[6:]}_2"


def test_a_job_with_no_failure_has_no_error_file_and_one_with_no_success_no_output(store):
    ok = _job(store, 1)
    store.claim("w", 30)
    store.commit_rows(ok, "w", 30, [(0, "done", 200, "{}")])
    store.finalize(ok, "w", "completed")
    assert store.retrieve("acme", ok)["error_file_id"] is None
    bad = _job(store, 1)
    store.claim("w", 30)
    store.finalize(bad, "w", "cancelled")
    assert store.retrieve("acme", bad)["output_file_id"] is None


def test_finalize_needs_the_lease(store):
    job = _job(store, 1)
    store.claim("w1", 30)
    assert not store.finalize(job, "w2", "completed")
    assert store.retrieve("acme", job)["status"] == "in_progress"


def test_a_failed_job_says_why_and_names_every_row_it_did_not_run(store):
    job = _job(store, 3)
    store.claim("w", 30)
    store.commit_rows(job, "w", 30, [(0, "done", 200, "{}")])
    store.fail(job, "other", "x", "not the holder")  # not its lease: nothing happens
    assert store.retrieve("acme", job)["status"] == "in_progress"
    store.clock.now = 1300
    store.fail(job, "w", "model_gone", "the endpoint's model was deleted")
    doc = store.retrieve("acme", job)
    assert (doc["status"], doc["failed_at"]) == ("failed", 1300)
    assert doc["errors"] == {"object": "list", "data": [{"code": "model_gone", "message": "the endpoint's model was deleted", "param": None, "line": None}]}
    assert doc["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert [e["error"]["code"] for e in _lines(store, "acme", doc["error_file_id"])] == ["batch_failed"] * 2


# ---- the worker -------------------------------------------------------------------------------------------------


async def test_a_worker_runs_rows_concurrency_at_a_time_and_commits_four_times_that_at_once(store):
    job = _job(store, 20)
    inflight, most, calls = [0], [0], []

    async def run_row(endpoint, body, tenant):
        calls.append(body["x"])
        inflight[0] += 1
        most[0] = max(most[0], inflight[0])
        await asyncio.sleep(0)
        inflight[0] -= 1
        if len(calls) == 8:
            store.cancel("acme", job)  # during the first row batch: 4 x concurrency rows run, no more
        return 200, {"y": body["x"]}

    worker = BatchWorker(store, run_row, concurrency=2)
    assert worker.owner.startswith("worker-") and len(worker.owner) == 19 and BatchWorker(store, run_row).owner != worker.owner
    await worker.work(store.claim(worker.owner, 30))
    assert most[0] == 2 and calls == list(range(8)) and worker.rows_done == 8
    assert store.retrieve("acme", job)["request_counts"]["completed"] == 8


async def test_by_default_eight_rows_run_at_once(store):
    job = _job(store, 40)
    inflight, most = [0], [0]

    async def run_row(endpoint, body, tenant):
        inflight[0] += 1
        most[0] = max(most[0], inflight[0])
        await asyncio.sleep(0)
        inflight[0] -= 1
        return 200, {}

    task = asyncio.create_task(BatchWorker(store, run_row, owner="w").run())
    while store.retrieve("acme", job)["status"] != "completed":
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert most[0] == 8


async def test_a_job_at_its_expiry_runs_no_more_rows(store):
    job = _job(store, 2, window="60s")
    store.clock.now = 1060  # exactly at expires_at

    async def run_row(endpoint, body, tenant):
        raise AssertionError("an expired job ran a row")

    await BatchWorker(store, run_row, owner="w").work(store.claim("w", 30))
    assert store.retrieve("acme", job)["status"] == "expired"


async def test_a_row_no_replica_could_take_stays_pending_and_runs_later(store):
    job = _job(store, 3)
    refusals = [BackendUnavailable("no replica"), ModelNotReady("reclaimed"), Overloaded("busy", retry_after_s=0.01)]

    async def run_row(endpoint, body, tenant):
        if body["x"] == 1 and refusals:
            raise refusals.pop(0)
        return 200, {"y": body["x"]}

    worker = BatchWorker(store, run_row, owner="w", poll_s=0.001)
    await worker.work(store.claim("w", 30))
    doc = store.retrieve("acme", job)
    assert doc["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and worker.rows_done == 3 and not refusals


async def test_a_rows_bug_is_its_own_500_and_the_job_goes_on(store):
    job = _job(store, 3)

    async def run_row(endpoint, body, tenant):
        if body["x"] == 1:
            raise KeyError("oops")
        return (399 if body["x"] == 0 else 400), {"y": body["x"]}

    await BatchWorker(store, run_row, owner="w").work(store.claim("w", 30))
    doc = store.retrieve("acme", job)
    assert doc["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    errors = _lines(store, "acme", doc["error_file_id"])
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("r1", 500), ("r2", 400)]
    # the error table's OpenAI shape, as every other row error (server.errors.http_error)
    assert errors[0]["response"]["body"] == {"error": {"message": "internal error (KeyError)", "type": "internal", "code": "INTERNAL", "param": None, "details": []}}
    assert [o["response"]["status_code"] for o in _lines(store, "acme", doc["output_file_id"])] == [399]


async def test_a_worker_that_lost_its_lease_commits_nothing_and_leaves_the_job(store):
    job = _job(store, 4)

    async def run_row(endpoint, body, tenant):
        store.clock.now += 100  # the lease lapses while the rows run
        store.claim("thief", 300)
        return 200, {}

    claimed = store.claim("w", 30)
    worker = BatchWorker(store, run_row, owner="w", lease_s=30, concurrency=1, row_batch=2)
    await worker.work(claimed)
    assert worker.rows_done == 0
    await worker.work(claimed)  # its next read finds the lease gone: it stops without touching the job
    doc = store.retrieve("acme", job)
    assert doc["request_counts"]["completed"] == 0 and doc["status"] == "in_progress"
    _, rows = store.next_rows(job, "thief", 30, 10)
    assert [r.index for r in rows] == [0, 1, 2, 3]


async def test_the_worker_loop_rides_out_a_failing_database_and_works_every_job(store):
    jobs = [_job(store, 2), _job(store, 1)]
    real_claim, failures = store.claim, [RuntimeError("database away")]

    def claim(owner, lease_s):
        if failures:
            raise failures.pop()
        return real_claim(owner, lease_s)

    store.claim = claim

    async def run_row(endpoint, body, tenant):
        return 200, {"tenant": tenant, "endpoint": endpoint}

    task = asyncio.create_task(BatchWorker(store, run_row, owner="w", poll_s=0.001).run())
    while any(store.retrieve("acme", j)["status"] != "completed" for j in jobs):
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not failures
    assert [o["response"]["body"] for o in _lines(store, "acme", store.retrieve("acme", jobs[0])["output_file_id"])] == [{"tenant": "acme", "endpoint": EP}] * 2


async def test_a_stopping_worker_whose_release_fails_still_stops(store):
    job = _job(store, 2)
    started = asyncio.Event()

    async def run_row(endpoint, body, tenant):
        started.set()
        await asyncio.Event().wait()

    def release(job_id, owner):
        raise RuntimeError("database away")

    store.release = release
    task = asyncio.create_task(BatchWorker(store, run_row, owner="w", poll_s=0.001).run())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    store.clock.now += 31  # its lease lapses by itself
    assert store.claim("next", 30).id == job


def test_a_worker_acts_only_on_the_job_it_names_even_holding_another(store):
    mine = _job(store, 2)
    store.clock.now += 1
    theirs = _job(store, 2)
    assert store.claim("w1", 30).id == mine and store.claim("w2", 30).id == theirs
    assert store.next_rows(theirs, "w1", 30, 10) is None  # w1's lease on its own job does not open another
    assert store.commit_rows(theirs, "w1", 30, [(0, "done", 200, "{}")]) == -1
    assert not store.finalize(theirs, "w1", "completed")
    store.release(theirs, "w1")
    store.fail(theirs, "w1", "x", "not its job")
    assert store.commit_rows(mine, "w1", 30, [(0, "done", 200, "{}")]) == 1  # row 0 of w1's job only
    assert store.finalize(mine, "w1", "expired")  # its pending row 1 expires; the other job's rows stay pending
    doc = store.retrieve("acme", theirs)
    assert (doc["status"], doc["errors"], doc["request_counts"]) == ("in_progress", None, {"total": 2, "completed": 0, "failed": 0})
    _, rows = store.next_rows(theirs, "w2", 30, 10)
    assert [r.index for r in rows] == [0, 1]
    store.clock.now += 20
    assert store.claim("w3", 30) is None  # w2 still holds its lease: the release named another job
    assert store.retrieve("acme", mine)["errors"] is None  # nor did fail() write on w1's own job


async def test_a_worker_with_nothing_to_do_keeps_polling_and_takes_a_job_that_comes_later(store):
    async def run_row(endpoint, body, tenant):
        return 200, {}

    worker = BatchWorker(store, run_row, owner="w", poll_s=0.001)
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(0.05)  # several empty polls
    job = _job(store, 1)
    while store.retrieve("acme", job)["status"] != "completed":
        assert not task.done()
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ---- what the mutation pass found unpinned (issue 34) ----------------------------------------------------


def test_each_refusal_says_what_is_wrong_in_words(store):
    """The messages a caller reads beside the violation (the OpenAI clients show the message)."""
    assert _refusal(lambda: parse_rows(b"\xff\xfe", EP)).message == "the input file is not UTF-8 JSONL"
    assert _refusal(lambda: parse_rows(b"\n  \n", EP)).message == "the input file has no requests"
    assert _refusal(lambda: store.create_batch("acme", "", None, EP, "24h", None)).message == "input_file_id is required"
    f = store.create_file("acme", "in.jsonl", "batch", _jsonl([_line(0)]))
    assert _refusal(lambda: store.create_batch("acme", "", f["id"], EP, "24h", {"k": 1})).message == (
        "metadata must be an object of up to 16 string keys (64 chars) and string values (512 chars)"
    )
    assert _refusal(lambda: store.create_file("acme", "x", "fine-tune", b"{}")).message == "purpose must be 'batch' (the only purpose this server accepts)"
    with pytest.raises(ModelNotFound) as unknown:
        store.retrieve("acme", "batch_nope")
    assert unknown.value.message == "no batch 'batch_nope'" and [(v.field, v.description) for v in unknown.value.violations] == [("batch_id", "unknown")]


def test_a_job_records_the_team_that_created_it(store):
    f = store.create_file("acme", "in.jsonl", "batch", _jsonl([_line(0)]))
    with_team = store.create_batch("acme", "ml", f["id"], EP, "24h", None)["id"]
    without = store.create_batch("acme", None, f["id"], EP, "24h", None)["id"]
    with store.engine.connect() as conn:
        teams = dict(conn.execute(select(jobs_table.c.id, jobs_table.c.team)).all())
    assert teams == {with_team: "ml", without: ""}


def test_jobs_created_in_the_same_second_are_claimed_in_id_order(store):
    store.clock.now = 1000.0
    jobs = [_job(store, 1) for _ in range(4)]
    store.clock.now = 1000.5
    assert [store.claim(f"w{i}", 30).id for i in range(4)] == sorted(jobs)


def test_a_claim_reaches_a_free_job_behind_five_older_ones_leased_to_other_workers(store):
    store.clock.now = 1000
    leased = [_job(store, 1) for _ in range(5)]
    store.clock.now = 1001
    free = _job(store, 1)
    store.clock.now = 1002
    assert sorted(store.claim(f"w{i}", 300).id for i in range(5)) == sorted(leased)
    assert store.claim("late", 300).id == free


def _between_look_and_take(store: BatchStore, change) -> None:
    """Run ``change`` (a statement on the claim's own connection) just before a claim's first take
    (its UPDATE of a candidate's lease), as if another worker's commit had landed between the claim's
    look at the candidates and its take: PostgreSQL's READ COMMITTED update reads that commit; SQLite
    cannot interleave two writers, so the test puts the other worker's write there itself."""
    pending = [change]

    def before(conn, cursor, statement, params, context, executemany):
        if pending and statement.lstrip().upper().startswith("UPDATE BATCH_JOBS SET LEASE_OWNER"):
            conn.execute(pending.pop())

    event.listen(store.engine, "before_cursor_execute", before)


def test_a_claim_does_not_take_a_job_another_worker_leased_after_the_claim_looked(store):
    job = _job(store, 1)
    _between_look_and_take(store, update(jobs_table).where(jobs_table.c.id == job).values(lease_owner="other", lease_until=store.clock() + 300))
    assert store.claim("w", 30) is None
    with store.engine.connect() as conn:
        assert conn.execute(select(jobs_table.c.lease_owner).where(jobs_table.c.id == job)).scalar_one() == "other"


def test_a_claim_does_not_take_a_job_that_finished_after_the_claim_looked(store):
    job = _job(store, 1)
    _between_look_and_take(store, update(jobs_table).where(jobs_table.c.id == job).values(status="completed"))
    assert store.claim("w", 30) is None
    assert store.retrieve("acme", job)["status"] == "completed"
