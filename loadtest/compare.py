"""Side-by-side comparison: the same load against A and B in interleaved rounds.

Rounds alternate A, B, A, B, ... so slow drifts of the machine (thermal, other tenants, the
page cache) fall on both targets; each figure is reported per round and as the ratio B/A
(and difference B-A) with median, min-max and mean ± stdev over the rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from loadtest.runner import RunConfig, run

# (name, extractor from a run result); latency figures in ms.
FIGURES: list[tuple[str, Callable[[dict], float | None]]] = [
    ("throughput_rps", lambda r: r["throughput_rps"]),
    ("p50_ms", lambda r: r["latency_ms"]["p50"]),
    ("p90_ms", lambda r: r["latency_ms"]["p90"]),
    ("p99_ms", lambda r: r["latency_ms"]["p99"]),
    ("p99.9_ms", lambda r: r["latency_ms"]["p99.9"]),
    ("max_ms", lambda r: r["latency_ms"]["max"]),
    ("mean_ms", lambda r: r["latency_ms"]["mean"]),
    ("error_rate", lambda r: r["errors_total"] / max(1, r["requests"] + r["errors_total"])),
    ("cpu_ms_per_request", lambda r: (r.get("cpu") or {}).get("total_cpu_ms_per_request")),
    ("client_cpu_ms_per_request", lambda r: r.get("client_cpu_ms_per_request")),
]


def spread(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "mean": None, "stdev": None, "rounds": values}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "mean": statistics.fmean(vals),
        "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "rounds": values,
    }


def summarize(results_a: list[dict], results_b: list[dict]) -> dict:
    """Per-figure values of A and B per round, ratio B/A and difference B-A with their spread."""
    out: dict = {"a": {}, "b": {}, "ratio_b_over_a": {}, "diff_b_minus_a": {}}
    for name, get in FIGURES:
        va = [get(r) for r in results_a]
        vb = [get(r) for r in results_b]
        if all(v is None for v in va + vb):
            continue
        ratios = [b / a if a not in (None, 0) and b is not None else None for a, b in zip(va, vb)]
        diffs = [b - a if a is not None and b is not None else None for a, b in zip(va, vb)]
        out["a"][name] = spread(va)
        out["b"][name] = spread(vb)
        out["ratio_b_over_a"][name] = spread(ratios)
        out["diff_b_minus_a"][name] = spread(diffs)
    return out


def compare(
    cfg_a: RunConfig,
    cfg_b: RunConfig,
    pool_a: list[bytes],
    pool_b: list[bytes],
    *,
    rounds: int = 6,
    quiet: bool = True,
    on_round: Callable[[int, dict, dict], None] | None = None,
) -> dict:
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    results_a: list[dict] = []
    results_b: list[dict] = []
    for i in range(rounds):
        ra = run(cfg_a, pool_a, quiet=quiet)
        rb = run(cfg_b, pool_b, quiet=quiet)
        results_a.append(ra)
        results_b.append(rb)
        if on_round is not None:
            on_round(i, ra, rb)
    return {
        "a": {"target": cfg_a.target, "label": cfg_a.label or "A", "pids": list(cfg_a.pids)},
        "b": {"target": cfg_b.target, "label": cfg_b.label or "B", "pids": list(cfg_b.pids)},
        "model": cfg_a.model,
        "rounds": rounds,
        "load": {
            "mode": "open" if cfg_a.spec.open_loop else "closed",
            "concurrency": cfg_a.spec.concurrency,
            "rate": cfg_a.spec.rate,
            "poisson": cfg_a.spec.poisson,
            "warmup_s": cfg_a.spec.warmup,
            "duration_s": cfg_a.spec.duration,
            "processes": cfg_a.processes,
        },
        "summary": summarize(results_a, results_b),
        "runs_a": results_a,
        "runs_b": results_b,
    }
