"""Batch jobs (``/v1/files`` + ``/v1/batches``, the OpenAI batch format): the store and the worker.

* Files: the bytes live in the artifact store (by sha256), one ``batch_files`` row names them for
  their tenant. A tenant sees only its own files and jobs; another's id reads as unknown.
* A job is created with one ``batch_rows`` row per input line (validated first: JSON, a unique
  ``custom_id``, ``method`` POST, ``url`` equal to the job's endpoint, a ``body`` object), in one
  transaction, so a job either has all its rows or does not exist.
* **Exactly once per row.** A worker holds a lease on the job (``lease_owner``, ``lease_until``),
  works on a row batch of pending rows (``concurrency`` in flight at once) and commits their results in one
  transaction that first renews the lease (no lease: nothing is committed) and sets each row
  ``pending -> done | failed`` only where it is still pending. A worker killed mid-job leaves its
  rows pending; when the lease lapses another worker (the restarted process) takes the job over and
  runs only what is still pending. The output file is written at the end from the rows table in
  row order, so it has every row exactly once whatever happened in between.
* A job past its ``completion_window`` ends ``expired`` (the completed rows kept in the output, the
  rest in the error file as ``batch_expired``); a cancelled one ends ``cancelled`` the same way.
  Both are checked between row batches, so cancellation stops within one row batch.
* Rows are sent through the data plane like any call, as their tenant, at the ``batch`` traffic
  class (``batching.fair_queue``: only capacity real-time traffic leaves), charged to the tenant's
  limits in a quota scope of their own (``server.dataplane.pipeline.BATCH_SCOPE``: a batch never
  spends what the tenant's live callers need) and metered as ``traffic_class=batch``. A row refused
  for overload or quota stays pending and is tried again after a back-off; it is never failed for it.
  So is a row no replica could take (UNAVAILABLE, MODEL_NOT_READY: its spot replica reclaimed and
  the work not yet on another); rows go to spot replicas first (``server.dataplane.capacity_policy``).

Synchronous SQLAlchemy Core over the tables of migration ``0008_composites_batches``; the async
worker calls the store with ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    false,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy import delete

from server.control.registry.artifacts import ArtifactStore
from server.errors import Conflict, InferplaneError, InvalidRequest, ModelNotFound, Overloaded, Violation
from server.control.registry.envelope import KeyRing
from server import migrations
from server.db import make_engine
from server.control.registry import retention
from server.errors import BackendUnavailable, Conflict, InferplaneError, InvalidRequest, ModelNotFound, ModelNotReady, Overloaded, Violation, http_error

log = logging.getLogger(__name__)

OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings", "/v1/completions")
OIP_ENDPOINT = re.compile(r"^/v2/models/(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})(/versions/(?P<version>[1-9][0-9]{0,8}))?/infer$")
WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
MAX_WINDOW_S = 7 * 24 * 3600
MAX_ROWS = 50_000
MAX_FILENAME = 255
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")

_meta = MetaData()
files_table = Table(
    "batch_files", _meta,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("filename", String(255), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("blob", String(64), nullable=False),
    Column("created_at", Integer, nullable=False),
    Column("deleted", Boolean, nullable=False, server_default=false()),
    Index("ix_batch_files_tenant", "tenant", "created_at"),
)  # fmt: skip
jobs_table = Table(
    "batch_jobs", _meta,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("team", String(128), nullable=False),
    Column("endpoint", String(300), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("metadata", JSON, nullable=True),
    Column("status", String(16), nullable=False),
    Column("errors", JSON, nullable=True),
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("created_at", Integer, nullable=False),
    Column("expires_at", Float, nullable=False),
    *(Column(f"{event}_at", Integer, nullable=True) for event in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
    Column("total", Integer, nullable=False),
    Column("completed", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("lease_owner", String(128), nullable=True),
    Column("lease_until", Float, nullable=True),
    Index("ix_batch_jobs_tenant", "tenant", "created_at"),
    Index("ix_batch_jobs_status", "status"),
)  # fmt: skip
rows_table = Table(
    "batch_rows", _meta,
    Column("job_id", String(64), ForeignKey("batch_jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("row_index", Integer, primary_key=True),
    Column("custom_id", String(512), nullable=False),
    Column("body", Text, nullable=False),
    Column("state", String(16), nullable=False),
    Column("status_code", Integer, nullable=True),
    Column("response", Text, nullable=True),
    UniqueConstraint("job_id", "custom_id", name="uq_batch_rows_custom_id"),
    Index("ix_batch_rows_state", "job_id", "state", "row_index"),
)  # fmt: skip


def window_seconds(window: str) -> int:
    """``24h``, ``90m``, ``30s`` -> seconds (OpenAI accepts only ``24h``; shorter windows serve tests and small jobs)."""
    m = WINDOW.match(window) if isinstance(window, str) else None
    if m is None:
        raise InvalidRequest("completion_window must be like '24h' (a number and s, m or h)", [Violation("completion_window", "must be like '24h'")])
    seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds > MAX_WINDOW_S:
        raise InvalidRequest("completion_window is at most 168h", [Violation("completion_window", "at most 168h")])
    return seconds


def check_endpoint(endpoint: object) -> str:
    if not isinstance(endpoint, str) or not (endpoint in OPENAI_ENDPOINTS or OIP_ENDPOINT.match(endpoint)):
        raise InvalidRequest(
            f"endpoint must be one of {', '.join(OPENAI_ENDPOINTS)} or /v2/models/NAME[/versions/N]/infer",
            [Violation("endpoint", "not a batch endpoint")],
        )
    return endpoint


def parse_rows(data: bytes, endpoint: str) -> list[tuple[str, str]]:
    """The input file's lines as (custom_id, body JSON); every bad line named (up to 20)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the input file is not UTF-8 JSONL", [Violation("input_file_id", "not UTF-8")]) from None
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()
    violations: list[Violation] = []
    for n, line in enumerate(text.splitlines(), 1):
        if len(violations) >= 20:  # before each line: a line that is not JSON must not get past the cap either
            break
        if not line.strip():
            continue
        where = f"line {n}"
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):
            violations.append(Violation(where, "is not valid JSON"))
            continue
        if not isinstance(doc, dict):
            violations.append(Violation(where, "must be a JSON object"))
            continue
        cid = doc.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > 512:
            violations.append(Violation(f"{where}.custom_id", "must be a non-empty string of up to 512 characters"))
        elif cid in seen:
            violations.append(Violation(f"{where}.custom_id", f"{cid!r} is not unique in the file"))
        else:
            seen.add(cid)
        if doc.get("method", "POST") != "POST":
            violations.append(Violation(f"{where}.method", "must be POST"))
        if doc.get("url") != endpoint:
            violations.append(Violation(f"{where}.url", f"must be the batch's endpoint {endpoint}"))
        if not isinstance(doc.get("body"), dict):
            violations.append(Violation(f"{where}.body", "must be a JSON object"))
        if not violations:
            rows.append((cid, json.dumps(doc["body"], separators=(",", ":"))))
    if violations:
        raise InvalidRequest(f"the input file has bad lines: {violations[0].field} {violations[0].description}", violations)
    if not rows:
        raise InvalidRequest("the input file has no requests", [Violation("input_file_id", "empty")])
    if len(rows) > MAX_ROWS:
        raise InvalidRequest(f"the input file has {len(rows)} requests; at most {MAX_ROWS}", [Violation("input_file_id", "too many lines")])
    return rows


