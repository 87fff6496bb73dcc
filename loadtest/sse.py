"""SSE token-stream driver: OpenAI-compatible ``/v1/chat/completions`` with ``stream: true``.

Per stream it records the time to first token (first event with content), the gaps between
content events (inter-token latency; a chunk holding several tokens is one gap) and the tokens
generated (``usage.completion_tokens``, asked for with ``stream_options.include_usage``).
``SSEDriver`` plugs into the engine's ``Driver``/``Session`` interface (a payload is the JSON
request body); ``stream_chat`` is the one-call primitive the LLM benchmark uses.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from loadtest.protocol import CallError, Driver, Session


@dataclass
class StreamResult:
    started: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0
    finished: float = 0.0
    finish_reason: str | None = None
    text: str = ""

    @property
    def duration_s(self) -> float:
        return self.finished - self.started


def chat_body(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict | bytes, timeout: float = 300.0) -> StreamResult:
    """POST one streaming chat completion and time its events; raises CallError on failure."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    result = StreamResult(started=time.perf_counter())
    last = None
    parts = []
    try:
        async with session.post(
            url, data=data, headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                raise CallError(f"HTTP_{response.status}", (await response.text())[:300])
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise CallError(event["error"].get("code", "STREAM_ERROR"), event["error"].get("message", ""))
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", ()):
                    content = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if content:
                        now = time.perf_counter()
                        if result.ttft_s is None:
                            result.ttft_s = now - result.started
                        else:
                            result.gaps_s.append(now - last)
                        last = now
                        result.chunks += 1
                        parts.append(content)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except aiohttp.ClientError as err:
        raise CallError("HTTP_ERROR", str(err)) from None
    result.finished = time.perf_counter()
    result.text = "".join(parts)
    if not result.tokens:
        result.tokens = result.chunks
    return result


class _SSESession(Session):
    concurrent_safe = True

    def __init__(self, driver: "SSEDriver") -> None:
        self.driver = driver

    async def call(self, payload: bytes) -> None:
        self.driver.results.append(await stream_chat(self.driver.http, self.driver.url, payload, self.driver.timeout))


class SSEDriver(Driver):
    """``http://host:port`` -> POST /v1/chat/completions streams; results collect in ``results``."""

    def __init__(self, target: str, *, timeout: float = 300.0, path: str = "/v1/chat/completions") -> None:
        parts = urlsplit(target)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"SSE targets are http(s)://host:port, got {target!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{path}"
        self.timeout = timeout
        self.http: aiohttp.ClientSession | None = None
        self.results: list[StreamResult] = []

    async def open(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def session(self, index: int) -> Session:
        return _SSESession(self)
