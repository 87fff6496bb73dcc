"""Transport drivers: what the load engine calls, one small interface per protocol.

The engine only knows `Driver` and `Session`: a session sends one pre-serialized request and
returns when its answer arrived, raising `CallError(code, message)` on failure. The target's
scheme picks the driver (`loadtest.drivers.make_driver`):

- `grpc://HOST:PORT` (or bare `HOST:PORT`): OIP v2 gRPC, `ModelInfer` or `ModelStreamInfer`.
- `http(s)://HOST:PORT`: KServe v2 REST `POST /v2/models/{model}/infer`, Triton's binary tensor
  extension by default (`rest`), JSON tensors with `rest_json` (`rest-json`).
- `sse://HOST:PORT` (or `http://` with `sse`): OpenAI chat completions streamed as Server-Sent
  Events (`loadtest.sse.SSEDriver`), with time to first token and inter-token latency.

A pool item is whatever the protocol's session takes: serialized protobuf bytes for gRPC,
`(body, headers)` for REST, a JSON body for SSE (`loadtest.request_pool.build_pool`).
Drivers may report per-request figures beyond latency (`measure_window`, `extra_wire`,
`extra_report`); the runner merges them into the result JSON.
"""

from __future__ import annotations

import abc
import asyncio
import json
from contextvars import ContextVar
from types import SimpleNamespace
from urllib.parse import quote, urlsplit

import aiohttp
import grpc

SERVICE = "inference.GRPCInferenceService"
MODEL_INFER = f"/{SERVICE}/ModelInfer"
MODEL_STREAM_INFER = f"/{SERVICE}/ModelStreamInfer"
MODEL_METADATA = f"/{SERVICE}/ModelMetadata"

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # Each channel gets its own TCP connection instead of sharing one subchannel.
    ("grpc.use_local_subchannel_pool", 1),
]


# The instant by which the engine decides whether a call is in the measured window (closed loop: its start;
# open loop: its scheduled send), set in the caller's task before each call: a driver that counts figures of
# its own (SSE's streams, tokens) decides by the same instant, so its counts match the engine's requests.
CALL_STARTED: ContextVar[float] = ContextVar("call_started")


