"""Which local replica hosts which model: first-fit decreasing on memory needs (pure).

Each model asks for ``copies`` replicas, each copy needing ``memory`` bytes (the registry's
hardware metadata where present — ``memory_mb`` / ``memory_gb`` — else a default); each replica
process offers ``capacity`` bytes. Copies already placed where they are still wanted stay put
(placement is sticky, so scaling one model never moves another); the remaining copies go, largest
first, to the first replica with room that does not already hold a copy of that model; when none
has room, a new replica is opened. Two copies of one model never share a replica (a copy is a
failure domain). A copy larger than an empty replica still gets a replica of its own (and is
reported as ``oversized``): refusing would leave the model unserved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_MEMORY_BYTES = 512 << 20


@dataclass(frozen=True)
class Demand:
    copies: int
    memory: int  # bytes per copy


@dataclass
class Plan:
    assignment: dict[str, set[str]]  # replica id -> models
    opened: list[str] = field(default_factory=list)  # replica ids the plan needs that do not exist yet
    oversized: list[str] = field(default_factory=list)

    def replicas_of(self, model: str) -> list[str]:
        return sorted(r for r, models in self.assignment.items() if model in models)

    def used(self, demands: Mapping[str, Demand], replica: str) -> int:
        return sum(demands[m].memory for m in self.assignment.get(replica, ()) if m in demands)


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
) -> Plan:
    """The assignment of model copies to replicas for ``demands``, starting from ``current``
    (replica id -> models it hosts now; ids in order of preference, the first is the primary)."""
    assignment = {r: set() for r in current}
    # keep what is still wanted, in the order replicas are listed, up to each model's copies
    kept: dict[str, int] = {}
    for replica, models in current.items():
        for model in sorted(models):
            want = demands.get(model)
            if want is not None and kept.get(model, 0) < want.copies:
                assignment[replica].add(model)
                kept[model] = kept.get(model, 0) + 1
    plan = Plan(assignment)
    order = sorted(demands, key=lambda m: (-demands[m].memory, m))
    counter = len(current)
    for model in order:
        need = demands[model]
        for _ in range(need.copies - kept.get(model, 0)):
            target = None
            for replica, models in plan.assignment.items():
                if model not in models and plan.used(demands, replica) + need.memory <= capacity:
                    target = replica
                    break
            if target is None:
                while new_id(counter) in plan.assignment:
                    counter += 1
                target = new_id(counter)
                counter += 1
                plan.assignment[target] = set()
                plan.opened.append(target)
                if need.memory > capacity:
                    plan.oversized.append(model)
            plan.assignment[target].add(model)
    return plan
