"""The OpenAI SSE policy for slow starts and slow clients, in process on real sockets (aiohttp's test
server and client, a raw socket for the client that stops reading); the engine's stream is a fake
driven by events, so nothing here depends on timing: a heartbeat is awaited because the first chunk
is withheld until it arrives, a stall because the client never reads."""

from __future__ import annotations

import asyncio
import json
import socket

from server.dataplane.port import Chunk
from server.errors import Overloaded
from server.transports.rest.appkeys import DATAPLANE

JSON = {"Content-Type": "application/json"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class _FakeLLM:
    """``generate`` yields what the test hands it: ``release`` lets the first chunk out; ``endless``
    yields big chunks forever; ``fail_first`` raises before any chunk."""

    def __init__(self, endless: bool = False, fail_first: BaseException | None = None, fail_after_first: bool = False):
        self.release = asyncio.Event()
        self.endless, self.fail_first, self.fail_after_first = endless, fail_first, fail_after_first
        self.closed = asyncio.Event()
        self.sent = 0

    def generate(self, model, params, timeout=None, ctx=None):
        async def gen():
            try:
                if self.fail_first is not None:
                    raise self.fail_first
                await self.release.wait()
                if self.fail_after_first:
                    raise Overloaded("the queue wait ran out")
                if self.endless:
                    while True:
                        self.sent += 1
                        yield Chunk("x" * 65536, None, 5, self.sent)
                        await asyncio.sleep(0)
                yield Chunk("Hello", None, 5, 1)
                yield Chunk(" world", "stop", 5, 2)
            finally:
                self.closed.set()

        return gen()


class _StubDataPlane:
    def __init__(self, llm, bound: int | None = None):
        from batching.overload_policy import LoopGate, LoopPolicy
        from server.dataplane.loop_gate import Admission

        self.llm = llm
        self.admission = Admission(LoopGate(LoopPolicy(ceiling=bound)))  # the real in-flight bound

    def is_ready(self) -> bool:
        return True


async def _server(llm, stall_s=30.0, heartbeat_s=15.0, bound=None):
    from aiohttp.test_utils import TestClient, TestServer

    from server.dataplane.metrics import Metrics
    from server.transports.openai.endpoints import SSEPolicy
    from server.composition import create_app

    app = create_app(_StubDataPlane(llm, bound), Metrics(), max_body_bytes=1 << 20, sse=SSEPolicy(stall_s=stall_s, heartbeat_s=heartbeat_s))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_a_slow_first_token_gets_heartbeats_then_the_stream():
    llm = _FakeLLM()
    client = await _server(llm, heartbeat_s=0.05)
    try:
        r = await client.post("/v1/chat/completions", json=BODY)
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        first = await r.content.readline()
        assert first == b": heartbeat\n"  # an SSE comment: headers went out before the first token
        llm.release.set()
        events = [line async for line in r.content if line.startswith(b"data: ")]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert events[-1] == b"data: [DONE]\n"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello world"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        await client.close()


async def test_an_error_after_the_heartbeat_travels_in_the_stream():
    llm = _FakeLLM(fail_after_first=True)
    client = await _server(llm, heartbeat_s=0.05)
    try:
        r = await client.post("/v1/chat/completions", json=BODY)
        assert r.status == 200 and await r.content.readline() == b": heartbeat\n"
        llm.release.set()
        events = [line async for line in r.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        error = json.loads(events[-2][6:])["error"]
        assert "queue wait ran out" in error["message"]
    finally:
        await client.close()


async def test_an_error_before_the_heartbeat_is_still_the_http_status():
    client = await _server(_FakeLLM(fail_first=Overloaded("too many requests")), heartbeat_s=30.0)
    try:
        r = await client.post("/v1/chat/completions", json=BODY)
        assert r.status == 429
        assert "too many requests" in (await r.json())["error"]["message"]
    finally:
        await client.close()


async def test_a_client_that_stops_reading_is_disconnected_and_its_generation_closed():
    llm = _FakeLLM(endless=True)
    llm.release.set()
    client = await _server(llm, stall_s=0.2, heartbeat_s=0)
    try:
        body = json.dumps(BODY).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (client.host, client.port))
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        await loop.sock_sendall(sock, request)
        # the client reads nothing: the server's writes stop draining, and after stall_s it gives up
        await asyncio.wait_for(llm.closed.wait(), 60)
        sent = llm.sent
        await asyncio.sleep(0.3)
        assert llm.sent == sent, "the engine's stream kept going after the stall"
        received = b""
        while True:  # the server closed the connection: what is left in the buffers, then EOF
            data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 30)
            if not data:
                break
            received += data
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
        sock.close()
    finally:
        await client.close()


async def test_a_stream_holds_its_place_until_its_last_byte_and_past_the_bound_is_refused_before_its_first():
    """The process's in-flight bound (server.dataplane.loop_gate) on the OpenAI routes: with a bound of
    one, a stream still waiting for its first token holds the place; a second chat completion (stream or
    not) and an embeddings request are 429 with Retry-After and the OpenAI error body, no SSE byte; once
    the first stream ends the place is free again."""
    llm = _FakeLLM()
    client = await _server(llm, heartbeat_s=0.05, bound=1)
    try:
        held = await client.post("/v1/chat/completions", json=BODY)
        assert held.status == 200 and await held.content.readline() == b": heartbeat\n"  # in flight, no token yet
        stub = client.server.app[DATAPLANE]
        assert stub.admission.gate.inflight == 1
        for path, body in (("/v1/chat/completions", BODY), ("/v1/chat/completions", {**BODY, "stream": False}),
                           ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True}),
                           ("/v1/embeddings", {"model": "m", "input": "hi"})):  # fmt: skip
            refused = await client.post(path, json=body)
            assert refused.status == 429, (path, refused.status)
            assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["Content-Type"].startswith("application/json")
            error = (await refused.json())["error"]
            assert error["code"] == "RESOURCE_EXHAUSTED" and "in flight" in error["message"], error
        llm.release.set()
        events = [line async for line in held.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"  # the held stream was served whole
        await asyncio.wait_for(_until(lambda: stub.admission.gate.inflight == 0), 30)  # its place came back
        assert stub.admission.gate.refused == 4
    finally:
        await client.close()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)
