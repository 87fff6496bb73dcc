"""Transport drivers: what the load engine calls, one small interface per protocol.

The engine only knows `Driver` and `Session`: a session sends one pre-serialized request and
returns when its answer arrived, raising `CallError(code, message)` on failure. Later protocols
(REST, SSE token streams) add a driver here; the engine, histograms and reports stay the same.
Only OIP v2 gRPC is implemented now.
"""

from __future__ import annotations

import abc
import asyncio
from urllib.parse import urlsplit

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


class CallError(Exception):
    """A request failed; `code` is the gRPC status name (or a protocol-specific label)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


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


def parse_grpc_target(target: str) -> str:
    """'grpc://host:port' (or bare 'host:port') -> 'host:port'."""
    if "://" not in target:
        return target
    parts = urlsplit(target)
    if parts.scheme != "grpc":
        raise ValueError(f"only grpc:// targets are supported for now, got {target!r}")
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
            raise CallError(e.code().name, e.details() or "") from None


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


def make_driver(target: str, **kwargs) -> Driver:
    """Pick the driver for a target URL. Only grpc:// for now."""
    if target.startswith(("http://", "https://")):
        raise NotImplementedError("REST/SSE drivers are not implemented yet; use grpc://")
    return GrpcDriver(target, **kwargs)


def fetch_model_metadata(
    target: str,
    model: str,
    *,
    version: str = "",
    metadata: tuple[tuple[str, str], ...] = (),
    timeout: float = 10.0,
):
    """ModelMetadataResponse for `model` (blocking; used once before a run)."""
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
