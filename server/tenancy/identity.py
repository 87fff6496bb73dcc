"""Identity: API keys -> tenant and team, per-model grants, and the per-call context.

Keys look like ``ipk_<key id>_<secret>``: the id (8 hex characters) names the key in listings,
logs and revocations; the secret (32 random bytes) is shown once, at creation. Only
HMAC-SHA256(pepper, key) is stored — keys carry 256 bits of entropy, so a fast keyed hash is the
right tool (a slow KDF buys nothing and would sit on the hot path). The pepper comes from the
settings (``INFERPLANE_KEY_PEPPER``), never from the database the hashes live in.

The hot path never touches the database: :class:`KeyRing` holds every live key's hash ->
:class:`Principal` in memory and is swapped whole on refresh (``server.tenancy.store`` reads it
off the event loop). Authenticating is one HMAC and one dict lookup.

Authorization hides: a model a tenant was not granted is reported exactly like a model that does
not exist (``DataPlane`` raises the same ``ModelNotFound`` for both).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from server.errors import InvalidRequest, ModelNotFound, PermissionDenied, Unauthenticated, Violation
from server.tenancy.quota_policy import Quota
from server.tenancy.tls import PEER_CERT, peer_identities

KEY_PREFIX = "ipk_"
ALL_MODELS = "*"
ANONYMOUS = "anonymous"
# weighted fair queuing: a tenant's share of a saturated model is proportional to its plan's weight
PLAN_WEIGHTS: dict[str, float] = {"free": 1.0, "standard": 2.0, "premium": 4.0, "enterprise": 8.0}
DEFAULT_PLAN = "standard"


def plan_priority(plan: str) -> int:
    """The LLM engine's priority of a plan: 0 for the heaviest weight, then 1, 2, ... (lower runs first
    and, under KV-cache pressure, is preempted last); an unknown plan ranks with the lightest."""
    ranked = sorted(set(PLAN_WEIGHTS.values()), reverse=True)
    weight = PLAN_WEIGHTS.get(plan)
    return ranked.index(weight) if weight is not None else len(ranked) - 1


class KeyNotFound(ModelNotFound):
    """No such API key, or none that is still active (NOT_FOUND on both transports)."""


# ---- keys ---------------------------------------------------------------------------------


def new_key() -> tuple[str, str]:
    """A fresh ``(key_id, key)``; the key is shown to its owner once and never stored."""
    key_id = secrets.token_hex(4)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def key_id_of(key: str) -> str | None:
    """The id part of a well-formed key (for log lines: never log the key itself)."""
    if not key.startswith(KEY_PREFIX):
        return None
    rest = key[len(KEY_PREFIX) :]
    key_id, sep, secret = rest.partition("_")
    return key_id if sep and len(key_id) == 8 and secret else None


def hash_key(key: str, pepper: bytes) -> str:
    # surrogatepass: aiohttp decodes a header that is not UTF-8 with surrogates; such a key is simply unknown
    return hmac.new(pepper, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def bearer_token(authorization: str | None, api_key: str | None) -> str | None:
    """The key from ``authorization: Bearer <key>`` or ``x-api-key: <key>``."""
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    if api_key:
        return api_key.strip() or None
    return None


# ---- who is calling -----------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    name: str
    team: str = ""
    plan: str = DEFAULT_PLAN
    models: frozenset[str] = frozenset({ALL_MODELS})  # granted model names, or "*"
    quota: Quota = Quota()
    model_quotas: Mapping[str, Quota] = field(default_factory=dict)  # per granted model
    admin: bool = False  # may call the Tenancy API and the mutating Admin RPCs (load, unload, register, deploy, rollback)

    @property
    def weight(self) -> float:
        return PLAN_WEIGHTS.get(self.plan, 1.0)

    def may_use(self, model: str) -> bool:
        return ALL_MODELS in self.models or model in self.models

    def model_quota(self, model: str) -> Quota | None:
        return self.model_quotas.get(model)


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: which key, which tenant."""

    key_id: str
    tenant: Tenant

    @property
    def name(self) -> str:
        return self.tenant.name


@dataclass(frozen=True, slots=True)
class Delegation:
    """A call the frontend makes itself on behalf of a principal it authenticated before; only the
    frontend makes one, never a transport from what a caller sent.

    ``principal``: who the call runs as (its quotas, its metering). ``covers``: whose grant covers
    the call — "" the principal's own grants (a batch job's row), a composite's name (its node call
    is covered by the composite's grant, if the principal has that), or ``ALL_MODELS`` (the
    platform's own call for the caller, e.g. a safety classifier: not limited to the caller's
    grants, and never screened itself)."""

    principal: Principal
    covers: str = ""

    @property
    def platform(self) -> bool:
        return self.covers == ALL_MODELS

    def grants(self, tenant: Tenant, name: str) -> bool:
        """Does the delegation cover a call of ``name`` by ``tenant`` beyond the tenant's own grants?"""
        return self.platform or (bool(self.covers) and tenant.may_use(self.covers))


