"""Content-addressed artifact store: blobs named by their sha256, verified on every read.

A local folder by default (``var/artifacts``); any fsspec URL (``s3://bucket/prefix``,
``gs://…``, ``memory://…``) by configuration. Layout: ``sha256/ab/abcdef…``. A blob is
written once (to a temporary name, then moved), never changed; reading one whose bytes no longer
hash to its name raises ``ArtifactTampered``.

With a key ring (``INFERPLANE_ENCRYPT_ARTIFACTS`` and an encryption key: ``server.control.envelope``)
blobs are stored sealed; the name stays the sha256 of the *plaintext* (signatures sign that digest),
reads open the envelope and check the digest of what it held. Blobs stored before encryption was
turned on are read as they are.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from pathlib import Path

import fsspec

from server.errors import InferplaneError, ModelNotFound

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


class ArtifactTampered(InferplaneError):
    """A stored blob's bytes do not hash to its name (tampered or corrupted): never served."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def artifact_store_for(settings) -> "ArtifactStore":
    """The settings' store; sealed blobs when ``encrypt_artifacts`` is on (it needs an encryption key)."""
    keys = None
    if settings.encrypt_artifacts:
        from server.control.envelope import KeyRing

        keys = KeyRing.from_settings(settings)
        if keys is None:
            raise ValueError("encrypt_artifacts needs INFERPLANE_ENCRYPTION_KEY or INFERPLANE_ENCRYPTION_KEY_FILE")
    elif settings.encryption_key.get_secret_value() or settings.encryption_key_file is not None:
        from server.control.envelope import KeyRing

        keys = KeyRing.from_settings(settings)  # reads sealed blobs; new ones are stored as before
        keys = _ReadOnly(keys)
    return ArtifactStore(settings.artifact_store, keys=keys)


class _ReadOnly:
    """A key ring that opens sealed blobs but seals nothing (encryption of new artifacts is off)."""

    def __init__(self, ring):
        self.ring = ring

    def decrypt(self, blob: bytes, aad: bytes = b"") -> bytes:
        return self.ring.decrypt(blob, aad)


class ArtifactStore:
    def __init__(self, url: str | Path = "var/artifacts", keys=None):
        url = str(url)
        self.url = url
        self.keys = keys  # server.control.envelope.KeyRing: blobs stored sealed (named by their plaintext)
        if "://" not in url:
            url = str(Path(url).resolve())
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, digest: str) -> str:
        if not _DIGEST.match(digest):
            raise ValueError(f"not a sha256 hex digest: {digest!r}")
        return f"{self.root}/sha256/{digest[:2]}/{digest}"

    def exists(self, digest: str) -> bool:
        return self.fs.exists(self.path(digest))

    def put(self, data: bytes) -> str:
        """Store ``data`` (idempotent) and return its sha256."""
        digest = sha256_bytes(data)
        target = self.path(digest)
        if self.fs.exists(target):
            try:
                self.get(digest)
                return digest
            except ArtifactTampered:
                pass  # heal a corrupted blob with the bytes we were given (they hash to the name)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex}"
        sealing = self.keys is not None and hasattr(self.keys, "encrypt")
        self.fs.pipe_file(tmp, self.keys.encrypt(data, digest.encode()) if sealing else data)
        self.fs.mv(tmp, target)
        return digest

    def get(self, digest: str) -> bytes:
        """The blob's bytes, after checking they still hash to ``digest``."""
        target = self.path(digest)
        try:
            data = self.fs.cat_file(target)
        except FileNotFoundError:
            raise ModelNotFound(f"artifact sha256:{digest} is not in the store {self.url}") from None
        data = self._open(digest, data)
        actual = sha256_bytes(data)
        if actual != digest:
            raise ArtifactTampered(f"artifact sha256:{digest} in {self.url} now hashes to {actual}: tampered or corrupted; refusing it")
        return data

    def _open(self, digest: str, data: bytes) -> bytes:
        from server.control.envelope import EncryptionError, is_envelope

        if not is_envelope(data):
            return data
        if self.keys is None:
            raise ArtifactTampered(f"artifact sha256:{digest} is stored encrypted and no encryption key is set (INFERPLANE_ENCRYPTION_KEY or _KEY_FILE)")
        try:
            return self.keys.decrypt(data, digest.encode())
        except EncryptionError as err:
            raise ArtifactTampered(f"artifact sha256:{digest} in {self.url} does not decrypt ({err}); refusing it") from None

    def copy_to(self, digest: str, dest: Path) -> Path:
        """Write the verified blob to the local file ``dest`` (for a Triton version directory)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(self.get(digest))
        return dest
