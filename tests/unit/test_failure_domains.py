"""Failure domains (issue 29) as pure policy: isolation groups keep the LLMs (and tier-1 endpoints) on
Triton processes of their own, and an endpoint's copies spread over zones before a zone gets two."""

from __future__ import annotations

import random

import pytest

from batching.autoscale_policy import ScalingConfig
from server.control.scaling import isolation
from server.control.scaling.executors import LocalExecutor
from server.control.scaling.placement import Demand, place
from server.dataplane.locality_policy import local_first
from server.dataplane.replicas import Member, ReplicaPolicy, ReplicaSet
from tests.unit.test_replicas import MODEL, Clock, fake

MB = 1 << 20


def test_the_llms_never_share_a_replica_with_the_tabular_models():
    """Capacity 4000 MB holds all four (1000+300+200+100 MB) in one replica; the groups split them:
    the shared group is placed first (it keeps the primary, local-0), the LLM opens local-1 although
    local-0 has room."""
    demands = {
        "tiny_llama": Demand(1, 1000 * MB, isolation.LLM_GROUP),
        "fraud": Demand(1, 300 * MB), "mlp": Demand(1, 200 * MB), "lgbm": Demand(1, 100 * MB),
    }  # fmt: skip
    plan = place(demands, {"local-0": set()}, 4000 * MB)
    assert plan.assignment == {"local-0": {"fraud", "mlp", "lgbm"}, "local-1": {"tiny_llama"}}
    assert plan.opened == ["local-1"]


