"""The weight cache: a scaled-to-zero endpoint's artifacts move into it and come back from it (a hit)
or, once evicted, from the artifact store (a miss, digest-verified); the least recent go first."""

from __future__ import annotations

import json
import os

import pytest

from server.control.registry.artifacts import ArtifactStore
from server.control.scaling.weight_cache import HIT, MISS, NONE, PRESENT, WeightCache


def deployed(repository, store, name, version, data: bytes):
    """A version folder as the deployer writes it (artifact + its pin)."""
    digest = store.put(data)
    folder = repository / name / str(version)
    folder.mkdir(parents=True)
    (folder / "model.json").write_bytes(data)
    (folder / "inferplane_version.json").write_text(json.dumps({"name": name, "version": version, "artifact": "model.json", "sha256": digest}))
    return folder, digest


def test_stash_then_restore_is_a_hit_and_the_bytes_are_the_same(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    folder, digest = deployed(tmp_path / "repo", store, "fraud", 1, b"{\"trees\": 1}")
    cache = WeightCache(tmp_path / "cache", max_bytes=1 << 20)
    assert cache.stash(tmp_path / "repo" / "fraud") == [digest]
    assert not (folder / "model.json").exists() and cache.has(digest)
    assert cache.restore(tmp_path / "repo" / "fraud", store) == HIT
    assert (folder / "model.json").read_bytes() == b"{\"trees\": 1}" and cache.hits == 1
    assert cache.restore(tmp_path / "repo" / "fraud", store) == PRESENT


def test_an_evicted_artifact_comes_back_from_the_store(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    a, da = deployed(tmp_path / "repo", store, "a", 1, b"A" * 600)
    b, db = deployed(tmp_path / "repo", store, "b", 1, b"B" * 600)
    cache = WeightCache(tmp_path / "cache", max_bytes=1000)
    cache.stash(tmp_path / "repo" / "a")
    os.utime(tmp_path / "cache" / da, (1, 1))  # the older one
    cache.stash(tmp_path / "repo" / "b")
    assert not cache.has(da) and cache.has(db) and cache.size() <= 1000
    assert cache.restore(tmp_path / "repo" / "a", store) == MISS and cache.misses == 1
    assert (a / "model.json").read_bytes() == b"A" * 600
    with pytest.raises(FileNotFoundError):
        (b / "model.json").unlink(missing_ok=True)
        cache.clear()
        cache.restore(tmp_path / "repo" / "b", None)


def test_hand_written_models_keep_their_files(tmp_path):
    model = tmp_path / "repo" / "demo" / "1"
    model.mkdir(parents=True)
    (model / "model.txt").write_text("trees")
    cache = WeightCache(tmp_path / "cache")
    assert cache.stash(tmp_path / "repo" / "demo") == []
    assert (model / "model.txt").exists()
    assert cache.restore(tmp_path / "repo" / "demo") == NONE
