"""The one translator of a backend's failures into domain errors (``server.errors``), used by every
backend (``server.dataplane.backend``): a gRPC status from a Triton process (``TritonClient``), a
TRITONSERVER_Error from the in-process one (``InProcessTriton``, through the status Triton's gRPC
frontend would have answered with) and an error message inside a stream's response.
"""

from __future__ import annotations

import grpc

from server.errors import (
    BackendError, BackendUnavailable, Cancelled, DeadlineExceeded, InferplaneError, InvalidRequest, ModelNotFound, Overloaded, Unimplemented,
)  # fmt: skip


class NotSent(BackendUnavailable):
    """UNAVAILABLE before Triton started the request: no connection could be made (grpc fails the
    call without writing it), or Triton refused it up front because the model is not there or not
    ready. Safe to send to another replica."""


class ConnectionLost(BackendUnavailable):
    """UNAVAILABLE because the connection broke after the request was written (socket closed or
    reset, GOAWAY): Triton may have started it, and its answer is lost with the connection."""


# A status Triton answered with becomes the domain error it means (an unknown code: BackendError).
_FROM_GRPC: dict[grpc.StatusCode, type[InferplaneError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.UNAVAILABLE: BackendUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}

# How NotSent and ConnectionLost are told apart: grpc's own UNAVAILABLE details. A call on a channel
# that cannot connect fails before anything is written ("failed to connect to all addresses",
# "Connection refused", DNS); a connection that drops under a written call reports the transport's
# end ("Socket closed", "Connection reset", "GOAWAY", "Broken pipe"); anything else came from Triton.
_NOT_CONNECTED = (
    "failed to connect", "connection refused", "connections to all backends failing", "dns resolution failed",
    "no route to host", "network is unreachable", "name resolution", "channel is not ready",
)  # fmt: skip
_TRANSPORT_LOST = ("socket closed", "connection reset", "goaway", "broken pipe", "stream removed", "rst_stream", "end of tcp stream", "connection aborted")
_TRITON_REFUSED = ("unknown model", "is not ready", "has no available versions", "server not ready", "is not found")

# Triton's answers once it got SIGTERM (a spot reclaim's notice, a pod terminating): its ServerLive
# answer first, then its refusals of new requests meanwhile (refused before any work: safe elsewhere)
EXITING_MARKERS = ("server exiting", "server is stopping", "stopped accepting new inference requests")

# what the Python backend answers once a model's stub process is gone (python_be.cc, stub_launcher.cc)
STUB_DEAD_MARKERS = ("is not healthy", "Failed to obtain the health mutex", "Stub process")

# in-stream errors carry no status: the engine adapter prefixes a caller's mistake with this, and an
# adapter the model does not hold with that (model_repository/adapters/_lora.py)
INVALID_PREFIX = "invalid request: "
NOT_FOUND_PREFIX = "not found: "


def refused_connection(message: str) -> bool:
    """grpc's details (or a ``NotSent``'s message, which carries them) say no connection could be made:
    nothing was written. The one marker list, so the frontend's forwarder and the replica set agree on
    what "the backend never got the call" means."""
    lowered = (message or "").lower()
    return any(marker in lowered for marker in _NOT_CONNECTED)


def never_connected(code: grpc.StatusCode, message: str) -> bool:
    """grpc failed the call before writing it: no connection could be made (safe to send elsewhere)."""
    return code == grpc.StatusCode.UNAVAILABLE and refused_connection(message)


def stub_died(code: grpc.StatusCode, message: str) -> bool:
    """The model's Python stub process died (killed, crashed): the backend is sick, not the request."""
    return code == grpc.StatusCode.INTERNAL and any(marker in message for marker in STUB_DEAD_MARKERS)


def backend_error(code: grpc.StatusCode, message: str) -> InferplaneError:
    """The domain error for a status a backend answered with (UNAVAILABLE carries a 1 s retry hint)."""
    message = message or code.name
    if any(marker in message.lower() for marker in EXITING_MARKERS):
        return NotSent(f"Triton is exiting: {message}", retry_after_s=1.0)
    if code == grpc.StatusCode.UNAVAILABLE:
        lowered = message.lower()
        if refused_connection(message) or any(marker in lowered for marker in _TRITON_REFUSED):
            return NotSent(f"Triton is unavailable: {message}", retry_after_s=1.0)
        if any(marker in lowered for marker in _TRANSPORT_LOST):
            return ConnectionLost(f"Triton is unavailable: {message}", retry_after_s=1.0)
        return BackendUnavailable(f"Triton is unavailable: {message}", retry_after_s=1.0)
    if stub_died(code, message):  # Triton restarts it (or the in-process one reloads the model)
        return BackendUnavailable(f"model process unavailable: {message}", retry_after_s=1.0)
    return _FROM_GRPC.get(code, BackendError)(message)


def stream_error(message: str) -> InferplaneError:
    """The domain error an in-stream error message from Triton or the LLM engine means."""
    text = message.split("] ", 1)[-1] if message.startswith("[") else message
    if INVALID_PREFIX in text:
        return InvalidRequest(text.split(INVALID_PREFIX, 1)[1])
    if text.startswith(NOT_FOUND_PREFIX):
        return ModelNotFound(text[len(NOT_FOUND_PREFIX) :])
    return BackendError(f"generation failed: {text}")
