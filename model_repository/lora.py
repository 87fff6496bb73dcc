"""Install LoRA adapters into an LLM's Triton model folder, as versions that point at its base weights.

``install_adapter(model_dir, name, folder)`` checks the peft folder against the base model
(``adapters/_lora.check_adapter``: safetensors only, every A/B pair shaped for a base module), copies
its two files to ``NAME/adapters/ADAPTER/VERSION/`` and records the version in ``adapters/index.json``
with the weights' sha256 and the base weights' sha256. The same bytes again are the same version; new
bytes are the next version, which the engines pick up at the next request (the index is re-read when
it changes: no model reload). ``remove_adapter`` takes a name out of the index (its folders stay on disk: a
request in flight may still be reading them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from model_repository.adapters._lora import (
    ADAPTERS_DIR, CONFIG_FILE, INDEX_FILE, NAME, WEIGHTS_FILE, AdapterError, check_adapter, read_index, sha256_file,
)  # fmt: skip
from model_repository.llm import HF_DIR


def base_dir(model_dir: Path) -> Path:
    """The base model's Hugging Face folder inside an LLM's Triton model folder: its newest version's
    (the registry version the deployer installed)."""
    model_dir = Path(model_dir)
    versions = [p for p in model_dir.iterdir() if p.name.isdigit() and (p / HF_DIR / "model.safetensors").is_file()] if model_dir.is_dir() else []
    if not versions:
        raise AdapterError(f"{model_dir} is not an LLM model folder (no VERSION/{HF_DIR}/model.safetensors)")
    return max(versions, key=lambda p: int(p.name)) / HF_DIR


def install_adapter(model_dir: Path, name: str, folder: Path, *, source: str = "") -> dict[str, Any]:
    """Check and install ``folder`` as adapter ``name`` of the LLM in ``model_dir``; its index entry."""
    model_dir = Path(model_dir)
    if not NAME.match(name or ""):
        raise AdapterError(f"adapter name {name!r}: lowercase letters, digits, '-' and '_', starting with a letter")
    base = base_dir(model_dir)
    spec = check_adapter(Path(folder), base)
    digest = sha256_file(Path(folder) / WEIGHTS_FILE)
    index = read_index(model_dir)
    current = index.get(name)
    if current is not None and current["sha256"] == digest:
        return current
    version = int(current["version"]) + 1 if current is not None else 1
    target = model_dir / ADAPTERS_DIR / name / str(version)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for file in (WEIGHTS_FILE, CONFIG_FILE):
        shutil.copyfile(Path(folder) / file, target / file)
    entry = {
        "version": version,
        "sha256": digest,
        "rank": spec.rank,
        "alpha": spec.alpha,
        "scale": spec.scale,
        "targets": list(spec.targets),
        "modules": len(spec.modules),
        "base_sha256": sha256_file(base / "model.safetensors"),
        "source": source,
    }
    index[name] = entry
    _write_index(model_dir, index)
    return entry


def remove_adapter(model_dir: Path, name: str) -> bool:
    index = read_index(model_dir)
    if index.pop(name, None) is None:
        return False
    _write_index(model_dir, index)
    return True


def _write_index(model_dir: Path, index: dict[str, Any]) -> None:
    folder = Path(model_dir) / ADAPTERS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".index-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"adapters": index}, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, folder / INDEX_FILE)  # engines read whole files only


def install_demo_adapters(model_dir: Path) -> list[str]:
    """Train (once, cached) and install the demo adapters of SmolLM2 (``model_repository/lora_demo.py``)."""
    from model_repository.llm import CACHE_DIR
    from model_repository.lora_demo import demo_adapters

    names = []
    for name, folder in demo_adapters(base_dir(model_dir), CACHE_DIR).items():
        install_adapter(model_dir, name, folder, source="inferplane demo (peft, synthetic examples)")
        names.append(name)
    return names
