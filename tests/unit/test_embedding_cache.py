"""The MiniLM ONNX export's cache (model_repository/embeddings.py ``cached_onnx``): exported once per weights
and recipe, reused by every later repository build, exported anew when the cached bytes no longer match their
sha256. The export itself is stubbed here (it traces the real model: tens of seconds); the real export is
what tests/integration/test_embeddings.py serves and checks against PyTorch."""

from __future__ import annotations

import pytest

from model_repository import embeddings


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """A fake MiniLM folder, the cache in tmp_path, and the list of paths export_onnx was called with."""
    source = tmp_path / "minilm"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"weights v1")
    monkeypatch.setattr(embeddings, "CACHE_DIR", tmp_path / "cache")
    calls = []

    def fake_export(path, model_dir=None):
        calls.append(path)
        path.write_bytes(b"graph of " + (model_dir / "model.safetensors").read_bytes())
        return path

    monkeypatch.setattr(embeddings, "export_onnx", fake_export)
    return source, calls


def test_the_export_is_made_once_and_then_reused(exports):
    source, calls = exports
    first = embeddings.cached_onnx(source)
    assert first.read_bytes() == b"graph of weights v1" and len(calls) == 1
    assert embeddings.cached_onnx(source) == first and len(calls) == 1
    assert not list(first.parent.glob("*.tmp"))  # written aside, then moved into place


def test_a_cached_file_whose_bytes_changed_is_exported_again(exports):
    source, calls = exports
    cached = embeddings.cached_onnx(source)
    cached.write_bytes(b"tampered")
    assert embeddings.cached_onnx(source).read_bytes() == b"graph of weights v1" and len(calls) == 2


def test_other_weights_or_another_recipe_is_another_entry(exports, monkeypatch):
    source, calls = exports
    v1 = embeddings.cached_onnx(source)
    (source / "model.safetensors").write_bytes(b"weights v2")
    v2 = embeddings.cached_onnx(source)
    assert v2 != v1 and v2.read_bytes() == b"graph of weights v2" and len(calls) == 2
    monkeypatch.setattr(embeddings, "EXPORT_RECIPE", embeddings.EXPORT_RECIPE + 1)
    assert embeddings.cached_onnx(source) not in (v1, v2) and len(calls) == 3
