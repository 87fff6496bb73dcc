"""CLI: ``models register|list|show|lineage|keygen|trust-key|require-signed|audit``, ``deploy``,
``rollback``, ``endpoints list|show``.

``models …`` work on the registry database directly (``--database-url`` / ``INFERPLANE_DATABASE_URL``,
``--artifact-store`` / ``INFERPLANE_ARTIFACT_STORE``); ``deploy``, ``rollback`` and ``endpoints``
talk to the running frontend's admin gRPC (``--url``, default 127.0.0.1:8001), which owns traffic.
Heavy imports happen inside the commands, so ``inferplane --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

import typer

from server.cli.options import (
    ACTOR, API_KEY, URL, ColdStartBudget, MaxReplicas, MinReplicas, ScaleToZeroAfter, TargetInflight, Tier, actor_name, frontend, scaling_options,
)  # fmt: skip

models_app = typer.Typer(help="The model registry: register, list, show, lineage, signing keys.", no_args_is_help=True)
endpoints_app = typer.Typer(help="Deployed endpoints (via the running frontend's admin API).", no_args_is_help=True)

_DB = typer.Option(None, "--database-url", help="Registry database URL [env INFERPLANE_DATABASE_URL; default sqlite:///DATA_DIR/inferplane.db].")
_STORE = typer.Option(None, "--artifact-store", help="Artifact store folder or fsspec URL [env INFERPLANE_ARTIFACT_STORE; default DATA_DIR/artifacts].")


def mount(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
    app.add_typer(endpoints_app, name="endpoints")
    app.command("deploy")(deploy)
    app.command("rollback")(rollback)


def open_registry(database_url: Optional[str], artifact_store: Optional[str]):
    from server.control.registry.artifacts import artifact_store_for
    from server.control.registry.registry import Registry

    from server.settings import Settings

    given = {k: v for k, v in (("database_url", database_url), ("artifact_store", artifact_store)) if v}
    settings = Settings(**given)  # flags > INFERPLANE_* environment > defaults (the data dir)
    return Registry(settings.database_url, artifact_store_for(settings))


@contextlib.contextmanager
def registry_for(database_url: Optional[str], artifact_store: Optional[str]):
    """``open_registry``'s registry for the block, closed after it; a domain error in the block ends
    the command with its reason (``fail``)."""
    from server.errors import InferplaneError

    registry = open_registry(database_url, artifact_store)
    try:
        yield registry
    except InferplaneError as err:
        fail(err)
    finally:
        registry.close()


def fail(err) -> None:
    typer.secho(f"error: {getattr(err, 'reason', type(err).__name__)}: {getattr(err, 'message', str(err))}", err=True, fg="red")
    raise typer.Exit(1)


def key_values(items: Optional[list[str]], what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{what} must be KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _version_dict(r) -> dict:
    return {
        "ref": r.ref, "sha256": r.sha256, "format": r.format, "framework": r.framework, "size_bytes": r.size_bytes,
        "signature": r.signature, "metrics": r.metrics, "hardware": r.hardware, "tags": r.tags,
        "training_run": r.training_run, "dataset_version": r.dataset_version, "experiment": r.experiment,
        "parent": r.parent, "owner_team": r.owner_team, "created_at": r.created_at.isoformat(), "created_by": r.created_by,
        "validation_set": bool(r.validation_sha256), "companions": sorted(r.companions), "signing_key_id": r.signing_key_id,
    }  # fmt: skip


# ---- models ----------------------------------------------------------------------------------


def model_dir_metadata(model_dir: Path) -> dict:
    """What a model directory written by ``inferplane demo build`` declares: artifact path,
    signature (with max_batch_size), validation set path and training tags."""
    meta = json.loads((model_dir / "inferplane.json").read_text())
    signature = meta["signature"]
    if "max_batch_size" in meta:
        signature = {**signature, "max_batch_size": meta["max_batch_size"]}
    return {
        "artifact": model_dir / meta["artifact"],
        "signature": signature,
        "validation": model_dir / meta["validation"] if meta.get("validation") else None,
        "training": meta.get("training", {}),
    }


def register_model_dirs(registry, repository: Path, names: list[str], actor: str) -> list:
    """Register the models of a repository that carry ``inferplane.json`` (identical bytes: their
    existing version); returns the version records."""
    records = []
    for name in names:
        model_dir = repository / name
        if not (model_dir / "inferplane.json").is_file():
            continue
        if "signature" not in json.loads((model_dir / "inferplane.json").read_text()):
            continue  # an LLM or embedding model folder: not a registrable artifact + signature
        meta = model_dir_metadata(model_dir)
        tags = {k: str(v) for k, v in meta["training"].items() if isinstance(v, (str, int, float))}
        record, _ = registry.register(
            name, meta["artifact"], signature=meta["signature"], filename=meta["artifact"].name,
            validation=meta["validation"].read_bytes() if meta["validation"] else None, tags=tags,
            description="a demo model (inferplane demo build)", actor=actor,
        )  # fmt: skip
        records.append(record)
    return records


@models_app.command("register")
def register(
    name: str = typer.Argument(..., help="Model name (the endpoint name when deployed)."),
    artifact: Optional[Path] = typer.Argument(None, help="The artifact file (ONNX, XGBoost JSON/UBJ, LightGBM text, safetensors, TensorRT plan)."),
    from_model_dir: Optional[Path] = typer.Option(None, help="A model directory written by `inferplane demo build` (inferplane.json + validation.npz)."),
    format: Optional[str] = typer.Option(None, help="Expected format (default: detected from the bytes)."),
    signature: Optional[Path] = typer.Option(None, help='JSON file: {"inputs": [{"name","datatype","dims","range"?}], "outputs": [...]}.'),
    validation: Optional[Path] = typer.Option(None, help=".npz validation set (inputs by name or 'features'; expected outputs by name or 'expected')."),
    companion: Optional[list[str]] = typer.Option(None, help="Companion file of a safetensors model (config.json, tokenizer.json); repeatable."),
    metric: Optional[list[str]] = typer.Option(None, help="Offline metric KEY=VALUE; repeatable."),
    tag: Optional[list[str]] = typer.Option(None, help="Tag KEY=VALUE; repeatable."),
    hardware: Optional[list[str]] = typer.Option(None, help="Hardware need KEY=VALUE (gpu=1, memory_mb=512); repeatable."),
    training_run: str = typer.Option("", help="Training run id."),
    dataset_version: str = typer.Option("", help="Dataset version."),
    experiment: str = typer.Option("", help="Experiment name."),
    parent: Optional[str] = typer.Option(None, help="Parent version: NAME:VERSION or VERSION of this model."),
    owner_team: str = typer.Option("", help="Owning team."),
    description: str = typer.Option("", help="Description (set when the model is first registered)."),
    sign_key: Optional[Path] = typer.Option(None, help="Ed25519 private key (PEM) to sign the artifact digest with."),
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
    actor: Optional[str] = ACTOR,
) -> None:
    """Register an artifact as the next version of NAME (identical bytes: the existing version)."""
    from server.errors import InferplaneError

    declared, training, extra_metrics = None, {}, {}
    if from_model_dir is not None:
        meta = model_dir_metadata(from_model_dir)
        artifact = artifact or meta["artifact"]
        declared = meta["signature"]
        validation = validation or meta["validation"]
        training = meta["training"]
    if artifact is None:
        raise typer.BadParameter("give ARTIFACT or --from-model-dir")
    if signature is not None:
        try:
            declared = json.loads(signature.read_text())
        except ValueError as err:
            raise typer.BadParameter(f"--signature {signature} is not JSON: {err}") from None
    if declared is None and artifact.suffix != ".safetensors":  # an LLM's is the engine's (registry.LLM_SIGNATURE)
        raise typer.BadParameter("a signature is required: --signature FILE (or --from-model-dir)")
    hw: dict = {}
    for key, value in key_values(hardware, "--hardware").items():
        hw[key] = int(value) if value.isdigit() else value
    tags = {**{k: str(v) for k, v in training.items() if isinstance(v, (str, int, float))}, **key_values(tag, "--tag")}
    metrics = {**extra_metrics, **{k: float(v) for k, v in key_values(metric, "--metric").items()}}
    companions = {Path(c).name: Path(c) for c in companion or []}  # files stream into the store
    registry = None
    try:
        registry = open_registry(database_url, artifact_store)
        artifact_signature = None
        if sign_key is not None:
            from server.control.registry.artifacts import content_digest, sha256_file
            from server.control.registry.signing import sign_digest

            digest = content_digest(sha256_file(artifact), {cname: sha256_file(cpath) for cname, cpath in companions.items()})
            artifact_signature = sign_digest(sign_key.read_bytes(), digest)
        record, created = registry.register(
            name, artifact, signature=declared, filename=artifact.name, format=format,
            validation=validation.read_bytes() if validation else None, companions=companions, metrics=metrics,
            hardware=hw, tags=tags, training_run=training_run, dataset_version=dataset_version, experiment=experiment,
            parent=parent, owner_team=owner_team, description=description, artifact_signature=artifact_signature,
            actor=actor_name(actor),
        )  # fmt: skip
    except InferplaneError as err:
        fail(err)
    finally:
        if registry is not None:
            registry.close()
    verb = "registered" if created else "already registered as"
    typer.echo(f"{verb} {record.ref} sha256:{record.sha256} ({record.format}, {record.size_bytes} bytes)")


@models_app.command("list")
def list_models(database_url: Optional[str] = _DB, artifact_store: Optional[str] = _STORE) -> None:
    """Every registered model with its latest version."""
    with registry_for(database_url, artifact_store) as registry:
        models = registry.list_models()
        for m in models:
            typer.echo(f"{m.name}\tlatest={m.latest_version}\tversions={m.version_count}\tteam={m.owner_team or '-'}")
        if not models:
            typer.echo(f"no models registered in {registry.url_for_display()} (`inferplane models register NAME ARTIFACT --signature FILE`, or `inferplane demo build`)")


@models_app.command("show")
def show(
    ref: str = typer.Argument(..., help="NAME (every version) or NAME:VERSION."),
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
) -> None:
    """A model's versions, or one version, as JSON."""
    from server.control.registry.registry import parse_ref

    with registry_for(database_url, artifact_store) as registry:
        name, version = parse_ref(ref)
        records = [registry.get(name, version)] if version else registry.list_versions(name)
    typer.echo(json.dumps([_version_dict(r) for r in records], indent=2))


