"""Which local replica hosts which model: first-fit decreasing on memory needs (pure).

Each model asks for ``copies`` replicas, each copy needing ``memory`` bytes (the registry's
hardware metadata where present — ``memory_mb`` / ``memory_gb`` — else a default); each replica
process offers ``capacity`` bytes. Copies already placed where they are still wanted stay put
(placement is sticky, so scaling one model never moves another); the remaining copies go, largest
first, to the first replica with room that does not already hold a copy of that model; when none
has room, a new replica is opened. Two copies of one model never share a replica (a copy is a
failure domain). A copy larger than an empty replica still gets a replica of its own (and is
reported as ``oversized``): refusing would leave the model unserved.

Failure domains (issue 29): a model's ``group`` is its isolation group — a replica hosts models of
one group only, so a crash of the Triton serving one group (the LLMs, a tier-1 endpoint's own
group) never touches another's. Replicas carry a zone (``zone_of``); a copy goes to the replica
with room whose zone holds the fewest copies of that model, and a new replica opens in the zone
(of ``zones``) with the fewest, so an endpoint's copies spread over zones before any zone gets two.

A zone that is down (``down``: every replica of it down for longer than a grace period, decided
by the executor) takes nothing new: its copies stay in the plan (so they serve again when it
returns) but do not count, so the copies it held are placed again in the zones that are up, on a
replica with room or a new one opened there (with no zone up, or no zones, ``down`` changes
nothing). When it returns (``down`` empty again) the plan keeps each model's first ``copies``
copies in the order replicas are listed — the returned zone's replicas, listed before the replicas
opened for its copies, keep theirs and the stand-ins are dropped.

Warm standbys (``Demand.standby``, ``INFERPLANE_WARM_STANDBY``) are in the budget too: each is a
Triton of its own holding one copy loaded, out of rotation, and the replica a scale-up makes of it
when it takes one. So a standby needs the model's memory within one replica's ``capacity``; the
plan keeps those that fit (``standby``) and refuses the others (``refused_standby``: a copy larger
than a replica still gets a replica of its own when it serves, but nothing holds it idle), and
``memory`` counts what the standbys hold beside the replicas' copies.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_MEMORY_BYTES = 512 << 20


@dataclass(frozen=True)
class Demand:
    copies: int
    memory: int  # bytes per copy
    group: str = ""  # isolation group: shares a replica only with models of the same group
    standby: int = 0  # warm standbys kept: Tritons holding one copy each, loaded and out of rotation


@dataclass
class Plan:
    assignment: dict[str, set[str]]  # replica id -> models
    opened: list[str] = field(default_factory=list)  # replica ids the plan needs that do not exist yet
    oversized: list[str] = field(default_factory=list)
    zones: dict[str, str] = field(default_factory=dict)  # replica id -> zone ('' where none is known)
    standby: dict[str, int] = field(default_factory=dict)  # model -> standbys kept (each fits a replica)
    refused_standby: dict[str, int] = field(default_factory=dict)  # model -> standbys refused: a copy outgrows a replica

    def replicas_of(self, model: str) -> list[str]:
        return sorted((r for r, models in self.assignment.items() if model in models), key=replica_order)

    def used(self, demands: Mapping[str, Demand], replica: str) -> int:
        return sum(demands[m].memory for m in self.assignment.get(replica, ()) if m in demands)

    def memory(self, demands: Mapping[str, Demand]) -> dict[str, int]:
        """Bytes the plan holds: the replicas' copies and the standbys' (idle, but loaded)."""
        return {
            "replicas": sum(self.used(demands, r) for r in self.assignment),
            "standby": sum(demands[m].memory * n for m, n in self.standby.items() if m in demands),
        }


def replica_order(replica: str) -> list:
    """Sort key of a replica id: its numbers as numbers (``local-2`` before ``local-10``). As text
    ``local-10`` comes first, and when a zone returns the plan keeps the copies of the replicas
    listed first: a stand-in opened as ``local-10`` would keep its copy and the returned ``local-2``
    lose it, leaving the model's copies in one zone."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", replica)]


