"""Content-addressed artifact store: blobs named by their sha256, verified on every read.

A local folder by default (``var/artifacts``); any fsspec URL (``s3://bucket/prefix``,
``gs://…``, ``memory://…``) by configuration. Layout: ``sha256/ab/abcdef…``. A blob is
written once (to a temporary name, then moved), never changed; reading one whose bytes no longer
hash to its name raises ``ArtifactTampered``.
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


class ArtifactStore:
    def __init__(self, url: str | Path = "var/artifacts"):
        url = str(url)
        self.url = url
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
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, target)
        return digest

    def get(self, digest: str) -> bytes:
        """The blob's bytes, after checking they still hash to ``digest``."""
        target = self.path(digest)
        try:
            data = self.fs.cat_file(target)
        except FileNotFoundError:
            raise ModelNotFound(f"artifact sha256:{digest} is not in the store {self.url}") from None
        actual = sha256_bytes(data)
        if actual != digest:
            raise ArtifactTampered(f"artifact sha256:{digest} in {self.url} now hashes to {actual}: tampered or corrupted; refusing it")
        return data

    def copy_to(self, digest: str, dest: Path) -> Path:
        """Write the verified blob to the local file ``dest`` (for a Triton version directory)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(self.get(digest))
        return dest
