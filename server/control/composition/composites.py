"""Composite endpoints in the registry: one versioned unit with lineage to its members.

A composite version is a row of ``model_versions`` like any model's (immutable, numbered, its
"artifact" the spec as canonical JSON, format ``inferplane-composite``, its signature the derived
one) plus one ``composite_members`` row per model / endpoint node naming the member version it
pins. Registering resolves every unpinned member to a version — the endpoint's live deployed
version, else the newest registered one, else (a model served but never registered) the version
the lookup finds — and stores the spec with those versions written in, so a composite version
always means the same members. The same spec with the same members registers as the existing
version (idempotent, by digest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ForeignKey, Index, Integer, String, UniqueConstraint, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from server.control.composition.composition import CompositeSpec, Lookup, Member, parse_spec
from server.control.composition.composition_compiler import Compiled, compile_spec
from server.control.registry.registry import AuditRecord, Base, Model, ModelVersion, Registry, VersionRecord, _record
from server.errors import Conflict, InferplaneError, InvalidRequest, ModelNotFound

COMPOSITE_FORMAT = "inferplane-composite"
COMPOSITE_FRAMEWORK = "inferplane"
ARTIFACT_NAME = "composite.json"


class CompositeMember(Base):
    __tablename__ = "composite_members"
    __table_args__ = (
        UniqueConstraint("composite_version_id", "node", name="uq_composite_members_node"),
        Index("ix_composite_members_composite", "composite_version_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    composite_version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    member_version_id: Mapped[int | None] = mapped_column(ForeignKey("model_versions.id", ondelete="RESTRICT"), nullable=True)



@dataclass(frozen=True)
class MemberRecord:
    node: str
    model: str
    version: int | None
    registered: bool
    sha256: str | None
    format: str | None


def is_composite(record: VersionRecord) -> bool:
    return record.format == COMPOSITE_FORMAT


def registry_lookup(registry: Registry, fallback: Lookup | None = None) -> Lookup:
    """Members from the registry: a pinned version, else the endpoint's live one, else the newest
    registered; a model the registry does not know comes from ``fallback`` (the repository)."""

    def lookup(name: str, version: int | None) -> Member:
        try:
            if version is None:
                try:
                    live = registry.endpoint(name, 0).live
                except ModelNotFound:
                    live = None
                record = registry.get(name, live)
            else:
                record = registry.get(name, version)
        except ModelNotFound:
            if fallback is None:
                raise
            return fallback(name, version)
        if is_composite(record):
            raise InvalidRequest(f"'{name}' is a composite; a node calls a model (nest composites by listing their nodes)")
        member = Member.from_signature(name, record.version, record.signature)
        if fallback is not None:  # the served config knows the kind (embedding, llm), optional inputs, decoupling
            try:
                served = fallback(name, record.version)
                return Member(name, record.version, member.inputs, member.outputs, member.max_batch_size,
                              served.optional_inputs, served.decoupled, served.kind)  # fmt: skip
            except InferplaneError:
                pass
        return member

    return lookup


def pinned(spec: CompositeSpec, compiled: Compiled) -> CompositeSpec:
    """The spec with every model node's version written in (what a registered version means)."""
    versions = {m["node"]: m["version"] for m in compiled.members}
    doc = spec.model_dump(mode="json", exclude_none=True)
    for node in doc["nodes"]:
        if "model" in node and "endpoint" not in node and versions.get(node["name"]) is not None:
            node["version"] = versions[node["name"]]
    return CompositeSpec.model_validate(doc)


def register_composite(
    registry: Registry, spec: CompositeSpec, lookup: Lookup, *, actor: str = "", owner_team: str = "", description: str = ""
) -> tuple[VersionRecord, bool, Compiled]:
    """Register ``spec`` as the next version of its name; (record, created, compiled)."""
    name = spec.name
    try:
        compiled = compile_spec(spec, 0, lookup)  # type-checks against the members; version numbers later
        spec = pinned(spec, compiled)
        return (*_insert(registry, spec, compiled, actor, owner_team, description or spec.description), compiled)
    except InferplaneError as err:
        registry.audit(actor, "register", f"{name}:?", "refused", f"{err.reason}: {err.message}")
        raise


