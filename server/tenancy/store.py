"""Persistence for tenancy: tenants, hashed API keys, usage records (SQLAlchemy 2, sync).

Tables are prefixed ``tenancy_`` and live in the platform's database
(``INFERPLANE_DATABASE_URL``; SQLite by default, PostgreSQL by URL). The Alembic migrations in
``server/migrations`` (revisions 0003, 0005) create them, with the registry's tables: opening a store
brings its database to the newest revision, exactly as opening the registry does. Every call here blocks:
the server calls it through ``asyncio.to_thread`` (key refresh, usage flush), the CLI directly.
Nothing on the request path reads or writes the database.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import JSON, BigInteger, Boolean, Float, Index, Integer, String, UniqueConstraint, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from server import migrations
from server.db import make_engine
from server.settings import Settings
from server.tenancy.identity import ALL_MODELS, DEFAULT_PLAN, PLAN_WEIGHTS, KeyEntry, Tenant, hash_key, new_key
from server.tenancy.quota_policy import Quota
from server.tenancy.tls import canonical_identity


class Base(DeclarativeBase):
    pass


class TenantRow(Base):
    __tablename__ = "tenancy_tenants"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    team: Mapped[str] = mapped_column(String(128), default="")
    plan: Mapped[str] = mapped_column(String(32), default=DEFAULT_PLAN)
    models: Mapped[list] = mapped_column(JSON, default=lambda: [ALL_MODELS])
    quota: Mapped[dict] = mapped_column(JSON, default=dict)
    model_quotas: Mapped[dict] = mapped_column(JSON, default=dict)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)


class KeyRow(Base):
    __tablename__ = "tenancy_keys"
    key_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    rotated_to: Mapped[str | None] = mapped_column(String(16), nullable=True)
    __table_args__ = (UniqueConstraint("key_hash", name="uq_tenancy_keys_key_hash"),)


class IdentityRow(Base):
    """A client-certificate identity bound to a tenant (mTLS; revision 0009)."""

    __tablename__ = "tenancy_identities"
    binding_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    identity: Mapped[str] = mapped_column(String(1024), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class UsageRow(Base):
    __tablename__ = "tenancy_usage"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float)  # start of the flush period (unix seconds)
    tenant: Mapped[str] = mapped_column(String(128))
    team: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    version: Mapped[str] = mapped_column(String(32))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # input + output (rows before 0005: the only count)
    compute_us: Mapped[int] = mapped_column(BigInteger, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # 0005
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    traffic_class: Mapped[str] = mapped_column(String(16), server_default="realtime")  # 0008: realtime | batch
    __table_args__ = (Index("ix_tenancy_usage_ts", "ts"),)
    __mapper_args__ = {"eager_defaults": False}  # never RETURNING traffic_class (a database before 0008 lacks it)


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str
    created_at: float
    revoked_at: float | None
    expires_at: float | None

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None:
            return "expired" if self.expires_at <= time.time() else "expiring"
        return "active"


@dataclass(frozen=True)
class UsageRecord:
    ts: float
    tenant: str
    team: str
    model: str
    version: str
    requests: int
    tokens: int  # input_tokens + output_tokens
    compute_us: int
    input_tokens: int = 0  # LLM prompt / embedding input
    output_tokens: int = 0  # LLM completion
    traffic_class: str = "realtime"  # or "batch": a batch job's rows (server.control.batches.batches)


def _usage_columns(record: UsageRecord) -> dict:
    """A record's columns; ``traffic_class`` only when not the server default (a writer against a
    database before 0008 keeps working for real-time usage)."""
    columns = dict(record.__dict__)
    if columns.get("traffic_class") == "realtime":
        del columns["traffic_class"]
    return columns


class TenancyStore:
    """Tenants, keys and usage in one database; ``migrate=False`` when the schema is managed elsewhere."""

    def __init__(self, url: str | None = None, *, engine: Engine | None = None, migrate: bool = True):
        if url is None:  # the settings' URL (flags > INFERPLANE_* environment > the data dir's SQLite)
            url = Settings().tenancy_url
        self.url = url
        if engine is None:
            engine = make_engine(self.url)  # the registry's engine rules (SQLite pragmas, psycopg 3)
        self.engine = engine
        if migrate:
            migrations.upgrade(engine)  # the schema comes from Alembic (0003), never create_all

    def close(self) -> None:
        self.engine.dispose()

    # ---- tenants --------------------------------------------------------------------------

    def put_tenant(
        self,
        name: str,
        *,
        team: str | None = None,
        plan: str | None = None,
        models: Sequence[str] | None = None,
        quota: Quota | None = None,
        model_quotas: dict[str, Quota] | None = None,
        admin: bool | None = None,
    ) -> Tenant:
        """Create a tenant or change the fields given (None leaves a field as it is)."""
        if plan is not None and plan not in PLAN_WEIGHTS:
            raise ValueError(f"unknown plan {plan!r} (plans: {', '.join(PLAN_WEIGHTS)})")
        with Session(self.engine) as s, s.begin():
            row = s.get(TenantRow, name)
            if row is None:
                row = TenantRow(name=name, team=team or name, plan=plan or DEFAULT_PLAN, models=[ALL_MODELS], quota={}, model_quotas={}, admin=False)
                s.add(row)
            if team is not None:
                row.team = team
            if plan is not None:
                row.plan = plan
            if models is not None:
                row.models = sorted(set(models))
            if quota is not None:
                row.quota = quota.to_dict()
            if model_quotas is not None:
                row.model_quotas = {m: q.to_dict() for m, q in model_quotas.items()}
            if admin is not None:
                row.admin = admin
            s.flush()
            return _tenant(row)

    def tenants(self) -> list[Tenant]:
        with Session(self.engine) as s:
            return [_tenant(r) for r in s.scalars(select(TenantRow).order_by(TenantRow.name))]

    # ---- keys -----------------------------------------------------------------------------

    def create_key(self, tenant: str, pepper: bytes, **tenant_fields) -> tuple[str, str]:
        """A new key for ``tenant`` (created with ``tenant_fields`` if new); returns ``(key_id, key)``."""
        self.put_tenant(tenant, **tenant_fields)
        key_id, key = new_key()
        with Session(self.engine) as s, s.begin():
            s.add(KeyRow(key_id=key_id, key_hash=hash_key(key, pepper), tenant=tenant, created_at=time.time()))
        return key_id, key

    def revoke_key(self, key_id: str) -> bool:
        with Session(self.engine) as s, s.begin():
            result = s.execute(
                update(KeyRow).where(KeyRow.key_id == key_id, KeyRow.revoked_at.is_(None)).values(revoked_at=time.time())
            )
            return result.rowcount > 0

    def rotate_key(self, key_id: str, pepper: bytes, grace_s: float = 0.0) -> tuple[str, str]:
        """A new key for the same tenant; the old one stops working after ``grace_s`` seconds."""
        with Session(self.engine) as s, s.begin():
            old = s.get(KeyRow, key_id)
            if old is None or old.revoked_at is not None:
                raise KeyError(f"no active key {key_id!r}")
            new_id, key = new_key()
            s.add(KeyRow(key_id=new_id, key_hash=hash_key(key, pepper), tenant=old.tenant, created_at=time.time()))
            now = time.time()
            if grace_s > 0:
                old.expires_at = now + grace_s if old.expires_at is None else min(old.expires_at, now + grace_s)
            else:
                old.revoked_at = now
            old.rotated_to = new_id
        return new_id, key

    def keys(self, tenant: str | None = None) -> list[KeyInfo]:
        with Session(self.engine) as s:
            q = select(KeyRow).order_by(KeyRow.tenant, KeyRow.created_at)
            if tenant is not None:
                q = q.where(KeyRow.tenant == tenant)
            return [KeyInfo(r.key_id, r.tenant, r.created_at, r.revoked_at, r.expires_at) for r in s.scalars(q)]

    def snapshot(self) -> tuple[list[Tenant], list[KeyEntry]]:
        """Every tenant and every key that is not revoked or expired (what the KeyRing loads)."""
        now = time.time()
        with Session(self.engine) as s:
            tenants = [_tenant(r) for r in s.scalars(select(TenantRow))]
            rows = s.scalars(select(KeyRow).where(KeyRow.revoked_at.is_(None)))
            keys = [
                KeyEntry(r.key_id, r.key_hash, r.tenant, r.expires_at)
                for r in rows
                if r.expires_at is None or r.expires_at > now
            ]
            bound = s.scalars(select(IdentityRow).where(IdentityRow.revoked_at.is_(None)))
            keys += [KeyEntry(r.binding_id, "", r.tenant, identity=r.identity) for r in bound]
        return tenants, keys

    # ---- certificate identities (mTLS) ----------------------------------------------------

    def bind_identity(self, tenant: str, identity: str, **tenant_fields) -> tuple[str, str]:
        """Bind a client-certificate identity (a SPIFFE ID / SAN URI, or a subject) to ``tenant``
        (created with ``tenant_fields`` if new); returns ``(binding_id, canonical identity)``. An
        identity names one tenant: binding it again moves it."""
        canonical = canonical_identity(identity)
        self.put_tenant(tenant, **tenant_fields)
        binding_id = "x509" + secrets.token_hex(2)
        now = time.time()
        with Session(self.engine) as s, s.begin():
            s.execute(update(IdentityRow).where(IdentityRow.identity == canonical, IdentityRow.revoked_at.is_(None)).values(revoked_at=now))
            s.add(IdentityRow(binding_id=binding_id, identity=canonical, tenant=tenant, created_at=now))
        return binding_id, canonical

    def unbind_identity(self, identity_or_id: str) -> bool:
        try:
            canonical = canonical_identity(identity_or_id)
        except ValueError:
            canonical = identity_or_id
        with Session(self.engine) as s, s.begin():
            result = s.execute(
                update(IdentityRow)
                .where((IdentityRow.binding_id == identity_or_id) | (IdentityRow.identity == canonical), IdentityRow.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
            return result.rowcount > 0

    def identities(self, tenant: str | None = None) -> list[dict]:
        with Session(self.engine) as s:
            q = select(IdentityRow).where(IdentityRow.revoked_at.is_(None)).order_by(IdentityRow.tenant, IdentityRow.created_at)
            if tenant is not None:
                q = q.where(IdentityRow.tenant == tenant)
            return [{"binding_id": r.binding_id, "identity": r.identity, "tenant": r.tenant, "created_at": r.created_at} for r in s.scalars(q)]

    # ---- usage ----------------------------------------------------------------------------

    def write_usage(self, records: Iterable[UsageRecord]) -> int:
        rows = [UsageRow(**_usage_columns(r)) for r in records]
        if rows:
            with Session(self.engine) as s, s.begin():
                s.add_all(rows)
        return len(rows)

    def usage(self, by: str = "tenant", since: float = 0.0, until: float | None = None) -> list[dict]:
        """Sums of requests, input/output/total tokens and compute per ``by`` (tenant | team | model | model_version)."""
        columns = {
            "tenant": (UsageRow.tenant,),
            "team": (UsageRow.team,),
            "model": (UsageRow.model,),
            "model_version": (UsageRow.model, UsageRow.version),
            "tenant_model": (UsageRow.tenant, UsageRow.model),
            "team_model": (UsageRow.team, UsageRow.model),
        }
        if by not in columns:
            raise ValueError(f"--by must be one of {', '.join(columns)}")
        keys = columns[by]
        q = select(
            *keys,
            func.sum(UsageRow.requests),
            func.sum(UsageRow.input_tokens),
            func.sum(UsageRow.output_tokens),
            func.sum(UsageRow.tokens),
            func.sum(UsageRow.compute_us),
        ).where(UsageRow.ts >= since)
        if until is not None:
            q = q.where(UsageRow.ts < until)
        q = q.group_by(*keys).order_by(*keys)
        out = []
        with Session(self.engine) as s:
            for row in s.execute(q):
                d = {k.key: v for k, v in zip(keys, row[: len(keys)])}
                requests, input_tokens, output_tokens, tokens, compute_us = (int(v or 0) for v in row[len(keys) :])
                d.update(requests=requests, input_tokens=input_tokens, output_tokens=output_tokens, tokens=tokens, compute_us=compute_us)
                out.append(d)
        return out


def _tenant(row: TenantRow) -> Tenant:
    return Tenant(
        name=row.name,
        team=row.team,
        plan=row.plan,
        models=frozenset(row.models or []),
        quota=Quota.from_dict(row.quota),
        model_quotas={m: Quota.from_dict(q) for m, q in (row.model_quotas or {}).items()},
        admin=bool(row.admin),
    )

