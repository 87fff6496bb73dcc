"""``inferplane tls dev-certs``: a throwaway CA, a server certificate and client certificates for trying
TLS and mutual TLS locally (the tests make theirs with the same functions). Production certificates
come from your CA (cert-manager, SPIRE, Vault); nothing here is meant for them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import typer


@dataclass
class Issued:
    cert_pem: bytes
    key_pem: bytes
    cert: object  # cryptography.x509.Certificate
    key: object

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / f"{name}.crt", folder / f"{name}.key"
        cert.write_bytes(self.cert_pem)
        key.touch(0o600)
        key.write_bytes(self.key_pem)
        return cert, key


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem(cert, key) -> Issued:
    from cryptography.hazmat.primitives import serialization

    return Issued(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        cert,
        key,
    )


def _name(common_name: str, org: str = "inferplane dev"):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "inferplane dev CA", days: int = 365) -> Issued:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def issue(
    ca: Issued,
    common_name: str,
    *,
    server: bool = False,
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    uris: tuple[str, ...] = (),
    org: str = "inferplane dev",
    days: float = 30,
    expired: bool = False,
) -> Issued:
    """A leaf certificate signed by ``ca``: a server one (SAN DNS names / IPs) or a client one (SAN URIs,
    e.g. a SPIFFE ID). ``expired``: valid yesterday only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    start, end = (now - dt.timedelta(days=2), now - dt.timedelta(days=1)) if expired else (now - dt.timedelta(minutes=5), now + dt.timedelta(days=days))
    alt: list = list(x509.UniformResourceIdentifier(u) for u in uris)
    if server:
        for host in hosts:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt.append(x509.DNSName(host))
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, org))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return _pem(builder.sign(ca.key, hashes.SHA256()), key)


def mount(app: typer.Typer) -> None:
    tls_app = typer.Typer(help="TLS helpers.", no_args_is_help=True)
    app.add_typer(tls_app, name="tls")

    @tls_app.command("dev-certs")
    def dev_certs(
        out: Path = typer.Option(Path("var/tls"), help="Folder to write ca.crt, server.crt/key and client.crt/key into."),
        host: list[str] = typer.Option(["localhost", "127.0.0.1"], "--host", help="Names and addresses the server certificate covers."),
        client: str = typer.Option("acme-client", help="The client certificate's common name."),
        spiffe_id: str = typer.Option("spiffe://inferplane.dev/tenant/acme", help="The client certificate's SPIFFE ID (SAN URI)."),
    ) -> None:
        """A development CA with a server and a client certificate (for --tls-cert/--tls-key/--tls-client-ca)."""
        ca = make_ca()
        ca.write(out, "ca")
        issue(ca, host[0], server=True, hosts=tuple(host)).write(out, "server")
        issue(ca, client, uris=(spiffe_id,) if spiffe_id else ()).write(out, "client")
        (out / "ca.key").unlink()  # nothing more is signed with it
        typer.echo(f"wrote {out}/ca.crt, {out}/server.crt, {out}/server.key, {out}/client.crt, {out}/client.key")
