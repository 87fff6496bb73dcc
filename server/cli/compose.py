"""CLI: ``compose register|explain|list|lineage`` (composite endpoints), and the demo composites.

``compose register SPEC.yaml`` type-checks a spec against its members (registered versions, or
models served from ``--model-repository`` that were never registered) and registers it as the
next version of its name; ``inferplane deploy NAME:VERSION`` then serves it (the deployer
compiles it: a Triton ensemble or a plan for the frontend's DAG executor), ``canary`` and
``rollback`` move traffic between its versions like any endpoint's. ``compose explain`` says
where each node runs and why. These commands read the registry database directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from server.cli.options import ACTOR, actor_name
from server.cli.registry import _DB, _STORE, registry_for

compose_app = typer.Typer(help="Composite endpoints: pipelines, ensembles and routers over registered models.", no_args_is_help=True)
_REPO = typer.Option(None, "--model-repository", help="Where members that are not registered are served from [default: the settings' model_repository].")


def mount(app: typer.Typer) -> None:
    app.add_typer(compose_app, name="compose")


def _lookup(registry, model_repository: Optional[Path]):
    from server.control.composition.composites import registry_lookup
    from server.control.composition.composition_compiler import repository_lookup
    from server.settings import Settings

    repository = model_repository or Settings().model_repository
    return registry_lookup(registry, repository_lookup(repository))


@compose_app.command("register")
def register(
    spec: Path = typer.Argument(..., exists=True, dir_okay=False, help="The composition spec (YAML or JSON)."),
    owner_team: str = typer.Option("", help="Owning team."),
    model_repository: Optional[Path] = _REPO,
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
    actor: Optional[str] = ACTOR,
) -> None:
    """Register a composition as the next version of its name (the same spec and members: the existing version)."""
    from server.control.composition.composites import register_composite
    from server.control.composition.composition import parse_spec

    with registry_for(database_url, artifact_store) as registry:
        parsed = parse_spec(spec.read_text(encoding="utf-8"), where=str(spec))
        record, created, compiled = register_composite(registry, parsed, _lookup(registry, model_repository), actor=actor_name(actor), owner_team=owner_team)
    state = "registered" if created else "already registered as"
    typer.echo(f"{state} {record.ref} ({compiled.mode}: {'; '.join(compiled.reasons)})")
    typer.echo(f"deploy it with: inferplane deploy {record.ref}")


@compose_app.command("explain")
def explain(
    ref: Optional[str] = typer.Argument(None, help="NAME[:VERSION] of a registered composite."),
    spec: Optional[Path] = typer.Option(None, "--spec", exists=True, dir_okay=False, help="Explain a spec file instead."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    model_repository: Optional[Path] = _REPO,
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
) -> None:
    """Where each node runs (one Triton ensemble, or the frontend's DAG executor) and why."""
    from server.control.composition.composites import spec_of
    from server.control.composition.composition import parse_spec
    from server.control.composition.composition_compiler import compile_spec
    from server.control.registry.registry import parse_ref

    if (ref is None) == (spec is None):
        raise typer.BadParameter("give NAME[:VERSION] or --spec FILE")
    with registry_for(database_url, artifact_store) as registry:
        if spec is not None:
            parsed, version = parse_spec(spec.read_text(encoding="utf-8"), where=str(spec)), 0
        else:
            name, version = parse_ref(ref)
            record = registry.get(name, version)
            parsed, version = spec_of(registry, record), record.version
        compiled = compile_spec(parsed, version, _lookup(registry, model_repository))
    doc = compiled.explain()
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    where = "one Triton ensemble" if compiled.mode == "ensemble" else "the frontend's DAG executor"
    typer.echo(f"{compiled.name}{f':{version}' if version else ''} runs as {where}")
    for reason in compiled.reasons:
        typer.echo(f"  because {reason}")
    typer.echo(f"signature: inputs {_tensors(compiled.signature['inputs'])} -> outputs {_tensors(compiled.signature['outputs'])}, "
               f"max_batch_size {compiled.signature['max_batch_size']}")  # fmt: skip
    width = max(len(p.node) for p in compiled.placements)
    for p in compiled.placements:
        typer.echo(f"  {p.node:<{width}}  {p.kind:<8}  {p.runs:<21}  {p.target or '-'}")
        if p.runs == "frontend":
            typer.echo(f"  {'':<{width}}  why: {p.why}")
    typer.echo(f"Triton models: {', '.join(compiled.triton_models) or '(none)'}")


def _tensors(tensors) -> str:
    return ", ".join(f"{t['name']} {t['datatype']}{t['dims']}" for t in tensors)


@compose_app.command("list")
def list_composites(database_url: Optional[str] = _DB, artifact_store: Optional[str] = _STORE) -> None:
    """Registered composites: versions and how the newest runs."""
    from server.control.composition.composites import composites

    with registry_for(database_url, artifact_store) as registry:
        rows = composites(registry)
    if not rows:
        typer.echo("no composites registered (inferplane compose register SPEC.yaml; the demos: inferplane demo build)")
        return
    for row in rows:
        typer.echo(f"{row['name']:<24} versions {','.join(map(str, row['versions'])):<10} {row['mode']:<9} {row['description']}")


@compose_app.command("lineage")
def lineage(ref: str = typer.Argument(..., help="NAME[:VERSION]"), database_url: Optional[str] = _DB, artifact_store: Optional[str] = _STORE) -> None:
    """The member versions a composite version pins."""
    from server.control.composition.composites import members
    from server.control.registry.registry import parse_ref

    with registry_for(database_url, artifact_store) as registry:
        name, version = parse_ref(ref)
        record, rows = members(registry, name, version)
    typer.echo(f"{record.ref} ({record.tags.get('mode', '')}, sha256 {record.sha256[:12]})")
    for m in rows:
        what = f"{m.model}:{m.version}" if m.version else m.model
        detail = f"{m.format}, sha256 {m.sha256[:12]}" if m.registered else "served, not registered"
        typer.echo(f"  {m.node:<12} {what:<28} {detail}")


# ---- the demos (inferplane demo build) --------------------------------------------------------


def build_demo_composites(out: Path, text: bool) -> tuple[list[str], list[str]]:
    """Train the demo composites' members into ``out`` and compile each composite into it as its
    version 1; returns (member names, composite names)."""
    from model_repository import composite_demo
    from server.control.composition.composition import parse_spec
    from server.control.composition.composition_compiler import compile_spec, repository_lookup, write_compiled

    text = text and (Path(out) / "minilm_embeddings" / "config.pbtxt").is_file()
    members = composite_demo.build_members(Path(out), text=text)
    names = list(composite_demo.TABULAR_COMPOSITES) + (list(composite_demo.TEXT_COMPOSITES) if text else [])
    lookup = repository_lookup(Path(out))
    for name in names:
        write_compiled(compile_spec(parse_spec(composite_demo.spec_text(name), where=name), 1, lookup), Path(out))
    return members, names


def register_demo_composites(registry, out: Path, names: list[str], actor: str) -> list:
    """Register the demo composites (their members registered first) with lineage."""
    from model_repository import composite_demo
    from server.control.composition.composites import register_composite, registry_lookup
    from server.control.composition.composition import parse_spec
    from server.control.composition.composition_compiler import repository_lookup

    lookup = registry_lookup(registry, repository_lookup(Path(out)))
    records = []
    for name in names:
        record, _, _ = register_composite(registry, parse_spec(composite_demo.spec_text(name), where=name), lookup, actor=actor)
        records.append(record)
    return records