@models_app.command("lineage")
def lineage(
    ref: str = typer.Argument(..., help="NAME (latest) or NAME:VERSION."),
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
) -> None:
    """The version and its ancestors: parent version, training run, dataset, experiment."""
    from server.control.registry.registry import parse_ref

    with registry_for(database_url, artifact_store) as registry:
        chain = registry.lineage(*parse_ref(ref))
    for depth, r in enumerate(chain):
        arrow = "  " * depth + ("└─ " if depth else "")
        typer.echo(
            f"{arrow}{r.ref}  sha256:{r.sha256[:12]}  run={r.training_run or '-'}  dataset={r.dataset_version or '-'}  "
            f"experiment={r.experiment or '-'}"
        )


@models_app.command("keygen")
def keygen(out: Path = typer.Argument(..., help="Writes OUT.key (private, mode 600) and OUT.pub.")) -> None:
    """A new Ed25519 signing key pair."""
    from server.control.registry.signing import generate_keypair, key_id

    private, public = generate_keypair()
    key_path, pub_path = out.with_suffix(".key"), out.with_suffix(".pub")
    key_path.write_bytes(private)
    key_path.chmod(0o600)
    pub_path.write_bytes(public)
    typer.echo(f"wrote {key_path} and {pub_path} (key id {key_id(public)})")


