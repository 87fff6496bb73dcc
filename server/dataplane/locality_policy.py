"""Locality-aware replica choice (issue 29), pure: a request picks among the replicas in its
frontend's own zone while one of them is serving and not saturated, and spills over to every zone
when none is (all of the zone's replicas down, ejected, or holding ``spill_outstanding`` requests
each). The replica set then applies its least-outstanding choice (power of two) to what is left,
so a spill goes to the least loaded replica anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Placed(Protocol):
    zone: str
    outstanding: int


M = TypeVar("M", bound=Placed)


def local_first(candidates: Sequence[M], zone: str, spill_outstanding: int) -> list[M]:
    """The candidates of ``zone`` below ``spill_outstanding`` in flight; all of them when there are none
    (or the frontend has no zone)."""
    if not zone:
        return list(candidates)
    local = [m for m in candidates if m.zone == zone and m.outstanding < spill_outstanding]
    return local or list(candidates)
