"""TLS and mutual TLS: the server's certificate on every port, reloaded when its files change, and the
identity a client certificate proves.

- :class:`CertificateFiles` reads a PEM certificate chain, its key and (for mTLS) a client CA bundle,
  and reads them again when a file changes (``check()``, polled by ``watch()``). A pair that does not
  load (a half-written file, a key that does not match) is refused with a log line naming the file,
  and the previous pair keeps serving.
- gRPC gets ``grpc.dynamic_ssl_server_credentials``: grpc asks the fetcher at each new handshake and
  is handed a new certificate configuration only when the files changed.
- aiohttp gets an ``ssl.SSLContext`` whose chain is reloaded in place (``load_cert_chain``): new
  handshakes use the new certificate, open connections keep theirs. A changed client CA bundle is
  added to the trusted set (OpenSSL cannot drop a CA from a live context: a removed CA stays trusted
  on the REST ports until the restart; gRPC's is replaced).
- :func:`peer_identities` reads a client certificate (DER or PEM) into the strings a tenant may be
  bound to: each SAN URI (a SPIFFE ID, ``spiffe://trust-domain/path``) and the subject in a canonical
  form (:func:`canonical_subject`, so ``CN=a,O=b`` and ``O=b, CN=a`` name the same subject).
- :func:`channel_credentials` is the client side: the frontend's channel to a remote Triton;
  :func:`frontend_channel` the CLIs' and the control plane's channel to a frontend (``client_tls_*``);
  :func:`leader_credentials` a frontend's channel to the control-plane leader (forwarded control writes).

The private key is read from its file and handed to OpenSSL / grpc; it is never logged or echoed.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from server.settings import Settings

log = logging.getLogger(__name__)

# The client certificate of the REST request being served (set by the aiohttp middleware of
# server.transports.rest.tls, read by CallContext.from_headers): a getter, so nothing is read
# unless a call authenticates by certificate.
PEER_CERT: contextvars.ContextVar[Callable[[], bytes | None] | None] = contextvars.ContextVar("inferplane_peer_cert", default=None)

SPIFFE_SCHEME = "spiffe://"


class TLSConfigError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file, never its contents."""


@dataclass(frozen=True)
class Material:
    cert: bytes
    key: bytes
    client_ca: bytes | None


