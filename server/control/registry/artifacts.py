"""Content-addressed artifact store: blobs named by their sha256, verified on every read.

A local folder by default (``var/artifacts``); any fsspec URL (``s3://bucket/prefix``,
``gs://…``, ``memory://…``) by configuration. Layout: ``sha256/ab/abcdef…``. A blob is
written once (to a temporary name, then moved), never changed; reading one whose bytes no longer
hash to its name raises ``ArtifactTampered``.

With a key ring (``INFERPLANE_ENCRYPT_ARTIFACTS`` and an encryption key: ``server.control.registry.envelope``)
blobs are stored sealed; the name stays the sha256 of the *plaintext* (signatures sign that digest),
reads open the envelope and check the digest of what it held. Blobs stored before encryption was
turned on are read as they are.

Large artifacts stream: ``put_stream`` / ``put_file`` write chunk by chunk (the sha256 computed on
the way, the blob named when it is complete), ``open_stream`` / ``copy_to`` read chunk by chunk and
check the digest at the end (``copy_to`` writes a temporary file and renames it only when the digest
holds). A 140 GB version needs ``_CHUNK`` of memory, not 140 GB. A sealed store (encryption on) seals
one envelope per blob, so there a blob passes through memory whole.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import fsspec

from server.control.registry.envelope import EncryptionError, KeyRing, is_envelope
from server.errors import InferplaneError, ModelNotFound

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


class ArtifactTampered(InferplaneError):
    """A stored blob's bytes do not hash to its name (tampered or corrupted): never served."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_digest(artifact_sha256: str, companions: Mapping[str, str] | None = None) -> str:
    """A version's digest: its artifact's sha256 alone, or with companion files (an LLM's config and
    tokenizer) the sha256 of ``artifact <digest>`` and one ``NAME <digest>`` line per companion, sorted.
    Signatures sign it; the same weights with another tokenizer make another version."""
    if not companions:
        return artifact_sha256
    lines = [f"artifact {artifact_sha256}", *(f"{name} {companions[name]}" for name in sorted(companions))]
    return sha256_bytes(("\n".join(lines) + "\n").encode())


def file_chunks(path: Path | str, chunk: int = _CHUNK) -> Iterator[bytes]:
    """A local file's bytes, ``chunk`` at a time."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            yield block


def sha256_file(path: Path | str) -> str:
    digest = hashlib.sha256()
    for block in file_chunks(path):
        digest.update(block)
    return digest.hexdigest()


def artifact_store_for(settings) -> "ArtifactStore":
    """The settings' store; sealed blobs when ``encrypt_artifacts`` is on (it needs an encryption key)."""
    keys = None
    if settings.encrypt_artifacts:
        keys = KeyRing.from_settings(settings)
        if keys is None:
            raise ValueError("encrypt_artifacts needs INFERPLANE_ENCRYPTION_KEY or INFERPLANE_ENCRYPTION_KEY_FILE")
    elif settings.encryption_key.get_secret_value() or settings.encryption_key_file is not None:
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
        self.keys = keys  # server.control.registry.envelope.KeyRing: blobs stored sealed (named by their plaintext)
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

    def _sealing(self) -> bool:
        return self.keys is not None and hasattr(self.keys, "encrypt")

    def put(self, data: bytes) -> str:
        """Store ``data`` (idempotent) and return its sha256."""
        return self.put_stream([data])[0]

    def put_file(self, path: Path | str) -> tuple[str, int]:
        """Store a local file chunk by chunk; (sha256, size)."""
        return self.put_stream(file_chunks(path))

    def put_stream(self, chunks: Iterable[bytes]) -> tuple[str, int]:
        """Store the concatenation of ``chunks`` (idempotent), hashing while writing; (sha256, size).

        The bytes go to a temporary name in the store and are moved to their digest's name when
        complete; a blob already stored under that name is kept when it still verifies (healed
        with these bytes when it does not)."""
        if self._sealing():
            data = b"".join(chunks)  # one envelope per blob: sealed blobs pass through memory whole
            digest = sha256_bytes(data)
            tmp = self._tmp_name(digest)
            self.fs.pipe_file(tmp, self.keys.encrypt(data, digest.encode()))
            return self._commit(tmp, digest), len(data)
        hasher, size = hashlib.sha256(), 0
        self.fs.makedirs(f"{self.root}/tmp", exist_ok=True)
        tmp = f"{self.root}/tmp/upload-{uuid.uuid4().hex}"
        try:
            with self.fs.open(tmp, "wb") as out:
                for block in chunks:
                    hasher.update(block)
                    size += len(block)
                    out.write(block)
            return self._commit(tmp, hasher.hexdigest()), size
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            raise

    def _tmp_name(self, digest: str) -> str:
        target = self.path(digest)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        return f"{target}.tmp-{uuid.uuid4().hex}"

    def _commit(self, tmp: str, digest: str) -> str:
        """Move the complete temporary blob ``tmp`` to its digest's name (or drop it: already stored)."""
        target = self.path(digest)
        if self.fs.exists(target) and self._verifies(digest):
            self.fs.rm(tmp)
            return digest
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.mv(tmp, target)
        return digest

    def _verifies(self, digest: str) -> bool:
        try:
            for _block in self.open_stream(digest):
                pass
        except ArtifactTampered:
            return False  # heal a corrupted blob with the bytes we were given (they hash to the name)
        return True

    def get(self, digest: str) -> bytes:
        """The blob's bytes, after checking they still hash to ``digest`` (small blobs; stream large ones)."""
        return b"".join(self.open_stream(digest))

    def _open(self, digest: str, data: bytes) -> bytes:
        if self.keys is None:
            raise ArtifactTampered(f"artifact sha256:{digest} is stored encrypted and no encryption key is set (INFERPLANE_ENCRYPTION_KEY or _KEY_FILE)")
        try:
            return self.keys.decrypt(data, digest.encode())
        except EncryptionError as err:
            raise ArtifactTampered(f"artifact sha256:{digest} in {self.url} does not decrypt ({err}); refusing it") from None

    def open_stream(self, digest: str, chunk: int = _CHUNK) -> Iterator[bytes]:
        """The blob's bytes, ``chunk`` at a time; ArtifactTampered after the last chunk when they do
        not hash to ``digest`` (a consumer keeps nothing it read until the stream ends cleanly)."""
        target = self.path(digest)
        try:
            f = self.fs.open(target, "rb")
        except FileNotFoundError:
            raise ModelNotFound(f"artifact sha256:{digest} is not in the store {self.url}") from None
        hasher = hashlib.sha256()
        with f:
            head = f.read(chunk)
            if is_envelope(head):  # an envelope opens whole
                plain = self._open(digest, head + f.read())
                hasher.update(plain)
                if hasher.hexdigest() == digest:
                    yield plain
            else:
                block = head
                while block:
                    hasher.update(block)
                    yield block
                    block = f.read(chunk)
        actual = hasher.hexdigest()
        if actual != digest:
            raise ArtifactTampered(f"artifact sha256:{digest} in {self.url} now hashes to {actual}: tampered or corrupted; refusing it")

    def copy_to(self, digest: str, dest: Path) -> Path:
        """Write the verified blob to the local file ``dest`` (for a Triton version directory), chunk
        by chunk; ``dest`` appears only when the whole blob arrived and verified."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as out:
                for block in self.open_stream(digest):
                    out.write(block)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest
