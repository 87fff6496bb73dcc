"""SSE token-stream driver: OpenAI-compatible ``/v1/chat/completions`` with ``stream: true``.

Per stream it records the time to first token (first event with content), the gaps between
content events (inter-token latency; a chunk holding several tokens is one gap) and the tokens
generated (``usage.completion_tokens``, asked for with ``stream_options.include_usage``).
``SSEDriver`` plugs into the engine's ``Driver``/``Session`` interface (a payload is the JSON
request body, pre-serialized by ``request_pool.sse_pool``); for streams started in the measured
window it keeps HDR histograms of TTFT and inter-token gaps and the token count, which the
runner reports as ``ttft_ms``, ``itl_ms``, ``tokens_per_s`` (``extra_report``).
``stream_chat`` is the one-call primitive the LLM benchmark uses.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from loadtest.histogram import LatencyHistogram
from loadtest.protocol import CALL_STARTED, CallError, Driver, Session, http_error

# used when no --prompt is given
DEFAULT_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a river.",
    "What is the capital of France, and what is it famous for?",
    "Give three tips for writing clear code.",
    "Describe how a bicycle works.",
    "What does a compiler do?",
)


@dataclass
class StreamResult:
    started: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the engine's prefix cache (usage.prompt_tokens_details)
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
                raise http_error(response.status, await response.read())
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
                    usage = event["usage"]
                    result.tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
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
    except asyncio.TimeoutError:
        raise CallError("TIMEOUT", f"stream not finished within {timeout} s") from None
    except aiohttp.ClientError as err:
        raise CallError("HTTP_ERROR", f"{type(err).__name__}: {err}") from None
    result.finished = time.perf_counter()
    result.text = "".join(parts)
    if not result.tokens:
        result.tokens = result.chunks
    return result


class _SSESession(Session):
    __slots__ = ("driver",)
    concurrent_safe = True

    def __init__(self, driver: "SSEDriver") -> None:
        self.driver = driver

    async def call(self, payload: bytes) -> None:
        d = self.driver
        started = CALL_STARTED.get(None)  # the engine's instant for this call: decides whether the stream is measured
        if started is None:  # called outside the engine
            started = time.monotonic()
        result = await stream_chat(d.http, d.url, payload, d.timeout)
        d.record(started, result)


class SSEDriver(Driver):
    """``http://host:port`` -> POST /v1/chat/completions streams.

    Streams started inside the measured window feed ``ttft``/``itl`` histograms and the token
    count; with ``keep_results`` every ``StreamResult`` is kept in ``results`` as well.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 300.0,
        path: str = "/v1/chat/completions",
        connections: int = 0,
        metadata: tuple[tuple[str, str], ...] = (),
        keep_results: bool = False,
    ) -> None:
        parts = urlsplit(target)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"SSE targets are http(s)://host:port, got {target!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{path}"
        self.timeout = timeout
        self.connections = max(0, connections)  # aiohttp: 0 = no limit
        self.headers = dict(metadata)
        self.keep_results = keep_results
        self.http: aiohttp.ClientSession | None = None
        self.results: list[StreamResult] = []
        self.window = (float("-inf"), float("inf"))
        self.ttft = LatencyHistogram()
        self.itl = LatencyHistogram()
        self.tokens = 0
        self.streams = 0
        self.without_content = 0

    async def open(self) -> None:
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections, limit_per_host=0), headers=self.headers
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None

    async def session(self, index: int) -> Session:
        return _SSESession(self)

    def record(self, started: float, result: StreamResult) -> None:
        if self.keep_results:
            self.results.append(result)
        t_meas, t_end = self.window
        if not t_meas <= started < t_end:
            return
        self.streams += 1
        self.tokens += result.tokens
        if result.ttft_s is None:
            self.without_content += 1
        else:
            self.ttft.record(result.ttft_s)
        for gap in result.gaps_s:
            self.itl.record(gap)

    def measure_window(self, t_meas: float, t_end: float) -> None:
        self.window = (t_meas, t_end)

    def extra_wire(self) -> dict:
        return {
            "ttft": self.ttft.encode() if self.ttft.count else b"",
            "itl": self.itl.encode() if self.itl.count else b"",
            "tokens": self.tokens,
            "streams": self.streams,
            "without_content": self.without_content,
        }

    @classmethod
    def extra_report(cls, wires: list[dict], duration_s: float) -> dict:
        ttft, itl = LatencyHistogram(), LatencyHistogram()
        tokens = streams = empty = 0
        for w in wires:
            ttft.add(LatencyHistogram.decode(w["ttft"]))
            itl.add(LatencyHistogram.decode(w["itl"]))
            tokens += w["tokens"]
            streams += w["streams"]
            empty += w["without_content"]
        return {
            "streams": streams,
            "streams_without_content": empty,
            "tokens": tokens,
            "tokens_per_s": tokens / duration_s,
            "tokens_per_stream": tokens / streams if streams else 0.0,
            "ttft_ms": ttft.summary_ms(),
            "itl_ms": itl.summary_ms(),
        }
