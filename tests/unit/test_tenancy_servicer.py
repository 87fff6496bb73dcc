"""The Tenancy admin API and the Admin service's authorization, on a real store and registry
(SQLite) with an in-process gRPC context: who may call what, audit records, secrets never listed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest

from server.transports.grpc.admin import AdminService
from server.control.registry.artifacts import ArtifactStore
from server.errors import InferplaneError, Unauthenticated, grpc_status
from server.protogen.inferplane.v1 import admin_pb2
from server.protogen.inferplane.v1 import tenancy_pb2 as tpb
from server.control.registry.registry import Registry
from server.tenancy.identity import Gatekeeper, KeyRing, hash_key
from server.transports.grpc.tenancy import TenancyService
from server.tenancy.store import TenancyStore, UsageRecord

PEPPER = b"servicer-pepper"


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class Context:
    """Enough of ``grpc.aio.ServicerContext`` for the servicers."""

    def __init__(self, key: str | None = None):
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def invocation_metadata(self):
        return self.metadata

    def peer(self):
        return "ipv4:127.0.0.1:5555"

    def time_remaining(self):
        return None

    async def abort(self, code, details, trailing_metadata=()):
        raise Aborted(code, details)


@pytest.fixture
def env(tmp_path):
    url = f"sqlite:///{tmp_path}/t.db"
    store = TenancyStore(url)
    registry = Registry(url, ArtifactStore(tmp_path / "artifacts"))
    _, admin_key = store.create_key("ops", PEPPER, admin=True)
    _, user_key = store.create_key("alpha", PEPPER, models=["m1"])
    ring = KeyRing(PEPPER)
    ring.load(*store.snapshot())
    dp = SimpleNamespace(gate=Gatekeeper(ring), names=lambda: ["m1", "m2"], signature=lambda name: None, backend_up=True)
    yield SimpleNamespace(
        store=store, registry=registry, dp=dp, admin=admin_key, user=user_key,
        tenancy=TenancyService(dp, store, PEPPER, registry), adm=AdminService(dp, registry, deployer=object()),
    )  # fmt: skip
    registry.close()
    store.close()


async def _code(coro):
    """The status the call ends with: servicers raise domain errors, which the server's
    DomainErrorInterceptor turns into the error table's status (here: grpc_status directly)."""
    try:
        await coro
    except Aborted as err:
        return err.code
    except InferplaneError as err:
        return grpc_status(err).code
    return grpc.StatusCode.OK


async def test_only_admins_call_the_tenancy_api_and_every_call_is_audited(env):
    t = env.tenancy
    request = tpb.CreateKeyRequest(tenant="x")
    assert await _code(t.CreateKey(request, Context())) == grpc.StatusCode.UNAUTHENTICATED
    assert await _code(t.CreateKey(request, Context("ipk_00000000_nope"))) == grpc.StatusCode.UNAUTHENTICATED
    for call, req in [
        (t.CreateKey, request), (t.RevokeKey, tpb.RevokeKeyRequest(key_id="k")), (t.RotateKey, tpb.RotateKeyRequest(key_id="k")),
        (t.ListKeys, tpb.ListKeysRequest()), (t.SetTenant, tpb.SetTenantRequest(name="alpha")),
        (t.ListTenants, tpb.ListTenantsRequest()), (t.GetUsage, tpb.GetUsageRequest()),
    ]:  # fmt: skip
        assert await _code(call(req, Context(env.user))) == grpc.StatusCode.PERMISSION_DENIED
        assert await _code(call(req, Context(env.admin))) in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND)
    assert "x" in {tn.name for tn in env.store.tenants()}  # only the admin's call created it
    entries = env.registry.audit_log(limit=100)
    assert {e.outcome for e in entries} == {"ok", "denied", "refused"}
    denied = [e for e in entries if e.outcome == "denied"]
    assert any(e.actor.startswith("unauthenticated@") for e in denied) and any(e.actor.startswith("alpha/") for e in denied)
    assert all(e.action.startswith("tenancy.") for e in entries)
    ok = [e for e in entries if e.outcome == "ok" and e.action == "tenancy.CreateKey"]
    assert ok and ok[0].actor.startswith("ops/") and ok[0].target == "tenant:x"


async def test_create_key_grants_and_takes_effect_at_once_and_listings_hold_no_secrets(env):
    t = env.tenancy
    changes = tpb.TenantChanges(team="team-t", plan="premium", grants=tpb.Grants(models=["m1"]), quota=tpb.Quota(rpm=60))
    changes.model_quotas.quotas["m1"].concurrency = 2
    answer = await t.CreateKey(tpb.CreateKeyRequest(tenant="T", changes=changes), Context(env.admin))
    assert answer.key.startswith(f"ipk_{answer.key_id}_")
    assert answer.tenant.models == ["m1"] and answer.tenant.plan == "premium" and answer.tenant.quota.rpm == 60
    assert not answer.tenant.quota.HasField("rps") and answer.tenant.model_quotas["m1"].concurrency == 2
    principal = env.dp.gate.authenticate(SimpleNamespace(api_key=answer.key, principal=None))  # no refresh needed
    assert principal.name == "T" and principal.tenant.may_use("m1") and not principal.tenant.may_use("m2")
    listed = await t.ListKeys(tpb.ListKeysRequest(tenant="T"), Context(env.admin))
    assert [k.key_id for k in listed.keys] == [answer.key_id] and listed.keys[0].state == "active"
    raw = listed.SerializeToString() + (await t.ListKeys(tpb.ListKeysRequest(), Context(env.admin))).SerializeToString()
    assert answer.key.encode() not in raw and hash_key(answer.key, PEPPER).encode() not in raw
    tenants = await t.ListTenants(tpb.ListTenantsRequest(), Context(env.admin))
    assert {x.name for x in tenants.tenants} == {"ops", "alpha", "T"}
    for bad in (
        tpb.SetTenantRequest(name="T", changes=tpb.TenantChanges(plan="platinum")),
        tpb.SetTenantRequest(name="T", changes=tpb.TenantChanges(quota=tpb.Quota(rps=0))),
        tpb.SetTenantRequest(name="", changes=tpb.TenantChanges()),
    ):
        assert await _code(t.SetTenant(bad, Context(env.admin))) == grpc.StatusCode.INVALID_ARGUMENT
    updated = await t.SetTenant(tpb.SetTenantRequest(name="T", changes=tpb.TenantChanges(grants=tpb.Grants(models=["m2"]))), Context(env.admin))
    assert updated.tenant.models == ["m2"] and updated.tenant.plan == "premium"
    assert env.dp.gate.authenticate(SimpleNamespace(api_key=answer.key, principal=None)).tenant.may_use("m2")


