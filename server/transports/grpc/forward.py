"""Control RPCs at any frontend (issue 27): carried to the control plane's leader, bytes unchanged.

A frontend process that does not lead (a worker of ``--workers N``, a frontend of a cluster, a
standby) answers the data plane and its own model table itself; the RPCs that need the registry,
the deployer, the traffic controller or the autoscaler go to the leader's gRPC address (read from the
lease row, server.control.service.leader.LeaderDirectory) with the caller's metadata (API key, actor), and the
leader's answer — message, status, details, trailing metadata — comes back as it is. The leader
authenticates and authorizes the call itself, so a frontend grants nothing it would not.

A server interceptor (the innermost, so the error table still wraps it; registered method handlers
would win over a generic handler): while this process leads, or for any other method, the call goes
on to the local service.

While the platform serves TLS the channel to the leader is TLS too (server.tenancy.tls.leader_credentials:
the frontend's CA, its client certificate for mTLS); plaintext only to a loopback address of this host
(the loopback control port of a parent of workers, server.app), never to another host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from server.dataplane.backend_errors import never_connected
from server.errors import BackendUnavailable
from server.tenancy.tls import is_loopback

log = logging.getLogger(__name__)

ADMIN_CONTROL = (
    "RegisterModel", "ListRegisteredModels", "ShowModel", "GetLineage", "Deploy", "Rollback",
    "ListEndpoints", "GetEndpoint", "ListAudit", "GetModelProto", "RetireSchema",
)  # fmt: skip
TRAFFIC = (
    "SetCanary", "Promote", "Rollback", "SetBlueGreen", "Switch", "SetExperiment", "Feedback", "AbReport",
    "SetShadow", "ShadowReport", "GetPolicy",
)  # fmt: skip
AUTOSCALE = ("Configure", "Status", "Explain")
FORWARDED = frozenset(
    [f"/inferplane.v1.Admin/{m}" for m in ADMIN_CONTROL]
    + [f"/inferplane.v1.Traffic/{m}" for m in TRAFFIC]
    + [f"/inferplane.v1.Autoscale/{m}" for m in AUTOSCALE]
)
_HOP = {"content-type", "user-agent", "te", "grpc-accept-encoding", "accept-encoding", "grpc-timeout"}


def _identity(raw: bytes) -> bytes:
    return raw


class LeaderForwarder(grpc.aio.ServerInterceptor):
    def __init__(
        self, leading: Callable[[], bool], directory, *, max_message_bytes: int, methods: frozenset[str] = FORWARDED, tls: tuple | None = None,
    ):  # fmt: skip
        """``tls``: (channel credentials, channel options) from ``leader_credentials`` while the platform serves TLS."""
        self.leading = leading
        self.tls = tls
        self.directory = directory  # server.control.service.leader.LeaderDirectory
        self.methods = methods
        self.options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method not in self.methods or self.leading():
            return await continuation(handler_call_details)

        async def forward(request: bytes, context):
            return await self._forward(method, request, context)

        return grpc.unary_unary_rpc_method_handler(forward, request_deserializer=_identity, response_serializer=_identity)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self.tls is None or is_loopback(address):
                channel = grpc.aio.insecure_channel(address, options=self.options)
            else:
                credentials, options = self.tls
                channel = grpc.aio.secure_channel(address, credentials, options=self.options + options)
            self._channels[address] = channel
        return channel

    async def _forward(self, method: str, request: bytes, context) -> bytes:
        address = await self.directory.address()
        if address is None:
            address = await self.directory.address(fresh=True)
        if address is None:
            raise BackendUnavailable("no control-plane leader holds the lease right now; retry in a few seconds")
        metadata = tuple((k, v) for k, v in context.invocation_metadata() if k not in _HOP and not k.startswith(":"))
        try:
            return await self._call(address, method, request, metadata, context)
        except grpc.aio.AioRpcError as err:
            failed = err
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                moved = await self.directory.address(fresh=True)  # the leader moved: ask the lease row again
                if moved is not None and moved != address and never_connected(err.code(), err.details()):
                    # the old leader's address refused the call (nothing was sent): the new leader takes it
                    log.info("forwarding %s to the new leader at %s (%s refused it)", method, moved, address)
                    try:
                        return await self._call(moved, method, request, metadata, context)
                    except grpc.aio.AioRpcError as again:
                        failed = again
            await context.abort(failed.code(), failed.details() or "", tuple(failed.trailing_metadata() or ()))

    async def _call(self, address: str, method: str, request: bytes, metadata: tuple, context) -> bytes:
        """One call to the leader at ``address``: its answer, its trailing metadata set on ``context``."""
        remaining = context.time_remaining()
        call = self._channel(address).unary_unary(method, request_serializer=_identity, response_deserializer=_identity)(
            request, metadata=metadata, timeout=remaining if remaining and remaining < 1e6 else None
        )
        response = await call
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return response

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
