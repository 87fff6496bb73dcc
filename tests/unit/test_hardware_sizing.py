"""Right-sizing across instance types on recorded profiles.

The CPU profiles are the recorded frontend benchmark (benchmarks/frontend/results.json, c=32 on this
2-core machine: fraud_xgboost 2049 requests/s at p99 51.5 ms). No GPU is measurable here, so the GPU
and MIG profiles are stated in benchmarks/rightsizing/profiles.json as illustrative figures (a T4 and an
A100 MIG 1g.10gb slice vs a whole A100); the arithmetic, not the figures, is what is tested."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.control.planning.capacity import load_profiles
from server.control.planning.hardware_sizing import HardwareProfile, from_benchmark, load_hardware_profiles, recommend
from server.control.planning.prices import parse_prices

ROOT = Path(__file__).resolve().parents[2]
PRICES = parse_prices({"version": "t", "prices": {
    "cpu": {"on_demand": 0.08}, "t4": {"on_demand": 0.35}, "a100": {"on_demand": 3.60}, "a100-mig-1g.10gb": {"on_demand": 0.52},
}})  # fmt: skip  (cpu: one 2-core replica)
ENOUGH = {"window_s": 86400.0, "requests": 10_000_000}


def _profiles(model: str, slo_ms: float) -> list[HardwareProfile]:
    cpu = load_profiles([ROOT / "benchmarks" / "frontend" / "results.json"], slo_p99_ms=slo_ms)[model]
    return [from_benchmark(cpu, "cpu"), *load_hardware_profiles(ROOT / "benchmarks" / "rightsizing" / "profiles.json")[model]]


def test_a_tree_model_is_cheapest_on_cpus_when_they_meet_the_slo():
    """fraud_xgboost at 3000 requests/s, p99 SLO 100 ms, running on 2 x t4 (0.35/h):
    cpu: ceil(3000 / (2049.2 x 0.6)) = 3 replicas x 0.08 x 730 = 175.20/month;
    t4:  ceil(3000 / (9000 x 0.6)) = 1 x 0.35 x 730 = 255.50; now 2 x 0.35 x 730 = 511.00 -> saving 335.80."""
    rec = recommend("fraud_xgboost", rps=3000, current_hardware="t4", current_replicas=2, slo_p99_ms=100,
                    profiles=_profiles("fraud_xgboost", 100), prices=PRICES, **ENOUGH)  # fmt: skip
    assert rec["verdict"] == "change" and rec["best"]["hardware"] == "cpu" and rec["best"]["replicas"] == 3
    assert rec["best"]["monthly_usd"] == pytest.approx(175.2) and rec["saving_per_month_usd"] == pytest.approx(335.8)
    assert rec["current"]["monthly_usd"] == pytest.approx(511.0)
    same = recommend("fraud_xgboost", rps=3000, current_hardware="cpu", current_replicas=3, slo_p99_ms=100,
                     profiles=_profiles("fraud_xgboost", 100), prices=PRICES, **ENOUGH)  # fmt: skip
    assert same["verdict"] == "keep" and same["saving_per_month_usd"] == 0.0


def test_a_tight_slo_moves_the_tree_to_a_gpu():
    """With p99 <= 20 ms the CPU replica (p99 51.5 ms at its profiled load) misses the SLO: the T4 (p99 4 ms)
    is the cheapest class that meets it, dearer than now — a fix, so the verdict is still to change."""
    profiles = [HardwareProfile("fraud_xgboost", "cpu", 2049.2, 51.5, "recorded"),
                *load_hardware_profiles(ROOT / "benchmarks" / "rightsizing" / "profiles.json")["fraud_xgboost"]]  # fmt: skip
    rec = recommend("fraud_xgboost", rps=3000, current_hardware="cpu", current_replicas=3, slo_p99_ms=20, profiles=profiles, prices=PRICES, **ENOUGH)
    assert rec["best"]["hardware"] == "t4" and rec["verdict"] == "change" and rec["current"]["meets_slo"] is False
    assert not next(o for o in rec["options"] if o["hardware"] == "cpu")["meets_slo"]
    assert rec["saving_per_month_usd"] == 0.0  # dearer than now (3 x 0.08 x 730 = 175.20 < 255.50): a fix, not a saving


def test_a_mig_slice_replaces_a_whole_gpu_for_a_small_network():
    """mlp_classifier at 1500 requests/s, SLO 50 ms, on 1 whole a100 (3.60 x 730 = 2628.00):
    mig 1g.10gb: ceil(1500 / (2500 x 0.6)) = 1 x 0.52 x 730 = 379.60 -> saving 2248.40."""
    profiles = load_hardware_profiles(ROOT / "benchmarks" / "rightsizing" / "profiles.json")["mlp_classifier"]
    rec = recommend("mlp_classifier", rps=1500, current_hardware="a100", current_replicas=1, slo_p99_ms=50, profiles=profiles, prices=PRICES, **ENOUGH)
    assert rec["best"]["hardware"] == "a100-mig-1g.10gb" and rec["best"]["replicas"] == 1
    assert rec["saving_per_month_usd"] == pytest.approx(2628.0 - 379.6)


def test_thin_data_recommends_nothing():
    profiles = _profiles("fraud_xgboost", 100)
    rec = recommend("fraud_xgboost", rps=3000, current_hardware="t4", current_replicas=2, slo_p99_ms=100, profiles=profiles, prices=PRICES,
                    window_s=600, requests=50)  # fmt: skip
    assert rec["verdict"] == "too_thin" and rec["best"] is None and "600 s" in rec["reason"] and "50 requests" in rec["reason"]
    rec = recommend("fraud_xgboost", rps=3000, current_hardware="h100", current_replicas=1, slo_p99_ms=100, profiles=profiles,
                    prices=parse_prices({"version": "t", "prices": {"cpu": {"on_demand": 0.08}, "h100": {"on_demand": 7}}}), **ENOUGH)  # fmt: skip
    assert rec["verdict"] == "too_thin" and "no profile of fraud_xgboost on its current hardware h100" in rec["reason"]
    rec = recommend("fraud_xgboost", rps=3000, current_hardware="cpu", current_replicas=3, slo_p99_ms=1, profiles=profiles, prices=PRICES, **ENOUGH)
    assert rec["verdict"] == "no_fit" and rec["best"] is None