async def test_revoke_and_rotate(env):
    t = env.tenancy
    created = await t.CreateKey(tpb.CreateKeyRequest(tenant="T"), Context(env.admin))
    rotated = await t.RotateKey(tpb.RotateKeyRequest(key_id=created.key_id, grace_s=60), Context(env.admin))
    assert rotated.replaces == created.key_id and rotated.key != created.key
    for key in (created.key, rotated.key):  # the old key works through its grace period
        assert env.dp.gate.authenticate(SimpleNamespace(api_key=key, principal=None)).name == "T"
    states = {k.key_id: k.state for k in (await t.ListKeys(tpb.ListKeysRequest(tenant="T"), Context(env.admin))).keys}
    assert states == {created.key_id: "expiring", rotated.key_id: "active"}
    await t.RevokeKey(tpb.RevokeKeyRequest(key_id=rotated.key_id), Context(env.admin))
    with pytest.raises(Unauthenticated):
        env.dp.gate.authenticate(SimpleNamespace(api_key=rotated.key, principal=None))
    assert await _code(t.RevokeKey(tpb.RevokeKeyRequest(key_id=rotated.key_id), Context(env.admin))) == grpc.StatusCode.NOT_FOUND
    assert await _code(t.RotateKey(tpb.RotateKeyRequest(key_id="nope"), Context(env.admin))) == grpc.StatusCode.NOT_FOUND
    assert await _code(t.RotateKey(tpb.RotateKeyRequest(key_id=created.key_id, grace_s=-1), Context(env.admin))) == grpc.StatusCode.INVALID_ARGUMENT


async def test_get_usage_by_group_and_since(env):
    now = time.time()
    env.store.write_usage(
        [
            UsageRecord(now - 10, "alpha", "ta", "m1", "1", 3, 5, 2_000_000, input_tokens=2, output_tokens=3),
            UsageRecord(now - 7200, "alpha", "ta", "m1", "2", 4, 0, 1),
        ]
    )
    t = env.tenancy
    answer = await t.GetUsage(tpb.GetUsageRequest(by="model_version", since="1h"), Context(env.admin))
    rows = [(r.key, r.version, r.requests, r.input_tokens, r.output_tokens, r.tokens, r.compute_s) for r in answer.rows]
    assert rows == [("m1", "1", 3, 2, 3, 5, 2.0)]
    answer = await t.GetUsage(tpb.GetUsageRequest(by="team", since="3h"), Context(env.admin))
    assert [(r.key, r.requests) for r in answer.rows] == [("ta", 7)]
    for bad in (tpb.GetUsageRequest(by="planet"), tpb.GetUsageRequest(since="yesterday-ish")):
        assert await _code(t.GetUsage(bad, Context(env.admin))) == grpc.StatusCode.INVALID_ARGUMENT


async def test_with_auth_off_the_tenancy_api_is_unimplemented(env):
    service = TenancyService(SimpleNamespace(gate=Gatekeeper(None)), None)
    assert await _code(service.CreateKey(tpb.CreateKeyRequest(tenant="x"), Context())) == grpc.StatusCode.UNIMPLEMENTED


async def test_admin_service_filters_by_grants_and_guards_mutations(env):
    adm = env.adm
    listed = await adm.ListModels(admin_pb2.ListModelsRequest(), Context(env.user))
    assert [m.name for m in listed.models] == ["m1"]
    listed = await adm.ListModels(admin_pb2.ListModelsRequest(), Context(env.admin))
    assert [m.name for m in listed.models] == ["m1", "m2"]
    assert await _code(adm.ListModels(admin_pb2.ListModelsRequest(), Context())) == grpc.StatusCode.UNAUTHENTICATED
    for call, req in [
        (adm.LoadModel, admin_pb2.LoadModelRequest(name="m1")), (adm.UnloadModel, admin_pb2.UnloadModelRequest(name="m1")),
        (adm.RegisterModel, admin_pb2.RegisterModelRequest(name="m1")), (adm.Deploy, admin_pb2.DeployRequest(ref="m1:1")),
        (adm.Rollback, admin_pb2.RollbackRequest(name="m1")), (adm.ListAudit, admin_pb2.ListAuditRequest()),
    ]:  # fmt: skip
        assert await _code(call(req, Context(env.user))) == grpc.StatusCode.PERMISSION_DENIED
    # read-only registry calls: an ungranted model answers like an unregistered one
    for name in ("m2", "ghost"):
        try:
            await adm.ShowModel(admin_pb2.ShowModelRequest(name=name), Context(env.user))
        except InferplaneError as err:
            status = grpc_status(err)
            assert status.code == grpc.StatusCode.NOT_FOUND and status.details == f"model '{name}' is not registered"
        else:
            raise AssertionError("expected NOT_FOUND")
