"""The model registry: immutable versions, content-addressed artifacts, lineage, deployments, audit.

SQLAlchemy 2 models over the schema the Alembic migrations in ``server/migrations`` create. Every
operation is synchronous and short; the async frontend calls them with ``asyncio.to_thread``.

* A version is ``name`` + a number that only grows; its artifact is stored by sha256 and the row
  never changes after registration. A safetensors LLM's config and tokenizer are its companions,
  stored beside it; the version's digest (``content_sha256``) covers the artifact and every
  companion. Registering content already registered under that name returns the existing version
  (idempotent).
* Only safe formats are accepted (``server.control.registry.safe_formats``); pickle is refused before anything is
  stored.
* When a team requires signatures, a version needs an Ed25519 signature over its content digest that
  verifies against one of the team's trusted keys.
* Deployments are a per-endpoint stack: deploy pushes, rollback pops; the live version is the
  newest active entry and the previous one is the entry below it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

from server import migrations
from server.control.registry import safe_formats
from server.control.registry import signing
from server.control.typed import typed_schema
from server.control.typed.declared_signature import check_signature
from server.control.registry.artifacts import ArtifactStore, content_digest
from server.db import display_url, make_engine, session_factory
from server.errors import Conflict, InferplaneError, InvalidRequest, ModelNotFound, PermissionDenied, Violation

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
COMPANION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.(json|txt|jinja|model|safetensors)$")
# an LLM's tensors (the engine adapter's, model_repository/llm.py): a safetensors version registered without a signature
LLM_SIGNATURE = {
    "inputs": [{"name": n, "datatype": "BYTES", "dims": [1]} for n in ("text_input", "messages", "parameters")],
    "outputs": [{"name": n, "datatype": "BYTES", "dims": [1]} for n in ("text_output", "info")],
}


def _now() -> datetime:
    return datetime.now(UTC)


def _utc(value: datetime | None) -> datetime | None:
    """Timestamps are stored in UTC; SQLite hands them back without a zone."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class Model(Base):
    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    owner_team: Mapped[str] = mapped_column(String(200), server_default="")
    description: Mapped[str] = mapped_column(Text, server_default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    versions: Mapped[list["ModelVersion"]] = relationship(back_populates="model", order_by="ModelVersion.version")


class ModelVersion(Base):
    __tablename__ = "model_versions"
    __table_args__ = (
        UniqueConstraint("model_id", "version", name="uq_model_versions_model_version"),
        UniqueConstraint("model_id", "content_sha256", name="uq_model_versions_model_content"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="RESTRICT"))
    version: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))  # the artifact's
    content_sha256: Mapped[str] = mapped_column(String(64))  # the version's: artifact + companions (0016)
    format: Mapped[str] = mapped_column(String(32))
    framework: Mapped[str] = mapped_column(String(32))
    artifact_name: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    signature: Mapped[dict] = mapped_column(JSON)
    validation_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    companions: Mapped[dict] = mapped_column(JSON)
    metrics: Mapped[dict] = mapped_column(JSON)
    hardware: Mapped[dict] = mapped_column(JSON)
    tags: Mapped[dict] = mapped_column(JSON)
    training_run: Mapped[str] = mapped_column(String(200), server_default="")
    dataset_version: Mapped[str] = mapped_column(String(200), server_default="")
    experiment: Mapped[str] = mapped_column(String(200), server_default="")
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("model_versions.id", ondelete="RESTRICT"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    created_by: Mapped[str] = mapped_column(String(200), server_default="")
    artifact_signature: Mapped[str | None] = mapped_column(String(128), nullable=True)
    signing_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)

    model: Mapped[Model] = relationship(back_populates="versions")
    parent: Mapped["ModelVersion | None"] = relationship(remote_side=[id])


class AuditRecord(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(255), index=True)
    outcome: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str] = mapped_column(Text, server_default="")


