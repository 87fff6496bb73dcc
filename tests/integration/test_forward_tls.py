"""Forwarded control writes over TLS (issue 27), on real sockets: a frontend that does not lead carries a
Deploy to the leader with the platform's own CA and its client certificate (mTLS) while the platform
serves TLS, and dials plaintext only to a loopback address of this host — never to another address.

The two ends are real grpc servers with the platform's own TLS (server.tenancy.tls.CertificateFiles:
client certificates required) and the real interceptor (server.transports.grpc.forward.LeaderForwarder);
the leader's side is one recording handler, as the forwarder carries bytes and never reads them."""

from __future__ import annotations

import asyncio
import socket

import grpc
import psutil
import pytest

from server.cli.certs import issue, make_ca
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.settings import Settings
from server.tenancy.tls import CertificateFiles, grpc_peer_cert, leader_credentials, peer_identities
from server.transports.grpc.forward import LeaderForwarder

pytestmark = [pytest.mark.integration]

DEPLOY = "/inferplane.v1.Admin/Deploy"
FRONTEND_ID = "spiffe://inferplane.test/frontend"
ACTOR = (("x-inferplane-actor", "alice"),)


def _other_address() -> str:
    """A non-loopback IPv4 address of this host (the leader "on another host")."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("this host has no non-loopback IPv4 address")


class _Directory:
    def __init__(self, address: str):
        self.target = address

    async def address(self, fresh: bool = False) -> str:
        return self.target


class _Leader:
    """A gRPC server answering Deploy; records the client identity and actor of each call."""

    def __init__(self):
        self.calls: list[tuple[tuple[str, ...], str]] = []

    def handler(self) -> grpc.GenericRpcHandler:
        async def deploy(request: admin_pb2.DeployRequest, context) -> admin_pb2.DeployResponse:
            cert = grpc_peer_cert(context)
            actor = dict(context.invocation_metadata()).get("x-inferplane-actor", "")
            self.calls.append((peer_identities(cert) if cert else (), actor))
            response = admin_pb2.DeployResponse()
            response.result.version = int(request.ref.rsplit(":", 1)[1])
            return response

        method = grpc.unary_unary_rpc_method_handler(
            deploy, request_deserializer=admin_pb2.DeployRequest.FromString, response_serializer=admin_pb2.DeployResponse.SerializeToString
        )
        return grpc.method_handlers_generic_handler("inferplane.v1.Admin", {"Deploy": method})


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("forward_tls")
    ca = make_ca("inferplane test CA")
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    hosts = ("localhost", "127.0.0.1", _other_address())
    server = issue(ca, "leader", server=True, hosts=hosts).write(folder, "server")
    client = issue(ca, "frontend", uris=(FRONTEND_ID,)).write(folder, "frontend")
    return folder / "ca.crt", server, client


def _settings(pki) -> Settings:
    ca, (cert, key), (client_cert, client_key) = pki
    return Settings(tls_cert=cert, tls_key=key, tls_client_ca=ca, client_tls_ca=ca, client_tls_cert=client_cert, client_tls_key=client_key)


async def _server(address: str, handlers, interceptors=(), tls: CertificateFiles | None = None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers(handlers)
    port = server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    await server.start()
    return server, port


async def _deploy_through(frontend: str, ref: str) -> tuple[grpc.StatusCode, int]:
    async with grpc.aio.insecure_channel(frontend) as channel:
        try:
            out = await admin_pb2_grpc.AdminStub(channel).Deploy(admin_pb2.DeployRequest(ref=ref), metadata=ACTOR, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code(), 0
    return grpc.StatusCode.OK, out.result.version


def test_a_forwarded_write_goes_to_a_tls_leader_over_mutual_tls_and_never_in_plaintext(pki):
    settings = _settings(pki)
    other = _other_address()

    async def scenario():
        leader = _Leader()
        files = CertificateFiles.from_settings(settings)
        secure_leader, secure_port = await _server(f"{other}:0", (leader.handler(),), tls=files)
        plain_leader, plain_port = await _server("0.0.0.0:0", (leader.handler(),))
        directory = _Directory(f"{other}:{secure_port}")
        forwarders = {
            "tls": LeaderForwarder(lambda: False, directory, max_message_bytes=1 << 20, tls=leader_credentials(settings)),
            "plaintext": LeaderForwarder(lambda: False, directory, max_message_bytes=1 << 20),  # what a forwarder without TLS does
        }
        servers = {name: await _server("127.0.0.1:0", (), interceptors=(f,)) for name, f in forwarders.items()}
        try:
            # TLS on: the write reaches the leader on another address, over mTLS with the frontend's certificate
            assert await _deploy_through(f"127.0.0.1:{servers['tls'][1]}", "scorer:3") == (grpc.StatusCode.OK, 3)
            assert leader.calls == [((FRONTEND_ID, "CN=frontend,O=inferplane dev"), "alice")]
            # a plaintext forwarder cannot reach a TLS leader: the handshake is refused, the leader sees nothing
            code, _ = await _deploy_through(f"127.0.0.1:{servers['plaintext'][1]}", "scorer:4")
            assert code == grpc.StatusCode.UNAVAILABLE and len(leader.calls) == 1
            # to a non-loopback plaintext port the TLS forwarder does not fall back to plaintext
            directory.target = f"{other}:{plain_port}"
            code, _ = await _deploy_through(f"127.0.0.1:{servers['tls'][1]}", "scorer:5")
            assert code == grpc.StatusCode.UNAVAILABLE and len(leader.calls) == 1
            # to a loopback address of this host (a parent of workers' control port) it dials plaintext
            directory.target = f"127.0.0.1:{plain_port}"
            assert await _deploy_through(f"127.0.0.1:{servers['tls'][1]}", "scorer:6") == (grpc.StatusCode.OK, 6)
            assert leader.calls[-1] == ((), "alice")
        finally:
            for f in forwarders.values():
                await f.close()
            for server, _ in (*servers.values(), (secure_leader, 0), (plain_leader, 0)):
                await server.stop(0)

    asyncio.run(scenario())


class _MovingDirectory:
    """The lease row as a frontend reads it around a failover: its cached answer is the dead leader's
    address until it asks again (``fresh``), then the new leader's."""

    def __init__(self, cached: str, fresh: str):
        self.cached, self.fresh, self.fresh_reads = cached, fresh, 0

    async def address(self, fresh: bool = False) -> str:
        if fresh:
            self.fresh_reads += 1
            return self.fresh
        return self.cached


