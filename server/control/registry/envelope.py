"""Envelope encryption at rest: AES-256-GCM data keys wrapped by a key-encryption key (KEK).

Each object (a payload-log record, a shadow record, a batch file, an artifact) gets a fresh random
256-bit data key (DEK); the data is sealed with AES-GCM under the DEK, and the DEK is sealed with
AES-GCM under the KEK. The envelope names the KEK by id, so rotating keys keeps old data readable:
the key ring holds every KEK still needed, the *primary* one seals new data, and ``rewrap`` moves an
old envelope to the primary key by re-sealing only its 32-byte DEK (the data is not touched).

KEKs come from the settings: ``INFERPLANE_ENCRYPTION_KEY`` (base64 of 32 bytes, or
``id:base64,id2:base64`` — the first is primary) or a KMS-style key file
``INFERPLANE_ENCRYPTION_KEY_FILE`` ``{"primary": "k2", "keys": {"k1": "<base64>", "k2": "<base64>"}}``
(``inferplane data keygen --key-file F`` adds a key and makes it primary). A KMS proper plugs in by
replacing :meth:`KeyRing.wrap` / :meth:`KeyRing.unwrap`; the envelope format does not change.

Formats (all integers big-endian)::

    record  "IPE1" | id length (1) | key id | DEK nonce (12) | sealed DEK (48) | nonce (12) | ciphertext+tag
    file    "IPF1" | id length (1) | key id | DEK nonce (12) | sealed DEK (48) | nonce prefix (8)
            then chunks: length (4) | ciphertext+tag, each sealed with nonce = prefix | counter (4)
            and associated data = sha256(prefix | aad) | counter | last-chunk flag (a cut, reordered or
            swapped file fails; the DEK header can be re-sealed without touching the chunks)

The key never appears in a log line, an error message or an envelope; errors name the key id only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

RECORD_MAGIC, FILE_MAGIC = b"IPE1", b"IPF1"
KEY_BYTES, NONCE_BYTES, SEALED_DEK_BYTES = 32, 12, 48
CHUNK_BYTES = 1 << 20
_DEK_AAD = b"inferplane-dek:"


class EncryptionError(ValueError):
    """A key that is missing or malformed, or data that does not decrypt (wrong key, tampered, cut short)."""


def _b64key(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        raise EncryptionError(f"{where}: not base64") from None
    if len(key) != KEY_BYTES:
        raise EncryptionError(f"{where}: expected {KEY_BYTES} bytes (AES-256), got {len(key)}")
    return key


def key_id_for(key: bytes) -> str:
    """A stable id for a key given without one: the first 8 hex digits of sha256("inferplane-kek" | key)."""
    return hashlib.sha256(b"inferplane-kek" + key).hexdigest()[:8]


def new_key() -> str:
    """A fresh KEK, base64."""
    return base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()


@dataclass
class KeyRing:
    primary: str
    keys: dict[str, bytes]

    def __post_init__(self):
        if self.primary not in self.keys:
            raise EncryptionError(f"the primary key '{self.primary}' is not among the keys ({', '.join(sorted(self.keys))})")
        for key_id in self.keys:
            if not key_id or len(key_id.encode()) > 64:
                raise EncryptionError(f"a key id must be 1-64 bytes, got {key_id!r:.80}")

    def __repr__(self) -> str:  # never the keys
        return f"KeyRing(primary={self.primary!r}, ids={sorted(self.keys)})"

    # ---- building ----------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> "KeyRing":
        """``base64`` or ``id:base64,id2:base64`` (the first is primary)."""
        keys: dict[str, bytes] = {}
        primary = ""
        for i, item in enumerate(p for p in text.split(",") if p.strip()):
            if ":" in item:
                key_id, _, value = item.partition(":")
                key = _b64key(value, f"encryption key '{key_id.strip()}'")
                key_id = key_id.strip()
            else:
                key = _b64key(item, f"encryption key #{i + 1}")
                key_id = key_id_for(key)
            keys[key_id] = key
            primary = primary or key_id
        if not keys:
            raise EncryptionError("no encryption key given")
        return cls(primary, keys)

    @classmethod
    def load_file(cls, path: Path) -> "KeyRing":
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as err:
            raise EncryptionError(f"cannot read the key file {path}: {err.strerror}") from None
        except ValueError:
            raise EncryptionError(f"the key file {path} is not JSON") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), dict) or not doc["keys"]:
            raise EncryptionError(f'the key file {path} needs {{"primary": "<id>", "keys": {{"<id>": "<base64>"}}}}')
        keys = {str(k): _b64key(str(v), f"key '{k}' of {path}") for k, v in doc["keys"].items()}
        return cls(str(doc.get("primary") or next(iter(keys))), keys)

    @classmethod
    def from_settings(cls, settings) -> "KeyRing | None":
        """The settings' keys (the key file's and the inline ones together; the file's primary wins), or None."""
        ring = None
        if settings.encryption_key_file is not None:
            ring = cls.load_file(settings.encryption_key_file)
        inline = settings.encryption_key.get_secret_value()
        if inline:
            parsed = cls.parse(inline)
            ring = parsed if ring is None else cls(ring.primary, {**parsed.keys, **ring.keys})
        return ring

    # ---- data keys ---------------------------------------------------------------------------

    def wrap(self, dek: bytes) -> tuple[str, bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        return self.primary, nonce, AESGCM(self.keys[self.primary]).encrypt(nonce, dek, _DEK_AAD + self.primary.encode())

    def unwrap(self, key_id: str, nonce: bytes, sealed: bytes) -> bytes:
        key = self.keys.get(key_id)
        if key is None:
            raise EncryptionError(f"data sealed with key '{key_id}', which is not in the key ring ({', '.join(sorted(self.keys))})")
        try:
            return AESGCM(key).decrypt(nonce, sealed, _DEK_AAD + key_id.encode())
        except InvalidTag:
            raise EncryptionError(f"the data key does not open with key '{key_id}' (a different key under that id, or tampered)") from None

    # ---- records -----------------------------------------------------------------------------

    def encrypt(self, plaintext: bytes, aad: bytes = b"") -> bytes:
        dek = AESGCM.generate_key(bit_length=256)
        key_id, dek_nonce, sealed = self.wrap(dek)
        nonce = os.urandom(NONCE_BYTES)
        return _header(RECORD_MAGIC, key_id, dek_nonce, sealed) + nonce + AESGCM(dek).encrypt(nonce, plaintext, aad)

    def decrypt(self, blob: bytes, aad: bytes = b"") -> bytes:
        key_id, dek_nonce, sealed, pos = _read_header(blob, RECORD_MAGIC)
        dek = self.unwrap(key_id, dek_nonce, sealed)
        nonce = blob[pos : pos + NONCE_BYTES]
        try:
            return AESGCM(dek).decrypt(nonce, blob[pos + NONCE_BYTES :], aad)
        except InvalidTag:
            raise EncryptionError("the record does not decrypt (tampered, or not the object it was sealed for)") from None

    def rewrap(self, blob: bytes) -> bytes:
        """The same envelope (a record, or a whole file's bytes) with its data key sealed under the primary key."""
        magic = blob[:4]
        key_id, dek_nonce, sealed, pos = _read_header(blob, magic)
        if key_id == self.primary:
            return blob
        new_id, new_nonce, new_sealed = self.wrap(self.unwrap(key_id, dek_nonce, sealed))
        return _header(magic, new_id, new_nonce, new_sealed) + blob[pos:]

    # ---- files (streamed in chunks) ------------------------------------------------------------

    def encrypt_stream(self, src: BinaryIO, dst: BinaryIO, aad: bytes = b"") -> int:
        dek = AESGCM.generate_key(bit_length=256)
        key_id, dek_nonce, sealed = self.wrap(dek)
        prefix = os.urandom(8)
        header = _header(FILE_MAGIC, key_id, dek_nonce, sealed) + prefix
        dst.write(header)
        aead, context = AESGCM(dek), hashlib.sha256(prefix + aad).digest()
        written, counter = len(header), 0
        chunk = src.read(CHUNK_BYTES)
        while True:
            following = src.read(CHUNK_BYTES) if chunk else b""
            last = not following
            sealed_chunk = aead.encrypt(prefix + struct.pack(">I", counter), chunk, context + struct.pack(">I?", counter, last))
            dst.write(struct.pack(">I", len(sealed_chunk)) + sealed_chunk)
            written += 4 + len(sealed_chunk)
            if last:
                return written
            chunk, counter = following, counter + 1

    def decrypt_stream(self, src: BinaryIO, dst: BinaryIO, aad: bytes = b"") -> int:
        head = src.read(4 + 1)
        if head[:4] != FILE_MAGIC or len(head) < 5:
            raise EncryptionError("not an encrypted file (no IPF1 header)")
        rest = src.read(head[4] + NONCE_BYTES + SEALED_DEK_BYTES + 8)
        key_id, dek_nonce, sealed, pos = _read_header(head + rest, FILE_MAGIC)
        prefix = rest[-8:]
        aead = AESGCM(self.unwrap(key_id, dek_nonce, sealed))
        context = hashlib.sha256(prefix + aad).digest()
        counter, total = 0, 0
        while True:
            size = src.read(4)
            if len(size) < 4:
                raise EncryptionError("the encrypted file ends before its last chunk (cut short)")
            sealed_chunk = src.read(struct.unpack(">I", size)[0])
            for last in (False, True):
                try:
                    plain = aead.decrypt(prefix + struct.pack(">I", counter), sealed_chunk, context + struct.pack(">I?", counter, last))
                    break
                except InvalidTag:
                    continue
            else:
                raise EncryptionError(f"chunk {counter} of the encrypted file does not decrypt (tampered, reordered or the wrong file)")
            dst.write(plain)
            total += len(plain)
            if last:
                if src.read(1):
                    raise EncryptionError("data after the last chunk of the encrypted file")
                return total
            counter += 1


def _header(magic: bytes, key_id: str, dek_nonce: bytes, sealed: bytes) -> bytes:
    kid = key_id.encode()
    return magic + bytes([len(kid)]) + kid + dek_nonce + sealed


def _read_header(blob: bytes, magic: bytes) -> tuple[str, bytes, bytes, int]:
    if blob[:4] != magic or len(blob) < 5:
        raise EncryptionError(f"not an encrypted object (no {magic.decode()} header)")
    n = blob[4]
    pos = 5 + n
    key_id = blob[5:pos].decode("utf-8", "replace")
    dek_nonce, sealed = blob[pos : pos + NONCE_BYTES], blob[pos + NONCE_BYTES : pos + NONCE_BYTES + SEALED_DEK_BYTES]
    if len(sealed) != SEALED_DEK_BYTES:
        raise EncryptionError("the envelope is cut short")
    return key_id, dek_nonce, sealed, pos + NONCE_BYTES + SEALED_DEK_BYTES


def is_envelope(blob: bytes) -> bool:
    return blob[:4] in (RECORD_MAGIC, FILE_MAGIC)


# ---- JSON-lines records (payload logs, shadow records) -----------------------------------------------


def seal_line(ring: "KeyRing | None", record: dict, clear: tuple[str, ...] = ("ts", "tenant")) -> str:
    """One JSON line: the record in clear without a ring; else ``{"ts", "tenant", "enc"}`` with the
    whole record sealed (``ts`` and ``tenant`` stay readable so retention and erasure need no key; the
    sealed record is bound to them as associated data)."""
    if ring is None:
        return json.dumps(record, separators=(",", ":"))
    outer = {k: record.get(k) for k in clear}
    aad = json.dumps(outer, sort_keys=True, separators=(",", ":")).encode()
    blob = ring.encrypt(json.dumps(record, separators=(",", ":")).encode(), aad)
    return json.dumps({**outer, "enc": base64.b64encode(blob).decode()}, separators=(",", ":"))


def open_line(ring: "KeyRing | None", line: str | bytes, clear: tuple[str, ...] = ("ts", "tenant")) -> dict:
    """A record written by :func:`seal_line` (sealed or in clear)."""
    doc = json.loads(line)
    if "enc" not in doc:
        return doc
    if ring is None:
        raise EncryptionError("this record is encrypted: set INFERPLANE_ENCRYPTION_KEY or INFERPLANE_ENCRYPTION_KEY_FILE")
    outer = {k: doc.get(k) for k in clear}
    aad = json.dumps(outer, sort_keys=True, separators=(",", ":")).encode()
    return json.loads(ring.decrypt(base64.b64decode(doc["enc"]), aad))


def rewrap_line(ring: "KeyRing", line: str) -> str:
    doc = json.loads(line)
    if "enc" not in doc:
        return line
    doc["enc"] = base64.b64encode(ring.rewrap(base64.b64decode(doc["enc"]))).decode()
    return json.dumps(doc, separators=(",", ":"))


def add_key(path: Path, key_id: str | None = None) -> str:
    """Add a fresh key to a KMS-style key file (created if missing) and make it primary; old keys stay."""
    path = Path(path)
    doc = json.loads(path.read_text()) if path.is_file() else {"keys": {}}
    key = new_key()
    key_id = key_id or key_id_for(base64.b64decode(key))
    if key_id in doc["keys"]:
        raise EncryptionError(f"the key file {path} already has a key '{key_id}'")
    doc["keys"][key_id] = key
    doc["primary"] = key_id
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.touch(0o600)
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return key_id