@dataclass(frozen=True)
class Row:
    index: int
    custom_id: str
    body: str


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    endpoint: str
    status: str
    expires_at: float


def _file_doc(r) -> dict:
    return {"id": r.id, "object": "file", "bytes": r.bytes, "created_at": r.created_at, "filename": r.filename, "purpose": r.purpose, "status": "processed"}


class BatchStore:
    """Files, jobs and rows in the platform database; every read scoped to one tenant."""

    def __init__(self, engine, store: ArtifactStore, clock: Callable[[], float] = time.time):
        self.engine = engine
        self.store = store
        self.clock = clock

    # ---- files ----------------------------------------------------------------------------

    def create_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict:
        if purpose != "batch":
            raise InvalidRequest("purpose must be 'batch' (the only purpose this server accepts)", [Violation("purpose", "must be batch")])
        return self._put_file(tenant, filename, purpose, data)

    def _put_file(self, tenant: str, filename: str, purpose: str, data: bytes, conn=None) -> dict:
        filename = (filename or "upload.jsonl")[:MAX_FILENAME]
        blob = self.store.put(data)
        row = {"id": "file-" + uuid.uuid4().hex, "tenant": tenant, "filename": filename, "purpose": purpose, "bytes": len(data),
               "blob": blob, "created_at": int(self.clock()), "deleted": False}  # fmt: skip
        if conn is None:
            with self.engine.begin() as c:
                c.execute(insert(files_table).values(**row))
        else:
            conn.execute(insert(files_table).values(**row))
        return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"], "filename": filename, "purpose": purpose, "status": "processed"}

    def _file(self, conn, tenant: str, file_id: str):
        r = conn.execute(select(files_table).where(files_table.c.id == file_id, files_table.c.tenant == tenant, files_table.c.deleted.is_(False))).first()
        if r is None:
            raise ModelNotFound(f"no file '{file_id}'", [Violation("file_id", "unknown")])
        return r

    def get_file(self, tenant: str, file_id: str) -> dict:
        with self.engine.connect() as conn:
            return _file_doc(self._file(conn, tenant, file_id))

    def file_content(self, tenant: str, file_id: str) -> bytes:
        with self.engine.connect() as conn:
            r = self._file(conn, tenant, file_id)
        return self.store.get(r.blob)

    # ---- jobs -----------------------------------------------------------------------------

    def create_batch(self, tenant: str, team: str, input_file_id: object, endpoint: object, completion_window: object, metadata: object) -> dict:
        endpoint = check_endpoint(endpoint)
        window = window_seconds(completion_window)
        if not isinstance(input_file_id, str) or not input_file_id:
            raise InvalidRequest("input_file_id is required", [Violation("input_file_id", "required")])
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
            raise InvalidRequest("metadata must be an object of up to 16 string keys (64 chars) and string values (512 chars)", [Violation("metadata", "bad shape")])
        with self.engine.connect() as conn:
            f = self._file(conn, tenant, input_file_id)
        if f.purpose != "batch":
            raise InvalidRequest(f"file '{input_file_id}' has purpose '{f.purpose}', not 'batch'", [Violation("input_file_id", "not a batch input file")])
        rows = parse_rows(self.store.get(f.blob), endpoint)
        now = self.clock()
        job_id = "batch_" + uuid.uuid4().hex
        with self.engine.begin() as conn:
            conn.execute(insert(jobs_table).values(
                id=job_id, tenant=tenant, team=team or "", endpoint=endpoint, input_file_id=input_file_id,
                completion_window=completion_window, metadata=metadata, status="validating", created_at=int(now),
                expires_at=now + window, total=len(rows), completed=0, failed=0,
            ))  # fmt: skip
            conn.execute(insert(rows_table), [
                {"job_id": job_id, "row_index": i, "custom_id": cid, "body": body, "state": "pending"} for i, (cid, body) in enumerate(rows)
            ])  # fmt: skip
        return self.retrieve(tenant, job_id)

    def _job(self, conn, tenant: str, job_id: str):
        r = conn.execute(select(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.tenant == tenant)).first()
        if r is None:
            raise ModelNotFound(f"no batch '{job_id}'", [Violation("batch_id", "unknown")])
        return r

    def _doc(self, conn, r) -> dict:
        if r.status in TERMINAL:
            done, failed = r.completed, r.failed
        else:
            counts = dict(conn.execute(
                select(rows_table.c.state, func.count()).where(rows_table.c.job_id == r.id).group_by(rows_table.c.state)
            ).all())  # fmt: skip
            done, failed = counts.get("done", 0), counts.get("failed", 0)
        return {
            "id": r.id, "object": "batch", "endpoint": r.endpoint, "errors": r.errors, "input_file_id": r.input_file_id,
            "completion_window": r.completion_window, "status": r.status, "output_file_id": r.output_file_id,
            "error_file_id": r.error_file_id, "created_at": r.created_at, "expires_at": int(r.expires_at),
            **{f"{e}_at": getattr(r, f"{e}_at") for e in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")},
            "request_counts": {"total": r.total, "completed": done, "failed": failed}, "metadata": r.metadata,
        }  # fmt: skip

    def retrieve(self, tenant: str, job_id: str) -> dict:
        with self.engine.connect() as conn:
            return self._doc(conn, self._job(conn, tenant, job_id))

    def list(self, tenant: str, after: str | None = None, limit: int = 20) -> dict:
        limit = max(1, min(100, limit))
        with self.engine.connect() as conn:
            q = select(jobs_table).where(jobs_table.c.tenant == tenant)
            if after:
                anchor = self._job(conn, tenant, after)
                q = q.where(or_(jobs_table.c.created_at < anchor.created_at, and_(jobs_table.c.created_at == anchor.created_at, jobs_table.c.id < anchor.id)))
            found = conn.execute(q.order_by(jobs_table.c.created_at.desc(), jobs_table.c.id.desc()).limit(limit + 1)).all()
            data = [self._doc(conn, r) for r in found[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(found) > limit}  # fmt: skip

    def cancel(self, tenant: str, job_id: str) -> dict:
        with self.engine.begin() as conn:
            r = self._job(conn, tenant, job_id)
            if r.status in ("completed", "failed", "expired"):
                raise Conflict(f"batch '{job_id}' is already {r.status}")
            if r.status not in ("cancelling", "cancelled"):
                conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.status.in_(ACTIVE))
                             .values(status="cancelling", cancelling_at=int(self.clock())))  # fmt: skip
        return self.retrieve(tenant, job_id)

    # ---- the worker's side ----------------------------------------------------------------

    def claim(self, owner: str, lease_s: float) -> Job | None:
        """An active job whose lease is free or lapsed, now leased to ``owner`` (oldest first)."""
        now = self.clock()
        with self.engine.begin() as conn:
            free = or_(jobs_table.c.lease_owner.is_(None), jobs_table.c.lease_until < now, jobs_table.c.lease_owner == owner)
            candidates = conn.execute(
                select(jobs_table.c.id).where(jobs_table.c.status.in_(ACTIVE), free).order_by(jobs_table.c.created_at, jobs_table.c.id).limit(5)
            ).scalars().all()  # fmt: skip
            for job_id in candidates:
                got = conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.status.in_(ACTIVE), free)
                                   .values(lease_owner=owner, lease_until=now + lease_s)).rowcount  # fmt: skip
                if got:
                    r = conn.execute(select(jobs_table).where(jobs_table.c.id == job_id)).first()
                    if r.status == "validating":
                        conn.execute(update(jobs_table).where(jobs_table.c.id == job_id).values(status="in_progress", in_progress_at=int(now)))
                    return Job(r.id, r.tenant, r.endpoint, "in_progress" if r.status == "validating" else r.status, r.expires_at)
        return None

    def _renew(self, conn, job_id: str, owner: str, lease_s: float) -> bool:
        return bool(conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.lease_owner == owner)
                                 .values(lease_until=self.clock() + lease_s)).rowcount)  # fmt: skip

    def next_rows(self, job_id: str, owner: str, lease_s: float, limit: int) -> tuple[str, list[Row]] | None:
        """Renew the lease; the job's status and up to ``limit`` pending rows. None: the lease is lost."""
        with self.engine.begin() as conn:
            if not self._renew(conn, job_id, owner, lease_s):
                return None
            status = conn.execute(select(jobs_table.c.status).where(jobs_table.c.id == job_id)).scalar_one()
            found = conn.execute(
                select(rows_table.c.row_index, rows_table.c.custom_id, rows_table.c.body)
                .where(rows_table.c.job_id == job_id, rows_table.c.state == "pending").order_by(rows_table.c.row_index).limit(limit)
            ).all()  # fmt: skip
        return status, [Row(*r) for r in found]

    def commit_rows(self, job_id: str, owner: str, lease_s: float, results: list[tuple[int, str, int, str]]) -> int:
        """Commit (row_index, state, status_code, response JSON) under the lease, each row once; -1: lease lost."""
        with self.engine.begin() as conn:
            if not self._renew(conn, job_id, owner, lease_s):
                return -1
            n = 0
            for index, state, code, response in results:
                n += conn.execute(update(rows_table).where(rows_table.c.job_id == job_id, rows_table.c.row_index == index, rows_table.c.state == "pending")
                                  .values(state=state, status_code=code, response=response)).rowcount  # fmt: skip
            return n

    def finalize(self, job_id: str, owner: str, outcome: str) -> bool:
        """Write the output and error files from the rows table (row order, each row once) and end the
        job ``outcome`` (completed | expired | cancelled | failed); False when the lease is lost."""
        with self.engine.begin() as conn:
            job = conn.execute(select(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.lease_owner == owner)).first()
            if job is None or job.status in TERMINAL:
                return False
            now = int(self.clock())
            left = {"expired": "expired", "cancelled": "cancelled", "failed": "failed"}.get(outcome)
            if left is not None:
                conn.execute(update(rows_table).where(rows_table.c.job_id == job_id, rows_table.c.state == "pending").values(state=left))
            rows = conn.execute(select(rows_table).where(rows_table.c.job_id == job_id).order_by(rows_table.c.row_index)).all()
            out, err = [], []
            for r in rows:
                rid = f"batch_req_{job_id[6:]}_{r.row_index}"
                if r.state == "done":
                    body = json.loads(r.response)
                    out.append({"id": rid, "custom_id": r.custom_id, "response": {"status_code": r.status_code, "request_id": rid, "body": body}, "error": None})
                elif r.state == "failed" and r.response is not None:  # a failed job's rows left unrun are "failed" with no answer
                    body = json.loads(r.response)
                    e = body.get("error") if isinstance(body, dict) else None
                    message = e.get("message") if isinstance(e, dict) else str(e)
                    code = e.get("code") if isinstance(e, dict) else None
                    err.append({"id": rid, "custom_id": r.custom_id, "response": {"status_code": r.status_code, "request_id": rid, "body": body},
                                "error": {"code": code, "message": message}})  # fmt: skip
                else:
                    err.append({"id": rid, "custom_id": r.custom_id, "response": None,
                                "error": {"code": f"batch_{r.state}", "message": f"the batch was {r.state} before this request ran"}})  # fmt: skip
            done = sum(1 for r in rows if r.state == "done")
            failed = len(rows) - done if outcome != "completed" else sum(1 for r in rows if r.state == "failed")
            values: dict[str, Any] = {"status": outcome, f"{outcome}_at": now, "finalizing_at": now, "completed": done, "failed": failed,
                                      "lease_owner": None, "lease_until": None}  # fmt: skip
            if out:
                values["output_file_id"] = self._put_file(job.tenant, f"{job_id}_output.jsonl", "batch_output", _jsonl(out), conn)["id"]
            if err:
                values["error_file_id"] = self._put_file(job.tenant, f"{job_id}_error.jsonl", "batch_output", _jsonl(err), conn)["id"]
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id).values(**values))
        return True

    def release(self, job_id: str, owner: str) -> None:
        """Give the lease back (a worker stopping): the next worker takes the job over at once."""
        with self.engine.begin() as conn:
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.lease_owner == owner).values(lease_owner=None, lease_until=None))

    def fail(self, job_id: str, owner: str, code: str, message: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(jobs_table).where(jobs_table.c.id == job_id, jobs_table.c.lease_owner == owner)
                         .values(errors={"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}))  # fmt: skip
        self.finalize(job_id, owner, "failed")


def _jsonl(docs: list[dict]) -> bytes:
    return b"".join(json.dumps(d, separators=(",", ":")).encode() + b"\n" for d in docs)


# (endpoint, body, tenant) -> (HTTP status, response body); raises Overloaded for "try again later"
RunRow = Callable[[str, dict, str], Awaitable[tuple[int, dict]]]


class BatchWorker:
    """Runs active jobs one at a time in this process: ``concurrency`` rows in flight, ``row_batch``
    rows committed together (cancellation and expiry are checked between row batches)."""

    def __init__(self, store: BatchStore, run_row: RunRow, *, owner: str | None = None, lease_s: float = 30.0,
                 concurrency: int = 8, row_batch: int | None = None, poll_s: float = 0.5):  # fmt: skip
        self.store = store
        self.run_row = run_row
        self.owner = owner or f"worker-{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.concurrency = concurrency  # rows in flight at once
        self.row_batch = row_batch or 4 * concurrency  # rows read, run and committed together (one transaction)
        self._slots = asyncio.Semaphore(concurrency)
        self.poll_s = poll_s
        self.rows_done = 0

    async def run(self) -> None:
        while True:
            try:
                job = await asyncio.to_thread(self.store.claim, self.owner, self.lease_s)
                if job is None:
                    await asyncio.sleep(self.poll_s)
                    continue
                try:
                    await self.work(job)
                except asyncio.CancelledError:  # the process stops: rows in flight stay pending, the lease goes back
                    try:
                        self.store.release(job.id, self.owner)
                    except Exception:  # the lease then lapses by itself
                        log.exception("batch %s: giving the lease back failed", job.id)
                    raise
            except asyncio.CancelledError:
                raise
            except Exception:  # the database away a moment: try again (the lease keeps others off meanwhile)
                log.exception("batch worker iteration failed")
                await asyncio.sleep(self.poll_s)

    async def work(self, job: Job) -> None:
        store = self.store
        while True:
            got = await asyncio.to_thread(store.next_rows, job.id, self.owner, self.lease_s, self.row_batch)
            if got is None:
                log.warning("batch %s: lease lost; another worker has it", job.id)
                return
            status, rows = got
            if status == "cancelling":
                await asyncio.to_thread(store.finalize, job.id, self.owner, "cancelled")
                return
            if not rows:
                await asyncio.to_thread(store.finalize, job.id, self.owner, "completed")
                return
            if store.clock() >= job.expires_at:
                await asyncio.to_thread(store.finalize, job.id, self.owner, "expired")
                return
            results = await asyncio.gather(*(self._one(job, row) for row in rows))
            committed = [r for r in results if r is not None]
            if committed and await asyncio.to_thread(store.commit_rows, job.id, self.owner, self.lease_s, committed) < 0:
                log.warning("batch %s: lease lost before commit; another worker has it", job.id)
                return
            self.rows_done += len(committed)
            if len(committed) < len(results):  # some rows were refused for load: back off before trying them again
                await asyncio.sleep(self.poll_s)

    async def _one(self, job: Job, row: Row) -> tuple[int, str, int, str] | None:
        try:
            async with self._slots:
                code, body = await self.run_row(job.endpoint, json.loads(row.body), job.tenant)
        except (Overloaded, BackendUnavailable, ModelNotReady):
            # refused for load, or no replica could take it (a spot replica reclaimed under it and no
            # other serving yet): it stays pending and is tried again after a back-off, never failed for it
            return None
        except asyncio.CancelledError:
            raise
        except InferplaneError as err:  # the status and body of the error table, in the batch output's (OpenAI) shape, as the row runner answers
            code, body, _headers = http_error(err, openai=True)
        except Exception as err:  # noqa: BLE001 - one row's bug must not stop the job
            log.exception("batch %s row %d failed", job.id, row.index)
            code, body, _headers = http_error(InferplaneError(f"internal error ({type(err).__name__})"), openai=True)
        return row.index, "done" if code < 400 else "failed", code, json.dumps(body, separators=(",", ":"))


# ---- at rest: sealed files, retention, erasure (server.control.registry.retention) ----------------------------


def file_store(settings) -> ArtifactStore:
    """Where batch files live: the artifact store's folder, each file sealed (envelope encryption,
    ``server.control.registry.envelope``) whenever an encryption key is set — batch files are customer data,
    so unlike model artifacts they need no ``encrypt_artifacts`` to be sealed."""
    return ArtifactStore(settings.artifact_store, keys=KeyRing.from_settings(settings))


class BatchFiles:
    """The retention target ``batch_files``: jobs (with their rows) and files, by age or by tenant.
    A blob leaves the store only when no remaining file names it (blobs are content-addressed, so two
    tenants who uploaded the same bytes share one)."""

    def __init__(self, settings, keys=None):
        self.settings = settings

    def _open(self):
        engine = make_engine(self.settings.database_url)
        migrations.upgrade(engine)
        return engine

    def purge_tenant(self, tenant: str) -> int:
        return self._purge(files_table.c.tenant == tenant, jobs_table.c.tenant == tenant)

    def purge_before(self, cutoff: float) -> int:
        # a job still running keeps its files and rows whatever their age
        old_jobs = and_(jobs_table.c.created_at < cutoff, jobs_table.c.status.in_(TERMINAL))
        return self._purge(files_table.c.created_at < cutoff, old_jobs, keep_active=True)

    def _purge(self, files_where, jobs_where, keep_active: bool = False) -> int:
        engine = self._open()
        try:
            with engine.begin() as conn:
                job_ids = [r.id for r in conn.execute(select(jobs_table.c.id).where(jobs_where))]
                if job_ids:
                    conn.execute(delete(rows_table).where(rows_table.c.job_id.in_(job_ids)))
                    conn.execute(delete(jobs_table).where(jobs_table.c.id.in_(job_ids)))
                where = files_where
                if keep_active:
                    live = select(jobs_table.c.input_file_id).where(jobs_table.c.status.in_(ACTIVE))
                    where = and_(files_where, files_table.c.id.not_in(live))
                doomed = conn.execute(select(files_table.c.id, files_table.c.blob).where(where)).all()
                if doomed:
                    conn.execute(delete(files_table).where(files_table.c.id.in_([d.id for d in doomed])))
                still = {r.blob for r in conn.execute(select(files_table.c.blob).where(files_table.c.blob.in_({d.blob for d in doomed})))}
            store = ArtifactStore(self.settings.artifact_store)
            for blob in {d.blob for d in doomed} - still:
                path = store.path(blob)
                if store.fs.exists(path):
                    store.fs.rm(path)
            return len(doomed)
        finally:
            engine.dispose()


def _register_retention() -> None:
    retention.register("batch_files", lambda settings, keys: BatchFiles(settings, keys))


_register_retention()
