"""Envelope encryption: records and chunked files round-trip, tampering and cut files fail, rotation
keeps old data readable, rewrap moves it to the new key, artifacts stay addressed by plaintext."""

from __future__ import annotations

import base64
import io
import json

import pytest

from server.control.registry.artifacts import ArtifactStore, ArtifactTampered, sha256_bytes
from server.control.registry.envelope import (
    CHUNK_BYTES,
    EncryptionError,
    KeyRing,
    add_key,
    is_envelope,
    new_key,
    open_line,
    rewrap_line,
    seal_line,
)


def test_records_round_trip_and_are_bound_to_their_associated_data():
    ring = KeyRing.parse(f"k1:{new_key()}")
    blob = ring.encrypt(b"the prompt: card 4111 1111 1111 1111", aad=b"tenant=acme")
    assert is_envelope(blob) and b"4111" not in blob
    assert ring.decrypt(blob, aad=b"tenant=acme") == b"the prompt: card 4111 1111 1111 1111"
    with pytest.raises(EncryptionError, match="does not decrypt"):
        ring.decrypt(blob, aad=b"tenant=beta")  # moved to another tenant's record
    tampered = bytearray(blob)
    tampered[-1] ^= 1
    with pytest.raises(EncryptionError):
        ring.decrypt(bytes(tampered), aad=b"tenant=acme")
    with pytest.raises(EncryptionError, match="'k1', which is not in the key ring"):
        KeyRing.parse(f"other:{new_key()}").decrypt(blob)


@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 17])
def test_files_round_trip_in_chunks(size):
    ring = KeyRing.parse(new_key())
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    sealed = io.BytesIO()
    ring.encrypt_stream(io.BytesIO(data), sealed, aad=b"batch-1/input.jsonl")
    out = io.BytesIO()
    assert ring.decrypt_stream(io.BytesIO(sealed.getvalue()), out, aad=b"batch-1/input.jsonl") == size
    assert out.getvalue() == data


def test_a_cut_or_reordered_file_fails():
    ring = KeyRing.parse(new_key())
    data = b"a" * CHUNK_BYTES + b"b" * CHUNK_BYTES + b"c" * 10
    sealed = io.BytesIO()
    ring.encrypt_stream(io.BytesIO(data), sealed)
    blob = sealed.getvalue()
    header = len(blob) - 3 * 4 - 2 * (CHUNK_BYTES + 16) - (10 + 16)
    first_end = header + 4 + CHUNK_BYTES + 16
    with pytest.raises(EncryptionError, match="cut short"):
        ring.decrypt_stream(io.BytesIO(blob[:first_end]), io.BytesIO())  # the last chunk dropped
    second_end = first_end + 4 + CHUNK_BYTES + 16
    swapped = blob[:header] + blob[first_end:second_end] + blob[header:first_end] + blob[second_end:]
    with pytest.raises(EncryptionError, match="chunk 0"):
        ring.decrypt_stream(io.BytesIO(swapped), io.BytesIO())


def test_rotation_keeps_old_data_readable_and_rewrap_moves_it(tmp_path):
    key_file = tmp_path / "keys.json"
    first = add_key(key_file, "k1")
    old = KeyRing.load_file(key_file)
    line = seal_line(old, {"ts": 1.0, "tenant": "acme", "request": "jane@example.com"})
    assert "jane" not in line and json.loads(line)["tenant"] == "acme"
    second = add_key(key_file)  # rotate: a new primary, the old key kept
    ring = KeyRing.load_file(key_file)
    assert ring.primary == second != first and set(ring.keys) == {first, second}
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert open_line(ring, line)["request"] == "jane@example.com"  # old data still readable
    moved = rewrap_line(ring, line)
    assert base64.b64decode(json.loads(moved)["enc"])[5 : 5 + len(second)].decode() == second
    only_new = KeyRing(second, {second: ring.keys[second]})
    assert open_line(only_new, moved)["request"] == "jane@example.com"  # the old key can now be retired
    with pytest.raises(EncryptionError, match=f"'{first}'"):
        open_line(only_new, line)


def test_inline_keys_and_their_errors():
    key = new_key()
    ring = KeyRing.parse(key)
    assert len(ring.primary) == 8 and key not in repr(ring)
    with pytest.raises(EncryptionError, match="32 bytes"):
        KeyRing.parse(base64.b64encode(b"short").decode())
    with pytest.raises(EncryptionError, match="not base64"):
        KeyRing.parse("k:not base64!")


def test_encrypted_artifacts_stay_addressed_by_their_plaintext(tmp_path):
    ring = KeyRing.parse(new_key())
    store = ArtifactStore(tmp_path / "artifacts", keys=ring)
    data = b"tree 0\nsplit_feature=1 2\n" * 100
    digest = store.put(data)
    assert digest == sha256_bytes(data)
    stored = (tmp_path / "artifacts" / "sha256" / digest[:2] / digest).read_bytes()
    assert is_envelope(stored) and data not in stored
    assert store.get(digest) == data
    plain = ArtifactStore(tmp_path / "artifacts")  # no key: an encrypted blob is refused, never served
    with pytest.raises(ArtifactTampered, match="stored encrypted"):
        plain.get(digest)
    legacy = ArtifactStore(tmp_path / "legacy")
    old = legacy.put(b"written before encryption")
    assert ArtifactStore(tmp_path / "legacy", keys=ring).get(old) == b"written before encryption"


def test_a_registry_on_an_encrypted_store_keeps_digests_and_signatures(tmp_path):
    from server.control.registry.registry import Registry
    from server.control.registry.signing import generate_keypair, sign_digest
    from tests.unit.test_registry import SIGNATURE, lightgbm

    ring = KeyRing.parse(new_key())
    registry = Registry(f"sqlite:///{tmp_path}/registry.db", ArtifactStore(tmp_path / "artifacts", keys=ring))
    try:
        private, public = generate_keypair()
        registry.trust_key("fraud", public.decode(), actor="admin")
        registry.set_require_signed("fraud", True, actor="admin")
        data = lightgbm(2)
        record, _ = registry.register("m", data, signature=SIGNATURE, owner_team="fraud", artifact_signature=sign_digest(private, sha256_bytes(data)))
        assert record.sha256 == sha256_bytes(data)  # the address is the plaintext's
        registry.verify_signed("m", 1)
        stored = (tmp_path / "artifacts" / "sha256" / record.sha256[:2] / record.sha256).read_bytes()
        assert is_envelope(stored) and data not in stored
        assert registry.store.get(record.sha256) == data
    finally:
        registry.close()
