"""Batch jobs on the real stack with the official ``openai`` SDK: files.create, batches.create /
retrieve / list / cancel, files.content; each row's answer equals the same request made live; a
frontend killed with SIGKILL mid-job resumes on restart and its output has every row exactly once,
equal to a one-shot run; the rows are metered as the ``batch`` traffic class."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration
import openai  # noqa: E402

TABULAR = "fraud_xgb"
EMBEDDINGS = "minilm_embeddings"
OIP = f"/v2/models/{TABULAR}/infer"
SAFETY_S = 240  # a job that never ends fails the test instead of hanging it (not a timing assertion)


def _client(stack, key: str = "unused"):
    return openai.OpenAI(base_url=f"http://{stack.http}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def features(compose_repository):
    with np.load(compose_repository / TABULAR / "validation.npz") as npz:
        return np.ascontiguousarray(npz["features"][:40], dtype=np.float32)


def _oip_body(row: np.ndarray) -> dict:
    return {"inputs": [{"name": "features", "shape": [1, row.shape[0]], "datatype": "FP32", "data": row.tolist()}]}


def _jsonl(url: str, bodies: list[dict]) -> bytes:
    return b"".join(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": url, "body": b}).encode() + b"\n" for i, b in enumerate(bodies))


def _submit(client, url: str, bodies: list[dict], **kwargs):
    f = client.files.create(file=("rows.jsonl", io.BytesIO(_jsonl(url, bodies))), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h", **kwargs)


def _wait(client, batch_id: str, until=("completed", "failed", "expired", "cancelled")):
    give_up = time.monotonic() + SAFETY_S
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < give_up, f"batch {batch_id} still {b.status}: {b.request_counts}"
        time.sleep(0.1)


def _lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def _live_infer(stack, body: dict) -> dict:
    request = urllib.request.Request(f"http://{stack.http}{OIP}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def _probability(answer: dict) -> list[float]:
    (out,) = [o for o in answer["outputs"] if o["name"] == "probability"]
    return out["data"]


def test_a_tabular_batch_equals_the_rows_called_live(compose_stack, features):
    client = _client(compose_stack)
    bodies = [_oip_body(r) for r in features[:30]]
    bodies.insert(7, {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]})  # wrong width
    batch = _submit(client, OIP, bodies, metadata={"purpose": "test"})
    assert batch.status == "validating" and batch.request_counts.total == 31 and batch.metadata == {"purpose": "test"}
    done = _wait(client, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (30, 1)
    out = _lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(31) if i != 7]
    for o in out:
        i = int(o["custom_id"].split("-")[1])
        assert o["response"]["status_code"] == 200
        assert np.allclose(_probability(o["response"]["body"]), _probability(_live_infer(compose_stack, bodies[i])), atol=1e-6)
    (err,) = _lines(client, done.error_file_id)
    assert err["custom_id"] == "row-7" and err["response"]["status_code"] == 400 and "features" in err["error"]["message"]
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    metrics = urllib.request.urlopen(f"http://{compose_stack.metrics}/metrics", timeout=10).read().decode()
    (line,) = [m for m in metrics.splitlines() if m.startswith("inferplane_admissions_total{") and f'model="{TABULAR}"' in m and 'path="batch"' in m]
    assert float(line.rsplit(" ", 1)[1]) >= 30  # every valid row went through the fair queue's batch class (the bad one stopped at validation)


def test_an_embeddings_batch_equals_the_live_endpoint(compose_stack):
    client = _client(compose_stack)
    texts = [f"sentence {i}: the batch runs at low priority" for i in range(12)]
    bodies = [{"model": EMBEDDINGS, "input": t} for t in texts]
    done = _wait(client, _submit(client, "/v1/embeddings", bodies).id)
    assert done.status == "completed" and done.request_counts.completed == 12
    live = client.embeddings.create(model=EMBEDDINGS, input=texts)
    for o, expected in zip(_lines(client, done.output_file_id), live.data, strict=True):
        got = np.array(o["response"]["body"]["data"][0]["embedding"], dtype=np.float32)
        assert np.allclose(got, np.array(expected.embedding, dtype=np.float32), atol=1e-5)


def test_bad_requests_are_named_and_cancel_stops_the_job(compose_stack, features):
    client = _client(compose_stack)
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert bad.value.body["param"] == "purpose"
    f = client.files.create(file=("x.jsonl", io.BytesIO(_jsonl("/v1/embeddings", [{"model": EMBEDDINGS, "input": "a"}]))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=f.id, endpoint=OIP, completion_window="24h")
    assert bad.value.body["param"] == "line 1.url"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    for method, path, body, ctype, status, code in (
        ("POST", "/v1/files", b'{"purpose": "batch"}', "application/json", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("POST", "/v1/batches", b"not json", "application/json", 400, "INVALID_ARGUMENT"),
        ("POST", "/v1/batches", json.dumps({"input_file_id": f.id, "endpoint": "/v1/embeddings", "completion_window": "soon"}).encode(), "application/json", 400, "INVALID_ARGUMENT"),
        ("GET", "/v1/batches?limit=0", None, None, 400, "INVALID_ARGUMENT"),
        ("GET", "/v1/files/file-nope/content", None, None, 404, "NOT_FOUND"),
        # a multipart part whose header is not valid (a control character in a field name; schemathesis found it)
        ("POST", "/v1/files", b'--b\r\nContent-Disposition: form-data; name="\xc1\xf1\x8b"\r\n\r\n1\r\n--b\r\n'
         b'Content-Disposition: form-data; name="\x12"\r\n\r\n2\r\n--b--\r\n',
         "multipart/form-data; boundary=b", 400, "INVALID_ARGUMENT"),
    ):  # fmt: skip
        request = urllib.request.Request(f"http://{compose_stack.http}{path}", body, {"Content-Type": ctype} if ctype else {}, method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == status, (path, refused.value.code)
        assert json.loads(refused.value.read())["error"]["code"] == code  # the OpenAI error shape, naming the reason
    big = _submit(client, OIP, [_oip_body(features[i % len(features)]) for i in range(600)])
    cancelling = client.batches.cancel(big.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = _wait(client, big.id)
    assert ended.status == "cancelled" and ended.request_counts.completed < 600 and ended.cancelled_at is not None
    kept = _lines(client, ended.output_file_id)
    assert len(kept) == ended.request_counts.completed
    assert {e["error"]["code"] for e in _lines(client, ended.error_file_id)} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_wait(client, _submit(client, OIP, [_oip_body(features[0])]).id).id)


def _db_rows(workdir, sql: str, *args):
    with sqlite3.connect(workdir / "registry.db", timeout=30) as conn:
        return conn.execute(sql, args).fetchall()


PEPPER = "batch-test-pepper"


def test_a_killed_frontend_resumes_the_job_and_every_row_is_there_once(compose_repository, tmp_path, features):
    from server.tenancy.store import TenancyStore

    store = TenancyStore(f"sqlite:///{tmp_path}/registry.db")  # the stack's database: tenants, keys, usage, jobs
    acme = store.create_key("acme", PEPPER.encode(), team="risk", models=[TABULAR])[1]
    globex = store.create_key("globex", PEPPER.encode(), team="other", models=[TABULAR])[1]
    store.close()
    env = {"INFERPLANE_MODELS": json.dumps([TABULAR]), "INFERPLANE_BATCH_LEASE_S": "2", "INFERPLANE_BATCH_CONCURRENCY": "2", "INFERPLANE_BATCH_ROW_BATCH": "2",
           "INFERPLANE_USAGE_FLUSH_S": "0.3", "INFERPLANE_AUTH": "on", "INFERPLANE_KEY_PEPPER": PEPPER}  # fmt: skip
    stack = start_stack(compose_repository, tmp_path, env=env)
    n = 600
    bodies = [_oip_body(features[i % len(features)] + np.float32(i % 7) * 0.01) for i in range(n)]
    try:
        client = _client(stack, acme)
        job = _submit(client, OIP, bodies)
        other = _client(stack, globex)
        with pytest.raises(openai.NotFoundError):  # another tenant's job and files read as unknown
            other.batches.retrieve(job.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(job.input_file_id)
        assert other.batches.list().data == []
        _wait_started = time.monotonic() + SAFETY_S
        while client.batches.retrieve(job.id).request_counts.completed == 0:
            assert time.monotonic() < _wait_started
            time.sleep(0.02)
        triton = stack.triton_pid()
        os.kill(stack.process.pid, signal.SIGKILL)  # mid-job: no shutdown, no lease given back
        stack.process.wait(30)
        os.kill(triton, signal.SIGKILL)
    except BaseException:
        stop_stack(stack)
        raise
    ((done_at_kill,),) = _db_rows(tmp_path, "SELECT COUNT(*) FROM batch_rows WHERE job_id = ? AND state = 'done'", job.id)
    assert 0 < done_at_kill < n, done_at_kill  # it really stopped mid-job
    stack = start_stack(compose_repository, tmp_path, env=env)  # the same database and artifact store
    try:
        client = _client(stack, acme)
        resumed = _wait(client, job.id)
        assert resumed.status == "completed" and resumed.request_counts.completed == n
        out = _lines(client, resumed.output_file_id)
        assert [o["custom_id"] for o in out] == [f"row-{i}" for i in range(n)]  # every row, once, in order
        one_shot = _wait(client, _submit(client, OIP, bodies).id)
        whole = _lines(client, one_shot.output_file_id)
        assert [_probability(o["response"]["body"]) for o in out] == [_probability(o["response"]["body"]) for o in whole]
        give_up = time.monotonic() + SAFETY_S
        while not _db_rows(tmp_path, "SELECT 1 FROM tenancy_usage WHERE traffic_class = 'batch' AND model = ? AND tenant = 'acme'", TABULAR):
            assert time.monotonic() < give_up, "no batch-class usage metered"
            time.sleep(0.2)
    finally:
        stop_stack(stack)


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "server.cli.main", "batch", *args], capture_output=True, text=True, timeout=300)


def test_the_cli_submits_waits_with_progress_and_downloads(compose_stack, features, tmp_path):
    url = f"http://{compose_stack.http}"
    bodies = [_oip_body(r) for r in features[:20]]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_jsonl(OIP, bodies))
    done = _cli("submit", str(path), "--endpoint", OIP, "--wait", "--poll-s", "0.1", "--metadata", "run=cli", "--json", "--url", url)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["status"] == "completed" and job["request_counts"]["completed"] == 20 and job["metadata"] == {"run": "cli"}
    assert "rows/s" in done.stderr and "ETA" in done.stderr and "/20 rows" in done.stderr  # the progress line
    shown = _cli("status", job["id"], "--url", url)
    assert shown.returncode == 0 and "completed" in shown.stdout and "20/20 done" in shown.stdout
    assert job["id"] in _cli("list", "--url", url).stdout
    out = tmp_path / "out.jsonl"
    got = _cli("download", job["id"], "--out", str(out), "--url", url)
    assert got.returncode == 0 and "20 rows" in got.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [f"row-{i}" for i in range(20)]
    missing = _cli("status", "batch_nope", "--url", url)
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr and "batch_nope" in missing.stderr
    no_errors = _cli("download", job["id"], "--errors", "--url", url)
    assert no_errors.returncode == 1 and "no error file" in no_errors.stderr


def test_chat_and_completion_batches_equal_the_live_endpoints(llm_stack):
    from model_repository.llm import TINY_NAME

    client = _client(llm_stack)
    greedy = {"model": TINY_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chats = [{**greedy, "messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(3)]
    done = _wait(client, _submit(client, "/v1/chat/completions", chats).id)
    assert done.status == "completed" and done.request_counts.completed == 3
    for o, body in zip(_lines(client, done.output_file_id), chats, strict=True):
        live = client.chat.completions.create(model=TINY_NAME, messages=body["messages"], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        answer = o["response"]["body"]
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert answer["usage"]["completion_tokens"] == 8
    prompts = [{**greedy, "prompt": "The capital of"}, {**greedy, "prompt": "Once upon", "stream": True}]  # a row cannot stream
    done = _wait(client, _submit(client, "/v1/completions", prompts).id)
    live = client.completions.create(model=TINY_NAME, prompt="The capital of", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    (ok,) = _lines(client, done.output_file_id)
    assert ok["response"]["body"]["choices"][0]["text"] == live.choices[0].text
    (bad,) = _lines(client, done.error_file_id)
    assert bad["custom_id"] == "row-1" and bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "stream"