class CallError(Exception):
    """A request failed; `code` is the gRPC status name (or a protocol-specific label);
    `retry_after`: the server's retry hint in seconds (gRPC ``retry-after`` or
    ``grpc-retry-pushback-ms`` trailers, HTTP ``Retry-After``), None without one."""

    def __init__(self, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after


def retry_hint(pairs) -> float | None:
    """Seconds from a refusal's metadata or headers (``(key, value)`` pairs): ``retry-after``
    (seconds) or ``grpc-retry-pushback-ms`` (milliseconds); None when absent or unreadable."""
    for key, value in pairs or ():
        key = key.lower()
        try:
            if key == "retry-after":
                return max(0.0, float(value))
            if key == "grpc-retry-pushback-ms":
                return max(0.0, float(value) / 1000.0)
        except (TypeError, ValueError):
            return None
    return None


class Session(abc.ABC):
    """One logical caller. Unary sessions may be used concurrently; stream sessions may not."""

    concurrent_safe: bool = True

    @abc.abstractmethod
    async def call(self, payload: bytes) -> None: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class Driver(abc.ABC):
    """A connection (pool) to one target."""

    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def session(self, index: int) -> Session: ...

    # Optional per-request figures beyond latency (SSE: time to first token, tokens/s, ...).
    def measure_window(self, t_meas: float, t_end: float) -> None:  # noqa: B027 - optional hook
        """Requests *started* in [t_meas, t_end) (monotonic clock) count towards `extra_wire`."""

    def extra_wire(self) -> dict | None:
        """Picklable per-process extras, merged across worker processes by `extra_report`."""
        return None

    @classmethod
    def extra_report(cls, wires: list[dict], duration_s: float) -> dict:
        """Keys added to the result JSON from the `extra_wire` of every process."""
        return {}


# ---------------------------------------------------------------- targets

PROTOCOLS = ("grpc", "grpc-stream", "rest", "rest-json", "sse")


def protocol_of(target: str, *, stream: bool = False, rest_json: bool = False, sse: bool = False) -> str:
    """The protocol a target speaks: grpc | grpc-stream | rest | rest-json | sse."""
    scheme = urlsplit(target).scheme if "://" in target else "grpc"
    if scheme == "grpc":
        if sse or rest_json:
            raise ValueError(f"--sse/--rest-json need an http:// target, got {target!r}")
        return "grpc-stream" if stream else "grpc"
    if scheme not in ("http", "https", "sse"):
        raise ValueError(f"unsupported target scheme {scheme!r} in {target!r} (grpc://, http(s)://, sse://)")
    if stream:
        raise ValueError("--stream is gRPC's ModelStreamInfer; for token streams use sse:// or --sse")
    if scheme == "sse" or sse:
        if rest_json:
            raise ValueError("--rest-json does not apply to SSE targets")
        return "sse"
    return "rest-json" if rest_json else "rest"


def http_base(target: str) -> str:
    """'http://h:p', 'https://h:p' or 'sse://h:p' (any path dropped) -> 'http(s)://h:p'."""
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https", "sse") or not parts.hostname:
        raise ValueError(f"target needs http(s)://HOST:PORT or sse://HOST:PORT, got {target!r}")
    scheme = "http" if parts.scheme == "sse" else parts.scheme
    return f"{scheme}://{parts.netloc}"


def http_error(status: int, body: bytes, headers=None) -> CallError:
    """A non-2xx answer as CallError('HTTP 429', 'RESOURCE_EXHAUSTED: ...') (message from the
    bridge's error body when it has one — Triton's {"error": "...", "code"} or OpenAI's
    {"error": {code, message}} — else the body's start)."""
    message = body[:300].decode(errors="replace")
    try:
        doc = json.loads(body)
        err = doc.get("error")
        if isinstance(err, dict):
            message = f"{err.get('code', '')}: {err.get('message', '')}".strip(": ")
        elif isinstance(err, str):
            message = f"{doc.get('code', '')}: {err}".strip(": ")
    except (ValueError, AttributeError):
        pass
    return CallError(f"HTTP {status}", message, retry_hint((headers or {}).items()))


def parse_grpc_target(target: str) -> str:
    """'grpc://host:port' (or bare 'host:port') -> 'host:port'."""
    if "://" not in target:
        return target
    parts = urlsplit(target)
    if parts.scheme != "grpc":
        raise ValueError(f"not a grpc:// target: {target!r}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"target needs host and port: {target!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{parts.port}"


class _UnarySession(Session):
    __slots__ = ("_mc", "_timeout", "_metadata")
    concurrent_safe = True

    def __init__(self, mc, timeout: float | None, metadata) -> None:
        self._mc = mc
        self._timeout = timeout
        self._metadata = metadata

    async def call(self, payload: bytes) -> None:
        try:
            await self._mc(payload, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise CallError(e.code().name, e.details() or "", retry_hint(e.trailing_metadata())) from None


class _StreamSession(Session):
    """One ModelStreamInfer bidi stream, one request outstanding at a time (closed loop)."""

    concurrent_safe = False

    def __init__(self, mc, metadata) -> None:
        self._call = mc(metadata=metadata)

    async def call(self, payload: bytes) -> None:
        try:
            await self._call.write(payload)
            resp = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise CallError(e.code().name, e.details() or "") from None
        if resp is grpc.aio.EOF:
            raise CallError("STREAM_EOF", "server closed the stream")
        # ModelStreamInferResponse: field 1 (error_message, tag 0x0A) serializes first, so a
        # non-empty error is visible in the first byte without parsing the message.
        if resp[:1] == b"\n":
            from server.protogen.inference import grpc_service_pb2 as pb

            msg = pb.ModelStreamInferResponse.FromString(resp).error_message
            raise CallError("STREAM_ERROR", msg)

    async def close(self) -> None:
        try:
            await self._call.done_writing()
        except Exception:  # noqa: BLE001 - the stream may already be broken
            pass
        self._call.cancel()


class GrpcDriver(Driver):
    """OIP v2 over gRPC with bytes-in/bytes-out multicallables (no protobuf work per request)."""

    def __init__(
        self,
        target: str,
        *,
        stream: bool = False,
        channels: int = 1,
        timeout: float | None = 30.0,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.address = parse_grpc_target(target)
        self.stream = stream
        self.n_channels = max(1, channels)
        self.timeout = timeout
        self.metadata = tuple(metadata) or None
        self._channels: list[grpc.aio.Channel] = []
        self._unary = []
        self._streams = []

    async def open(self) -> None:
        for _ in range(self.n_channels):
            ch = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            self._channels.append(ch)
            self._unary.append(
                ch.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)
            )
            self._streams.append(
                ch.stream_stream(
                    MODEL_STREAM_INFER, request_serializer=None, response_deserializer=None
                )
            )
        await asyncio.gather(*(ch.channel_ready() for ch in self._channels))

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels), return_exceptions=True)
        self._channels.clear()

    async def session(self, index: int) -> Session:
        i = index % self.n_channels
        if self.stream:
            return _StreamSession(self._streams[i], self.metadata)
        return _UnarySession(self._unary[i], self.timeout, self.metadata)


# ---------------------------------------------------------------- KServe v2 REST


class _RestSession(Session):
    __slots__ = ("_post", "_url")
    concurrent_safe = True

    def __init__(self, http, url: str) -> None:
        self._post = http.post
        self._url = url

    async def call(self, payload) -> None:
        body, headers = payload
        try:
            async with self._post(self._url, data=body, headers=headers) as response:
                data = await response.read()  # read to the end so the connection is reused
                if response.status != 200:
                    raise http_error(response.status, data, response.headers)
        except asyncio.TimeoutError:
            raise CallError("TIMEOUT", f"no answer within the deadline ({self._url})") from None
        except aiohttp.ClientError as e:
            raise CallError("HTTP_ERROR", f"{type(e).__name__}: {e}") from None


class RestDriver(Driver):
    """KServe v2 REST infer on one `aiohttp.ClientSession`; a pool item is `(body, headers)`
    (`request_pool.rest_binary_body` / `rest_json_body`), so no JSON or numpy work per request."""

    def __init__(
        self,
        target: str,
        model: str,
        *,
        version: str = "",
        connections: int = 0,
        timeout: float | None = 30.0,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.base = http_base(target)
        path = f"/v2/models/{quote(model, safe='')}"
        if version:
            path += f"/versions/{quote(version, safe='')}"
        self.url = f"{self.base}{path}/infer"
        self.connections = max(0, connections)  # aiohttp: 0 = no limit
        self.timeout = timeout
        self.headers = dict(metadata)
        self.http = None

    async def open(self) -> None:
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers=self.headers,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None

    async def session(self, index: int) -> Session:
        return _RestSession(self.http, self.url)


def fetch_model_metadata(
    target: str,
    model: str,
    *,
    version: str = "",
    metadata: tuple[tuple[str, str], ...] = (),
    timeout: float = 10.0,
):
    """The model's signature (blocking; used once before a run): the ModelMetadata RPC for gRPC
    targets, `GET /v2/models/{model}` for http(s):// ones (same attributes: name, inputs[].name,
    .datatype, .shape)."""
    if "://" in target and urlsplit(target).scheme in ("http", "https"):
        return fetch_rest_metadata(target, model, version=version, metadata=metadata, timeout=timeout)
    from server.protogen.inference import grpc_service_pb2 as pb

    with grpc.insecure_channel(parse_grpc_target(target), options=_CHANNEL_OPTIONS) as ch:
        mc = ch.unary_unary(
            MODEL_METADATA,
            request_serializer=pb.ModelMetadataRequest.SerializeToString,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        return mc(
            pb.ModelMetadataRequest(name=model, version=version),
            timeout=timeout,
            metadata=tuple(metadata) or None,
            wait_for_ready=True,
        )


def fetch_rest_metadata(
    target: str,
    model: str,
    *,
    version: str = "",
    metadata: tuple[tuple[str, str], ...] = (),
    timeout: float = 10.0,
) -> SimpleNamespace:
    """`GET /v2/models/{model}[/versions/{v}]` as an object shaped like ModelMetadataResponse."""
    import urllib.error
    import urllib.request

    path = f"/v2/models/{quote(model, safe='')}"
    if version:
        path += f"/versions/{quote(version, safe='')}"
    req = urllib.request.Request(http_base(target) + path, headers=dict(metadata))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            doc = json.loads(response.read())
    except urllib.error.HTTPError as e:
        err = http_error(e.code, e.read())
        raise RuntimeError(f"model metadata for {model!r}: {err.code}: {err.message}") from None
    return metadata_from_json(doc, model)


def metadata_from_json(doc: dict, model: str = "") -> SimpleNamespace:
    def tensors(items) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(name=t["name"], datatype=t["datatype"], shape=[int(d) for d in t.get("shape", [])])
            for t in items or ()
        ]

    return SimpleNamespace(
        name=doc.get("name") or model,
        versions=list(doc.get("versions") or ()),
        platform=doc.get("platform", ""),
        inputs=tensors(doc.get("inputs")),
        outputs=tensors(doc.get("outputs")),
    )
