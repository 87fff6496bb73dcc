"""``inferplane tenants bind|unbind|identities``, ``inferplane data purge|retention|add-key|rewrap`` and
``inferplane tls dev-certs`` (issue 23).

- ``tenants bind IDENTITY --tenant T``: a client certificate's SPIFFE ID (SAN URI) or subject
  authenticates as tenant ``T`` under mTLS, like one of its API keys (the running frontend picks it
  up at its next key refresh).
- ``data purge --tenant T``: erase the tenant's stored payload logs, shadow records and batch files
  (right to erasure); the erasure is written to the audit log with who asked.
- ``data retention``: one retention pass now (the frontend runs one every ``retention_interval_s``).
- ``data add-key --key-file F`` / ``data rewrap``: rotate the encryption key (old data stays readable
  by the old key; ``rewrap`` re-seals the stored records' data keys under the new primary).

They work on the databases and folders of the settings directly (``INFERPLANE_*`` / flags), like the
other administrative commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

data_app = typer.Typer(help="Stored data: erasure by tenant, retention, encryption keys.", no_args_is_help=True)

DbUrl = Annotated[Optional[str], typer.Option("--database-url", help="SQLAlchemy URL [env INFERPLANE_DATABASE_URL].")]


def _settings(**given):
    from server.settings import Settings

    return Settings(**{k: v for k, v in given.items() if v})


def _keys(settings):
    from server.control.registry.envelope import EncryptionError, KeyRing

    try:
        return KeyRing.from_settings(settings)
    except EncryptionError as err:
        raise typer.BadParameter(str(err)) from None


# ---- certificate identities -> tenants ------------------------------------------------------------


def bind(
    identity: Annotated[str, typer.Argument(help="A SPIFFE ID / SAN URI (spiffe://domain/path) or a subject (CN=svc,O=Acme).")],
    tenant: Annotated[str, typer.Option(help="The tenant the certificate authenticates as (created if new).")],
    model: Annotated[Optional[list[str]], typer.Option("--model", help="Grant this model when the tenant is new (repeatable).")] = None,
    database_url: DbUrl = None,
) -> None:
    """Bind a client-certificate identity to a tenant (mTLS): it authenticates like the tenant's API key."""
    from server.tenancy.store import TenancyStore

    store = TenancyStore(database_url or _settings().tenancy_url)
    fields = {"models": model} if model and tenant not in {t.name for t in store.tenants()} else {}
    try:
        binding_id, canonical = store.bind_identity(tenant, identity, **fields)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(json.dumps({"binding_id": binding_id, "identity": canonical, "tenant": tenant}))


def unbind(identity: Annotated[str, typer.Argument(help="The identity (or its binding id).")], database_url: DbUrl = None) -> None:
    """Remove a certificate identity's binding (the frontend stops accepting it at its next key refresh)."""
    from server.tenancy.store import TenancyStore

    if not TenancyStore(database_url or _settings().tenancy_url).unbind_identity(identity):
        typer.echo(f"no binding for {identity!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"unbound {identity}")


def identities(tenant: Annotated[Optional[str], typer.Option()] = None, database_url: DbUrl = None) -> None:
    """The certificate identities bound to tenants."""
    from server.tenancy.store import TenancyStore

    for row in TenancyStore(database_url or _settings().tenancy_url).identities(tenant):
        typer.echo(json.dumps(row))


# ---- stored data ----------------------------------------------------------------------------------


@data_app.command("purge")
def purge(
    tenant: Annotated[str, typer.Option(help="The tenant whose stored payloads, shadow records and batch files are erased.")],
    actor: Annotated[Optional[str], typer.Option(help="Who asked (the audit record's actor) [default: $USER].")] = None,
    database_url: DbUrl = None,
) -> None:
    """Erase a tenant's stored data (right to erasure); the erasure is recorded in the audit log."""
    from server.cli.options import actor_name
    from server.control.registry import retention

    s = _settings(database_url=database_url)
    try:
        counts = retention.purge_tenant(s, tenant, actor_name(actor), keys=_keys(s))
    except (ValueError, RuntimeError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"tenant": tenant, "deleted": {k: v for k, v in counts.items() if v is not None}}))


@data_app.command("retention")
def retention_pass(database_url: DbUrl = None) -> None:
    """One retention pass now: each kind with a ``retention_days`` entry loses what is older (audited)."""
    import asyncio

    from server.control.registry.retention import RetentionJob, _audit_writer

    s = _settings(database_url=database_url)
    write = _audit_writer(s)
    results = asyncio.run(RetentionJob(s, lambda record: write([record])).run_once(_keys(s)))
    typer.echo(json.dumps({r.target: {"days": r.days, "deleted": r.removed} for r in results}))


@data_app.command("add-key")
def add_key(
    key_file: Annotated[Path, typer.Option(help="The KMS-style key file (created if missing); the new key becomes primary.")],
    key_id: Annotated[Optional[str], typer.Option(help="The new key's id [default: derived from the key].")] = None,
) -> None:
    """Rotate: a fresh AES-256 key, primary from now on; the old keys stay and still decrypt."""
    from server.control.registry.envelope import EncryptionError
    from server.control.registry.envelope import add_key as add

    try:
        typer.echo(f"added key {add(key_file, key_id)} to {key_file} (primary)")
    except EncryptionError as err:
        raise typer.BadParameter(str(err)) from None


@data_app.command("rewrap")
def rewrap() -> None:
    """Re-seal the stored payload logs' and shadow records' data keys under the primary key."""
    from server.control.registry.records import RecordFiles

    s = _settings()
    keys = _keys(s)
    if keys is None:
        raise typer.BadParameter("no encryption key is set (INFERPLANE_ENCRYPTION_KEY or INFERPLANE_ENCRYPTION_KEY_FILE)")
    counts = {
        "payload_logs": RecordFiles(s.payload_log_destination, "payloads-", keys).rewrap(),
        "shadow_records": RecordFiles(s.shadow_record_destination, "shadow-", keys).rewrap(),
    }
    typer.echo(json.dumps({"rewrapped": counts, "primary": keys.primary}))


def mount(app: typer.Typer) -> None:
    from server.cli import certs
    from server.cli.tenancy import tenants_app

    tenants_app.command("bind")(bind)
    tenants_app.command("unbind")(unbind)
    tenants_app.command("identities")(identities)
    app.add_typer(data_app, name="data")
    certs.mount(app)