class TrustedKey(Base):
    __tablename__ = "trusted_keys"
    __table_args__ = (UniqueConstraint("team", "key_id", name="uq_trusted_keys_team_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    team: Mapped[str] = mapped_column(String(200))
    key_id: Mapped[str] = mapped_column(String(64))
    public_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class TeamPolicy(Base):
    __tablename__ = "team_policies"

    team: Mapped[str] = mapped_column(String(200), primary_key=True)
    require_signed: Mapped[bool] = mapped_column(Boolean)


class Deployment(Base):
    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(200), index=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="RESTRICT"))
    serving: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))  # active | rolled_back
    actor: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    model_version: Mapped[ModelVersion] = relationship()


# ---- what callers get back (plain data, detached from sessions) ----------------------------


@dataclass(frozen=True)
class VersionRecord:
    name: str
    version: int
    sha256: str
    format: str
    framework: str
    artifact_name: str
    size_bytes: int
    signature: dict
    validation_sha256: str | None
    companions: dict
    metrics: dict
    hardware: dict
    tags: dict
    training_run: str
    dataset_version: str
    experiment: str
    parent: str | None  # "NAME:VERSION"
    owner_team: str
    created_at: datetime
    created_by: str
    artifact_signature: str | None
    signing_key_id: str | None
    content_sha256: str = ""  # the artifact with its companions (artifacts.content_digest): what is signed

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"


@dataclass(frozen=True)
class DeploymentRecord:
    endpoint: str
    version: int
    serving: dict
    state: str
    actor: str
    created_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True)
class EndpointRecord:
    name: str
    live: int | None
    previous: int | None
    serving: dict
    history: list[DeploymentRecord] = field(default_factory=list)


@dataclass(frozen=True)
class ModelSummary:
    name: str
    owner_team: str
    description: str
    latest_version: int
    version_count: int


@dataclass(frozen=True)
class AuditEntry:
    at: datetime
    actor: str
    action: str
    target: str
    outcome: str
    detail: str


def _same_hardware(existing: ModelVersion, hardware: Mapping[str, Any] | None) -> None:
    """The same bytes registered again are the version they already are; asking for other hardware metadata
    with them is a conflict, not a silent return of the old metadata (the digest covers the content only)."""
    if hardware and dict(hardware) != dict(existing.hardware or {}):
        raise Conflict(
            f"model '{existing.model.name}' already holds these bytes as version {existing.version} with hardware "
            f"{dict(existing.hardware or {})}; the same content cannot be registered again with hardware {dict(hardware)}"
        )


def _record(v: ModelVersion) -> VersionRecord:
    parent = f"{v.parent.model.name}:{v.parent.version}" if v.parent is not None else None
    return VersionRecord(
        name=v.model.name, version=v.version, sha256=v.sha256, format=v.format, framework=v.framework,
        artifact_name=v.artifact_name, size_bytes=v.size_bytes, signature=dict(v.signature or {}),
        validation_sha256=v.validation_sha256, companions=dict(v.companions or {}), metrics=dict(v.metrics or {}),
        hardware=dict(v.hardware or {}), tags=dict(v.tags or {}), training_run=v.training_run,
        dataset_version=v.dataset_version, experiment=v.experiment, parent=parent, owner_team=v.model.owner_team,
        created_at=_utc(v.created_at), created_by=v.created_by, artifact_signature=v.artifact_signature,
        signing_key_id=v.signing_key_id, content_sha256=v.content_sha256,
    )  # fmt: skip


def parse_ref(ref: str) -> tuple[str, int | None]:
    """``NAME:VERSION`` or ``NAME`` (latest) -> (name, version or None)."""
    name, _, version = ref.partition(":")
    if not NAME.match(name):
        raise InvalidRequest(f"invalid model name {name!r} (letters, digits, '_', '.', '-'; up to 128)")
    if not version:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise InvalidRequest(f"invalid version {version!r} in {ref!r}: a positive integer")
    return name, int(version)


