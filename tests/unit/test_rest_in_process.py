"""The REST bridge in process (aiohttp's test server, no Triton): what the live stack cannot show
cheaply — a chunked body over the limit, and an unexpected exception in the data plane."""

from __future__ import annotations

import asyncio
import contextlib
import json

JSON = {"Content-Type": "application/json"}


def _error(body: bytes) -> dict:
    doc = json.loads(body)
    assert set(doc) == {"error", "code", "details"} and isinstance(doc["error"], str), doc
    return {"code": doc["code"], "message": doc["error"], "details": doc["details"]}


class _StubDataPlane:
    """Resolves nothing, and its infer raises an unexpected (non-domain) exception."""

    llm = None  # no generation here
    admission = contextlib.nullcontext()  # no loop gate

    def is_ready(self) -> bool:
        return True

    def resolve(self, name, version=""):
        from server.errors import ModelNotFound

        raise ModelNotFound(f"unknown model '{name}'")

    def authorize(self, ctx, name):
        return None  # auth off: everyone, every model

    async def infer(self, request, raw=None, timeout=None, ctx=None):
        raise RuntimeError("a bug")


async def _in_process(max_body_bytes: int):
    from aiohttp.test_utils import TestClient, TestServer

    from server.composition import create_app
    from server.dataplane.metrics import Metrics

    client = TestClient(TestServer(create_app(_StubDataPlane(), Metrics(), max_body_bytes=max_body_bytes)))
    await client.start_server()
    return client


async def test_chunked_body_over_the_limit_is_413():
    client = await _in_process(4096)
    try:

        async def chunks():
            for _ in range(16):
                yield b"x" * 1024
                await asyncio.sleep(0)

        response = await client.post("/v2/models/m/infer", data=chunks(), headers=JSON)
        assert response.status == 413
        assert _error(await response.read())["code"] == "REQUEST_TOO_LARGE"
        assert (await client.get("/v2/health/live")).status == 200
    finally:
        await client.close()


async def test_unexpected_exception_is_a_500_with_the_error_shape():
    client = await _in_process(1 << 20)
    try:
        doc = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        response = await client.post("/v2/models/m/infer", json=doc)
        assert response.status == 500
        error = _error(await response.read())
        assert error["code"] == "INTERNAL" and "a bug" not in error["message"]
        assert (await client.get("/v2/health/live")).status == 200
    finally:
        await client.close()


def test_each_instance_of_a_predict_call_gets_a_context_of_its_own():
    """Each instance is its own request: its own idempotency key by index."""
    from server.tenancy.identity import CallContext
    from server.transports.rest.endpoints import _instance

    ctx = CallContext(api_key="k", timeout=5.0)
    first, second = _instance(ctx, 0), _instance(ctx, 1)
    assert first is not ctx and second is not ctx and first is not second
    assert (second.api_key, second.timeout, second.idempotency_key) == ("k", 5.0, None)
    keyed = CallContext(idempotency_key="order-1")
    assert [_instance(keyed, i).idempotency_key for i in (0, 1)] == ["order-1#0", "order-1#1"]
