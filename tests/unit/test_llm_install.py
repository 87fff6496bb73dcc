"""The one way an LLM is put on the platform (server/control/rollout/llm_install.py): registered in a
real registry (SQLite + a local artifact store) and installed into the repository by the deployer."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from model_repository.config_writer import read_config  # noqa: E402
from model_repository.llm import TINY_NAME, TINY_SETTINGS, build_tiny_llama  # noqa: E402
from server.control.rollout.llm_install import install_llm, install_llm_models, scratch_registry  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


def test_an_llm_is_registered_as_one_version_and_deployed_from_the_registry(tiny, tmp_path):
    repo = tmp_path / "repo"
    registry = scratch_registry(tmp_path / "registry")
    try:
        record = install_llm(registry, repo, "chat", tiny, TINY_SETTINGS, source="test")
        assert record.ref == "chat:1" and record.format == "safetensors"
        assert {"config.json", "tokenizer.json"} <= set(record.companions)  # the tokenizer and config are part of the version
        assert registry.endpoint("chat", 0).live == 1  # deployed: the endpoint's live version
        version = repo / "chat" / "1"
        pinned = json.loads((version / "inferplane_version.json").read_text())
        assert pinned["sha256"] == record.sha256 and pinned["artifact"] == "hf"
        assert sorted(p.name for p in (version / "hf").iterdir()) == sorted([*record.companions, "model.safetensors"])
        config = read_config(repo / "chat")
        assert config.model_transaction_policy.decoupled and config.parameters["engine"].string_value == "cpu"
        assert list(config.version_policy.specific.versions) == [1]
        # the same files again: the same version; under another name with other settings: that endpoint's own config
        assert install_llm(registry, repo, "chat", tiny, TINY_SETTINGS).ref == "chat:1"
        other = install_llm(registry, repo, "chat_small", tiny, dataclasses.replace(TINY_SETTINGS, kv_cache_memory="4MiB"))
        assert other.ref == "chat_small:1" and other.sha256 == record.sha256
        assert read_config(repo / "chat_small").parameters["kv_cache_memory"].string_value == "4MiB"
        assert read_config(repo / "chat").parameters["kv_cache_memory"].string_value == "16MiB"
    finally:
        registry.close()


def test_without_a_registry_a_scratch_one_beside_the_repository_is_used(tmp_path):
    repo = tmp_path / "model_repository"
    assert install_llm_models(repo, tiny=True, work=tmp_path) == [TINY_NAME]
    assert sorted(p.name for p in repo.iterdir()) == [TINY_NAME]  # nothing else inside (Triton would list it)
    registry = scratch_registry(tmp_path / "model_repository.registry")
    try:
        assert registry.endpoint(TINY_NAME, 0).live == 1
    finally:
        registry.close()