def check_validation(data: bytes, signature: Mapping[str, Any] | None = None) -> None:
    """A validation set is an ``.npz`` of plain arrays (loaded with ``allow_pickle=False``) whose keys
    name the signature's tensors: every input (``features`` for a single-input model) and any of the
    outputs (``expected`` for a single-output model), with the declared per-row dims. A set that
    names nothing the model takes would warm a deploy up with zeros, so it is refused here."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except Exception as err:
        raise InvalidRequest(f"the validation set must be an .npz of numeric arrays without pickles: {err}") from None
    if signature is None:
        return
    inputs, outputs = signature["inputs"], signature["outputs"]
    aliases = {}
    if len(inputs) == 1:
        aliases["features"] = inputs[0]
    if len(outputs) == 1:
        aliases["expected"] = outputs[0]
    tensors = {t["name"]: t for t in (*inputs, *outputs)}
    violations = []
    for key, array in arrays.items():
        spec = tensors.get(key) or aliases.get(key)
        if spec is None:
            violations.append(Violation(f"validation[{key!r}]", f"names no tensor of the signature (inputs {[t['name'] for t in inputs]}, outputs {[t['name'] for t in outputs]})"))
            continue
        dims = list(spec["dims"])
        if array.ndim != len(dims) + 1 or any(d != -1 and d != n for d, n in zip(dims, array.shape[1:])):
            violations.append(Violation(f"validation[{key!r}]", f"rows of shape {list(array.shape[1:])}, expected {dims} (-1: any)"))
    for t in inputs:
        if t["name"] not in arrays and not (len(inputs) == 1 and "features" in arrays):
            violations.append(Violation(f"validation[{t['name']!r}]", "missing: the validation set must hold every input"))
    if violations:
        raise InvalidRequest(f"the validation set does not match the signature: {violations[0].field} {violations[0].description}", violations)


def _check_model(artifact: bytes | Path, filename: str, declared: str | None) -> str:
    if isinstance(artifact, (bytes, bytearray, memoryview)):
        return safe_formats.check_model(bytes(artifact), filename, declared)
    return safe_formats.check_model_file(Path(artifact), filename or Path(artifact).name, declared)


def _check_companion(data: bytes | Path, filename: str) -> None:
    """A companion's check: bytes and small files whole; a large file must be a safetensors shard
    (recognised by its header, never read whole)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return safe_formats.check_companion(bytes(data), filename)
    path = Path(data)
    if path.stat().st_size <= safe_formats.STREAM_ABOVE:
        return safe_formats.check_companion(path.read_bytes(), filename)
    if safe_formats.check_model_file(path, filename) != safe_formats.SAFETENSORS:
        raise InvalidRequest(f"companion file {filename} over {safe_formats.STREAM_ABOVE >> 20} MiB must be safetensors")
    return None


