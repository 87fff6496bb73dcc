"""Chargeback and right-sizing.

- **Chargeback** (:func:`chargeback`): per team and endpoint, requests, compute seconds (the metered
  Triton / engine time, ``server.tenancy.metering``) and cost: compute hours x the hardware's price
  (``deploy/pricing.json``'s table, the same one ``inferplane plan cost`` reads).
- **Right-sizing** (:func:`rightsize`): from two readings of a running frontend's /metrics some seconds
  apart, per endpoint: request rate, how busy its Triton instances were (compute seconds per second /
  instances), the instances that would run it at the target utilization, the rows per Triton call, and
  whether its p99 meets the latency SLO — with a batching suggestion when it does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.control.monitoring import scrape
from server.control.planning.capacity import HOURS_PER_MONTH
from server.tenancy.metering import DEFAULT_PRICES


def chargeback(rows: list[dict], prices: dict[str, float] | None = None, hardware: dict[str, str] | None = None, default_hardware: str = "cpu") -> list[dict]:
    """``rows``: ``TenancyStore.usage("team_model", since)``; one line per (team, endpoint), then a total per team."""
    prices = DEFAULT_PRICES if prices is None else prices
    hardware = hardware or {}
    out, totals = [], {}
    for row in rows:
        hw = hardware.get(row["model"], default_hardware)
        if hw not in prices:
            raise ValueError(f"no price for hardware {hw!r} (prices: {', '.join(sorted(prices))})")
        compute_s = row["compute_us"] / 1e6
        cost = compute_s / 3600.0 * prices[hw]
        out.append({"team": row["team"], "endpoint": row["model"], "hardware": hw, "requests": row["requests"],
                    "tokens": row["tokens"], "compute_s": round(compute_s, 6), "cost_usd": round(cost, 9)})  # fmt: skip
        t = totals.setdefault(row["team"], {"team": row["team"], "endpoint": "*", "hardware": "", "requests": 0, "tokens": 0, "compute_s": 0.0, "cost_usd": 0.0})
        t["requests"] += row["requests"]
        t["tokens"] += row["tokens"]
        t["compute_s"] = round(t["compute_s"] + compute_s, 6)
        t["cost_usd"] = round(t["cost_usd"] + cost, 9)
    return sorted(out, key=lambda r: (r["team"], r["endpoint"])) + sorted(totals.values(), key=lambda r: r["team"])


@dataclass
class Reading:
    """What right-sizing needs of one endpoint, cumulative, at one scrape."""

    requests: float = 0.0
    busy_s: float = 0.0  # Triton compute seconds (input + infer + output)
    rows: float = 0.0  # rows in frontend Triton calls
    calls: float = 0.0
    buckets: tuple = ()


def readings(text: str) -> dict[str, Reading]:
    out: dict[str, Reading] = {}

    def add(model: str, s) -> None:
        r = out.setdefault(model, Reading())
        if s.name == "inferplane_requests_total":
            r.requests += s.value
        elif s.name == "inferplane_triton_stat_seconds" and s.labels.get("phase", "").startswith("compute_"):
            r.busy_s += s.value
        elif s.name == "inferplane_batch_rows_sum":
            r.rows += s.value
        elif s.name == "inferplane_batch_rows_count":
            r.calls += s.value

    for model, buckets in scrape.per_model(text, add).items():
        out[model].buckets = buckets
    return out


def _p99(a: Reading, b: Reading) -> float | None:
    before = dict(a.buckets)
    deltas = [(le, max(0.0, c - before.get(le, 0.0))) for le, c in b.buckets]
    total = deltas[-1][1] if deltas else 0.0
    if not total:
        return None
    for le, c in deltas:
        if c >= 0.99 * total:
            return le
    return None


def rightsize(
    before: dict[str, Reading], after: dict[str, Reading], seconds: float, *, instances: dict[str, int], slo_latency_s: dict[str, float],
    max_batch: dict[str, int] | None = None, target_utilization: float = 0.6, price_per_instance_hour: float = DEFAULT_PRICES["cpu"],
) -> list[dict]:  # fmt: skip
    """One recommendation per endpoint seen in both readings."""
    max_batch = max_batch or {}
    out = []
    for model in sorted(set(before) & set(after)):
        a, b = before[model], after[model]
        rps = max(0.0, b.requests - a.requests) / seconds
        busy = max(0.0, b.busy_s - a.busy_s) / seconds  # instance-seconds of compute per second
        have = max(1, instances.get(model, 1))
        utilization = busy / have
        need = max(1, math.ceil(busy / target_utilization)) if busy > 0 else 1
        calls = b.calls - a.calls
        rows_per_call = (b.rows - a.rows) / calls if calls > 0 else None
        p99 = _p99(a, b)
        threshold = slo_latency_s.get(model)
        meets = None if p99 is None or threshold is None else p99 <= threshold
        if meets is False and need <= have:
            batching = "p99 over the SLO with idle instances: lower inferplane.coalesce_max_batch (smaller, faster calls)"
        elif meets is False:
            batching = f"p99 over the SLO and instances saturated: run {need} instances"
        elif rows_per_call is not None and rows_per_call < 1.5 and utilization > target_utilization:
            batching = "calls carry ~1 row while busy: raise inferplane.coalesce_max_inflight or Triton's max_queue_delay to batch more"
        else:
            batching = "batching fits the SLO"
        out.append({
            "model": model, "rps": round(rps, 3), "busy_instances": round(busy, 4), "instances": have,
            "utilization": round(utilization, 4), "recommended_instances": need, "rows_per_call": None if rows_per_call is None else round(rows_per_call, 3),
            "p99_ms": None if p99 is None else p99 * 1000, "slo_latency_ms": None if threshold is None else threshold * 1000, "meets_slo": meets,
            "monthly_cost_now_usd": round(have * price_per_instance_hour * HOURS_PER_MONTH, 2),
            "monthly_cost_recommended_usd": round(need * price_per_instance_hour * HOURS_PER_MONTH, 2),
            "batching": batching, "max_batch": max_batch.get(model),
        })  # fmt: skip
    return out
