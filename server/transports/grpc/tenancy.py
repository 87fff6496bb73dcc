"""The tenancy admin API (``inferplane.v1.Tenancy``): keys, tenants and usage over gRPC.

A thin adapter over :class:`server.tenancy.store.TenancyStore` (the same store the ``inferplane
keys|tenants|usage`` commands use directly on the database). Rules:

* Only an admin tenant may call it: no or a bad key is UNAUTHENTICATED, a known non-admin key is
  PERMISSION_DENIED (``Gatekeeper.require_admin``), through the one error table.
* With ``--auth off`` it answers UNIMPLEMENTED: nothing unauthenticated may mint keys.
* A new or rotated key is in the answer once; listings never carry keys or their hashes.
* Every call, refused ones included, is written to the registry's audit log when this process has
  the registry, else logged. Key changes are loaded into this process's key ring at once; other
  frontends pick them up on their next refresh.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from server.dataplane.dataplane import DataPlane
from server.errors import InferplaneError, InvalidRequest, PermissionDenied, Unauthenticated, Unimplemented
from server.protogen.inferplane.v1 import tenancy_pb2 as tpb
from server.protogen.inferplane.v1 import tenancy_pb2_grpc
from server.tenancy.quota_policy import Quota
from server.transports.grpc.context import call_context
from server.tenancy.identity import KeyNotFound, Principal, Tenant
from server.tenancy.metering import parse_since

log = logging.getLogger(__name__)

USAGE_GROUPS = ("tenant", "team", "model", "model_version")
MAX_NAME = 128


class TenancyService(tenancy_pb2_grpc.TenancyServicer):
    def __init__(self, dataplane: DataPlane, store=None, pepper: bytes = b"", registry=None):
        self.dp = dataplane
        self.store = store  # server.tenancy.store.TenancyStore; None: auth is off
        self._pepper = pepper
        self.registry = registry  # server.control.registry.registry.Registry, for the audit log (None: log only)

    # ---- the one path every RPC takes ----------------------------------------------------------

    async def _call(self, context, action: str, target: str, run, *, changes_keys: bool = False):
        """Authorize (admin), run ``run(principal)`` off the loop, audit, and map errors to statuses.

        ``run`` returns ``(response, detail)``; ``detail`` goes to the audit log (never a key).
        """
        who = f"unauthenticated@{context.peer()}"
        try:
            gate = self.dp.gate
            principal: Principal = gate.authenticate(call_context(context))
            who = f"{principal.name}/{principal.key_id}" if gate.enabled else f"anonymous@{context.peer()}"
            gate.check_admin(principal, f"Tenancy.{action}")
            if self.store is None:
                raise Unimplemented("the Tenancy API needs --auth on (with auth off no caller is authenticated)")
            response, detail = await run(principal)
        except (Unauthenticated, PermissionDenied) as err:
            await self._audit(who, action, target, "denied", f"{err.reason}: {err.message}")
            raise
        except InferplaneError as err:
            await self._audit(who, action, target, "refused", f"{err.reason}: {err.message}")
            raise
        else:
            await self._audit(who, action, target, "ok", detail)
            if changes_keys:
                await self._reload_keys()
            return response

    async def _audit(self, actor: str, action: str, target: str, outcome: str, detail: str) -> None:
        action = f"tenancy.{action}"
        if self.registry is not None:
            try:
                await asyncio.to_thread(self.registry.audit, actor, action, target, outcome, detail)
                return
            except Exception as err:  # the audit table is away: the log line below still records it
                log.warning("writing the audit record failed: %s", err)
        log.info("audit actor=%s action=%s target=%s outcome=%s detail=%s", actor, action, target, outcome, detail)

    async def _reload_keys(self) -> None:
        """This process serves the change at once (others on their next refresh)."""
        if self.dp.gate.keyring is None:
            return
        try:
            self.dp.gate.keyring.load(*await asyncio.to_thread(self.store.snapshot))
        except Exception as err:  # the next periodic refresh tries again
            log.warning("reloading API keys failed: %s", err)

    # ---- keys ----------------------------------------------------------------------------------

    async def CreateKey(self, request, context):
        async def run(_principal):
            name = _name(request.tenant, "tenant")
            fields = _changes(request.changes) if request.HasField("changes") else {}
            try:
                key_id, key = await asyncio.to_thread(self.store.create_key, name, self._pepper, **fields)
            except ValueError as err:
                raise InvalidRequest(str(err)) from None
            tenant = await self._tenant(name)
            response = tpb.CreateKeyResponse(key_id=key_id, key=key, tenant=_tenant_pb(tenant))
            return response, f"key_id={key_id} changes={_describe(fields)}"

        return await self._call(context, "CreateKey", f"tenant:{request.tenant}", run, changes_keys=True)

    async def RevokeKey(self, request, context):
        async def run(_principal):
            key_id = _name(request.key_id, "key_id")
            if not await asyncio.to_thread(self.store.revoke_key, key_id):
                raise KeyNotFound(f"no active key '{key_id}'")
            return tpb.RevokeKeyResponse(), f"key_id={key_id}"

        return await self._call(context, "RevokeKey", f"key:{request.key_id}", run, changes_keys=True)

    async def RotateKey(self, request, context):
        async def run(_principal):
            key_id = _name(request.key_id, "key_id")
            if not request.grace_s >= 0:
                raise InvalidRequest(f"grace_s must be >= 0 seconds, got {request.grace_s}")
            try:
                new_id, key = await asyncio.to_thread(self.store.rotate_key, key_id, self._pepper, request.grace_s)
            except KeyError:
                raise KeyNotFound(f"no active key '{key_id}'") from None
            return tpb.RotateKeyResponse(key_id=new_id, key=key, replaces=key_id), f"new_key_id={new_id} grace_s={request.grace_s:g}"

        return await self._call(context, "RotateKey", f"key:{request.key_id}", run, changes_keys=True)

    async def ListKeys(self, request, context):
        async def run(_principal):
            keys = await asyncio.to_thread(self.store.keys, request.tenant or None)
            response = tpb.ListKeysResponse(
                keys=[
                    tpb.KeyInfo(
                        key_id=k.key_id, tenant=k.tenant, state=k.state, created_at=k.created_at or 0.0,
                        revoked_at=k.revoked_at or 0.0, expires_at=k.expires_at or 0.0,
                    )
                    for k in keys
                ]
            )  # fmt: skip
            return response, f"{len(keys)} keys"

        return await self._call(context, "ListKeys", f"tenant:{request.tenant or '*'}", run)

    # ---- tenants -------------------------------------------------------------------------------

    async def SetTenant(self, request, context):
        async def run(_principal):
            name = _name(request.name, "name")
            fields = _changes(request.changes) if request.HasField("changes") else {}
            try:
                tenant = await asyncio.to_thread(self.store.put_tenant, name, **fields)
            except ValueError as err:
                raise InvalidRequest(str(err)) from None
            return tpb.SetTenantResponse(tenant=_tenant_pb(tenant)), f"changes={_describe(fields)}"

        return await self._call(context, "SetTenant", f"tenant:{request.name}", run, changes_keys=True)

    async def ListTenants(self, request, context):
        async def run(_principal):
            tenants = await asyncio.to_thread(self.store.tenants)
            return tpb.ListTenantsResponse(tenants=[_tenant_pb(t) for t in tenants]), f"{len(tenants)} tenants"

        return await self._call(context, "ListTenants", "tenant:*", run)

    async def _tenant(self, name: str) -> Tenant:
        for t in await asyncio.to_thread(self.store.tenants):
            if t.name == name:
                return t
        raise KeyNotFound(f"no tenant '{name}'")  # pragma: no cover - created just before

    # ---- usage ---------------------------------------------------------------------------------

    async def GetUsage(self, request, context):
        async def run(_principal):
            by = request.by or "tenant"
            if by not in USAGE_GROUPS:
                raise InvalidRequest(f"by must be one of {', '.join(USAGE_GROUPS)}, got {by!r}")
            now = time.time()
            try:
                since = parse_since(request.since or "24h", now)
                until = parse_since(request.until, now) if request.until else None
            except ValueError as err:
                raise InvalidRequest(f"since/until: {err} (use 1h, 30m, 7d, an ISO date or unix seconds)") from None
            rows = await asyncio.to_thread(self.store.usage, by, since, until)
            key = "model" if by == "model_version" else by
            response = tpb.GetUsageResponse(by=by, since=since)
            for r in rows:
                response.rows.add(
                    key=str(r[key]), version=str(r.get("version", "")), requests=r["requests"], tokens=r["tokens"],
                    input_tokens=r["input_tokens"], output_tokens=r["output_tokens"], compute_s=r["compute_us"] / 1e6,
                )  # fmt: skip
            return response, f"by={by} since={since:.0f} rows={len(rows)}"

        return await self._call(context, "GetUsage", f"usage:{request.by or 'tenant'}", run)


# ---- messages <-> domain ------------------------------------------------------------------------


def _name(value: str, field: str) -> str:
    value = value.strip()
    if not value or len(value) > MAX_NAME:
        raise InvalidRequest(f"{field} must be 1 to {MAX_NAME} characters")
    return value


def _quota(q: tpb.Quota, where: str) -> Quota:
    for f in ("rps", "rpm", "tpm"):
        if q.HasField(f) and not getattr(q, f) > 0:
            raise InvalidRequest(f"{where}.{f} must be > 0 (leave it unset for no limit)")
    for f in ("concurrency", "requests_month", "tokens_month"):
        if q.HasField(f) and getattr(q, f) < 1:
            raise InvalidRequest(f"{where}.{f} must be >= 1 (leave it unset for no limit)")
    return Quota(
        rps=q.rps if q.HasField("rps") else None,
        rpm=q.rpm if q.HasField("rpm") else None,
        tpm=q.tpm if q.HasField("tpm") else None,
        concurrency=q.concurrency if q.HasField("concurrency") else None,
        requests_month=q.requests_month if q.HasField("requests_month") else None,
        tokens_month=q.tokens_month if q.HasField("tokens_month") else None,
    )


def _quota_pb(q: Quota) -> tpb.Quota:
    return tpb.Quota(**q.to_dict())


def _changes(c: tpb.TenantChanges) -> dict:
    """The fields a ``TenantChanges`` sets, as ``TenancyStore.put_tenant`` takes them."""
    fields: dict = {}
    if c.HasField("team"):
        fields["team"] = _name(c.team, "changes.team")
    if c.HasField("plan"):
        fields["plan"] = c.plan
    if c.HasField("grants"):
        fields["models"] = [_name(m, "changes.grants.models[]") for m in c.grants.models]
    if c.HasField("quota"):
        fields["quota"] = _quota(c.quota, "changes.quota")
    if c.HasField("model_quotas"):
        fields["model_quotas"] = {_name(m, "changes.model_quotas key"): _quota(q, f"changes.model_quotas[{m}]") for m, q in c.model_quotas.quotas.items()}
    if c.HasField("admin"):
        fields["admin"] = c.admin
    return fields


def _describe(fields: dict) -> str:
    def plain(v):
        if isinstance(v, Quota):
            return v.to_dict()
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return json.dumps({k: plain(v) for k, v in fields.items()}, sort_keys=True)


def _tenant_pb(t: Tenant) -> tpb.Tenant:
    return tpb.Tenant(
        name=t.name, team=t.team, plan=t.plan, models=sorted(t.models), quota=_quota_pb(t.quota),
        model_quotas={m: _quota_pb(q) for m, q in t.model_quotas.items()}, admin=t.admin,
    )  # fmt: skip


def add_to_server(service: TenancyService, server) -> str:
    """Register the service on a ``grpc.aio`` server; returns its full name (for reflection)."""
    tenancy_pb2_grpc.add_TenancyServicer_to_server(service, server)
    return tpb.DESCRIPTOR.services_by_name["Tenancy"].full_name