class Registry:
    def __init__(self, url: str, store: ArtifactStore, *, migrate: bool = True):
        self.url = url
        self.engine = make_engine(url)
        self.store = store
        if migrate:
            migrations.upgrade(self.engine)
        self._session = session_factory(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def url_for_display(self) -> str:
        return display_url(self.url)

    # ---- versions -----------------------------------------------------------------------

    def register(self, name: str, artifact: bytes | Path, **kwargs) -> tuple[VersionRecord, bool]:
        """Register ``artifact`` (bytes, or a local file streamed into the store in chunks) as the
        next version of ``name``; (record, created).

        Bytes already registered under ``name`` return that version with ``created`` False. A
        refusal (unsafe format, bad signature, ...) is audited and raised.
        """
        try:
            return self._register(name, artifact, **kwargs)
        except InferplaneError as err:
            self.audit(kwargs.get("actor", ""), "register", f"{name}:?", "refused", f"{err.reason}: {err.message}")
            raise

    def _register(
        self,
        name: str,
        artifact: bytes | Path,
        *,
        signature: Mapping[str, Any] | None = None,
        filename: str = "",
        format: str | None = None,
        validation: bytes | None = None,
        companions: Mapping[str, bytes | Path] | None = None,
        metrics: Mapping[str, float] | None = None,
        hardware: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        training_run: str = "",
        dataset_version: str = "",
        experiment: str = "",
        parent: str | None = None,
        owner_team: str = "",
        description: str = "",
        artifact_signature: str | None = None,
        actor: str = "",
    ) -> tuple[VersionRecord, bool]:
        parse_ref(name)
        fmt = _check_model(artifact, filename, format or None)
        if signature is None and fmt == safe_formats.SAFETENSORS:
            signature = LLM_SIGNATURE  # an LLM speaks the engine's tensors
        if signature is None:
            raise InvalidRequest(f"a {fmt} model needs a signature (its inputs and outputs)")
        declared = check_signature(signature)
        typed_schema.check_declared(name, declared)  # the feature names make a valid typed API
        companions = dict(companions or {})
        for cname, cdata in companions.items():
            if not COMPANION.match(cname):
                raise InvalidRequest(f"companion file name {cname!r} must be a plain .json/.txt/.jinja/.model/.safetensors name")
            _check_companion(cdata, cname)
        if companions and fmt != safe_formats.SAFETENSORS:
            raise InvalidRequest("companion files (config, tokenizer) belong to safetensors models only")
        if validation is not None:
            check_validation(validation, declared)
        digest, size = self._put(artifact)
        companion_digests = {cname: self._put(cdata)[0] for cname, cdata in sorted(companions.items())}
        content = content_digest(digest, companion_digests)  # the version: weights, config and tokenizer as one
        with self._session() as session:
            model = session.scalar(select(Model).where(Model.name == name))
            existing = None
            if model is not None:
                existing = session.scalar(select(ModelVersion).where(ModelVersion.model_id == model.id, ModelVersion.content_sha256 == content))
            if existing is not None:
                _same_hardware(existing, hardware)
                return _record(existing), False
            team = owner_team or (model.owner_team if model is not None else "")
            if model is not None and owner_team and model.owner_team and owner_team != model.owner_team:
                raise Conflict(f"model '{name}' belongs to team '{model.owner_team}', not '{owner_team}'")
            key_id = self._check_signed(session, team, content, artifact_signature)
            parent_row = self._parent(session, name, parent) if parent else None
        validation_digest = self.store.put(validation) if validation is not None else None
        for _attempt in range(5):
            with self._session() as session:
                try:
                    model = session.scalar(select(Model).where(Model.name == name))
                    if model is None:
                        model = Model(name=name, owner_team=owner_team, description=description)
                        session.add(model)
                        session.flush()
                    elif owner_team and not model.owner_team:
                        model.owner_team = owner_team
                    existing = session.scalar(
                        select(ModelVersion).where(ModelVersion.model_id == model.id, ModelVersion.content_sha256 == content)
                    )
                    if existing is not None:
                        _same_hardware(existing, hardware)
                        return _record(existing), False
                    latest = session.scalar(select(func.max(ModelVersion.version)).where(ModelVersion.model_id == model.id))
                    row = ModelVersion(
                        model=model, version=(latest or 0) + 1, sha256=digest, content_sha256=content, format=fmt,
                        framework=safe_formats.FRAMEWORKS[fmt], artifact_name=safe_formats.FILE_NAMES[fmt],
                        size_bytes=size, signature=declared, validation_sha256=validation_digest,
                        companions=companion_digests, metrics={k: float(v) for k, v in (metrics or {}).items()},
                        hardware=dict(hardware or {}), tags={k: str(v) for k, v in (tags or {}).items()},
                        training_run=training_run, dataset_version=dataset_version, experiment=experiment,
                        parent_id=parent_row.id if parent_row is not None else None, created_by=actor,
                        artifact_signature=artifact_signature if key_id else None, signing_key_id=key_id,
                    )  # fmt: skip
                    session.add(row)
                    session.flush()
                    record = _record(row)
                    session.add(AuditRecord(actor=actor or "unknown", action="register", target=record.ref, outcome="ok",
                                            detail=f"sha256={digest} content={content} format={fmt} size={size}"))  # fmt: skip
                    session.commit()
                    return record, True
                except IntegrityError:
                    session.rollback()  # a concurrent registration took the number (or the bytes): look again
        raise Conflict(f"could not register a version of '{name}': too many concurrent registrations")

    def _put(self, data: bytes | Path) -> tuple[str, int]:
        """Store bytes, or a local file in chunks; (sha256, size)."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            return self.store.put(bytes(data)), len(data)
        return self.store.put_file(Path(data))

    def _parent(self, session: Session, name: str, parent: str) -> ModelVersion:
        pname, pversion = parse_ref(parent) if ":" in parent or not parent.isdigit() else (name, int(parent))
        if pversion is None:
            raise InvalidRequest(f"the parent {parent!r} must name a version (NAME:VERSION)")
        row = self._version_row(session, pname, pversion)
        return row

    def _check_signed(self, session: Session, team: str, digest: str, artifact_signature: str | None) -> str | None:
        """The id of the trusted key that signed ``digest``; PermissionDenied when one is required and none does."""
        policy = session.get(TeamPolicy, team) if team else None
        required = bool(policy and policy.require_signed)
        if not artifact_signature:
            if required:
                raise PermissionDenied(f"team '{team}' requires signed artifacts; sign sha256:{digest} with a trusted Ed25519 key")
            return None
        keys = session.scalars(select(TrustedKey).where(TrustedKey.team == team)).all() if team else []
        for key in keys:
            if signing.verify_digest(key.public_key, digest, artifact_signature):
                return key.key_id
        if required or keys:
            raise PermissionDenied(f"the signature over sha256:{digest} does not verify against any trusted key of team '{team}'")
        raise InvalidRequest(f"a signature was given but team '{team or '(none)'}' has no trusted keys to check it against")

    def verify_signed(self, name: str, version: int) -> None:
        """Check again (at deploy time) that a version of a team requiring signatures is still signed by a trusted key."""
        with self._session() as session:
            row = self._version_row(session, name, version)
            self._check_signed(session, row.model.owner_team, row.content_sha256, row.artifact_signature)

    def _version_row(self, session: Session, name: str, version: int | None) -> ModelVersion:
        query = select(ModelVersion).join(Model).where(Model.name == name)
        if version is None:
            row = session.scalar(query.order_by(ModelVersion.version.desc()).limit(1))
        else:
            row = session.scalar(query.where(ModelVersion.version == version))
        if row is None:
            what = f"model '{name}'" if version is None else f"version {version} of model '{name}'"
            raise ModelNotFound(f"{what} is not registered")
        return row

    def get(self, name: str, version: int | None = None) -> VersionRecord:
        with self._session() as session:
            return _record(self._version_row(session, name, version))

    def list_models(self) -> list[ModelSummary]:
        with self._session() as session:
            rows = session.execute(
                select(Model, func.max(ModelVersion.version), func.count(ModelVersion.id))
                .join(ModelVersion, isouter=True)
                .group_by(Model.id)
                .order_by(Model.name)
            ).all()
            return [ModelSummary(m.name, m.owner_team, m.description, latest or 0, count) for m, latest, count in rows]

    def list_versions(self, name: str) -> list[VersionRecord]:
        with self._session() as session:
            rows = session.scalars(select(ModelVersion).join(Model).where(Model.name == name).order_by(ModelVersion.version)).all()
            if not rows:
                raise ModelNotFound(f"model '{name}' is not registered")
            return [_record(r) for r in rows]

    def lineage(self, name: str, version: int | None = None) -> list[VersionRecord]:
        """The version and its ancestors, newest first (parent links across models followed)."""
        with self._session() as session:
            row: ModelVersion | None = self._version_row(session, name, version)
            chain, seen = [], set()
            while row is not None and row.id not in seen:
                seen.add(row.id)
                chain.append(_record(row))
                row = row.parent
            return chain

    def read_artifact(self, record: VersionRecord) -> bytes:
        return self.store.get(record.sha256)

    # ---- keys and policies --------------------------------------------------------------

    def trust_key(self, team: str, public_pem: str, actor: str = "") -> str:
        kid = signing.key_id(public_pem)
        with self._session() as session:
            exists = session.scalar(select(TrustedKey).where(TrustedKey.team == team, TrustedKey.key_id == kid))
            if exists is None:
                session.add(TrustedKey(team=team, key_id=kid, public_key=public_pem))
            session.add(AuditRecord(actor=actor or "unknown", action="trust-key", target=f"team:{team}", outcome="ok", detail=f"key_id={kid}"))
            session.commit()
        return kid

    def set_require_signed(self, team: str, required: bool, actor: str = "") -> None:
        with self._session() as session:
            policy = session.get(TeamPolicy, team)
            if policy is None:
                session.add(TeamPolicy(team=team, require_signed=required))
            else:
                policy.require_signed = required
            session.add(AuditRecord(actor=actor or "unknown", action="require-signed", target=f"team:{team}", outcome="ok", detail=f"require_signed={required}"))
            session.commit()

    # ---- deployments --------------------------------------------------------------------

    def _active(self, session: Session, endpoint: str) -> list[Deployment]:
        return list(
            session.scalars(
                select(Deployment).where(Deployment.endpoint == endpoint, Deployment.state == "active").order_by(Deployment.id.desc())
            ).all()
        )

    def record_deployment(self, endpoint: str, name: str, version: int, serving: Mapping[str, Any], actor: str) -> None:
        with self._session() as session:
            row = self._version_row(session, name, version)
            session.add(Deployment(endpoint=endpoint, model_version_id=row.id, serving=dict(serving), state="active", actor=actor or "unknown"))
            session.commit()

    def record_rollback(self, endpoint: str) -> None:
        """Pop the live deployment off the endpoint's stack."""
        with self._session() as session:
            active = self._active(session, endpoint)
            if len(active) < 2:
                raise Conflict(f"endpoint '{endpoint}' has no previous version to roll back to")
            active[0].state = "rolled_back"
            active[0].ended_at = _now()
            session.commit()

    def endpoint(self, endpoint: str, history: int = 20) -> EndpointRecord:
        with self._session() as session:
            active = self._active(session, endpoint)
            rows = session.scalars(select(Deployment).where(Deployment.endpoint == endpoint).order_by(Deployment.id.desc()).limit(max(history, 1))).all()
            if not rows:
                raise ModelNotFound(f"endpoint '{endpoint}' has never been deployed")
            live = active[0] if active else None
            previous = next((d for d in active[1:] if live is None or d.model_version.version != live.model_version.version), None)
            return EndpointRecord(
                name=endpoint,
                live=live.model_version.version if live else None,
                previous=previous.model_version.version if previous else None,
                # serving options belong to the endpoint: the newest deploy's stay in effect across rollbacks
                serving=dict(rows[0].serving),
                history=[
                    DeploymentRecord(endpoint, d.model_version.version, dict(d.serving), d.state, d.actor, _utc(d.created_at), _utc(d.ended_at))
                    for d in rows[:history]
                ],
            )

    def endpoints(self) -> list[EndpointRecord]:
        with self._session() as session:
            names = session.scalars(select(Deployment.endpoint).distinct().order_by(Deployment.endpoint)).all()
        return [self.endpoint(n, history=0) for n in names]

    # ---- audit --------------------------------------------------------------------------

    def audit(self, actor: str, action: str, target: str, outcome: str, detail: str = "") -> None:
        with self._session() as session:
            session.add(AuditRecord(actor=actor or "unknown", action=action, target=target, outcome=outcome, detail=detail[:4000]))
            session.commit()

    def audit_log(self, limit: int = 50, target: str | None = None) -> list[AuditEntry]:
        with self._session() as session:
            query = select(AuditRecord).order_by(AuditRecord.id.desc()).limit(limit)
            if target:
                query = query.where(AuditRecord.target.like(f"{target}%"))
            return [AuditEntry(_utc(r.at), r.actor, r.action, r.target, r.outcome, r.detail) for r in session.scalars(query).all()]