def test_models_of_one_group_share_by_memory():
    demands = {"a": Demand(1, 100 * MB, "llm"), "b": Demand(1, 100 * MB, "llm"), "c": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": {"c"}}, 4000 * MB)
    assert plan.assignment == {"local-0": {"c"}, "local-1": {"a", "b"}}


def test_a_sticky_copy_that_now_breaks_isolation_moves_out():
    """local-0 hosts fraud and the LLM from before isolation: fraud stays (listed first), the LLM
    copy is not kept there and opens its own replica."""
    demands = {"fraud": Demand(1, 100 * MB), "llm": Demand(1, 100 * MB, "llm")}
    plan = place(demands, {"local-0": {"fraud", "llm"}}, 4000 * MB)
    assert plan.assignment == {"local-0": {"fraud"}, "local-1": {"llm"}}


def test_copies_spread_over_zones_before_any_zone_gets_two():
    """Two existing replicas both in zone a with room; the second copy opens a replica in zone b
    rather than take local-1 in zone a; the third goes back to zone a (a: 1, b: 1 -> a first)."""
    current = {"local-0": set(), "local-1": set()}
    plan = place({"m": Demand(3, 100 * MB)}, current, 4000 * MB, zone_of={"local-0": "a", "local-1": "a"}, zones=("a", "b"))
    assert plan.replicas_of("m") == ["local-0", "local-1", "local-2"]
    assert plan.zones == {"local-0": "a", "local-1": "a", "local-2": "b"}
    by_zone = sorted(plan.zones[r] for r in plan.replicas_of("m"))
    assert by_zone == ["a", "a", "b"]


def test_new_replicas_open_in_the_zone_with_fewest_copies_then_fewest_replicas():
    demands = {"x": Demand(2, 100 * MB, "own:x"), "y": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": {"y"}}, 4000 * MB, zone_of={"local-0": "a"}, zones=("a", "b", "c"))
    # y (group '') holds local-0 in a: x's copies open local-1 in b (no replica there), then local-2 in c
    assert plan.replicas_of("x") == ["local-1", "local-2"]
    assert [plan.zones[r] for r in plan.replicas_of("x")] == ["b", "c"]


def test_tier_one_gets_a_group_of_its_own_and_two_copies_in_two_zones():
    config = ScalingConfig(tier=1)  # min/max replicas 1 asked: tier 1 raises both to two
    assert (config.min_replicas, config.max_replicas) == (2, 2) and ScalingConfig(tier=2).min_replicas == 1
    group = isolation.isolation_group("fraud", streams=False, mode="llm", tier=1)
    assert group == "own:fraud"
    demands = {"fraud": Demand(config.min_replicas, 100 * MB, group), "lgbm": Demand(1, 100 * MB), "mlp": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": {"lgbm"}}, 4000 * MB, zone_of={"local-0": "a"}, zones=("a", "b"))
    fraud = plan.replicas_of("fraud")
    assert len(fraud) == 2 and {plan.zones[r] for r in fraud} == {"a", "b"}
    assert all(plan.assignment[r] == {"fraud"} for r in fraud)  # no co-tenants
    assert plan.assignment["local-0"] == {"lgbm", "mlp"}


def test_an_endpoint_raised_to_tier_one_moves_out_and_its_co_tenants_stay():
    """local-0 hosts fraud, lgbm, mlp (all tier 2); fraud becomes tier 1: the shared models keep
    local-0, fraud's two copies open replicas of their own (zones b then a)."""
    demands = {"fraud": Demand(2, 100 * MB, "own:fraud"), "lgbm": Demand(1, 100 * MB), "mlp": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": {"fraud", "lgbm", "mlp"}}, 4000 * MB, zone_of={"local-0": "a"}, zones=("a", "b"))
    assert plan.assignment["local-0"] == {"lgbm", "mlp"}
    assert plan.replicas_of("fraud") == ["local-1", "local-2"] and plan.opened == ["local-1", "local-2"]
    assert {plan.zones["local-1"], plan.zones["local-2"]} == {"a", "b"}


# ---- a zone that stays down: its copies placed again in the zones that are up ----------------------

ZONED = {"local-0": "a", "local-1": "a", "local-2": "b", "local-3": "b"}
TIER1 = {"fraud": Demand(2, 100 * MB, "own:fraud"), "lgbm": Demand(1, 100 * MB)}
BEFORE = {"local-0": {"lgbm"}, "local-1": {"fraud"}, "local-2": {"fraud"}, "local-3": set()}  # fraud in a and b, lgbm in a


def test_a_down_zones_copies_are_placed_again_in_the_zone_that_is_up():
    plan = place(TIER1, BEFORE, 4000 * MB, zone_of=ZONED, zones=("a", "b"), down={"a"})
    # lgbm (the shared group, placed first): its one copy was in a, so it gets one in b, on the empty local-3;
    # fraud: its zone-a copy is kept (it serves again when a returns), and a copy is added in b on a new replica
    assert plan.replicas_of("lgbm") == ["local-0", "local-3"]
    assert plan.replicas_of("fraud") == ["local-1", "local-2", "local-4"] and plan.opened == ["local-4"] and plan.zones["local-4"] == "b"
    assert sum(plan.zones[r] != "a" for r in plan.replicas_of("fraud")) == TIER1["fraud"].copies  # min replicas up
    # nothing new in the down zone, even where it has the most room
    assert plan.assignment["local-1"] == {"fraud"} and plan.assignment["local-0"] == {"lgbm"}


def test_while_a_zone_stays_down_the_plan_is_stable_and_when_it_returns_the_stand_ins_go():
    down = place(TIER1, BEFORE, 4000 * MB, zone_of=ZONED, zones=("a", "b"), down={"a"})
    zone_of = {**ZONED, **{r: down.zones[r] for r in down.opened}}
    again = place(TIER1, down.assignment, 4000 * MB, zone_of=zone_of, zones=("a", "b"), down={"a"})
    assert again.assignment == down.assignment and again.opened == []
    back = place(TIER1, down.assignment, 4000 * MB, zone_of=zone_of, zones=("a", "b"))
    assert back.replicas_of("fraud") == ["local-1", "local-2"] and back.replicas_of("lgbm") == ["local-0"]
    assert back.assignment["local-3"] == set() and back.assignment["local-4"] == set()  # emptied: the executor stops them


@pytest.mark.parametrize("down,zones", [({"a", "b"}, ("a", "b")), ({"a"}, ())])
def test_with_no_zone_up_or_no_zones_a_down_zone_changes_nothing(down, zones):
    plan = place(TIER1, BEFORE, 4000 * MB, zone_of=ZONED, zones=zones, down=down)
    assert plan.assignment == place(TIER1, BEFORE, 4000 * MB, zone_of=ZONED, zones=zones).assignment
    assert plan.opened == [] and plan.replicas_of("fraud") == ["local-1", "local-2"]


@pytest.mark.parametrize(
    "mode,streams,want",
    [("llm", True, "llm"), ("llm", False, ""), ("none", True, ""), ("each", False, "own:m"), ("each", True, "own:m")],
)
def test_isolation_group_by_mode(mode, streams, want):
    assert isolation.isolation_group("m", streams=streams, mode=mode) == want


@pytest.mark.parametrize("mode,streams,want", [("llm", False, "own:m"), ("llm", True, "own:m"), ("each", False, "own:m"), ("none", False, "")])
def test_a_warm_standby_gives_the_model_a_group_of_its_own(mode, streams, want):
    """A standby holds one model and replaces a dead replica only if it hosted nothing else: a model
    with one asked for leaves the shared (embedded) Triton, except in ``none`` and for an ensemble's steps."""
    assert isolation.isolation_group("m", streams=streams, mode=mode, standby=True) == want
    assert isolation.isolation_group("m", streams=False, mode="llm", standby=True, ensemble=True) == ""


def test_the_tree_model_with_a_standby_moves_off_the_embedded_replica_and_its_co_tenants_stay():
    group = isolation.isolation_group("fraud", streams=False, mode="llm", standby=True)
    demands = {"fraud": Demand(1, 100 * MB, group, 1), "lgbm": Demand(1, 100 * MB), "mlp": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": {"fraud", "lgbm", "mlp"}}, 4000 * MB)
    assert plan.assignment["local-0"] == {"lgbm", "mlp"}
    (host,) = plan.replicas_of("fraud")
    assert host != "local-0" and plan.assignment[host] == {"fraud"}  # alone: a standby of fraud can take its place
    assert plan.standby == {"fraud": 1}


def test_unknown_modes_and_tiers_are_refused():
    with pytest.raises(ValueError):
        isolation.isolation_group("m", streams=False, mode="some")
    with pytest.raises(ValueError, match="tier"):
        ScalingConfig(tier=4)


def test_streams_reads_the_decoupled_policy_of_the_config(tmp_path):
    from model_repository.config_writer import ModelConfig, write_config

    for name, decoupled in (("gen", True), ("tab", False)):
        config = ModelConfig(name=name, backend="python")
        config.model_transaction_policy.decoupled = decoupled
        write_config(config, tmp_path / name)
    assert isolation.streams(tmp_path, "gen") and not isolation.streams(tmp_path, "tab")
    assert not isolation.streams(tmp_path, "missing")


# ---- locality-aware choice (server.dataplane.locality_policy, through the replica set) -------------


def _zoned_set(zones: dict[str, str], frontend_zone: str, spill: int = 2):
    members = []
    for name, zone in zones.items():
        member = Member(name, fake(name), zone=zone)
        member.models = {MODEL}
        members.append(member)
    policy = ReplicaPolicy(wait_for_member_s=0.5, zone=frontend_zone, zone_spill_outstanding=spill)
    return ReplicaSet(members, policy=policy, clock=Clock(), rng=random.Random(7)), MODEL


def test_requests_stay_in_the_frontends_zone_while_it_serves():
    rs, model = _zoned_set({"a-0": "a", "b-0": "b", "b-1": "b"}, "a")
    assert {rs._choose(model).id for _ in range(50)} == {"a-0"}


def test_a_saturated_zone_spills_to_the_least_outstanding_elsewhere():
    """a-0 holds 2 in flight = the spill threshold: the choice is among all three; a-0 (2) and b-0
    (1) lose to idle b-1 (never a busy replica while one is idle)."""
    rs, model = _zoned_set({"a-0": "a", "b-0": "b", "b-1": "b"}, "a", spill=2)
    rs.member("a-0").outstanding, rs.member("b-0").outstanding = 2, 1
    assert {rs._choose(model).id for _ in range(20)} == {"b-1"}
    rs.member("a-0").outstanding = 1  # below the threshold again: home
    assert {rs._choose(model).id for _ in range(20)} == {"a-0"}


def test_a_zone_whose_replicas_are_down_spills_over():
    rs, model = _zoned_set({"a-0": "a", "a-1": "a", "b-0": "b"}, "a")
    rs.mark_down("a-0")
    rs.mark_down("a-1")
    assert {rs._choose(model).id for _ in range(20)} == {"b-0"}


def test_without_a_zone_the_choice_is_the_sets_own():
    rs, model = _zoned_set({"a-0": "a", "b-0": "b"}, "")
    assert {rs._choose(model).id for _ in range(100)} == {"a-0", "b-0"}


def test_local_first_is_pure():
    from types import SimpleNamespace as M

    a, b, c = M(zone="a", outstanding=0), M(zone="b", outstanding=0), M(zone="a", outstanding=9)
    assert local_first([a, b, c], "a", 8) == [a]
    assert local_first([b, c], "a", 8) == [b, c]  # the only zone-a member is saturated: every candidate
    assert local_first([a, b], "", 8) == [a, b]


def test_a_model_loaded_after_start_without_a_replica_of_its_group_prefers_its_groups_replica():
    """local-1 holds an LLM and has no room for a second (capacity 600 MB, 512 MB each), so the plan
    would open a replica; until a scale-up does, the new LLM goes to its group's replica, not to the
    tree models' local-0 (both host one model)."""
    members = []
    for name, wanted in (("local-0", {"fraud"}), ("local-1", {"tiny_llama"})):
        member = Member(name, fake(name, models=wanted), local=True)
        member.models, member.wanted = set(wanted), set(wanted)
        members.append(member)
    rs = ReplicaSet(members, clock=Clock(), rng=random.Random(7))
    groups = {"fraud": "", "tiny_llama": "llm", "smollm2": "llm"}
    executor = LocalExecutor(rs, pool=None, client_factory=fake, capacity_bytes=600 << 20, group_of=groups.get)
    assert executor.plan({"smollm2": 1}).opened  # the plan wants a replica of its own
    assert executor.place_one("smollm2") == ["local-1"]


def test_the_fleet_isolates_the_llms_only_in_a_single_process_frontend(tmp_path):
    from model_repository.config_writer import ModelConfig, write_config
    from server.control.scaling.fleet import Fleet
    from server.settings import Settings

    config = ModelConfig(name="gen", backend="python")
    config.model_transaction_policy.decoupled = True
    write_config(config, tmp_path / "gen")
    one = Fleet(Settings(model_repository=tmp_path, workers=1, isolation="llm"), ReplicaSet())
    several = Fleet(Settings(model_repository=tmp_path, workers=2, isolation="llm"), ReplicaSet())
    assert one.isolation_of("gen") == isolation.LLM_GROUP and one.isolation_of("missing") == ""
    assert several.isolation_of("gen") == ""  # workers reach the embedded Triton only


def test_each_keeps_an_ensemble_and_its_steps_in_one_triton(tmp_path):
    from model_repository.config_writer import EnsembleStep, ModelConfig, ensemble_config, write_config

    for name in ("scorer", "lone"):
        write_config(ModelConfig(name=name, backend="python"), tmp_path / name)
    step = EnsembleStep("scorer", -1, {"x": "x"}, {"y": "y"})
    write_config(ensemble_config("pipeline", 8, [("x", 11, (4,))], [("y", 11, (1,))], [step]), tmp_path / "pipeline")
    assert isolation.ensemble_bound(tmp_path) == {"pipeline", "scorer"}
    assert isolation.isolation_group("scorer", streams=False, mode="each", ensemble=True) == ""
    assert isolation.isolation_group("lone", streams=False, mode="each") == "own:lone"


# ---- the local executor: a zone down past its grace period (LocalExecutor.heal) ------------------------


class _Pool:
    """The local pool as the executor uses it: replicas start (on a fake target) and stop."""

    adopted: set = set()

    def __init__(self):
        self.started, self.stopped = [], []

    async def start(self, replica_id, models=()):
        self.started.append(replica_id)
        return replica_id

    def holds(self, replica_id):
        return set()

    async def stop(self, replica_id):
        self.stopped.append(replica_id)

    def pid(self, replica_id):
        return None


def _zoned_executor(clock, layout=(("local-0", "a", {"lgbm"}), ("local-1", "a", {"fraud"}), ("local-2", "b", {"fraud"}))):
    members = []
    for name, zone, wanted in layout:
        member = Member(name, fake(name, models=wanted), local=True, zone=zone)
        member.models, member.wanted = set(wanted), set(wanted)
        members.append(member)
    rs = ReplicaSet(members, clock=clock, rng=random.Random(7), client_factory=lambda target: fake(target, models=()))
    groups = {"fraud": "own:fraud", "lgbm": "", "mlp": ""}
    pool = _Pool()
    executor = LocalExecutor(
        rs, pool, client_factory=lambda target: fake(target, models=()), group_of=groups.get, zones=("a", "b"), zone_down_grace_s=10.0,
        clock=clock,
    )  # fmt: skip
    executor.copies["fraud"] = 2  # tier 1: autoscaled to two copies
    return executor, rs, pool


def _hosts(rs, model):
    return sorted((m.id, m.zone) for m in rs.members() if model in m.wanted)


async def test_a_zone_down_past_its_grace_has_its_copies_placed_in_the_other_and_back_when_it_returns():
    clock = Clock()
    executor, rs, pool = _zoned_executor(clock)
    assert await executor.heal() is False  # every zone up
    rs.mark_down("local-0")
    rs.mark_down("local-1")  # zone a's Tritons died and do not come back
    assert await executor.heal() is False and pool.started == []  # within the grace: the supervisor may restart them
    clock.t += 9.9
    assert await executor.heal() is False and executor.down_zones == frozenset()
    clock.t += 0.1
    assert await executor.heal() is True and executor.down_zones == {"a"}
    # fraud: two copies up again (its b copy and a new replica in b); lgbm: its one copy, in b, beside fraud's group
    assert [h for h in _hosts(rs, "fraud") if h[1] == "b"] == [("local-2", "b"), ("local-4", "b")]
    assert [h for h in _hosts(rs, "lgbm") if h[1] == "b"] == [("local-3", "b")]
    assert pool.started == ["local-3", "local-4"] and all(rs.member(r).state == "up" for r in ("local-3", "local-4"))
    assert await executor.heal() is False and pool.started == ["local-3", "local-4"]  # stable while a stays down
    rs.revive("local-1")  # zone a is back (a replica of it up): the stand-ins go
    assert await executor.heal() is True and executor.down_zones == frozenset()
    assert _hosts(rs, "fraud") == [("local-1", "a"), ("local-2", "b")] and _hosts(rs, "lgbm") == [("local-0", "a")]
    assert sorted(pool.stopped) == ["local-3", "local-4"]


async def test_when_a_zone_returns_its_local_2_keeps_the_copy_and_the_stand_in_local_10_goes():
    """Ten replicas, so the stand-in for fraud's zone-a copy (local-2) opens as local-10. The plan keeps
    the copies of the replicas listed first, and the executor lists local-2 before local-10 (by number;
    as text local-10 comes first): when a returns, fraud is in both zones again, not twice in b."""
    layout = (
        ("local-0", "a", {"lgbm"}), ("local-1", "b", {"fraud"}), ("local-2", "a", {"fraud"}),
        *((f"local-{n}", "b", {"mlp"}) for n in range(3, 10)),
    )  # fmt: skip
    clock = Clock()
    executor, rs, pool = _zoned_executor(clock, layout)
    rs.mark_down("local-0")
    rs.mark_down("local-2")
    assert await executor.heal() is False
    clock.t += 10.0
    assert await executor.heal() is True and pool.started == ["local-10"]
    assert [h for h in _hosts(rs, "fraud") if h[1] == "b"] == [("local-1", "b"), ("local-10", "b")]
    rs.revive("local-2")
    assert await executor.heal() is True and executor.down_zones == frozenset()
    assert _hosts(rs, "fraud") == [("local-1", "b"), ("local-2", "a")] and pool.stopped == ["local-10"]


async def test_a_zone_back_within_its_grace_changes_nothing():
    clock = Clock()
    executor, rs, pool = _zoned_executor(clock)
    rs.mark_down("local-0")
    rs.mark_down("local-1")
    assert await executor.heal() is False
    clock.t += 5.0
    rs.revive("local-0")  # restarted by its supervisor (local-1 still restarting): a is not all down
    clock.t += 5.0
    assert await executor.heal() is False and pool.started == []
    rs.mark_down("local-0")  # down again: the grace starts over
    clock.t += 9.0
    assert await executor.heal() is False and executor.down_zones == frozenset()