@models_app.command("trust-key")
def trust_key(
    team: str = typer.Argument(...),
    public_key: Path = typer.Argument(..., help="Ed25519 public key (PEM)."),
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
    actor: Optional[str] = ACTOR,
) -> None:
    """Trust a public key for TEAM's artifact signatures."""
    with registry_for(database_url, artifact_store) as registry:
        typer.echo(f"team {team} trusts key {registry.trust_key(team, public_key.read_text(), actor_name(actor))}")


@models_app.command("require-signed")
def require_signed(
    team: str = typer.Argument(...),
    off: bool = typer.Option(False, "--off", help="Turn the requirement off."),
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
    actor: Optional[str] = ACTOR,
) -> None:
    """Require (or stop requiring) TEAM's versions to be signed by a trusted key."""
    with registry_for(database_url, artifact_store) as registry:
        registry.set_require_signed(team, not off, actor_name(actor))
    typer.echo(f"team {team}: require_signed={'off' if off else 'on'}")


@models_app.command("audit")
def audit(
    target: Optional[str] = typer.Argument(None, help="Only records whose target starts with this (a model name)."),
    limit: int = typer.Option(50),
    database_url: Optional[str] = _DB,
    artifact_store: Optional[str] = _STORE,
) -> None:
    """The control plane's audit records, newest first."""
    with registry_for(database_url, artifact_store) as registry:
        for e in registry.audit_log(limit, target):
            typer.echo(f"{e.at.isoformat()}\t{e.actor}\t{e.action}\t{e.target}\t{e.outcome}\t{e.detail}")