def memory_need(hardware: Mapping | None, default: int = DEFAULT_MEMORY_BYTES) -> int:
    """Bytes one copy needs, from a registry version's hardware metadata."""
    hardware = hardware or {}
    for key, scale in (("memory_bytes", 1), ("memory_mb", 1 << 20), ("memory_gb", 1 << 30), ("memory_gib", 1 << 30)):
        value = hardware.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return int(value * scale)
    return default


def place(
    demands: Mapping[str, Demand],
    current: Mapping[str, set[str]],
    capacity: int,
    *,
    new_id=lambda n: f"local-{n}",
    zone_of: Mapping[str, str] | None = None,
    zones: Sequence[str] = (),
    down: Collection[str] = (),
) -> Plan:
    """The assignment of model copies to replicas for ``demands``, starting from ``current``
    (replica id -> models it hosts now; ids in order of preference, the first is the primary);
    ``zone_of``: the zone of each existing replica, ``zones``: the zones a new replica may open in,
    ``down``: the zones down (their copies kept but not counted; nothing new goes there)."""
    if set(zones) <= set(down):
        down = ()  # no zone is up to take the copies (or none is known): the plan is as without any down
    assignment = {r: set() for r in current}
    zone = {r: (zone_of or {}).get(r, "") for r in current}
    # keep what is still wanted, in the order replicas are listed, up to each model's copies
    kept: dict[str, int] = {}
    for replica, models in current.items():
        # the shared group's copies first: a model that moved to a group of its own (tier 1) leaves
        for model in sorted(models, key=lambda m: (m not in demands or demands[m].group != "", m)):
            want = demands.get(model)
            if want is not None and kept.get(model, 0) < want.copies and _fits_group(demands, models & assignment[replica], want.group):
                assignment[replica].add(model)
                if zone[replica] not in down:  # a down zone's copy waits for it, and is placed again meanwhile
                    kept[model] = kept.get(model, 0) + 1
    plan = Plan(assignment, zones=zone)
    zones = [z for z in zones if z not in down]  # new replicas open where the zones are up
    order = sorted(demands, key=lambda m: (demands[m].group != "", -demands[m].memory, m))  # the shared group first: the primary
    counter = len(current)
    for model in order:
        need = demands[model]
        for _ in range(need.copies - kept.get(model, 0)):
            spread = _copies_by_zone(plan, model)
            fits = [
                r for r, models in plan.assignment.items()
                if model not in models and plan.zones[r] not in down and _fits_group(demands, models, need.group)
                and plan.used(demands, r) + need.memory <= capacity
            ]  # fmt: skip
            target = min(fits, key=lambda r: spread.get(plan.zones[r], 0)) if fits else None  # min keeps list order on ties
            if target is not None and zones and spread.get(plan.zones[target], 0) > min(spread.get(z, 0) for z in zones):
                target = None  # a zone with fewer copies has no room: a replica opens there
            if target is None:
                while new_id(counter) in plan.assignment:
                    counter += 1
                target = new_id(counter)
                counter += 1
                plan.assignment[target] = set()
                plan.zones[target] = _emptiest_zone(plan, zones, spread)
                plan.opened.append(target)
                if need.memory > capacity:
                    plan.oversized.append(model)
            plan.assignment[target].add(model)
    for model in sorted(m for m in demands if demands[m].standby > 0):
        need = demands[model]
        (plan.standby if need.memory <= capacity else plan.refused_standby)[model] = need.standby
    return plan


def _fits_group(demands: Mapping[str, Demand], models: set[str], group: str) -> bool:
    """A replica takes a model only when every model it hosts is of the model's isolation group."""
    return all(demands[m].group == group for m in models if m in demands)


def _copies_by_zone(plan: Plan, model: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for replica, models in plan.assignment.items():
        if model in models:
            out[plan.zones[replica]] = out.get(plan.zones[replica], 0) + 1
    return out


def _emptiest_zone(plan: Plan, zones: Sequence[str], spread: Mapping[str, int]) -> str:
    """Where a new replica opens: the zone with the fewest copies of the model, then the fewest replicas."""
    if not zones:
        return ""
    replicas = {z: sum(1 for r in plan.assignment if plan.zones.get(r) == z) for z in zones}
    return min(zones, key=lambda z: (spread.get(z, 0), replicas[z]))
