"""Right-sizing across instance types: from an endpoint's measured load and the benchmark profiles
of its model on each hardware class (one replica's throughput and p99, ``loadtest`` results), the
cheapest (hardware class, replica count) whose p99 meets the endpoint's SLO, priced from the price
list, with the saving per month against what runs now — CPU vs GPU for a tree model, a MIG slice vs
a whole GPU for a small network.

Replicas for a class: ``ceil(rps / (throughput x utilization))`` (the rest is headroom), at least
one; a class whose profiled p99 misses the SLO is never recommended. When the load was measured over
too short a window or too few requests, or no profile of the hardware it runs on exists (so the
profiles cannot be checked against reality), the verdict is ``too_thin`` and nothing is recommended.
Pure functions; :func:`load_hardware_profiles` reads one JSON file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from server.control.planning.capacity import HOURS_PER_MONTH
from server.control.planning.prices import PriceBook


@dataclass(frozen=True)
class HardwareProfile:
    model: str
    hardware: str  # a class of the price list
    throughput_rps: float  # one replica, at the p99 below
    p99_ms: float
    source: str = ""


def load_hardware_profiles(path: Path | str) -> dict[str, list[HardwareProfile]]:
    """``{"profiles": [{"model", "hardware", "throughput_rps", "p99_ms", "source"}...]}`` -> per model."""
    out: dict[str, list[HardwareProfile]] = {}
    for entry in json.loads(Path(path).read_text())["profiles"]:
        p = HardwareProfile(entry["model"], entry["hardware"], float(entry["throughput_rps"]), float(entry["p99_ms"]), entry.get("source", ""))
        if p.throughput_rps <= 0:
            raise ValueError(f"{path}: {p.model} on {p.hardware}: throughput must be > 0")
        out.setdefault(p.model, []).append(p)
    return out


def recommend(
    model: str, *, rps: float, window_s: float, requests: int, current_hardware: str, current_replicas: int, slo_p99_ms: float,
    profiles: list[HardwareProfile], prices: PriceBook, capacity_type: str = "on_demand", utilization: float = 0.6,
    min_window_s: float = 3600.0, min_requests: int = 1000,
) -> dict:  # fmt: skip
    """One endpoint's recommendation (see the module docstring)."""
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    current_monthly = current_replicas * prices.hourly(current_hardware, capacity_type) * HOURS_PER_MONTH
    out = {"model": model, "rps": rps, "slo_p99_ms": slo_p99_ms, "prices": prices.version,
           "current": {"hardware": current_hardware, "replicas": current_replicas, "monthly_usd": round(current_monthly, 2)}}  # fmt: skip
    thin = []
    if window_s < min_window_s:
        thin.append(f"load measured over {window_s:.0f} s (< {min_window_s:.0f} s)")
    if requests < min_requests:
        thin.append(f"{requests} requests seen (< {min_requests})")
    if not any(p.hardware == current_hardware for p in profiles):
        thin.append(f"no profile of {model} on its current hardware {current_hardware}")
    options = []
    for p in sorted(profiles, key=lambda p: p.hardware):
        if p.hardware not in prices.per_hour:
            continue  # a class this price list does not sell
        replicas = max(1, math.ceil(rps / (p.throughput_rps * utilization) - 1e-9))
        monthly = replicas * prices.hourly(p.hardware, capacity_type) * HOURS_PER_MONTH
        options.append({"hardware": p.hardware, "replicas": replicas, "p99_ms": p.p99_ms, "meets_slo": p.p99_ms <= slo_p99_ms,
                        "monthly_usd": round(monthly, 2), "source": p.source})  # fmt: skip
    out["options"] = sorted(options, key=lambda o: (not o["meets_slo"], o["monthly_usd"], o["hardware"]))
    fitting = [o for o in out["options"] if o["meets_slo"]]
    if thin:
        out.update(verdict="too_thin", reason="; ".join(thin) + ": not enough data to recommend", best=None, saving_per_month_usd=None)
    elif not fitting:
        out.update(verdict="no_fit", reason=f"no profiled hardware meets p99 <= {slo_p99_ms:g} ms", best=None, saving_per_month_usd=None)
    else:
        best = fitting[0]
        saving = round(current_monthly - best["monthly_usd"], 2)
        same = best["hardware"] == current_hardware and best["replicas"] == current_replicas
        mine = next((o for o in options if o["hardware"] == current_hardware), None)
        current_ok = mine is not None and mine["meets_slo"] and current_replicas >= mine["replicas"]
        out["current"]["meets_slo"] = current_ok
        # change when it saves money, or when what runs now misses the SLO (then a dearer fix is still the answer)
        out.update(
            verdict="keep" if same or (saving <= 0 and current_ok) else "change", best=best, saving_per_month_usd=max(0.0, saving),
            reason=(f"{best['replicas']} x {best['hardware']} meets p99 {best['p99_ms']:g} <= {slo_p99_ms:g} ms at ${best['monthly_usd']:,.2f}/month"
                    + (f", saving ${saving:,.2f}/month" if saving > 0 and not same else "")),
        )  # fmt: skip
    return out


def from_benchmark(profile, hardware: str) -> HardwareProfile:
    """A ``server.control.planning.capacity.Profile`` (a recorded loadtest result) measured on ``hardware``."""
    if profile.p99_ms is None:
        raise ValueError(f"{profile.source}: no p99 in the profile of {profile.model}")
    return HardwareProfile(profile.model, hardware, profile.throughput_rps, profile.p99_ms, profile.source)
