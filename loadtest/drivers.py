"""The driver for a target URL: its scheme picks the protocol (``loadtest.protocol``'s docstring lists
them), and with it the gRPC, REST or SSE driver. Kept apart from the drivers' shared interface
(``loadtest.protocol``) so that the SSE driver, built on that interface, and this choice among all
drivers do not import each other.
"""

from __future__ import annotations

from loadtest.protocol import Driver, GrpcDriver, RestDriver, http_base, protocol_of
from loadtest.sse import SSEDriver


def make_driver(
    target: str,
    *,
    model: str = "",
    stream: bool = False,
    rest_json: bool = False,
    sse: bool = False,
    channels: int = 1,
    connections: int = 0,
    timeout: float | None = 30.0,
    metadata: tuple[tuple[str, str], ...] = (),
) -> Driver:
    """The driver for a target URL (see the module docstring for the schemes)."""
    proto = protocol_of(target, stream=stream, rest_json=rest_json, sse=sse)
    if proto in ("grpc", "grpc-stream"):
        return GrpcDriver(target, stream=stream, channels=channels, timeout=timeout, metadata=metadata)
    if proto == "sse":
        return SSEDriver(http_base(target), connections=connections, timeout=timeout or 300.0, metadata=metadata)
    if not model:
        raise ValueError("REST targets need the model name")
    return RestDriver(target, model, connections=connections, timeout=timeout, metadata=metadata)
