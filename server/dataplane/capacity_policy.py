"""Spot (preemptible) capacity (issue 29), pure: which replicas a request may go to by its traffic
class and the replicas' capacity.

* ``realtime`` (every caller's request): on-demand replicas only, unless the endpoint opts in
  (its config's ``inferplane.spot: "true"``); with no on-demand replica serving the model the
  request is held for one like any request no replica serves, never sent to spot;
* ``batch`` (a batch job's rows) and ``shadow`` (shadow copies): spot replicas first; with none
  serving the model a batch row takes an on-demand replica (the work goes on when the spot pool is
  reclaimed or empty), while a shadow copy *pauses* (dropped and counted) if the model has spot
  replicas that are all away — a shadow never spends on-demand capacity the spot pool was meant to
  carry; a fleet without spot replicas for the model sends its shadow copies on-demand as before.

A replica being reclaimed (its notice received) is draining: it serves nothing new, so it is not
among the candidates this policy sees.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Protocol, TypeVar

ON_DEMAND, SPOT = "on_demand", "spot"
CAPACITIES = (ON_DEMAND, SPOT)
REALTIME, BATCH, SHADOW = "realtime", "batch", "shadow"
SPOT_PARAMETER = "inferplane.spot"  # a model config parameter: "true" lets its real-time traffic use spot replicas
# the traffic class of this task's calls: batch rows (server.dataplane.dataplane) and shadow copies
# (server.dataplane.routing) set it; everything else is real-time
TRAFFIC: contextvars.ContextVar[str] = contextvars.ContextVar("inferplane_traffic", default=REALTIME)


class Provisioned(Protocol):
    capacity: str


M = TypeVar("M", bound=Provisioned)


class ShadowPaused(Exception):
    """The model's spot replicas are all away (reclaimed): its shadow copies pause."""


def parse_capacity(value: str) -> str:
    value = (value or ON_DEMAND).strip().lower().replace("-", "_")
    if value not in CAPACITIES:
        raise ValueError(f"capacity must be one of {', '.join(CAPACITIES)}, got {value!r}")
    return value


def spot_opt_in(params: dict[str, str] | None) -> bool:
    return str((params or {}).get(SPOT_PARAMETER, "")).strip().lower() in ("true", "1", "yes", "on")


def eligible(candidates: Sequence[M], traffic: str, *, spot_ok: bool = False, spot_hosts: int = 0) -> list[M]:
    """The candidates (replicas serving the model now) ``traffic`` may use, preferred ones only.
    ``spot_ok``: the endpoint lets real-time traffic use spot; ``spot_hosts``: the model's spot
    replicas whether serving or not (reclaimed ones included). Raises :class:`ShadowPaused` for a
    shadow copy whose model's spot replicas are all away."""
    spot = [m for m in candidates if m.capacity == SPOT]
    if traffic == REALTIME:
        return list(candidates) if spot_ok else [m for m in candidates if m.capacity != SPOT]
    if spot:
        return spot
    if traffic == SHADOW and spot_hosts:
        raise ShadowPaused("the model's spot replicas are away (reclaimed): shadow copies pause")
    return list(candidates)