def anonymous(quota: Quota = Quota()) -> Principal:
    """Who calls when authentication is off: one tenant that sees every model."""
    return Principal("", Tenant(ANONYMOUS, team=ANONYMOUS, quota=quota))


@dataclass
class CallContext:
    """What a transport learned about one call, handed to ``DataPlane``: what the caller sent (the
    data plane writes nothing into it; who called is the admitted call's, who answered the answer's).

    ``timeout`` is the caller's remaining deadline in seconds (gRPC deadline, ``x-request-timeout``).
    """

    api_key: str | None = None
    idempotency_key: str | None = None
    timeout: float | None = None
    quota_headers: tuple = ()  # the monthly allowance left (server.tenancy.monthly_quotas), sent with the answer
    # traffic (server.dataplane.routing): the call's headers / gRPC metadata, read only when a split
    # needs a caller key (the version and arm that answered come back with the answer)
    headers: object = None
    # set only inside the frontend, never from a caller's headers: the call's traffic class (``batch``
    # waits for capacity real-time traffic leaves: batching.fair_queue), and a call made on behalf
    # of an already authenticated principal (a composite's node, a batch job's row, a safety
    # classifier: ``Delegation``)
    priority: str = "realtime"
    delegation: Delegation | None = None
    # mTLS (server.tenancy.tls): a getter of the client certificate (DER or PEM), read only when the
    # call sends no API key and some tenant is bound to a certificate identity
    peer: object = None
    # the caller asked for a per-stage breakdown (``inferplane-timing``): a
    # server.dataplane.stage_timing.StageTimer the stages mark; None (the default): nothing is timed
    timing: object = None

    @classmethod
    def from_headers(cls, headers, max_timeout_s: float | None = None) -> "CallContext":
        """From HTTP headers: ``Authorization: Bearer`` / ``x-api-key``, ``Idempotency-Key`` and
        ``x-request-timeout`` (seconds).

        A timeout that is not a number > 0 (``nan``, ``0``, ``-1``, ``abc``) is INVALID_ARGUMENT;
        one beyond ``max_timeout_s`` (``inf``, ``1e300``) is clamped to it, like a gRPC deadline
        (:func:`clamp_timeout`): no deadline reaches Triton that its clients would overflow.
        """
        timeout = headers.get("x-request-timeout")
        if timeout is not None:
            try:
                seconds = float(timeout)
                if not seconds > 0:  # also NaN
                    raise ValueError
            except ValueError:
                raise InvalidRequest(
                    f"x-request-timeout: expected seconds > 0, got {timeout!r:.40}",
                    [Violation("x-request-timeout", f"expected seconds > 0, got {timeout!r:.40}")],
                ) from None
            timeout = clamp_timeout(seconds, max_timeout_s)
        key = bearer_token(headers.get("Authorization"), headers.get("x-api-key"))
        return cls(key, headers.get("Idempotency-Key"), timeout, headers=headers, peer=_rest_peer())


def _rest_peer():
    return PEER_CERT.get()  # set per request by the REST transport under mTLS (server.transports.rest.tls)


# The longest deadline the frontend passes on (a day): a caller's 1e10 s would overflow grpc's
# nanosecond deadline arithmetic on the way to Triton and expire at once (an immediate 504).
MAX_TIMEOUT_S = 86_400.0


def clamp_timeout(seconds: float | None, max_timeout_s: float | None = None) -> float | None:
    """A caller's remaining deadline, at most ``max_timeout_s`` (default MAX_TIMEOUT_S); None stays None."""
    if seconds is None:
        return None
    return min(seconds, MAX_TIMEOUT_S if max_timeout_s is None else max_timeout_s)


# ---- the in-memory key index ----------------------------------------------------------------


@dataclass(frozen=True)
class KeyEntry:
    """One live key as the store hands it over (hash, never the key)."""

    key_id: str
    key_hash: str
    tenant: str
    expires_at: float | None = None  # unix seconds; a rotated key's grace period
    identity: str = ""  # a certificate binding instead of a key: a SPIFFE ID / SAN URI or a canonical subject


