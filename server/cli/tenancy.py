"""``inferplane keys|tenants|usage``: API keys, tenant grants and quotas, usage reports (cost: ``server/cli/cost.py``).

They work on the database directly (``--database-url`` / ``INFERPLANE_DATABASE_URL``); a running
frontend picks changes up on its next key refresh (``INFERPLANE_AUTH_REFRESH_S``). Keys are hashed
with ``INFERPLANE_KEY_PEPPER``: give the CLI the same one as the server.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
from typing import Annotated, Optional

import typer

keys_app = typer.Typer(help="API keys: create, revoke, rotate, list (stored hashed).", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants: team, plan, granted models, quotas.", no_args_is_help=True)

DbUrl = Annotated[
    Optional[str],
    typer.Option("--database-url", help="SQLAlchemy URL [env INFERPLANE_TENANCY_DATABASE_URL or INFERPLANE_DATABASE_URL; default sqlite:///DATA_DIR/inferplane.db]."),
]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
Models = Annotated[Optional[list[str]], typer.Option("--model", help="Grant this model (repeatable); '*' grants all.")]
Team = Annotated[Optional[str], typer.Option(help="Team the tenant's usage is attributed to.")]
Plan = Annotated[Optional[str], typer.Option(help="Plan tier: free | standard | premium | enterprise (fair-queuing weight).")]
Rps = Annotated[Optional[float], typer.Option(help="Requests per second (tenant quota).")]
Rpm = Annotated[Optional[float], typer.Option(help="Requests per minute (tenant quota).")]
Tpm = Annotated[Optional[float], typer.Option(help="Tokens per minute (tenant quota).")]
Concurrency = Annotated[Optional[int], typer.Option(help="Concurrent requests (tenant cap).")]
RequestsMonth = Annotated[Optional[int], typer.Option("--requests-month", help="Requests per calendar month, UTC (tenant quota).")]
TokensMonth = Annotated[Optional[int], typer.Option("--tokens-month", help="Tokens per calendar month, UTC (tenant quota).")]
ModelQuota = Annotated[
    Optional[list[str]],
    typer.Option("--model-quota", help="Per-model quota MODEL:rps=N,rpm=N,tpm=N,concurrency=N,requests_month=N,tokens_month=N (repeatable)."),
]


def _settings(**given):
    from server.settings import Settings

    return Settings(**{k: v for k, v in given.items() if v})  # flags > INFERPLANE_* environment > defaults


def _pepper() -> bytes:
    """The key pepper the server hashes keys with (``INFERPLANE_KEY_PEPPER``): the CLI must share it."""
    return _settings().key_pepper.get_secret_value().encode()


def _store(url: Optional[str]):
    from server.tenancy.store import TenancyStore

    return TenancyStore(url or _settings().tenancy_url)


def _emit(data, as_json: bool, lines) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
    else:
        for line in lines:
            typer.echo(line)


def _tenant_fields(team, plan, models, rps, rpm, tpm, concurrency, model_quota, admin=None, requests_month=None, tokens_month=None) -> dict:
    from server.tenancy.quota_policy import Quota

    fields: dict = {}
    if team is not None:
        fields["team"] = team
    if plan is not None:
        fields["plan"] = plan
    if models:
        fields["models"] = [m for item in models for m in item.split(",") if m]
    if any(v is not None for v in (rps, rpm, tpm, concurrency, requests_month, tokens_month)):
        fields["quota"] = Quota(rps=rps, rpm=rpm, tpm=tpm, concurrency=concurrency, requests_month=requests_month, tokens_month=tokens_month)
    if model_quota:
        parsed = {}
        for item in model_quota:
            model, _, spec = item.partition(":")
            try:
                parsed[model] = Quota.from_dict(dict(kv.split("=", 1) for kv in spec.split(",") if kv))
            except ValueError:
                raise typer.BadParameter(f"--model-quota {item!r} is not MODEL:rps=N,rpm=N,...") from None
        fields["model_quotas"] = parsed
    if admin is not None:
        fields["admin"] = admin
    return fields


Admin = Annotated[Optional[bool], typer.Option("--admin/--no-admin", help="May manage keys via the Tenancy API.")]
TENANT_OPTIONS = {"team": Team, "plan": Plan, "model": Models, "rps": Rps, "rpm": Rpm, "tpm": Tpm, "concurrency": Concurrency,
                  "requests_month": RequestsMonth, "tokens_month": TokensMonth, "model_quota": ModelQuota, "admin": Admin}  # fmt: skip


def tenant_options(command):
    """A command that takes a tenant's fields: its ``fields`` parameter becomes the ``TENANT_OPTIONS``
    (in its place, in ``--help`` too), and the command gets them as one ``_tenant_fields`` dict."""
    own = inspect.signature(command, eval_str=True).parameters.values()
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind) for name, kind in TENANT_OPTIONS.items()]
    params = [q for p in own for q in (options if p.name == "fields" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)])]

    @functools.wraps(command)
    def with_fields(**given):
        tenant = {name: given.pop(name) for name in TENANT_OPTIONS}
        try:
            fields = _tenant_fields(tenant["team"], tenant["plan"], tenant["model"], tenant["rps"], tenant["rpm"], tenant["tpm"], tenant["concurrency"],
                                    tenant["model_quota"], tenant["admin"], tenant["requests_month"], tenant["tokens_month"])  # fmt: skip
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        return command(**given, fields=fields)

    with_fields.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    with_fields.__annotations__ = {p.name: p.annotation for p in params}
    return with_fields


def _tenant_json(t) -> dict:
    return {
        "name": t.name,
        "team": t.team,
        "plan": t.plan,
        "models": sorted(t.models),
        "quota": t.quota.to_dict(),
        "model_quotas": {m: q.to_dict() for m, q in t.model_quotas.items()},
        "admin": t.admin,
    }


# ---- keys ---------------------------------------------------------------------------------


@keys_app.command("create")
@tenant_options
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to (created if new).")],
    fields: dict,
    database_url: DbUrl = None,
    as_json: AsJson = False,
) -> None:
    """Create a key; it is printed once and stored only as a hash."""
    store = _store(database_url)
    try:
        key_id, key = store.create_key(tenant, _pepper(), **fields)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    _emit({"key_id": key_id, "tenant": tenant, "key": key}, as_json, [key, f"# key id {key_id} for tenant {tenant}; shown once, store it now"])


@keys_app.command("revoke")
def keys_revoke(key_id: str, database_url: DbUrl = None) -> None:
    """Revoke a key (effective on the servers' next refresh)."""
    if not _store(database_url).revoke_key(key_id):
        typer.echo(f"no active key {key_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")


@keys_app.command("rotate")
def keys_rotate(
    key_id: str,
    grace: Annotated[str, typer.Option(help="How long the old key keeps working: 0, 30m, 1h, 7d.")] = "0",
    database_url: DbUrl = None,
    as_json: AsJson = False,
) -> None:
    """Issue a new key for the same tenant; the old one stops after --grace."""
    from server.tenancy.metering import parse_since

    grace_s = 0.0 if grace in ("0", "") else time.time() - parse_since(grace)
    try:
        new_id, key = _store(database_url).rotate_key(key_id, _pepper(), grace_s)
    except KeyError as err:
        typer.echo(str(err.args[0]), err=True)
        raise typer.Exit(1) from None
    _emit({"key_id": new_id, "replaces": key_id, "key": key}, as_json, [key, f"# key id {new_id} replaces {key_id}; shown once"])


@keys_app.command("list")
def keys_list(tenant: Annotated[Optional[str], typer.Option()] = None, database_url: DbUrl = None, as_json: AsJson = False) -> None:
    """Key ids, tenants and states (never the keys)."""
    keys = _store(database_url).keys(tenant)
    rows = [{"key_id": k.key_id, "tenant": k.tenant, "state": k.state, "created_at": k.created_at, "expires_at": k.expires_at} for k in keys]
    _emit(rows, as_json, [f"{r['key_id']}  {r['tenant']:<24} {r['state']}" for r in rows])


# ---- tenants ------------------------------------------------------------------------------


@tenants_app.command("set")
@tenant_options
def tenants_set(name: str, fields: dict, database_url: DbUrl = None) -> None:
    """Create a tenant or change its team, plan, grants (replaced) or quotas."""
    try:
        t = _store(database_url).put_tenant(name, **fields)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(json.dumps(_tenant_json(t)))


@tenants_app.command("list")
def tenants_list(database_url: DbUrl = None) -> None:
    for t in _store(database_url).tenants():
        typer.echo(json.dumps(_tenant_json(t)))


# ---- reports ------------------------------------------------------------------------------


def usage(
    by: Annotated[str, typer.Option(help="tenant | team | model | model_version")] = "tenant",
    since: Annotated[str, typer.Option(help="1h, 30m, 7d, an ISO date, or unix seconds")] = "24h",
    database_url: DbUrl = None,
    as_json: AsJson = False,
    with_cost: Annotated[bool, typer.Option("--cost", help="Also cost (compute hours x the built-in price table, CPU): see `inferplane chargeback`.")] = False,
) -> None:
    """Requests, input/output tokens (LLMs, embeddings) and Triton compute seconds per tenant, team or model."""
    from server.tenancy.metering import DEFAULT_PRICES, parse_since, usage_report

    try:
        rows = usage_report(_store(database_url), by, parse_since(since))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if with_cost:
        for r in rows:
            r["cost_usd"] = round(r["compute_s"] / 3600.0 * DEFAULT_PRICES["cpu"], 9)
        if not as_json:
            _emit(rows, False, [f"{by:<24} {'requests':>12} {'compute_s':>12} {'cost_usd':>12}"]
                  + [f"{r.get(by if by != 'model_version' else 'model'):<24} {r['requests']:>12} {r['compute_s']:>12.3f} {r['cost_usd']:>12.6f}" for r in rows])
            return
    key = "model" if by == "model_version" else by
    if not rows and not as_json:
        typer.echo(
            f"no usage recorded since {since}: usage is metered for authenticated tenants only "
            "(a frontend started with --auth off records none)"
        )
        return
    _emit(
        rows,
        as_json,
        [f"{by:<24} {'requests':>12} {'in_tokens':>12} {'out_tokens':>12} {'tokens':>12} {'compute_s':>12}"]
        + [
            f"{r[key] + ('@' + r['version'] if 'version' in r else ''):<24} {r['requests']:>12} "
            f"{r['input_tokens']:>12} {r['output_tokens']:>12} {r['tokens']:>12} {r['compute_s']:>12.3f}"
            for r in rows
        ],
    )


def mount(app: typer.Typer) -> None:
    """Add ``keys``, ``tenants`` and ``usage`` to the ``inferplane`` command line (``cost``: server/cli/cost.py)."""
    app.add_typer(keys_app, name="keys")
    app.add_typer(tenants_app, name="tenants")
    app.command("usage")(usage)