def _insert(registry: Registry, spec: CompositeSpec, compiled: Compiled, actor: str, owner_team: str, description: str):
    data = spec.canonical()
    digest = registry.store.put(data)
    for _attempt in range(5):
        with registry._session() as session:  # noqa: SLF001 - the registry's own session, same room
            try:
                model = session.scalar(select(Model).where(Model.name == spec.name))
                if model is None:
                    model = Model(name=spec.name, owner_team=owner_team, description=description)
                    session.add(model)
                    session.flush()
                else:
                    if model.versions and not any(v.format == COMPOSITE_FORMAT for v in model.versions):
                        raise Conflict(f"'{spec.name}' is a registered model, not a composite; give the composite a name of its own")
                    if owner_team and model.owner_team and owner_team != model.owner_team:
                        raise Conflict(f"model '{spec.name}' belongs to team '{model.owner_team}', not '{owner_team}'")
                existing = session.scalar(select(ModelVersion).where(ModelVersion.model_id == model.id, ModelVersion.content_sha256 == digest))
                if existing is not None:
                    return _record(existing), False
                latest = session.scalar(select(func.max(ModelVersion.version)).where(ModelVersion.model_id == model.id))
                row = ModelVersion(
                    model=model, version=(latest or 0) + 1, sha256=digest, content_sha256=digest, format=COMPOSITE_FORMAT, framework=COMPOSITE_FRAMEWORK,
                    artifact_name=ARTIFACT_NAME, size_bytes=len(data), signature=compiled.signature, validation_sha256=None,
                    companions={}, metrics={}, hardware={}, tags={"kind": "composite", "mode": compiled.mode}, created_by=actor,
                )  # fmt: skip
                session.add(row)
                session.flush()
                for m in compiled.members:
                    member_row = None
                    if m["version"] is not None:
                        member_row = session.scalar(
                            select(ModelVersion).join(Model).where(Model.name == m["model"], ModelVersion.version == m["version"])
                        )
                    session.add(CompositeMember(
                        composite_version_id=row.id, node=m["node"], model=m["model"], version=m["version"],
                        member_version_id=member_row.id if member_row is not None else None,
                    ))  # fmt: skip
                record = _record(row)
                members = ", ".join(f"{m['node']}={m['model']}:{m['version'] or 'latest'}" for m in compiled.members)
                session.add(AuditRecord(actor=actor or "unknown", action="register", target=record.ref, outcome="ok",
                                        detail=f"composite mode={compiled.mode} sha256={digest} members: {members}"[:4000]))  # fmt: skip
                session.commit()
                return record, True
            except IntegrityError:
                session.rollback()
    raise Conflict(f"could not register a version of '{spec.name}': too many concurrent registrations")


def spec_of(registry: Registry, record: VersionRecord) -> CompositeSpec:
    if not is_composite(record):
        raise InvalidRequest(f"{record.ref} is a {record.format} model, not a composite")
    return parse_spec(registry.store.get(record.sha256), where=record.ref)


def members(registry: Registry, name: str, version: int | None = None) -> tuple[VersionRecord, list[MemberRecord]]:
    """A composite version and the member versions it pins (its lineage)."""
    record = registry.get(name, version)
    if not is_composite(record):
        raise InvalidRequest(f"{record.ref} is a {record.format} model, not a composite")
    with registry._session() as session:  # noqa: SLF001
        row = session.scalar(select(ModelVersion).join(Model).where(Model.name == name, ModelVersion.version == record.version))
        found = session.scalars(select(CompositeMember).where(CompositeMember.composite_version_id == row.id).order_by(CompositeMember.id)).all()
        out = []
        for m in found:
            member = session.get(ModelVersion, m.member_version_id) if m.member_version_id else None
            out.append(MemberRecord(m.node, m.model, m.version, member is not None, member.sha256 if member else None, member.format if member else None))
    return record, out


def composites(registry: Registry) -> list[dict[str, Any]]:
    """Every registered composite: name, versions, newest mode."""
    out = []
    for summary in registry.list_models():
        versions = registry.list_versions(summary.name)
        if versions and is_composite(versions[-1]):
            out.append({"name": summary.name, "versions": [v.version for v in versions], "mode": versions[-1].tags.get("mode", ""),
                        "description": summary.description})  # fmt: skip
    return out
