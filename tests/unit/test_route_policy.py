"""LLM routing across replicas (batching.route_policy): the prefix key, rendezvous ranking, the load
and KV bounds, round robin; and the replica set choosing by them for streams opened with an
affinity key (scripted members; the real Tritons are tests/integration/test_llm_routing.py)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from batching import route_policy as rp
from server.dataplane.replicas import Member, ReplicaPolicy, ReplicaSet
from tests.unit.test_replicas import Clock, fake, request

SYSTEM = "You are the support assistant of a bicycle shop. " * 20  # ~1000 characters


def chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# ---- the key ---------------------------------------------------------------------------------------


def test_requests_sharing_a_long_system_prompt_share_the_key_whatever_the_user_asks():
    a = rp.prefix_key(chat(SYSTEM, "Where is my order?"))
    b = rp.prefix_key(chat(SYSTEM, "Do you sell tyres?"))
    assert a == b and len(a) == 16
    assert rp.prefix_key(chat(SYSTEM.replace("bicycle", "flower"), "Where is my order?")) != a


def test_a_short_shared_start_does_not_share_the_key():
    short = "You are helpful."
    assert rp.prefix_key(chat(short, "Where is my order?")) != rp.prefix_key(chat(short, "Do you sell tyres?"))
    # ... unless the first characters that count are all shared
    assert rp.prefix_key(chat(short, "Where is my order?"), chars=20) == rp.prefix_key(chat(short, "Do you sell tyres?"), chars=20)


def test_roles_count_and_prompts_use_their_first_characters():
    assert rp.prefix_key([{"role": "system", "content": "x"}]) != rp.prefix_key([{"role": "user", "content": "x"}])
    assert rp.prefix_key(prompt=SYSTEM + "one") == rp.prefix_key(prompt=SYSTEM + "two")
    assert rp.prefix_key(prompt="one") != rp.prefix_key(prompt="two")
    assert rp.prefix_key(prompt="") == rp.prefix_key([]) == rp.prefix_key(prompt="x", chars=0) == ""
    # content parts (a list of {type, text}) read as their text
    parts = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}, {"role": "user", "content": "hi"}]
    assert rp.prefix_key(parts) == rp.prefix_key(chat(SYSTEM, "hello"))


# ---- ranking and bounds ----------------------------------------------------------------------------


def test_rendezvous_ranking_is_stable_and_moves_only_the_keys_of_a_member_that_left():
    members = ["local-0", "local-1", "local-2"]
    keys = [rp.prefix_key(prompt=f"prompt {i}") for i in range(300)]
    first = {k: members[rp.rank(k, members)[0]] for k in keys}
    assert first == {k: members[rp.rank(k, members)[0]] for k in keys}  # deterministic
    spread = Counter(first.values())
    assert set(spread) == set(members) and min(spread.values()) > 60  # ~100 each
    remaining = ["local-0", "local-2"]
    after = {k: remaining[rp.rank(k, remaining)[0]] for k in keys}
    moved = [k for k in keys if after[k] != first[k]]
    assert moved and all(first[k] == "local-1" for k in moved)  # only local-1's keys moved
    # and they went to their second choice
    assert all(after[k] == members[rp.rank(k, members)[1]] for k in moved)


def test_affinity_holds_until_the_load_bound_then_spills_to_the_second_ranked_member():
    bounds = rp.RouteBounds(load_factor=1.25, load_slack=1.0)
    key = rp.prefix_key(chat(SYSTEM, "q"))
    members = ["a", "b", "c"]
    order = [members[i] for i in rp.rank(key, members)]
    loads = {m: 0 for m in members}
    whys = []
    for _ in range(12):  # streams that all stay open
        i, why = rp.choose_prefix_aware(key, [rp.Load(m, loads[m]) for m in members], bounds)
        loads[members[i]] += 1
        whys.append((members[i], why))
    assert whys[0] == (order[0], rp.AFFINITY)
    assert whys[1] == (order[1], rp.SPILL)  # 2 streams > 1.25 x 2/3 + 1: the second-ranked member
    assert whys[2] == (order[0], rp.AFFINITY)  # 3 streams: 2 <= 1.25 x 1 + 1 again
    spilled = [m for m, why in whys if why == rp.SPILL]
    assert spilled and spilled[0] == order[1]
    total = sum(loads.values())
    assert max(loads.values()) <= rp.cap(total - 1, 3, bounds)  # nobody past the bound
    assert loads[order[0]] >= loads[order[1]] >= loads[order[2]]


def test_the_bound_at_small_loads():
    bounds = rp.RouteBounds(load_factor=1.0, load_slack=0.0)
    assert rp.within_bounds(rp.Load("a", 0), 0, 2, bounds)  # an idle member always may
    assert not rp.within_bounds(rp.Load("a", 1), 1, 2, bounds)  # 2 > (1 + 1) / 2
    assert rp.within_bounds(rp.Load("a", 1), 1, 2, rp.RouteBounds())  # 2 <= 1.25 * 1 + 1


def test_a_member_with_a_full_kv_cache_loses_affinity_and_unknown_kv_does_not_count():
    key = rp.prefix_key(prompt=SYSTEM)
    members = ["a", "b"]
    first = members[rp.rank(key, members)[0]]
    second = members[rp.rank(key, members)[1]]
    i, why = rp.choose_prefix_aware(key, [rp.Load(m, 0, 0.95 if m == first else 0.1) for m in members])
    assert (members[i], why) == (second, rp.SPILL)
    i, why = rp.choose_prefix_aware(key, [rp.Load(m, 0, None) for m in members])
    assert (members[i], why) == (first, rp.AFFINITY)


def test_nobody_within_bounds_falls_back_to_the_least_loaded():
    key = rp.prefix_key(prompt=SYSTEM)
    loads = [rp.Load("a", 3, 0.95), rp.Load("b", 2, 0.99), rp.Load("c", 2, 0.97)]
    i, why = rp.choose_prefix_aware(key, loads)
    assert (loads[i].member, why) == ("c", rp.FALLBACK)  # fewest streams, then the emptier cache


def test_round_robin_cycles_in_member_order_and_policies_parse():
    loads = [rp.Load("b"), rp.Load("a"), rp.Load("c")]
    assert [loads[rp.choose_round_robin(t, loads)[0]].member for t in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert rp.parse_policy("Prefix-Aware") == rp.PREFIX_AWARE
    with pytest.raises(ValueError, match="unknown routing policy"):
        rp.parse_policy("random")
    with pytest.raises(ValueError):
        rp.choose_prefix_aware("k", [])


# ---- the replica set routing streams by it -----------------------------------------------------------


def _set(policy: str, names=("a", "b"), **bounds):
    clients = [fake(n) for n in names]
    members = [Member(n, c) for n, c in zip(names, clients)]
    for m, c in zip(members, clients):
        m.models = set(c.loaded)
    rs = ReplicaSet(members, policy=ReplicaPolicy(llm_routing=policy, route_bounds=rp.RouteBounds(**bounds)), clock=Clock(), rng=random.Random(3))
    return rs


async def _open(rs, key, n=1, model="fraud"):
    """``n`` streams opened (bound to a member) and left open: the members they went to."""
    streams = []
    for _ in range(n):
        s = rs.stream_raw(model=model, affinity=key)
        await s.write(request(model))
        streams.append(s)
    return streams


def test_prefix_aware_streams_stick_to_the_keys_member_and_spill_past_the_bound():
    async def main():
        rs = _set(rp.PREFIX_AWARE, load_factor=1.0, load_slack=0.0)
        key = rp.prefix_key(chat(SYSTEM, "hi"))
        home = ["a", "b"][rp.rank(key, ["a", "b"])[0]]
        # one at a time (each finished before the next): all at home
        for _ in range(4):
            (s,) = await _open(rs, key)
            assert s.member.id == home
            s.cancel()
        # two open at once: the second spills
        a, b = await _open(rs, key, 2)
        assert a.member.id == home and b.member.id != home
        assert rs.member(home).routed == {"affinity": 5} and rs.member(b.member.id).routed == {"spill": 1}
        a.cancel(), b.cancel()
        # home's engine says its KV cache is full: the key goes to the other member while that lasts
        rs.report_kv(rs.member(home), "fraud", 0.97)
        (s,) = await _open(rs, key)
        assert s.member.id != home
        s.cancel()
        rs._clock.t += rs.policy.kv_stale_s + 1  # the report is stale: unknown again
        (s,) = await _open(rs, key)
        assert s.member.id == home
        s.cancel()
        assert rs.snapshot()["members"][0]["kv_utilization"] == ({"fraud": 0.97} if home == "a" else {})

    asyncio.run(main())


def test_round_robin_alternates_and_least_outstanding_ignores_the_key():
    async def main():
        rs = _set(rp.ROUND_ROBIN)
        key = rp.prefix_key(chat(SYSTEM, "hi"))
        seen = []
        for _ in range(4):
            (s,) = await _open(rs, key)
            seen.append(s.member.id)
            s.cancel()
        assert seen == ["a", "b", "a", "b"]
        rs = _set(rp.LEAST_OUTSTANDING)
        a, b = await _open(rs, key, 2)  # the idle member first, whatever the key
        assert {a.member.id, b.member.id} == {"a", "b"}
        assert not rs.member("a").routed and not rs.member("b").routed

    asyncio.run(main())


def test_an_endpoint_names_its_own_policy_and_a_bad_name_falls_back_to_the_sets():
    async def main():
        rs = _set(rp.PREFIX_AWARE)
        rs.routing_of = lambda model: {"fraud": "round_robin"}.get(model)
        assert rs.routing("fraud") == rp.ROUND_ROBIN and rs.routing("other") == rp.PREFIX_AWARE
        rs.routing_of = lambda model: "nonsense"
        assert rs.routing("fraud") == rp.PREFIX_AWARE
        # streams without a key (every non-LLM stream) keep the set's own choice
        s = rs.stream_raw(model="fraud")
        await s.write(request())
        assert not any(m.routed for m in rs.members())

    asyncio.run(main())


# ---- the frontend computes the key and passes the engine's KV report back ------------------------------


def test_a_generation_opens_its_stream_with_the_prompts_key_and_reports_the_engines_kv_use():
    from server.dataplane.port import GenerateParams
    from server.tenancy.identity import CallContext
    from tests.unit.test_pipeline import DONE, _dataplane, _llm, scripted

    async def main():
        backend = scripted({**DONE, "kv_utilization": 0.25})  # the scripted Triton that records what the generation passed
        dp, _ = _dataplane(_llm("llm"), backend=backend, llm_route_prefix_chars=40)
        messages = chat(SYSTEM, "Where is my order?")
        await dp.llm.complete("llm", GenerateParams(messages=messages, max_tokens=1), ctx=CallContext())
        await dp.llm.complete("llm", GenerateParams(prompt="hello", max_tokens=1), ctx=CallContext())
        return backend

    backend = asyncio.run(main())
    assert backend.affinities == [rp.prefix_key(chat(SYSTEM, "Where is my order?"), chars=40), rp.prefix_key(prompt="hello", chars=40)]
    assert backend.kv == [0.25, 0.25]
