"""Placement across zones and isolation groups: the behaviours the mutation pass found unpinned (issue 34).

Each test states what an operator relies on (a copy spreads to the zone with the fewest copies, a
replica of no known zone reads as zone ``""``, a model that leaves for a group of its own does not
take the shared models with it); the mutants each one kills are named in its docstring.
"""

from __future__ import annotations

from server.control.scaling.placement import Demand, place

MB = 1 << 20
CAPACITY = 1000 * MB


def test_a_copy_goes_to_the_replica_in_the_zone_without_one_even_when_it_is_listed_later():
    """local-1 (zone a, which already holds a copy) comes first, local-2 (zone b, none) second: the copy
    goes to b. (Kills: spread counted for no model, its default read as 1, min by replica id.)"""
    current = {"local-0": {"m"}, "local-1": set(), "local-2": set()}
    zone_of = {"local-0": "a", "local-1": "a", "local-2": "b"}
    plan = place({"m": Demand(2, 100 * MB)}, current, CAPACITY, zone_of=zone_of)
    assert plan.replicas_of("m") == ["local-0", "local-2"]
    assert not plan.opened


def test_a_replica_opens_in_the_zone_without_a_copy_when_only_a_crowded_zone_has_room():
    """Zone b has no replica at all; the room on local-1 (zone a, which holds a copy) is not taken:
    a replica opens in b. (Kills: the crowded-zone check reading no zone, or empty zones as 1 copy.)"""
    current = {"local-0": {"m"}, "local-1": set()}
    plan = place({"m": Demand(2, 100 * MB)}, current, CAPACITY, zone_of={"local-0": "a", "local-1": "a"}, zones=["a", "b"])
    assert plan.replicas_of("m") == ["local-0", "local-2"]
    assert plan.opened == ["local-2"] and plan.zones["local-2"] == "b"


def test_a_new_replica_opens_where_the_model_has_fewer_copies_before_looking_at_replica_counts():
    """Zone a holds two copies of m, zone b one, and both zones have two replicas (b's second is full
    of another model): the new replica opens in b. (Kills: copies counted as 1 per zone however
    many, the emptiest zone ignoring copies.)"""
    current = {"local-0": {"m"}, "local-1": {"m"}, "local-2": {"m"}, "local-3": {"x"}}
    zone_of = {"local-0": "a", "local-1": "a", "local-2": "b", "local-3": "b"}
    demands = {"m": Demand(4, 100 * MB), "x": Demand(1, CAPACITY)}
    plan = place(demands, current, CAPACITY, zone_of=zone_of, zones=["a", "b"])
    assert plan.opened == ["local-4"] and plan.zones["local-4"] == "b"
    assert plan.replicas_of("m") == ["local-0", "local-1", "local-2", "local-4"]


def test_a_zone_with_no_copy_wins_over_one_with_a_copy_and_fewer_replicas():
    """Zone a: one replica, holding m. Zone b: two replicas, both full of another model. The second
    copy opens a replica in b (no copy there), not in a (fewer replicas). (Kills: a zone without
    copies read as holding one.)"""
    current = {"local-0": {"m"}, "local-1": {"x"}, "local-2": {"y"}}
    zone_of = {"local-0": "a", "local-1": "b", "local-2": "b"}
    demands = {"m": Demand(2, 100 * MB), "x": Demand(1, CAPACITY), "y": Demand(1, CAPACITY)}
    plan = place(demands, current, CAPACITY, zone_of=zone_of, zones=["a", "b"])
    assert plan.opened == ["local-3"] and plan.zones["local-3"] == "b"


def test_replicas_of_no_known_zone_read_as_zone_empty_string():
    """A replica missing from ``zone_of``, and a replica opened with no ``zones`` to choose from, are
    in zone "" (never None or another name). (Kills: the defaults of the zone maps.)"""
    plan = place({"m": Demand(2, 100 * MB)}, {"local-0": {"m"}, "local-1": {"m"}}, CAPACITY, zone_of={"local-0": "a"})
    assert plan.zones == {"local-0": "a", "local-1": ""}
    grown = place({"m": Demand(2, 100 * MB)}, {"local-0": {"m"}}, CAPACITY)
    assert grown.opened == ["local-1"] and grown.zones["local-1"] == ""


def test_a_model_moving_to_a_group_of_its_own_leaves_the_shared_models_where_they_are():
    """local-0 hosts a and b; b moves to isolation group "t1" while a new, larger shared model c
    arrives: a stays on local-0 (sticky; c would otherwise have taken local-0 first, being larger),
    c and b get replicas of their own. (Kills: the keep check reading every model the replica hosted
    before, the one leaving included.)"""
    demands = {"a": Demand(1, 100 * MB), "b": Demand(1, 100 * MB, group="t1"), "c": Demand(1, 950 * MB)}
    plan = place(demands, {"local-0": {"a", "b"}}, CAPACITY)
    assert plan.assignment == {"local-0": {"a"}, "local-1": {"c"}, "local-2": {"b"}}
    assert plan.opened == ["local-1", "local-2"]