# ---- deploy / rollback / endpoints (admin gRPC) -----------------------------------------------


def admin(url: str, actor: Optional[str], api_key: Optional[str]):
    """``call(method, request, timeout)`` on the frontend's admin gRPC (``options.frontend``)."""
    from server.protogen.inferplane.v1 import admin_pb2_grpc

    return frontend(admin_pb2_grpc.AdminStub, url, actor, api_key)


def _print_result(r, verb: str) -> None:
    prev = f" (was {r.previous})" if r.previous else ""
    typer.echo(
        f"{verb} {r.endpoint}:{r.version}{prev}: switch {r.switch_ms:.2f} ms, total {r.total_ms:.0f} ms, "
        f"loaded versions {list(r.loaded_versions)}{'' if r.reloaded else ', no reload'} — {r.message}"
    )


def deploy(
    ref: str = typer.Argument(..., help="NAME:VERSION (or NAME for the latest version)."),
    instances: Optional[int] = typer.Option(None, help="Triton model instances."),
    max_batch: Optional[int] = typer.Option(None, help="Max batch size (0: no batching)."),
    queue_delay_us: Optional[int] = typer.Option(None, help="Dynamic batcher max queue delay (µs)."),
    cache: Optional[bool] = typer.Option(None, "--cache/--no-cache", help="Triton response cache."),
    threads: Optional[int] = typer.Option(None, help="The adapter's framework threads per instance (ONNX Runtime, XGBoost, LightGBM)."),
    coalesce: Optional[bool] = typer.Option(None, "--coalesce/--no-coalesce", help="The frontend merges concurrent requests into one Triton call."),
    coalesce_max_inflight: Optional[int] = typer.Option(None, help="Merged calls at Triton at once (default: one per instance)."),
    coalesce_window_us: Optional[int] = typer.Option(None, help="Longest a request waits for a free call slot, µs (default 0: until one frees)."),
    min_replicas: MinReplicas = None,
    max_replicas: MaxReplicas = None,
    target_inflight: TargetInflight = None,
    scale_to_zero_after: ScaleToZeroAfter = None,
    cold_start_budget: ColdStartBudget = None,
    tier: Tier = None,
    url: str = URL,
    timeout: float = typer.Option(300.0, help="Seconds to wait for the deploy."),
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Load a registered version, warm it up, then switch the endpoint's traffic to it. Autoscaling
    flags store the endpoint's scaling config first (so the deploy loads --min-replicas copies)."""
    from server.cli.autoscale import configure
    from server.protogen.inferplane.v1 import admin_pb2

    scaling = scaling_options(min_replicas, max_replicas, target_inflight, scale_to_zero_after, cold_start_budget, tier=tier)
    if scaling:
        status = configure(url, ref.partition(":")[0], scaling, actor, api_key)
        typer.echo(f"autoscaling {status['endpoint']}: {status['min_replicas']}..{status['max_replicas']} replicas, target {status['target']:g} {status['signal']}")

    serving = admin_pb2.ServingOptions(instances=instances or 0)
    if max_batch is not None:
        serving.max_batch, serving.has_max_batch = max_batch, True
    if queue_delay_us is not None:
        serving.queue_delay_us, serving.has_queue_delay_us = queue_delay_us, True
    if cache is not None:
        serving.cache, serving.has_cache = cache, True
    serving.threads = threads or 0
    for field, value in (("coalesce", coalesce), ("coalesce_max_inflight", coalesce_max_inflight), ("coalesce_window_us", coalesce_window_us)):
        if value is not None:
            setattr(serving, field, value)
    with admin(url, actor, api_key) as call:
        response = call("Deploy", admin_pb2.DeployRequest(ref=ref, serving=serving), timeout)
    _print_result(response.result, "deployed")


def rollback(
    name: str = typer.Argument(..., help="Endpoint (model) name."),
    url: str = URL,
    timeout: float = typer.Option(300.0),
    actor: Optional[str] = ACTOR,
    api_key: Optional[str] = API_KEY,
) -> None:
    """Traffic back to the previous version (instant while it is still loaded)."""
    from server.protogen.inferplane.v1 import admin_pb2

    with admin(url, actor, api_key) as call:
        response = call("Rollback", admin_pb2.RollbackRequest(name=name), timeout)
    _print_result(response.result, "rolled back to")


@endpoints_app.command("list")
def endpoints_list(url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY) -> None:
    """Every deployed endpoint: live, previous and loaded versions."""
    from server.protogen.inferplane.v1 import admin_pb2

    with admin(url, actor, api_key) as call:
        response = call("ListEndpoints", admin_pb2.ListEndpointsRequest(), 30)
        served = call("ListModels", admin_pb2.ListModelsRequest(), 30).models
    for e in response.endpoints:
        typer.echo(
            f"{e.name}\tlive={e.live or '-'}\tprevious={e.previous or '-'}\trouted={e.routed or '-'}\t"
            f"loaded={list(e.loaded_versions)}\tserving={e.serving_json}"
        )
    from server.control.composition.composition_compiler import is_internal

    deployed = {e.name for e in response.endpoints}
    for m in served:
        if m.name not in deployed and not is_internal(m.name):  # a composite's ensemble and operators are its own parts  # served from the model repository as it was at start, not deployed from the registry
            typer.echo(f"{m.name}\tlive={','.join(m.versions) or '-'}\tstate={m.state}\t(not deployed: served from the model repository)")
    if not response.endpoints and not served:
        typer.echo("no endpoints: nothing is deployed or served (`inferplane deploy NAME:VERSION`)")


@endpoints_app.command("show")
def endpoints_show(
    name: str = typer.Argument(...), url: str = URL, actor: Optional[str] = ACTOR, api_key: Optional[str] = API_KEY
) -> None:
    """One endpoint with its deployment history, as JSON."""
    from google.protobuf.json_format import MessageToDict

    from server.protogen.inferplane.v1 import admin_pb2

    with admin(url, actor, api_key) as call:
        response = call("GetEndpoint", admin_pb2.GetEndpointRequest(name=name), 30)
    typer.echo(json.dumps(MessageToDict(response.endpoint, preserving_proto_field_name=True), indent=2))
