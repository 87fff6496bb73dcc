"""Artifacts stream through the store in chunks (server/control/registry/artifacts.py): a large version
registers, verifies and materializes without being held in memory."""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import pytest

from server.control.registry import safe_formats
from server.control.registry.artifacts import ArtifactStore, ArtifactTampered, sha256_file
from server.control.registry.registry import Registry

GIB = 1 << 30
MEMORY_BOUND = 100 << 20  # what streaming a 1 GiB artifact may allocate (Python heap peak)


def safetensors_file(path: Path, size: int) -> Path:
    """A valid safetensors file of ``size`` bytes: one F32 tensor filling the body; the body is a
    sparse hole (zeros) except a few written blocks, so the digest depends on every region."""
    body = size - 8
    header = b""
    for _ in range(3):  # the header's own length changes the body's: settle it
        count = (body - len(header)) // 4
        header = json.dumps({"w": {"dtype": "F32", "shape": [count], "data_offsets": [0, count * 4]}}).encode()
        header += b" " * ((size - 8 - len(header)) % 4)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(size)
        for offset in (size // 3, size // 2, size - 4096):
            f.seek(offset)
            f.write(b"\x01\x02\x03\x04" * 1024)
    return path


def peak_of(fn):
    tracemalloc.start()
    try:
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def test_put_stream_and_open_stream_round_trip_in_chunks(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    chunks = [bytes([i]) * (300_000 + i) for i in range(7)]
    whole = b"".join(chunks)
    digest, size = store.put_stream(iter(chunks))
    assert digest == hashlib.sha256(whole).hexdigest() and size == len(whole)
    assert store.put(whole) == digest  # idempotent: the same name, one blob
    pieces = list(store.open_stream(digest, chunk=1 << 16))
    assert len(pieces) > 1 and max(map(len, pieces)) <= 1 << 16 and b"".join(pieces) == whole
    assert store.get(digest) == whole
    assert not list((tmp_path / "store" / "tmp").iterdir())  # no upload left behind


def test_a_tampered_blob_fails_the_stream_and_copy_to_leaves_no_file(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    digest = store.put(b"x" * 3_000_000)
    blob = Path(store.path(digest))
    blob.write_bytes(b"y" + blob.read_bytes()[1:])
    with pytest.raises(ArtifactTampered):
        list(store.open_stream(digest))
    dest = tmp_path / "out" / "model.onnx"
    with pytest.raises(ArtifactTampered):
        store.copy_to(digest, dest)
    assert not dest.exists() and not list(dest.parent.iterdir())  # neither the file nor its temporary
    assert store.put(b"x" * 3_000_000) == digest and store.get(digest) == b"x" * 3_000_000  # healed by a put


def test_a_failed_upload_leaves_nothing_in_the_store(tmp_path):
    store = ArtifactStore(tmp_path / "store")

    def broken():
        yield b"a" * 1000
        raise ConnectionError("the client went away")

    with pytest.raises(ConnectionError):
        store.put_stream(broken())
    assert not list((tmp_path / "store" / "tmp").iterdir()) and not (tmp_path / "store" / "sha256").exists()


def test_a_large_safetensors_file_is_recognised_by_its_header_without_reading_it(tmp_path):
    path = safetensors_file(tmp_path / "model.safetensors", safe_formats.STREAM_ABOVE + 4096)
    result, peak = peak_of(lambda: safe_formats.check_model_file(path))
    assert result == safe_formats.SAFETENSORS and peak < 1 << 20
    lying = tmp_path / "lying.safetensors"  # a header whose tensor lies beyond the file's end
    with open(lying, "wb") as f:
        header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 2 * safe_formats.STREAM_ABOVE]}}).encode()
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(safe_formats.STREAM_ABOVE + 4096)
    with pytest.raises(safe_formats.UnsafeArtifact):
        safe_formats.check_model_file(lying)


@pytest.mark.slow
def test_a_1_gib_version_registers_and_materializes_under_a_memory_bound(tmp_path):
    path = safetensors_file(tmp_path / "model.safetensors", GIB)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "store"))
    signature = {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}], "outputs": [{"name": "text_output", "datatype": "BYTES", "dims": [1]}]}
    try:
        (record, created), peak = peak_of(
            lambda: registry.register("big_llm", path, signature=signature, companions={"config.json": config}, hardware={"gpus": 1})
        )
        assert created and record.size_bytes == GIB and record.format == safe_formats.SAFETENSORS
        assert peak < MEMORY_BOUND, f"registering 1 GiB allocated {peak >> 20} MiB"
        assert record.sha256 == sha256_file(path)
        dest = tmp_path / "repo" / "big_llm" / "1" / "model.safetensors"
        _, peak = peak_of(lambda: registry.store.copy_to(record.sha256, dest))
        assert peak < MEMORY_BOUND, f"materializing 1 GiB allocated {peak >> 20} MiB"
        assert dest.stat().st_size == GIB and sha256_file(dest) == record.sha256
    finally:
        registry.close()
