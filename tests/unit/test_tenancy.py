"""Identity: key format and hashing, the in-memory key ring, the tenancy store (SQLite)."""

import time

import pytest

from server.errors import Unauthenticated
from server.tenancy.quota_policy import Quota
from server.tenancy.identity import (
    PLAN_WEIGHTS, KeyEntry, KeyRing, Tenant, bearer_token, hash_key, key_id_of, new_key, plan_priority,
)
from server.tenancy.store import TenancyStore, UsageRecord

PEPPER = b"test-pepper"


def test_keys_are_random_and_carry_their_id():
    key_id, key = new_key()
    assert key.startswith(f"ipk_{key_id}_") and len(key) > 40
    assert key_id_of(key) == key_id
    assert key_id_of("Bearer nonsense") is None
    assert new_key()[1] != key
    assert hash_key(key, PEPPER) != hash_key(key, b"other") and len(hash_key(key, PEPPER)) == 64


def test_bearer_and_x_api_key():
    assert bearer_token("Bearer abc", None) == "abc"
    assert bearer_token("bearer  abc ", None) == "abc"
    assert bearer_token("Basic xyz", "k") == "k"
    assert bearer_token(None, None) is None


def test_key_ring_authenticates_by_hash_and_honours_expiry():
    now = [1000.0]
    ring = KeyRing(PEPPER, clock=lambda: now[0])
    _, key = new_key()
    _, key2 = new_key()
    acme = Tenant("acme", team="ml", models=frozenset({"m1"}))
    ring.load([acme], [KeyEntry("a", hash_key(key, PEPPER), "acme"), KeyEntry("b", hash_key(key2, PEPPER), "acme", 1010.0)])
    p = ring.authenticate(key)
    assert p.name == "acme" and p.tenant.team == "ml" and p.key_id == "a"
    assert p.tenant.may_use("m1") and not p.tenant.may_use("m2")
    assert ring.authenticate(key2).key_id == "b"
    now[0] = 1010.0
    with pytest.raises(Unauthenticated, match="expired"):
        ring.authenticate(key2)
    for bad in (None, "", key + "x"):
        with pytest.raises(Unauthenticated):
            ring.authenticate(bad)


def test_store_create_revoke_rotate_and_snapshot(tmp_path):
    store = TenancyStore(f"sqlite:///{tmp_path}/t.db")
    key_id, key = store.create_key("acme", PEPPER, team="ml", plan="premium", models=["m1", "m2"], quota=Quota(rpm=10))
    tenants, keys = store.snapshot()
    assert [t.name for t in tenants] == ["acme"]
    assert tenants[0].models == frozenset({"m1", "m2"}) and tenants[0].quota == Quota(rpm=10) and tenants[0].weight == 4.0
    assert [k.key_id for k in keys] == [key_id]
    assert keys[0].key_hash == hash_key(key, PEPPER)
    # the plain key is stored nowhere
    assert key.encode() not in (tmp_path / "t.db").read_bytes()

    new_id, new = store.rotate_key(key_id, PEPPER, grace_s=60)
    _, keys = store.snapshot()
    assert {k.key_id for k in keys} == {key_id, new_id}
    old = next(k for k in keys if k.key_id == key_id)
    assert old.expires_at is not None and old.expires_at > time.time()

    assert store.revoke_key(key_id)
    assert not store.revoke_key(key_id)
    _, keys = store.snapshot()
    assert [k.key_id for k in keys] == [new_id]
    ring = KeyRing(PEPPER)
    ring.load(*store.snapshot())
    assert ring.authenticate(new).name == "acme"
    with pytest.raises(Unauthenticated):
        ring.authenticate(key)

    rid, _ = store.rotate_key(new_id, PEPPER)  # no grace: the old key is revoked at once
    assert [k.key_id for k in store.snapshot()[1]] == [rid]
    with pytest.raises(KeyError):
        store.rotate_key(key_id, PEPPER)
    assert {k.state for k in store.keys("acme")} == {"revoked", "active"}
    with pytest.raises(ValueError):
        store.put_tenant("x", plan="gold")


def test_store_usage_sums_by_tenant_team_and_model(tmp_path):
    store = TenancyStore(f"sqlite:///{tmp_path}/u.db")
    store.write_usage(
        [
            UsageRecord(100.0, "a", "t1", "m1", "1", 10, 0, 1000),
            UsageRecord(160.0, "a", "t1", "m2", "1", 5, 50, 500, input_tokens=20, output_tokens=30),
            UsageRecord(170.0, "a", "t1", "m2", "1", 1, 7, 5, input_tokens=7),  # an embedding request
            UsageRecord(160.0, "b", "t1", "m1", "1", 1, 0, 100),
            UsageRecord(10.0, "b", "t2", "m1", "1", 99, 0, 9),
        ]
    )
    by_tenant = store.usage("tenant", since=50.0)
    assert by_tenant == [
        {"tenant": "a", "requests": 16, "input_tokens": 27, "output_tokens": 30, "tokens": 57, "compute_us": 1505},
        {"tenant": "b", "requests": 1, "input_tokens": 0, "output_tokens": 0, "tokens": 0, "compute_us": 100},
    ]
    assert store.usage("team", since=0) == [
        {"team": "t1", "requests": 17, "input_tokens": 27, "output_tokens": 30, "tokens": 57, "compute_us": 1605},
        {"team": "t2", "requests": 99, "input_tokens": 0, "output_tokens": 0, "tokens": 0, "compute_us": 9},
    ]
    assert store.usage("model_version", since=150.0) == [
        {"model": "m1", "version": "1", "requests": 1, "input_tokens": 0, "output_tokens": 0, "tokens": 0, "compute_us": 100},
        {"model": "m2", "version": "1", "requests": 6, "input_tokens": 27, "output_tokens": 30, "tokens": 57, "compute_us": 505},
    ]
    assert [r["model"] for r in store.usage("model")] == ["m1", "m2"]
    with pytest.raises(ValueError):
        store.usage("colour")


def test_plans_map_to_engine_priorities_heaviest_first():
    """The fair queue's weights order the LLM engine's priorities (0 first, preempted last)."""
    assert [plan_priority(p) for p in ("enterprise", "premium", "standard", "free")] == [0, 1, 2, 3]
    assert plan_priority("no-such-plan") == plan_priority("free")  # unknown ranks with the lightest
    heavier_first = sorted(PLAN_WEIGHTS, key=PLAN_WEIGHTS.get, reverse=True)
    assert [plan_priority(p) for p in heavier_first] == sorted(plan_priority(p) for p in PLAN_WEIGHTS)
