"""Who may call what: key parsing, the key ring, the gatekeeper (keys, certificates, on-behalf calls,
admin checks), the per-call context from HTTP headers, and the grant check of the pipeline. Pure
logic, no store; the live cross-tenant matrix is tests/integration/test_tenancy.py."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from server.dataplane.metrics import Metrics
from server.dataplane.pipeline import Pipeline, granted
from server.dataplane.routing import Router
from server.dataplane.signature import ModelSignature, TensorSpec
from server.errors import InvalidRequest, ModelNotFound, PermissionDenied, Unauthenticated
from server.tenancy.identity import (
    ALL_MODELS, ANONYMOUS, MAX_TIMEOUT_S, CallContext, Delegation, Gatekeeper, KeyEntry, KeyRing, Principal, Tenant,
    bearer_token, clamp_timeout, hash_key, key_id_of, new_key, plan_priority,
)  # fmt: skip
from server.tenancy.quota_policy import Quota, QuotaPolicy
from server.tenancy.tls import PEER_CERT

PEPPER = b"pepper"
ACME = Tenant("acme", team="ml", models=frozenset({"fraud"}), quota=Quota(rpm=5))
GLOBEX = Tenant("globex", team="ops", admin=True)


def _ring(now: list[float] | None = None) -> tuple[KeyRing, str, str]:
    clock = (lambda: now[0]) if now is not None else (lambda: 1000.0)
    ring = KeyRing(PEPPER, clock=clock)
    key_a, key_g = new_key()[1], new_key()[1]
    ring.load(
        [ACME, GLOBEX],
        [KeyEntry("aaaaaaaa", hash_key(key_a, PEPPER), "acme"), KeyEntry("gggggggg", hash_key(key_g, PEPPER), "globex")],
    )
    return ring, key_a, key_g


# ---- keys -------------------------------------------------------------------------------------


def test_a_key_id_is_eight_characters_between_the_prefix_and_a_secret():
    assert key_id_of("ipk_0123abcd_secret") == "0123abcd"
    for malformed in ("ipk_0123abc_secret", "ipk_0123abcde_secret", "ipk_0123abcd_", "ipk_0123abcd", "xpk_0123abcd_secret", ""):
        assert key_id_of(malformed) is None, malformed


def test_bearer_takes_precedence_over_x_api_key_and_blanks_are_no_key():
    assert bearer_token("Bearer from-auth", "from-header") == "from-auth"
    assert bearer_token("Bearer   ", "from-header") == "from-header"  # an empty bearer falls back to x-api-key
    assert bearer_token(None, "  k  ") == "k"
    assert bearer_token(None, "   ") is None
    assert bearer_token("Bearerabc", None) is None


def test_plan_priority_ranks_an_unknown_plan_with_the_lightest():
    assert [plan_priority(p) for p in ("enterprise", "premium", "standard", "free")] == [0, 1, 2, 3]
    assert plan_priority("gold") == 3


# ---- the key ring -------------------------------------------------------------------------------


def test_the_ring_maps_each_key_to_its_own_tenant_and_skips_keys_of_unknown_tenants():
    ring, key_a, key_g = _ring()
    assert ring.authenticate(key_a) == Principal("aaaaaaaa", ACME)
    assert ring.authenticate(key_g).tenant is GLOBEX
    _, stray = new_key()
    ring.load([ACME], [KeyEntry("aaaaaaaa", hash_key(key_a, PEPPER), "acme"), KeyEntry("ssssssss", hash_key(stray, PEPPER), "gone")])
    assert len(ring) == 1 and set(ring.tenants) == {"acme"}
    with pytest.raises(Unauthenticated, match="invalid"):
        ring.authenticate(stray)
    with pytest.raises(Unauthenticated, match="invalid"):
        ring.authenticate(key_g)  # a reload replaces the ring whole


def test_a_key_is_valid_until_its_expiry_and_not_at_it():
    now = [100.0]
    ring = KeyRing(PEPPER, clock=lambda: now[0])
    _, key = new_key()
    ring.load([ACME], [KeyEntry("aaaaaaaa", hash_key(key, PEPPER), "acme", expires_at=200.0)])
    assert ring.loaded_at == 100.0
    now[0] = 199.999
    assert ring.authenticate(key).tenant is ACME
    now[0] = 200.0
    with pytest.raises(Unauthenticated, match="expired"):
        ring.authenticate(key)


def test_the_missing_key_message_says_how_to_send_one():
    ring, _, _ = _ring()
    for missing in (None, ""):
        with pytest.raises(Unauthenticated, match="missing API key"):
            ring.authenticate(missing)


# ---- certificates ---------------------------------------------------------------------------------


def _certificate(spiffe: str | None, common_name: str = "client") -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
    )  # fmt: skip
    if spiffe:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe)]), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


SPIFFE = "spiffe://example.org/billing"


def _cert_ring() -> tuple[Gatekeeper, str]:
    ring, key_a, _ = _ring()
    _, key_a2 = new_key()
    ring.load([ACME, GLOBEX], [KeyEntry("aaaaaaaa", hash_key(key_a2, PEPPER), "acme"), KeyEntry("cccccccc", "", "globex", identity=SPIFFE)])
    return Gatekeeper(ring), key_a2


def test_a_bound_certificate_authenticates_a_call_without_a_key():
    gate, _ = _cert_ring()
    assert gate.keyring.binds_certificates and len(gate.keyring) == 1  # the binding is no key
    cert = _certificate(SPIFFE)
    ctx = CallContext(peer=lambda: cert)
    principal = gate.authenticate(ctx)
    assert principal == Principal("cccccccc", GLOBEX) and not hasattr(ctx, "principal")  # the context is what the caller sent
    assert gate.authenticate(CallContext(peer=cert)).tenant is GLOBEX  # the certificate itself, not a getter


def test_a_key_wins_over_a_bound_certificate():
    gate, key = _cert_ring()
    assert gate.authenticate(CallContext(key, peer=_certificate(SPIFFE))).tenant is ACME


def test_an_unbound_certificate_is_refused_naming_its_identity():
    gate, _ = _cert_ring()
    with pytest.raises(Unauthenticated, match="spiffe://example.org/other.*bound to no tenant"):
        gate.authenticate(CallContext(peer=_certificate("spiffe://example.org/other")))
    with pytest.raises(Unauthenticated, match="unreadable"):
        gate.authenticate(CallContext(peer=b"not a certificate"))
    with pytest.raises(Unauthenticated, match="^missing API key"):
        gate.authenticate(CallContext(peer=lambda: None))  # a plain connection: no certificate at all


def test_without_bindings_a_certificate_is_not_read():
    ring, _, _ = _ring()
    assert not ring.binds_certificates
    assert ring.authenticate_certificate(_certificate(SPIFFE)) is None
    with pytest.raises(Unauthenticated, match="missing API key"):
        Gatekeeper(ring).authenticate(CallContext(peer=_certificate(SPIFFE)))
    gate, _ = _cert_ring()
    assert gate.keyring.authenticate_certificate(None) is None and gate.keyring.authenticate_certificate(b"") is None


# ---- the gatekeeper ---------------------------------------------------------------------------------


def test_with_auth_off_every_call_is_the_open_tenant_with_the_default_quota():
    gate = Gatekeeper(None, default_quota=Quota(rpm=7))
    assert not gate.enabled
    ctx = CallContext("any-key")
    principal = gate.authenticate(ctx)
    assert principal.name == ANONYMOUS and principal.tenant.may_use("anything")
    assert principal.tenant.quota == Quota(rpm=7) and gate.authenticate(None) is principal
    assert gate.principal_of("whoever") is principal
    assert gate.is_admin(principal)


def test_with_auth_on_a_call_needs_a_valid_key():
    ring, key_a, _ = _ring()
    gate = Gatekeeper(ring)
    assert gate.enabled
    with pytest.raises(Unauthenticated):
        gate.authenticate(None)
    with pytest.raises(Unauthenticated):
        gate.authenticate(CallContext("ipk_00000000_forged"))
    assert gate.authenticate(CallContext(key_a)).tenant is ACME


def test_a_delegated_call_runs_as_its_principal_and_only_a_delegation_says_so():
    ring, key_a, _ = _ring()
    gate = Gatekeeper(ring)
    other = Principal("gggggggg", GLOBEX)
    ctx = CallContext(delegation=Delegation(other))
    assert gate.authenticate(ctx) is other
    # only a delegation says so: without one the key decides
    assert gate.authenticate(CallContext(key_a)).tenant is ACME
    with pytest.raises(Unauthenticated):
        gate.authenticate(CallContext())  # no key, no delegation


def test_the_platforms_own_call_runs_as_the_caller_it_serves():
    ring, _, _ = _ring()
    caller = Principal("aaaaaaaa", ACME)
    ctx = CallContext(delegation=Delegation(caller, ALL_MODELS))
    assert Gatekeeper(ring).authenticate(ctx) is caller


def test_a_batch_job_runs_as_its_tenant_as_the_ring_knows_it_now():
    ring, _, _ = _ring()
    gate = Gatekeeper(ring)
    assert gate.principal_of("acme") == Principal("", ACME)
    with pytest.raises(Unauthenticated, match="'gone' no longer exists"):
        gate.principal_of("gone")


def test_only_an_admin_tenant_passes_the_admin_check():
    ring, key_a, key_g = _ring()
    gate = Gatekeeper(ring)
    assert gate.require_admin(CallContext(key_g), "deploy").tenant is GLOBEX
    with pytest.raises(PermissionDenied, match="deploy needs an admin key \\(tenant 'acme' is not an admin\\)"):
        gate.require_admin(CallContext(key_a), "deploy")
    with pytest.raises(Unauthenticated):
        gate.require_admin(CallContext(), "deploy")


def test_a_tenant_without_a_quota_of_its_own_gets_the_default():
    gate = Gatekeeper(None, default_quota=Quota(rpm=3))
    assert gate.quota(GLOBEX) == Quota(rpm=3)
    assert gate.quota(ACME) == Quota(rpm=5)


# ---- grants -------------------------------------------------------------------------------------


def test_a_grant_names_the_models_a_tenant_may_call():
    acme = Principal("a", ACME)
    assert granted(acme, "fraud", None) and granted(acme, "fraud", CallContext())
    assert not granted(acme, "churn", None)
    assert not granted(acme, "churn", CallContext("key"))  # a context present changes nothing
    assert granted(Principal("g", GLOBEX), "churn", CallContext())  # "*": every model


def test_a_composite_node_is_covered_by_the_composite_grant_only_inside_the_frontend():
    acme = Principal("a", ACME)
    assert granted(acme, "churn", CallContext(delegation=Delegation(acme, "fraud")))
    assert granted(acme, "churn", CallContext(delegation=Delegation(acme, ALL_MODELS)))  # the platform's own call
    assert not granted(acme, "churn", CallContext(delegation=Delegation(acme, "other")))  # a composite it was not granted
    assert not granted(acme, "churn", CallContext(delegation=Delegation(acme)))  # a batch row: its own grants


# ---- the call's context from HTTP headers ---------------------------------------------------------


def test_headers_give_the_key_the_idempotency_key_and_the_deadline():
    token = PEER_CERT.set(b"cert")
    try:
        ctx = CallContext.from_headers({"Authorization": "Bearer k1", "Idempotency-Key": "i1", "x-request-timeout": "2.5"})
    finally:
        PEER_CERT.reset(token)
    assert (ctx.api_key, ctx.idempotency_key, ctx.timeout) == ("k1", "i1", 2.5)
    assert ctx.peer == b"cert" and ctx.headers["Idempotency-Key"] == "i1"
    assert CallContext.from_headers({"x-api-key": "k2"}).api_key == "k2"
    assert CallContext.from_headers({}).timeout is None


@pytest.mark.parametrize("value", ["0", "-1", "nan", "abc", ""])
def test_a_deadline_that_is_not_seconds_above_zero_is_refused_naming_the_header(value):
    with pytest.raises(InvalidRequest) as err:
        CallContext.from_headers({"x-request-timeout": value})
    assert [v.field for v in err.value.violations] == ["x-request-timeout"]
    assert "expected seconds > 0" in err.value.violations[0].description


def test_a_long_deadline_is_clamped_like_a_grpc_one():
    assert CallContext.from_headers({"x-request-timeout": "inf"}).timeout == MAX_TIMEOUT_S
    assert CallContext.from_headers({"x-request-timeout": "1e300"}, max_timeout_s=30.0).timeout == 30.0
    assert CallContext.from_headers({"x-request-timeout": "29"}, max_timeout_s=30.0).timeout == 29.0
    assert clamp_timeout(None) is None and clamp_timeout(MAX_TIMEOUT_S + 1) == MAX_TIMEOUT_S
    assert clamp_timeout(5.0, 3.0) == 3.0 and clamp_timeout(2.0, 3.0) == 2.0 and not math.isinf(clamp_timeout(math.inf))


# ---- the grant check in the admission pipeline ------------------------------------------------------

MODELS = {
    name: ModelSignature(name, 8, {"x": TensorSpec("x", "FP32", (4,))}, {"y": TensorSpec("y", "FP32", (1,))}, frozenset({"1"}))
    for name in ("fraud", "churn")
}


def _pipeline() -> tuple[Pipeline, str]:
    ring, key_a, _ = _ring()
    return Pipeline(
        gate=Gatekeeper(ring), quotas=QuotaPolicy(), router=Router({}), metrics=Metrics(),
        resolve=lambda name, version: MODELS[name], replica="test",
    ), key_a  # fmt: skip


async def test_an_authenticated_call_to_a_model_not_granted_is_not_found():
    """Every real call has a context: the grant is checked with one present, and answers like a missing model."""
    pipeline, key = _pipeline()
    call = await pipeline.admitted(CallContext(key), "fraud").open()
    await pipeline.exit(call, None)
    with pytest.raises(ModelNotFound, match="unknown model 'churn'"):
        await pipeline.admitted(CallContext(key), "churn").open()


async def test_the_platforms_own_call_for_a_caller_is_not_limited_to_its_grants():
    pipeline, _ = _pipeline()
    call = await pipeline.admitted(CallContext(delegation=Delegation(Principal("aaaaaaaa", ACME), ALL_MODELS)), "churn").open()  # a safety classifier
    assert call.principal.tenant is ACME
    await pipeline.exit(call, None)


# ---- the rest of identity's contract, as callers and operators see it ------------------------------


def test_a_key_carries_32_random_bytes_and_its_secret_may_hold_underscores():
    key_id, key = new_key()
    assert len(key_id) == 8 and len(key) == len("ipk_") + 8 + 1 + 43  # token_urlsafe(32): 43 characters
    assert key_id_of("ipk_0123abcd_se_cr_et") == "0123abcd"  # the id ends at the first underscore


def test_a_key_that_is_not_utf8_hashes_and_is_simply_unknown():
    ring, _, _ = _ring()
    odd = "ipk_0123abcd_\udcff"  # aiohttp's decoding of a header that is not UTF-8
    assert len(hash_key(odd, PEPPER)) == 64
    with pytest.raises(Unauthenticated, match="^invalid API key$"):
        ring.authenticate(odd)


def test_the_open_tenant_is_named_and_teamed_anonymous_with_no_key_id():
    principal = Gatekeeper(None, default_quota=Quota(rpm=2)).authenticate(None)
    assert principal == Principal("", Tenant(ANONYMOUS, team=ANONYMOUS, quota=Quota(rpm=2)))


def test_a_fresh_ring_knows_nobody():
    ring = KeyRing(PEPPER)
    assert (len(ring), ring.tenants, ring.loaded_at, ring.binds_certificates) == (0, {}, 0.0, False)
    with pytest.raises(Unauthenticated, match="^invalid API key$"):
        ring.authenticate(new_key()[1])
    assert ring.authenticate_certificate(_certificate(SPIFFE)) is None


def test_a_key_of_an_unknown_tenant_does_not_hide_the_keys_after_it():
    ring = KeyRing(PEPPER)
    _, stray = new_key()
    _, key = new_key()
    ring.load([ACME], [KeyEntry("ssssssss", hash_key(stray, PEPPER), "gone"), KeyEntry("aaaaaaaa", hash_key(key, PEPPER), "acme")])
    assert ring.authenticate(key).tenant is ACME


def test_the_key_ring_messages_read_exactly():
    now = [0.0]
    ring = KeyRing(PEPPER, clock=lambda: now[0])
    _, key = new_key()
    ring.load([ACME], [KeyEntry("aaaaaaaa", hash_key(key, PEPPER), "acme", expires_at=1.0)])
    with pytest.raises(Unauthenticated) as missing:
        ring.authenticate(None)
    assert missing.value.message == "missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>'"
    now[0] = 1.0
    with pytest.raises(Unauthenticated) as expired:
        ring.authenticate(key)
    assert expired.value.message == "API key expired"


def test_an_unbound_certificate_message_lists_every_identity_it_proves():
    gate, _ = _cert_ring()
    with pytest.raises(Unauthenticated) as err:
        gate.authenticate(CallContext(peer=_certificate("spiffe://example.org/other", common_name="svc")))
    assert err.value.message == (
        "missing API key, and the client certificate (spiffe://example.org/other; CN=svc) is bound to no tenant: "
        "send 'authorization: Bearer <key>' or bind the certificate (inferplane tenants bind)"
    )
    with pytest.raises(Unauthenticated) as err:
        gate.authenticate(CallContext(peer=b"junk"))
    assert "client certificate (unreadable) is bound" in err.value.message


def test_a_model_quota_is_found_by_the_model_name():
    tenant = Tenant("acme", model_quotas={"fraud": Quota(rpm=1)})
    assert tenant.model_quota("fraud") == Quota(rpm=1) and tenant.model_quota("churn") is None


def test_a_deadline_under_a_second_is_a_deadline():
    assert CallContext.from_headers({"x-request-timeout": "0.25"}).timeout == 0.25
    with pytest.raises(InvalidRequest) as err:
        CallContext.from_headers({"x-request-timeout": "soon"})
    assert err.value.message == "x-request-timeout: expected seconds > 0, got 'soon'"


async def test_the_ring_is_reloaded_periodically_and_a_failing_store_keeps_the_old_keys(caplog):
    ring, key_a, _ = _ring()
    gate = Gatekeeper(ring)
    _, fresh = new_key()
    loads = []

    def load():
        loads.append(1)
        if len(loads) == 1:
            raise OSError("database away")
        return [ACME], [KeyEntry("ffffffff", hash_key(fresh, PEPPER), "acme")]

    task = asyncio.create_task(gate.refresh_forever(load, every_s=0))
    try:
        async def reloaded():
            while len(ring) != 1 or len(loads) < 2:
                await asyncio.sleep(0)

        await asyncio.wait_for(reloaded(), timeout=30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert ring.authenticate(fresh).key_id == "ffffffff"
    failures = [r for r in caplog.records if r.name == "server.tenancy.identity"]
    assert [r.getMessage() for r in failures] == ["refreshing API keys failed: database away"]