def _dead_address() -> str:
    """A loopback port nothing listens on (a killed leader's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_call_the_dead_leaders_address_refused_goes_to_the_new_leader_once():
    """Right after a failover a frontend's cached leader address refuses the connection (nothing was
    sent): the call is carried to the leader the lease row names now, not failed back to the caller.
    With the lease row naming the same dead address, the caller gets the UNAVAILABLE."""

    async def scenario():
        leader = _Leader()
        live, port = await _server("127.0.0.1:0", (leader.handler(),))
        dead = _dead_address()
        moving = _MovingDirectory(dead, f"127.0.0.1:{port}")
        stuck = _MovingDirectory(dead, dead)
        forwarders = [LeaderForwarder(lambda: False, d, max_message_bytes=1 << 20) for d in (moving, stuck)]
        servers = [await _server("127.0.0.1:0", (), interceptors=(f,)) for f in forwarders]
        try:
            assert await _deploy_through(f"127.0.0.1:{servers[0][1]}", "scorer:7") == (grpc.StatusCode.OK, 7)
            assert leader.calls == [((), "alice")] and moving.fresh_reads == 1  # once, at the new leader
            code, _ = await _deploy_through(f"127.0.0.1:{servers[1][1]}", "scorer:8")
            assert code == grpc.StatusCode.UNAVAILABLE and len(leader.calls) == 1 and stuck.fresh_reads == 1
        finally:
            for f in forwarders:
                await f.close()
            for server, _ in (*servers, (live, 0)):
                await server.stop(0)

    asyncio.run(scenario())