def _stat(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def _read(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise TLSConfigError(f"cannot read the TLS {what} {path}: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise TLSConfigError(f"the TLS {what} {path} is not PEM")
    return data


def _check_pair(material: Material, cert_path: Path, key_path: Path) -> None:
    """Load the pair (and the CA) into a throwaway context: a mismatch is refused before it serves."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads chains from files only
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(material.cert)
        key.touch(0o600)
        key.write_bytes(material.key)
        try:
            context.load_cert_chain(cert, key)
        except ssl.SSLError as err:
            raise TLSConfigError(
                f"the TLS certificate {cert_path} and key {key_path} do not load together ({err.reason or err.__class__.__name__})"
            ) from None
    if material.client_ca is not None:
        try:
            context.load_verify_locations(cadata=material.client_ca.decode("ascii", "replace"))
        except ssl.SSLError as err:
            raise TLSConfigError(f"the client CA bundle does not load ({err.reason or err.__class__.__name__})") from None


class CertificateFiles:
    """A certificate chain, its key and an optional client CA bundle, read again when they change."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None):
        self.cert_path, self.key_path = Path(cert), Path(key)
        self.client_ca_path = Path(client_ca) if client_ca is not None else None
        self.generation = 0  # bumped at every successful reload
        self._contexts: list[ssl.SSLContext] = []
        self._stamp = self._stamps()
        self.material = self._load()

    @classmethod
    def from_settings(cls, settings) -> "CertificateFiles | None":
        if settings.tls_cert is None:
            return None
        return cls(settings.tls_cert, settings.tls_key, settings.tls_client_ca)

    @property
    def mutual(self) -> bool:
        return self.client_ca_path is not None

    def _paths(self) -> list[Path]:
        return [p for p in (self.cert_path, self.key_path, self.client_ca_path) if p is not None]

    def _stamps(self) -> tuple:
        try:
            return tuple(_stat(p) for p in self._paths())
        except OSError as err:
            raise TLSConfigError(f"cannot read the TLS file {err.filename}: {err.strerror}") from None

    def _load(self) -> Material:
        material = Material(
            _read(self.cert_path, "certificate"),
            _read(self.key_path, "key"),
            _read(self.client_ca_path, "client CA bundle") if self.client_ca_path is not None else None,
        )
        _check_pair(material, self.cert_path, self.key_path)
        return material

    # ---- reload ----------------------------------------------------------------------------

    def check(self) -> bool:
        """Read the files again if any changed; True when a new pair now serves."""
        try:
            stamp = self._stamps()
        except TLSConfigError as err:  # a file being replaced (rename in flight): try again next time
            log.warning("TLS reload: %s; the current certificate keeps serving", err)
            return False
        if stamp == self._stamp:
            return False
        try:
            material = self._load()
        except TLSConfigError as err:
            log.warning("TLS reload refused: %s; the current certificate keeps serving", err)
            return False
        self._stamp = stamp
        if material == self.material:
            return False
        self.material = material
        for context in self._contexts:
            self._apply(context)
        self.generation += 1
        log.info("TLS certificate reloaded from %s (generation %d)", self.cert_path, self.generation)
        return True

    async def watch(self, every_s: float) -> None:
        """Poll the files every ``every_s`` (stat only, off the loop when they changed)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.check)
            except Exception:  # never let the watcher die
                log.exception("TLS reload failed")

    # ---- the servers' credentials -----------------------------------------------------------

    def _apply(self, context: ssl.SSLContext) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            cert.write_bytes(self.material.cert)
            key.touch(0o600)
            key.write_bytes(self.material.key)
            context.load_cert_chain(cert, key)
        if self.material.client_ca is not None:
            context.load_verify_locations(cadata=self.material.client_ca.decode("ascii", "replace"))

    def ssl_context(self) -> ssl.SSLContext:
        """A server context for aiohttp (TLS 1.2+; client certificates asked for and verified with a client CA);
        reloaded in place by :meth:`check`."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        self._apply(context)
        if self.mutual:
            # a presented certificate is verified in the handshake (expired, another CA: refused); a
            # connection without one is answered 401 by every request (server.transports.rest.tls)
            context.verify_mode = ssl.CERT_OPTIONAL
        self._contexts.append(context)
        return context

    def _grpc_config(self):
        m = self.material
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.client_ca)

    def grpc_credentials(self):
        """``grpc.dynamic_ssl_server_credentials``: grpc calls the fetcher at each new handshake; it
        answers a new configuration only when the files changed since the last one it gave."""
        seen = [self.generation]

        def fetch():
            if self.generation == seen[0]:
                return None  # unchanged: grpc keeps the current one
            seen[0] = self.generation
            return self._grpc_config()

        return grpc.dynamic_ssl_server_credentials(self._grpc_config(), fetch, require_client_authentication=self.mutual)


# ---- client certificates -> identities ---------------------------------------------------------


def canonical_subject(name) -> str:
    """A subject (``cryptography`` Name or an RFC 4514 string, any attribute order or spacing) as one
    canonical string: ``TYPE=value`` pairs sorted, joined by commas (``CN=svc,O=Acme``)."""
    if isinstance(name, str):
        try:
            name = x509.Name.from_rfc4514_string(name.strip())
        except ValueError as err:
            raise ValueError(f"not an RFC 4514 subject ({err})") from None
    parts = []
    for attribute in name:
        one = x509.Name([x509.RelativeDistinguishedName([attribute])]).rfc4514_string()
        key, _, value = one.partition("=")
        parts.append(f"{key.upper()}={value}")
    return ",".join(sorted(parts))


def canonical_identity(identity: str) -> str:
    """What ``inferplane tenants bind`` stores: a SAN URI as given (a SPIFFE ID is case-sensitive in its
    path; scheme and trust domain are lowered) or a canonical subject."""
    identity = identity.strip()
    if "://" in identity:
        scheme, _, rest = identity.partition("://")
        domain, slash, path = rest.partition("/")
        return f"{scheme.lower()}://{domain.lower()}{slash}{path}"
    return canonical_subject(identity)


@functools.lru_cache(maxsize=4096)
def peer_identities(cert: bytes) -> tuple[str, ...]:
    """The identities a client certificate (DER or PEM) proves, most specific first: its SAN URIs
    (SPIFFE IDs), then its canonical subject. An unreadable certificate proves nothing (``()``)."""
    try:
        certificate = x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----BEGIN") else x509.load_der_x509_certificate(cert)
    except ValueError:
        return ()
    out: list[str] = []
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        out.extend(canonical_identity(uri) for uri in san.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        pass
    out.append(canonical_subject(certificate.subject))
    return tuple(out)


def grpc_peer_cert(context) -> bytes | None:
    """The client certificate of a gRPC call (PEM, from ``context.auth_context()``), or None."""
    try:
        pems = context.auth_context().get("x509_pem_cert")
    except Exception:  # noqa: BLE001 - an insecure port has no auth context worth reading
        return None
    return pems[0] if pems else None


def transport_peer_cert(transport) -> bytes | None:
    """The client certificate of an aiohttp request's connection (DER), or None."""
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    return ssl_object.getpeercert(binary_form=True)


# ---- the client side: the frontend's channel to a remote Triton ------------------------------------


def channel_credentials(settings):
    """grpc channel credentials for ``--triton-url`` from the settings' ``triton_tls_*`` (None: plaintext)."""
    if not settings.triton_tls:
        return None
    ca = _read(settings.triton_tls_ca, "Triton CA bundle") if settings.triton_tls_ca else None
    cert = _read(settings.triton_tls_cert, "Triton client certificate") if settings.triton_tls_cert else None
    key = _read(settings.triton_tls_key, "Triton client key") if settings.triton_tls_key else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def triton_files(settings) -> list[Path]:
    return [p for p in (settings.triton_tls_ca, settings.triton_tls_cert, settings.triton_tls_key) if p is not None]


class FileStamp:
    """Whether a set of files changed since the last look (mtime, size, inode)."""

    def __init__(self, paths: list[Path]):
        self.paths = [Path(p) for p in paths]
        self._stamp = self._read()

    def _read(self) -> tuple:
        out = []
        for p in self.paths:
            try:
                out.append(_stat(p))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self) -> bool:
        stamp = self._read()
        if stamp == self._stamp or None in stamp:
            return False
        self._stamp = stamp
        return True


# ---- the client side: the CLIs' and the control plane's channel to a frontend ----------------------------


def frontend_channel(url: str, settings=None, *, aio: bool = False, options: list | None = None):
    """A gRPC channel to a frontend: TLS with the settings' ``client_tls_ca`` (and a client certificate
    from ``client_tls_cert``/``_key`` for mTLS) when it is set, plaintext otherwise."""
    if settings is None:
        settings = Settings()
    options = list(options or [])
    module = grpc.aio if aio else grpc
    if settings.client_tls_ca is None and settings.client_tls_cert is None:
        return module.insecure_channel(url, options=options)
    credentials, name = _client_credentials(settings.client_tls_ca, "client CA bundle", settings.client_tls_cert, settings.client_tls_key, settings)
    return module.secure_channel(url, credentials, options=options + name)


def _client_credentials(ca_path, ca_label: str, cert_path, key_path, settings) -> tuple[object, list]:
    """A client side's gRPC credentials (the CA to check the server by; a client certificate for mTLS when
    given) and the channel option naming the server to check (``client_tls_server_name``, when set)."""
    ca = _read(ca_path, ca_label) if ca_path else None
    cert = _read(cert_path, "client certificate") if cert_path else None
    key = _read(key_path, "client key") if key_path else None
    options = [("grpc.ssl_target_name_override", settings.client_tls_server_name)] if settings.client_tls_server_name else []
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert), options


# ---- the client side: a frontend's channel to the control-plane leader (server.transports.grpc.forward) -------


def is_loopback(address: str) -> bool:
    """Whether a ``host:port`` target is a loopback address of this host (127.0.0.0/8, ::1, localhost)."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def leader_credentials(settings) -> tuple[object, list] | None:
    """Credentials and channel options for forwarded control RPCs while this platform serves TLS (None: it
    does not). The leader's certificate is checked against ``client_tls_ca``, else the platform's own
    client CA (``tls_client_ca``), else the system's; the client certificate is ``client_tls_cert`` (mTLS),
    else — when the platform requires client certificates — the frontend's own ``tls_cert`` (it must
    allow clientAuth); the name checked is ``client_tls_server_name`` when set."""
    if not settings.tls:
        return None
    cert_path, key_path = settings.client_tls_cert, settings.client_tls_key
    if cert_path is None and settings.tls_client_ca is not None:
        cert_path, key_path = settings.tls_cert, settings.tls_key
    ca_path = settings.client_tls_ca or settings.tls_client_ca
    return _client_credentials(ca_path, "CA bundle of the control-plane leader", cert_path, key_path, settings)
