"""Optional Ed25519 artifact signatures: a team's key signs the 32-byte sha256 digest.

When a team has ``require_signed`` on, registering (and deploying) one of its versions needs a
signature that verifies against one of the team's trusted public keys. Keys are PEM
(SubjectPublicKeyInfo / PKCS#8); signatures travel as base64; a key's id is the first 16 hex
digits of the sha256 of its raw public bytes.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from server.errors import InvalidRequest


def generate_keypair() -> tuple[bytes, bytes]:
    """(private PEM, public PEM) of a new Ed25519 key."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def load_public_key(pem: bytes | str) -> Ed25519PublicKey:
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as err:
        raise InvalidRequest(f"not a PEM public key: {err}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidRequest("only Ed25519 public keys are accepted")
    return key


def key_id(public_pem: bytes | str) -> str:
    raw = load_public_key(public_pem).public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_digest(private_pem: bytes, digest: str) -> str:
    key = serialization.load_pem_private_key(private_pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidRequest("only Ed25519 private keys can sign artifacts")
    return base64.b64encode(key.sign(bytes.fromhex(digest))).decode()


def verify_digest(public_pem: bytes | str, digest: str, signature_b64: str) -> bool:
    try:
        signature = base64.b64decode(signature_b64, validate=True)
        load_public_key(public_pem).verify(signature, bytes.fromhex(digest))
    except (InvalidSignature, ValueError):
        return False
    return True
