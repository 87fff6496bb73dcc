"""The frontend's connection to one Triton: long-lived grpc.aio channels, raw-bytes calls.

Inference requests travel as the bytes the caller sent (no re-serialization); control calls
(config, repository index, load, unload) are typed. Every failure comes back as a domain error
from ``server.errors``.
"""

from __future__ import annotations

import itertools

import grpc

from server.dataplane.backend import DOWN, EXITING, LIVE, typed_call
from server.dataplane.backend_errors import EXITING_MARKERS, backend_error
from server.dataplane.tracing import outgoing_metadata
from server.errors import InferplaneError
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2
from server.dataplane.batch_codec import CODEC

_SERVICE = "/inference.GRPCInferenceService/"


class TritonClient:
    """One Triton over gRPC: a ``server.dataplane.backend.Backend``."""

    def __init__(
        self, target: str, *, channels: int = 1, max_message_bytes: int = 64 << 20, credentials=None, server_name: str | None = None,
        max_reconnect_backoff_ms: int = 1000,
    ):  # fmt: skip
        self.target = target
        # how long a channel that lost its Triton waits, at most, between tries to reach it again: a call
        # meanwhile fails at once (UNAVAILABLE), so a Triton back on its port is reached up to this late
        self._max_reconnect_backoff_ms = max_reconnect_backoff_ms
        self._max_message_bytes = max_message_bytes
        # TLS to a remote Triton (server.tenancy.tls.channel_credentials): CA, client certificate; the name
        # Triton's certificate is checked against when it is not the target's host
        self._credentials = credentials
        self._server_name = server_name
        self._channel_count = max(1, channels)
        self._channels: list[grpc.aio.Channel] = []
        self._infer_calls: list = []
        self._rr = itertools.cycle([0])

    def connect(self) -> None:
        """Open the channels. They reconnect on their own when Triton comes back on the same port."""
        options = [
            ("grpc.max_send_message_length", self._max_message_bytes),
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", self._max_reconnect_backoff_ms),
            ("grpc.enable_retries", 0),
            # distinct subchannels, so N channels are N HTTP/2 connections
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._channels = [self._channel(options) for _ in range(self._channel_count)]
        self._infer_calls = [
            ch.unary_unary(_SERVICE + "ModelInfer", request_serializer=None, response_deserializer=None)
            for ch in self._channels
        ]
        self._rr = itertools.cycle(range(len(self._channels)))

    def _channel(self, options: list) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        if self._server_name:
            options = [*options, ("grpc.ssl_target_name_override", self._server_name)]
        return grpc.aio.secure_channel(self.target, self._credentials, options=options)

    async def reconnect(self, credentials, grace_s: float = 30.0) -> None:
        """New channels with new credentials (a renewed client certificate); calls in flight on the old
        channels finish on them (up to ``grace_s``)."""
        old = self._channels
        self._credentials = credentials
        self.connect()
        for ch in old:
            await ch.close(grace_s)

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        for ch in channels:
            await ch.close()

    # ---- data plane --------------------------------------------------------------------

    async def infer_raw(self, request: bytes, timeout: float | None = None, *, model: str = "") -> bytes:
        """``model`` names the request's model for a replica set (``server.dataplane.replicas``); one
        Triton ignores it."""
        call = self._infer_calls[next(self._rr)]
        try:
            return await call(request, timeout=timeout, metadata=outgoing_metadata())  # a traced call's traceparent
        except grpc.aio.AioRpcError as err:
            raise translate(err) from None

    # ---- what the data plane's coalescer calls (batching/coalescer.py) ----------------------

    def batch_codec(self):
        """Merged batches as one serialized ModelInferRequest (``server.dataplane.batch_codec``)."""
        return CODEC

    async def send_batch(self, payload: bytes, timeout: float | None, request: pb.ModelInferRequest | None = None) -> bytes:
        return await self.infer_raw(payload, timeout, model=request.model_name if request is not None else "")

    def stream_raw(self, timeout: float | None = None, metadata: tuple | None = None, *, model: str = "", affinity: str | None = None) -> "RawStream":
        """A bidirectional ModelStreamInfer call on bytes (the caller writes and reads); its failures
        are domain errors like every other call's. ``metadata``: e.g. a traced generation's traceparent.
        ``affinity`` (an LLM routing key) is the replica set's business: one Triton ignores it."""
        channel = self._channels[next(self._rr)]
        method = channel.stream_stream(_SERVICE + "ModelStreamInfer", request_serializer=None, response_deserializer=None)
        return RawStream(method(timeout=timeout, metadata=metadata))

    async def unary_raw(self, method: str, request: bytes, timeout: float | None = 30.0) -> bytes:
        call = self._channels[0].unary_unary(_SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            return await call(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise translate(err) from None

    # ---- control -----------------------------------------------------------------------

    async def _typed(self, method: str, request, response_type, timeout: float | None = 30.0):
        return await typed_call(self.unary_raw, method, request, response_type, timeout)

    async def server_live(self, timeout: float = 1.0) -> bool:
        return await self.liveness(timeout) == LIVE

    async def liveness(self, timeout: float = 1.0) -> str:
        """LIVE, EXITING (Triton got SIGTERM — a spot reclaim's notice, a pod terminating — and answers
        "Server exiting" while it finishes what it has) or DOWN."""
        try:
            live = (await self._typed("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse, timeout)).live
        except InferplaneError as err:
            return EXITING if _EXITING in err.message.lower() else DOWN
        return LIVE if live else DOWN

    async def server_ready(self, timeout: float = 1.0) -> bool:
        try:
            return (await self._typed("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse, timeout)).ready
        except InferplaneError:
            return False

    async def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        resp = await self._typed("ModelConfig", pb.ModelConfigRequest(name=name, version=version), pb.ModelConfigResponse)
        return resp.config

    async def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse:
        return await self._typed("ModelMetadata", pb.ModelMetadataRequest(name=name, version=version), pb.ModelMetadataResponse)

    async def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        return await self._typed("ModelStatistics", pb.ModelStatisticsRequest(name=name, version=version), pb.ModelStatisticsResponse, 5.0)

    async def repository_index(self, ready_only: bool = False) -> list:
        resp = await self._typed("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready_only), pb.RepositoryIndexResponse)
        return list(resp.models)

    async def load_model(self, name: str, timeout: float = 300.0, *, config: str | None = None) -> None:
        """Load (or reload) ``name``; ``config``: a JSON model config that overrides config.pbtxt for
        this load (Triton's load-with-config, e.g. another ``instance_group`` count)."""
        request = pb.RepositoryModelLoadRequest(model_name=name)
        if config is not None:
            request.parameters["config"].string_param = config
        await self._typed("RepositoryModelLoad", request, pb.RepositoryModelLoadResponse, timeout)

    async def unload_model(self, name: str, timeout: float = 60.0) -> None:
        await self._typed("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=name), pb.RepositoryModelUnloadResponse, timeout)


class RawStream:
    """A ModelStreamInfer call whose errors arrive as domain errors (``translate``)."""

    __slots__ = ("_call",)

    def __init__(self, call):
        self._call = call

    async def write(self, raw: bytes) -> None:
        try:
            await self._call.write(raw)
        except grpc.aio.AioRpcError as err:
            raise translate(err) from None

    async def done_writing(self) -> None:
        try:
            await self._call.done_writing()
        except grpc.aio.AioRpcError as err:
            raise translate(err) from None

    def cancel(self) -> bool:
        return self._call.cancel()

    def report_kv(self, utilisation: float) -> None:
        """One Triton: no member to score."""

    async def __aiter__(self):
        try:
            async for raw in self._call:
                yield raw
        except grpc.aio.AioRpcError as err:
            raise translate(err) from None


_EXITING = EXITING_MARKERS[0]  # Triton's ServerLive answer once it got SIGTERM


def translate(err: grpc.aio.AioRpcError) -> InferplaneError:
    """A failed call's status as a domain error (``server.dataplane.backend_errors``)."""
    return backend_error(err.code(), err.details() or "")