class KeyRing:
    """Every live key's hash -> Principal, swapped whole by :meth:`load`."""

    def __init__(self, pepper: bytes, clock: Callable[[], float] = time.time):
        self._pepper = pepper
        self._clock = clock
        self._by_hash: dict[str, tuple[Principal, float | None]] = {}
        self._by_identity: dict[str, Principal] = {}
        self.tenants: dict[str, Tenant] = {}
        self.loaded_at = 0.0

    def load(self, tenants: Iterable[Tenant], keys: Iterable[KeyEntry]) -> None:
        by_name = {t.name: t for t in tenants}
        index: dict[str, tuple[Principal, float | None]] = {}
        identities: dict[str, Principal] = {}
        for k in keys:
            tenant = by_name.get(k.tenant)
            if tenant is None:
                continue
            if k.identity:
                identities[k.identity] = Principal(k.key_id, tenant)
            else:
                index[k.key_hash] = (Principal(k.key_id, tenant), k.expires_at)
        self._by_hash, self._by_identity, self.tenants = index, identities, by_name
        self.loaded_at = self._clock()

    @property
    def binds_certificates(self) -> bool:
        return bool(self._by_identity)

    def authenticate_certificate(self, cert: bytes | None) -> Principal | None:
        """The tenant a client certificate's SPIFFE ID (SAN URI) or subject is bound to, or None."""
        if not cert or not self.binds_certificates:
            return None
        for identity in peer_identities(bytes(cert)):
            principal = self._by_identity.get(identity)
            if principal is not None:
                return principal
        return None

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>'")
        found = self._by_hash.get(hash_key(key, self._pepper))
        if found is None:
            raise Unauthenticated("invalid API key")
        principal, expires_at = found
        if expires_at is not None and self._clock() >= expires_at:
            raise Unauthenticated("API key expired")
        return principal


class Gatekeeper:
    """Authentication for the data plane: a :class:`KeyRing` when auth is on, one open tenant when off.

    ``default_quota`` applies to tenants that have no quota of their own (and to the anonymous
    tenant when auth is off).
    """

    def __init__(self, keyring: KeyRing | None = None, default_quota: Quota = Quota()):
        self.keyring = keyring
        self.default_quota = default_quota
        self._anonymous = anonymous(default_quota)

    @property
    def enabled(self) -> bool:
        return self.keyring is not None

    def authenticate(self, ctx: CallContext | None) -> Principal:
        delegation = getattr(ctx, "delegation", None)
        if delegation is not None:  # a call the frontend makes for a principal authenticated before
            return delegation.principal
        if self.keyring is None:
            principal = self._anonymous
        elif ctx is not None and not ctx.api_key and getattr(ctx, "peer", None) is not None and self.keyring.binds_certificates:
            principal = self._by_certificate(ctx)
        else:
            principal = self.keyring.authenticate(ctx.api_key if ctx is not None else None)
        return principal

    def principal_of(self, tenant: str) -> Principal:
        """The principal a batch job runs as: its tenant as the key ring knows it now (grants and
        quotas as they are today); UNAUTHENTICATED when the tenant is gone."""
        if self.keyring is None:
            return self._anonymous
        found = self.keyring.tenants.get(tenant)
        if found is None:
            raise Unauthenticated(f"tenant '{tenant}' no longer exists")
        return Principal("", found)
    def _by_certificate(self, ctx: CallContext) -> Principal:
        """mTLS: no API key came, so the client certificate's bound identity is the caller's."""
        cert = ctx.peer() if callable(ctx.peer) else ctx.peer
        principal = self.keyring.authenticate_certificate(cert)
        if principal is not None:
            return principal
        if cert:
            ids = peer_identities(bytes(cert))
            raise Unauthenticated(
                f"missing API key, and the client certificate ({'; '.join(ids) if ids else 'unreadable'}) is bound to no tenant: "
                "send 'authorization: Bearer <key>' or bind the certificate (inferplane tenants bind)"
            )
        raise Unauthenticated("missing API key: send 'authorization: Bearer <key>' or 'x-api-key: <key>'")

    def is_admin(self, principal: Principal) -> bool:
        """Admin tenants manage keys, tenants and deployments; with auth off the open tenant may."""
        return self.keyring is None or principal.tenant.admin

    def require_admin(self, ctx: CallContext | None, what: str) -> Principal:
        """The caller, who must be an admin tenant (UNAUTHENTICATED without a valid key). The one
        admin check of every API (Admin, Traffic, Tenancy, OIP repository load/unload)."""
        return self.check_admin(self.authenticate(ctx), what)

    def check_admin(self, principal: Principal, what: str) -> Principal:
        if not self.is_admin(principal):
            raise PermissionDenied(f"{what} needs an admin key (tenant '{principal.name}' is not an admin)")
        return principal

    def quota(self, tenant: Tenant) -> Quota:
        return self.default_quota if tenant.quota.unlimited else tenant.quota

    async def refresh_forever(self, load: Callable[[], tuple[list[Tenant], list[KeyEntry]]], every_s: float) -> None:
        """Reload the key ring from the store every ``every_s`` (off the event loop)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                tenants, keys = await asyncio.to_thread(load)
            except Exception as err:  # the database is away: keep serving the keys we have
                logging.getLogger(__name__).warning("refreshing API keys failed: %s", err)
                continue
            self.keyring.load(tenants, keys)
