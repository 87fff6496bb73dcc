"""What a Triton backend offers the data plane: the one declared contract below ``DataPlane``.

Three implement it — ``server.dataplane.triton_client.TritonClient`` (one Triton over gRPC),
``server.dataplane.replicas.ReplicaSet`` (many, one picked per request) and
``server.runtime.inprocess.InProcessTriton`` (Triton in this process, through its C API) — and
``tests/backend_fake.py`` for unit tests. ``tests/unit/test_backend_types.py`` checks the three
statically (mypy) and ``tests/integration/test_backend_contract.py`` runs one suite against each.

Every failure is a domain error (``server.errors``); inference requests and answers travel as
the serialized ``inference.GRPCInferenceService`` messages the caller sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2

Answer = TypeVar("Answer")

# what ``Backend.liveness`` finds: serving; got SIGTERM (a spot reclaim's notice, a pod terminating)
# and finishing what it has while it refuses new work; not answering
LIVE, EXITING, DOWN = "live", "exiting", "down"


class BackendStream(Protocol):
    """A bidirectional ModelStreamInfer call on bytes: write requests, read answers."""

    async def write(self, raw: bytes) -> None: ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> bool: ...

    def report_kv(self, utilisation: float) -> None:
        """The engine's KV-cache utilisation from an answer of this stream (a replica set scores
        its members by it; one Triton ignores it)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...


class Backend(Protocol):
    @property
    def target(self) -> str:
        """What breakers and logs call this backend (an address, a set's name, "in-process")."""

    def connect(self) -> None: ...

    async def close(self) -> None: ...

    # ---- inference ----------------------------------------------------------------------------

    async def infer_raw(self, request: bytes, timeout: float | None = None, *, model: str = "") -> bytes:
        """A serialized ModelInferRequest in, the serialized ModelInferResponse out; ``model``
        names the request's model when the caller knows it (a replica set routes by it)."""

    def batch_codec(self) -> Any:
        """How the coalescer merges requests for this backend (``server.dataplane.batch_codec``)."""

    async def send_batch(self, payload: Any, timeout: float | None, request: pb.ModelInferRequest | None = None) -> Any:
        """A lone request's bytes or a merged batch (``batch_codec``'s payload); ``request``: the
        first member, parsed."""

    def stream_raw(
        self, timeout: float | None = None, metadata: tuple | None = None, *, model: str = "", affinity: str | None = None
    ) -> BackendStream:
        """``metadata``: e.g. a traceparent; ``affinity``: an LLM generation's prefix key."""

    async def unary_raw(self, method: str, request: bytes, timeout: float | None = 30.0) -> bytes:
        """Any other GRPCInferenceService method, on serialized messages."""

    # ---- models -------------------------------------------------------------------------------

    async def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig: ...

    async def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse: ...

    async def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        """Triton's statistics (every model's when ``name`` is empty)."""

    async def repository_index(self, ready_only: bool = False) -> list: ...

    async def load_model(self, name: str, timeout: float = 300.0, *, config: str | None = None) -> None:
        """Load (or reload) ``name``; ``config``: a JSON model config overriding config.pbtxt."""

    async def unload_model(self, name: str, timeout: float = 60.0) -> None: ...

    # ---- health -------------------------------------------------------------------------------

    async def server_live(self, timeout: float = 1.0) -> bool: ...

    async def liveness(self, timeout: float = 1.0) -> str:
        """LIVE, EXITING or DOWN (a replica set drains an exiting member at once)."""

    async def server_ready(self, timeout: float = 1.0) -> bool: ...


async def typed_call(
    unary_raw: Callable[..., Awaitable[bytes]], method: str, request, response_type: type[Answer], timeout: float | None = 30.0
) -> Answer:
    """A typed GRPCInferenceService call through a backend's ``unary_raw``."""
    raw = await unary_raw(method, request.SerializeToString(), timeout=timeout)
    return response_type.FromString(raw)  # type: ignore[attr-defined]
