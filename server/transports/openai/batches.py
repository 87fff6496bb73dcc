"""OpenAI batch API over HTTP: ``/v1/files`` (JSONL upload, content) and ``/v1/batches``
(create, retrieve, list, cancel), in the shapes the ``openai`` SDK reads. The rows of a job run
through ``server.transports.batch_rows``.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from server.control.batches.batches import BatchStore
from server.errors import BackendUnavailable, InvalidRequest, UnsupportedMediaType, Violation
from server.tenancy.identity import CallContext
from server.transports.openai.body import json_object
from server.transports.rest.appkeys import DATAPLANE
from server.transports.rest.openapi import Body, Route, error_body, error_responses, json_body

BATCHES: web.AppKey[BatchStore] = web.AppKey("batch_store", BatchStore)
MULTIPART = "multipart/form-data"


def _store(request: web.Request) -> BatchStore:
    store = request.app.get(BATCHES)
    if store is None:
        raise BackendUnavailable("batch jobs are served by a single-process frontend with a registry (--workers 1)")
    return store


def _tenant(request: web.Request) -> tuple[str, str]:
    principal = request.app[DATAPLANE].gate.authenticate(CallContext.from_headers(request.headers))
    return principal.tenant.name, principal.tenant.team


def _thread(fn, *args):
    return asyncio.to_thread(fn, *args)


# ---- files --------------------------------------------------------------------------------------


async def create_file(request: web.Request) -> web.Response:
    tenant, _team = _tenant(request)
    store = _store(request)
    if not request.content_type.startswith(MULTIPART):
        raise UnsupportedMediaType(f"upload a file as {MULTIPART} with fields 'purpose' and 'file'")
    try:
        purpose, filename, data = await _read_upload(request)
    except (HttpProcessingError, ValueError, UnicodeDecodeError) as err:  # a malformed body is the caller's mistake
        reason = type(err).__name__ if not isinstance(err, HttpProcessingError) else (err.message or type(err).__name__)
        raise InvalidRequest(f"the upload is not valid {MULTIPART}: {str(reason)[:200]}", [Violation("body", "malformed multipart")]) from None
    if data is None:
        raise InvalidRequest("the upload has no 'file' field", [Violation("file", "required")])
    if purpose is None:
        raise InvalidRequest("the upload has no 'purpose' field", [Violation("purpose", "required")])
    return web.json_response(await _thread(store.create_file, tenant, filename, purpose, data))


async def _read_upload(request: web.Request) -> tuple[str | None, str, bytes | None]:
    purpose, filename, data = None, "", None
    reader = await request.multipart()
    async for part in reader:
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename = part.filename or ""
            data = bytes(await part.read())
    return purpose, filename, data


async def get_file(request: web.Request) -> web.Response:
    tenant, _ = _tenant(request)
    return web.json_response(await _thread(_store(request).get_file, tenant, request.match_info["file_id"]))


async def file_content(request: web.Request) -> web.Response:
    tenant, _ = _tenant(request)
    data = await _thread(_store(request).file_content, tenant, request.match_info["file_id"])
    return web.Response(body=data, content_type="application/jsonl")


# ---- batches ------------------------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    tenant, team = _tenant(request)
    store = _store(request)
    doc = await json_object(request)
    job = await _thread(
        store.create_batch, tenant, team, doc.get("input_file_id"), doc.get("endpoint"), doc.get("completion_window", "24h"), doc.get("metadata")
    )  # fmt: skip
    return web.json_response(job)


async def get_batch(request: web.Request) -> web.Response:
    tenant, _ = _tenant(request)
    return web.json_response(await _thread(_store(request).retrieve, tenant, request.match_info["batch_id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    tenant, _ = _tenant(request)
    return web.json_response(await _thread(_store(request).cancel, tenant, request.match_info["batch_id"]))


async def list_batches(request: web.Request) -> web.Response:
    tenant, _ = _tenant(request)
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be an integer", [Violation("limit", "not an integer")]) from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", [Violation("limit", "out of range")])
    return web.json_response(await _thread(_store(request).list, tenant, request.query.get("after"), limit))


# ---- routes (mounted into the OpenAI routes) ----------------------------------------------------

_OBJ = {"type": "object", "additionalProperties": True}
_ERRORS = error_responses(400, 404, 503, schema="OpenAIError") | {409: error_body("The batch already ended", "OpenAIError")}

ROUTES: list[Route] = [
    Route("POST", "/v1/files", create_file, "files_create", "Upload a JSONL file (multipart: purpose=batch, file)", "openai",
          {200: json_body("The file object", _OBJ)} | _ERRORS,
          request=Body("purpose and file", {MULTIPART: {"schema": {"type": "object", "required": ["purpose", "file"], "properties": {
              "purpose": {"type": "string", "enum": ["batch"]}, "file": {"type": "string", "format": "binary"}}}}})),
    Route("GET", "/v1/files/{file_id}", get_file, "files_retrieve", "A file object of the caller's tenant", "openai",
          {200: json_body("The file object", _OBJ)} | _ERRORS),
    Route("GET", "/v1/files/{file_id}/content", file_content, "files_content", "A file's bytes (an input, output or error JSONL)", "openai",
          {200: Body("JSONL", {"application/jsonl": {"schema": {"type": "string"}}})} | _ERRORS),
    Route("POST", "/v1/batches", create_batch, "batches_create", "Start a batch job over an uploaded JSONL file", "openai",
          {200: json_body("The batch object", _OBJ)} | _ERRORS,
          request=json_body("OpenAI batch request", {"type": "object", "required": ["input_file_id", "endpoint"], "properties": {
              "input_file_id": {"type": "string"}, "endpoint": {"type": "string"}, "completion_window": {"type": "string"},
              "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}})),
    Route("GET", "/v1/batches", list_batches, "batches_list", "The caller's batch jobs, newest first (after, limit)", "openai",
          {200: json_body("A page of batch objects", _OBJ)} | _ERRORS),
    Route("GET", "/v1/batches/{batch_id}", get_batch, "batches_retrieve", "A batch job: status, request counts, files", "openai",
          {200: json_body("The batch object", _OBJ)} | _ERRORS),
    Route("POST", "/v1/batches/{batch_id}/cancel", cancel_batch, "batches_cancel", "Cancel a batch job (stops within one row batch)", "openai",
          {200: json_body("The batch object", _OBJ)} | _ERRORS),
]  # fmt: skip
