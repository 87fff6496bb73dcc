"""Placement of model copies on local replicas: first-fit decreasing on memory, sticky, one copy per replica."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.control.scaling.placement import DEFAULT_MEMORY_BYTES, Demand, Plan, memory_need, place, replica_order

MB = 1 << 20


def test_first_fit_decreasing_packs_largest_first():
    demands = {"big": Demand(1, 3000 * MB), "mid": Demand(1, 1500 * MB), "small": Demand(1, 900 * MB), "tiny": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": set()}, 4000 * MB)
    # big (3000) + tiny (100) + ... fill local-0 first-fit in decreasing order: big, then mid does not fit -> local-1
    assert plan.assignment == {"local-0": {"big", "small", "tiny"}, "local-1": {"mid"}}
    assert plan.opened == ["local-1"]


def test_copies_of_one_model_never_share_a_replica():
    plan = place({"fraud": Demand(3, 100 * MB)}, {"local-0": set()}, 4000 * MB)
    assert plan.replicas_of("fraud") == ["local-0", "local-1", "local-2"]


def test_placement_is_sticky_when_another_model_scales():
    current = {"local-0": {"a"}, "local-1": {"a", "b"}}
    plan = place({"a": Demand(2, 100 * MB), "b": Demand(2, 100 * MB)}, current, 4000 * MB)
    assert plan.assignment["local-0"] >= {"a"} and plan.assignment["local-1"] == {"a", "b"}
    assert plan.replicas_of("b") == ["local-0", "local-1"] and not plan.opened


def test_scaling_down_keeps_the_first_listed_copies():
    current = {"local-0": {"a"}, "local-1": {"a"}, "local-2": {"a"}}
    plan = place({"a": Demand(1, 100 * MB)}, current, 4000 * MB)
    assert plan.assignment == {"local-0": {"a"}, "local-1": set(), "local-2": set()}


def test_an_oversized_model_gets_a_replica_of_its_own():
    plan = place({"huge": Demand(1, 9000 * MB)}, {"local-0": {"x"}}, 4000 * MB)
    assert plan.oversized == ["huge"] and plan.replicas_of("huge") == ["local-1"]


def test_memory_need_reads_the_registry_hardware_metadata():
    assert memory_need({"memory_mb": 300}) == 300 * MB
    assert memory_need({"memory_gb": 2}) == 2 << 30
    assert memory_need({"gpu": 0}) == DEFAULT_MEMORY_BYTES
    assert memory_need(None, default=7) == 7


@settings(max_examples=300, deadline=None)
@given(
    demands=st.dictionaries(st.sampled_from("abcdefgh"), st.tuples(st.integers(0, 4), st.integers(1, 3000)), max_size=8),
    current=st.lists(st.sets(st.sampled_from("abcdefgh"), max_size=4), min_size=1, max_size=4),
    capacity=st.integers(500, 4000),
)
def test_every_copy_is_placed_once_per_replica_without_overcommitting(demands, current, capacity):
    wanted = {m: Demand(c, mb * MB) for m, (c, mb) in demands.items()}
    start = {f"local-{i}": set(models) for i, models in enumerate(current)}
    plan = place(wanted, start, capacity * MB)
    for model, need in wanted.items():
        assert len(plan.replicas_of(model)) == need.copies
    for replica, models in plan.assignment.items():
        assert models <= set(wanted)
        used = plan.used(wanted, replica)
        kept = start.get(replica, set()) & models
        # only copies that were already there (sticky) or a lone oversized copy may exceed the capacity
        if used > capacity * MB:
            assert models == kept or (len(models) == 1 and next(iter(models)) in plan.oversized), (replica, models, used)
    # copies already placed and still wanted stay where they were
    for replica, models in start.items():
        for model in models:
            if model in wanted and wanted[model].copies >= sum(1 for r in start.values() if model in r):
                assert model in plan.assignment[replica]


# ---- exact plans (the mutation pass of placement.py) --------------------------------------------------


@pytest.mark.parametrize(
    ("hardware", "need"),
    [
        ({"memory_bytes": 1000}, 1000),
        ({"memory_mb": 2}, 2 << 20),
        ({"memory_mb": 0.5}, 1 << 19),
        ({"memory_gb": 1.5}, 3 << 29),
        ({"memory_gib": 2}, 2 << 30),
        ({"memory_bytes": 7, "memory_gb": 1}, 7),  # the most precise key wins
        ({"memory_mb": 0}, DEFAULT_MEMORY_BYTES),
        ({"memory_mb": -1}, DEFAULT_MEMORY_BYTES),
        ({"memory_gb": True}, DEFAULT_MEMORY_BYTES),
        ({"memory_gb": "2"}, DEFAULT_MEMORY_BYTES),
        (None, DEFAULT_MEMORY_BYTES),
    ],
)
def test_memory_need_reads_each_key_with_its_unit(hardware, need):
    assert memory_need(hardware) == need


def test_the_largest_model_is_placed_first():
    plan = place({"a": Demand(1, 3), "z": Demand(1, 8)}, {}, capacity=10)
    assert plan.assignment == {"local-0": {"z"}, "local-1": {"a"}} and plan.opened == ["local-0", "local-1"]
    tie = place({"b": Demand(1, 6), "a": Demand(1, 6)}, {}, capacity=10)
    assert tie.assignment == {"local-0": {"a"}, "local-1": {"b"}}  # equal sizes: by name


def test_new_replicas_get_ids_no_replica_has():
    plan = place({"m": Demand(4, 5)}, {"local-0": {"m"}, "local-2": {"m"}}, capacity=5)
    assert plan.opened == ["local-3", "local-4"] and plan.replicas_of("m") == ["local-0", "local-2", "local-3", "local-4"]


def test_replicas_are_ordered_by_their_number_not_as_text():
    """Eleven copies: local-2 comes before local-10 (as text local-10 would come first, and the executor
    lists replicas in this order, so a stand-in local-10 would keep its copy over a returned local-2)."""
    plan = place({"m": Demand(11, 5)}, {}, capacity=5)
    assert plan.replicas_of("m") == [f"local-{n}" for n in range(11)]
    assert sorted(["local-10", "local-2", "local-1", "local-0"], key=replica_order) == ["local-0", "local-1", "local-2", "local-10"]
    assert sorted(["b-2", "a-10", "a-9"], key=replica_order) == ["a-9", "a-10", "b-2"]  # the name first, then the number


def test_a_copy_that_fills_a_replica_exactly_is_not_oversized():
    assert place({"m": Demand(1, 10)}, {}, capacity=10).oversized == []
    assert place({"m": Demand(1, 11)}, {}, capacity=10).oversized == ["m"]


def test_a_replica_the_plan_does_not_know_uses_nothing():
    assert Plan({}).used({"m": Demand(1, 5)}, "local-9") == 0
    assert Plan({"r": {"m", "gone"}}).used({"m": Demand(1, 5)}, "r") == 5


# ---- warm standbys in the budget ------------------------------------------------------------------------


def test_a_standby_that_fits_a_replica_is_kept_and_its_memory_counted():
    demands = {"fraud": Demand(1, 300 * MB, standby=2), "mlp": Demand(1, 100 * MB)}
    plan = place(demands, {"local-0": set()}, 4000 * MB)
    assert plan.standby == {"fraud": 2} and plan.refused_standby == {}
    assert plan.memory(demands) == {"replicas": 400 * MB, "standby": 600 * MB}  # two idle copies beside the serving ones
    assert plan.assignment == {"local-0": {"fraud", "mlp"}} and not plan.opened  # standbys open no replica of their own


def test_a_standby_larger_than_a_replica_is_refused_while_its_copy_still_serves():
    demands = {"huge": Demand(1, 9000 * MB, standby=1), "fraud": Demand(1, 300 * MB, standby=1)}
    plan = place(demands, {"local-0": set()}, 4000 * MB)
    assert plan.refused_standby == {"huge": 1} and plan.standby == {"fraud": 1}
    assert plan.oversized == ["huge"] and plan.replicas_of("huge")  # serving, on a replica of its own
    assert plan.memory(demands)["standby"] == 300 * MB  # the refused one holds nothing
    assert place({"m": Demand(1, 10, standby=1)}, {}, capacity=10).standby == {"m": 1}  # fills a replica exactly: fits


def test_a_model_at_zero_copies_keeps_its_standby_and_no_replica():
    plan = place({"m": Demand(0, 100 * MB, standby=1)}, {"local-0": {"m"}}, 4000 * MB)
    assert plan.standby == {"m": 1} and plan.assignment == {"local-0": set()}
    assert plan.memory({"m": Demand(0, 100 * MB, standby=1)}) == {"replicas": 0, "standby": 100 * MB}


@settings(max_examples=200, deadline=None)
@given(
    demands=st.dictionaries(st.sampled_from("abcdef"), st.tuples(st.integers(0, 3), st.integers(1, 3000), st.integers(0, 3)), max_size=6),
    capacity=st.integers(500, 4000),
)
def test_every_standby_asked_for_is_kept_within_a_replica_or_refused(demands, capacity):
    wanted = {m: Demand(c, mb * MB, standby=n) for m, (c, mb, n) in demands.items()}
    plan = place(wanted, {"local-0": set()}, capacity * MB)
    assert {**plan.standby, **plan.refused_standby} == {m: d.standby for m, d in wanted.items() if d.standby}
    assert not set(plan.standby) & set(plan.refused_standby)
    assert all(wanted[m].memory <= capacity * MB for m in plan.standby) and all(wanted[m].memory > capacity * MB for m in plan.refused_standby)
    assert plan.memory(wanted)["standby"] == sum(wanted[m].memory * n for m, n in plan.standby.items())
    without = place({m: Demand(d.copies, d.memory) for m, d in wanted.items()}, {"local-0": set()}, capacity * MB)
    assert plan.assignment == without.assignment and plan.opened == without.opened  # standbys change nothing of where copies go
