"""Two views of cost over a window, pure functions of metered data (no clock, no database).

- **Owner view** (:func:`owner_view`): what each endpoint's replicas *reserved*: replica-seconds in
  the window x the price of the replica's hardware class and capacity type, idle time included. A
  replica shared by several endpoints is split between the endpoints on it at each moment by their
  memory share (equal shares when no memory is recorded). Charged to the endpoint's owner team.
- **Caller view** (:func:`caller_view`): what each calling team's requests *consumed*: the metered
  compute seconds and tokens (``tenancy_usage``), priced at the endpoint's cost per reserved second.
  The reserved time nobody's requests used is one ``(idle)`` line per endpoint, charged to its owner,
  so both views add up to the same total: the callers of endpoint E share
  ``owner_cost(E) x min(1, compute_s(E) / replica_s(E))`` in proportion to their compute seconds,
  and ``(idle)`` is the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from server.control.planning.cost_store import Interval
from server.control.planning.prices import PriceBook

IDLE = "(idle)"
UNOWNED = "(unowned)"


@dataclass
class _Acc:
    replica_s: float = 0.0
    cost: float = 0.0
    hardware: set | None = None


def owner_view(intervals: Iterable[Interval], prices: PriceBook, since: float, until: float, owners: Mapping[str, str]) -> list[dict]:
    """One row per (owner team, endpoint): replica-seconds reserved in [since, until) and their cost."""
    by_replica: dict[str, list[Interval]] = {}
    for iv in intervals:
        by_replica.setdefault(iv.replica, []).append(iv)
    acc: dict[str, _Acc] = {}
    for rows in by_replica.values():
        spans = [(max(since, r.started_at), min(until, until if r.ended_at is None else r.ended_at), r) for r in rows]
        spans = [(a, b, r) for a, b, r in spans if b > a]
        cuts = sorted({t for a, b, _ in spans for t in (a, b)})
        for lo, hi in zip(cuts, cuts[1:]):
            active = [r for a, b, r in spans if a <= lo and b >= hi]
            if not active:
                continue
            first = active[0]  # a replica's hardware is one class; its first interval in the segment names it
            seconds = hi - lo
            segment_cost = seconds * prices.per_second(first.hardware, first.capacity_type)
            memory = sum(max(0, r.memory_bytes) for r in active)
            for r in active:
                share = max(0, r.memory_bytes) / memory if memory else 1.0 / len(active)
                a = acc.setdefault(r.endpoint, _Acc(hardware=set()))
                a.replica_s += seconds * share
                a.cost += segment_cost * share
                a.hardware.add(f"{first.hardware}/{first.capacity_type}")
    out = [
        {"team": owners.get(ep) or UNOWNED, "endpoint": ep, "hardware": ",".join(sorted(a.hardware)), "replica_s": round(a.replica_s, 6),
         "cost_usd": round(a.cost, 9), "prices": prices.version}
        for ep, a in acc.items()
    ]  # fmt: skip
    return sorted(out, key=lambda r: (r["team"], r["endpoint"]))


def caller_view(usage: Iterable[Mapping], owner_rows: Iterable[Mapping]) -> list[dict]:
    """One row per (calling team, endpoint), then one ``(idle)`` row per endpoint with reserved time unused.

    ``usage``: ``TenancyStore.usage("team_model", since, until)`` rows; ``owner_rows``: :func:`owner_view`.
    Usage of an endpoint with no reserved interval in the window has no price: its cost is 0 and
    ``priced`` is False (the replica ledger did not record it)."""
    owners = {r["endpoint"]: r for r in owner_rows}
    per_endpoint: dict[str, list[Mapping]] = {}
    for row in usage:
        per_endpoint.setdefault(row["model"], []).append(row)
    out = []
    for ep in sorted(set(per_endpoint) | set(owners)):
        rows = per_endpoint.get(ep, [])
        owner = owners.get(ep)
        compute_s = sum(r["compute_us"] for r in rows) / 1e6
        reserved_s = owner["replica_s"] if owner else 0.0
        cost = owner["cost_usd"] if owner else 0.0
        used = min(1.0, compute_s / reserved_s) if reserved_s > 0 else 0.0
        used_cost = cost * used
        for r in rows:
            share = (r["compute_us"] / 1e6) / compute_s if compute_s > 0 else 0.0
            out.append({
                "team": r["team"], "endpoint": ep, "requests": r["requests"], "input_tokens": r.get("input_tokens", 0),
                "output_tokens": r.get("output_tokens", 0), "tokens": r["tokens"], "compute_s": round(r["compute_us"] / 1e6, 6),
                "cost_usd": round(used_cost * share, 9), "priced": owner is not None,
            })  # fmt: skip
        if owner is not None and cost - used_cost > 0:
            out.append({
                "team": IDLE, "endpoint": ep, "requests": 0, "input_tokens": 0, "output_tokens": 0, "tokens": 0,
                "compute_s": round(max(0.0, reserved_s - compute_s), 6), "cost_usd": round(cost - used_cost, 9), "priced": True,
                "owner": owner["team"],
            })  # fmt: skip
    return sorted(out, key=lambda r: (r["team"] == IDLE, r["team"], r["endpoint"]))


def by_team(rows: Iterable[Mapping]) -> dict[str, float]:
    """Cost per team of either view."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["team"]] = out.get(r["team"], 0.0) + r["cost_usd"]
    return out


def total(rows: Iterable[Mapping]) -> float:
    return sum(r["cost_usd"] for r in rows)
