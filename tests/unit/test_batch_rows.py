"""The batch row runner (``server.transports.batch_rows``): which answer a row's endpoint reaches, the
context it runs in, and which errors are the row's answer. The rows through a real frontend and
Triton: ``tests/integration/test_batches.py``."""

from __future__ import annotations

import re

import pytest

from server.control.batches.batches import OIP_ENDPOINT
from server.transports.batch_rows import ROW_TIMEOUT_S, RowRunner
from server.errors import ModelNotFound, Overloaded
from server.tenancy.identity import anonymous

PRINCIPAL = anonymous()


def _runner(answer):
    return RowRunner(lambda tenant: PRINCIPAL, [(re.compile(r"/v1/embeddings"), answer), (OIP_ENDPOINT, answer)])


async def test_a_row_reaches_its_endpoints_answer_as_its_tenant_at_the_batch_class():
    seen = []

    async def answer(match, body, ctx):
        seen.append((match[0], match.groupdict().get("name"), match.groupdict().get("version"), body, ctx))
        return {"ok": True}

    run = _runner(answer)
    assert await run("/v2/models/m/versions/3/infer", {"inputs": []}, "acme") == (200, {"ok": True})
    assert await run("/v1/embeddings", {"input": "x"}, "acme") == (200, {"ok": True})
    (_, name, version, body, ctx), (path, *_rest) = seen
    assert (name, version, body) == ("m", "3", {"inputs": []}) and path == "/v1/embeddings"
    assert ctx.priority == "batch" and ctx.timeout == ROW_TIMEOUT_S
    assert ctx.delegation is not None and ctx.delegation.principal is PRINCIPAL and ctx.delegation.covers == ""


async def test_an_unknown_endpoint_or_a_refusal_is_the_rows_answer_an_overload_is_raised():
    async def missing(match, body, ctx):
        raise ModelNotFound("unknown model 'm'")

    status, doc = await _runner(missing)("/v2/models/m/infer", {}, "acme")
    assert status == 404 and "unknown model" in doc["error"]["message"]
    status, doc = await _runner(missing)("/v1/embeddingsX", {}, "acme")  # the whole endpoint must match
    assert status == 400 and "not a batch endpoint" in doc["error"]["message"]

    async def overloaded(match, body, ctx):
        raise Overloaded("busy", retry_after_s=1.0)

    with pytest.raises(Overloaded):  # the row stays pending and is tried again
        await _runner(overloaded)("/v1/embeddings", {}, "acme")
