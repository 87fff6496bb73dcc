"""How well compare() measures a known difference: two real dummy gRPC servers, B adding ``delay_ms`` to
each answer, compared in interleaved rounds (``python -m loadtest delay-check``).

A benchmark, not a test: the measured B-A p50 difference depends on the machine (the load generator and
both servers share its cores), so it is recorded with the load average (BENCHMARKS.md), never asserted
in the suite. ``within`` says whether the median difference came within ``tolerance_ms`` of the delay.
"""

from __future__ import annotations

import os

from loadtest.compare import compare
from loadtest.dummy_server import DummyProcess
from loadtest.engine import LoadSpec
from loadtest.runner import RunConfig, prepare_pool


def delay_check(
    delay_ms: float = 2.0,
    *,
    rounds: int = 6,
    concurrency: int = 2,
    warmup: float = 0.5,
    duration: float = 2.0,
    tolerance_ms: float = 1.0,
) -> dict:
    load_before = os.getloadavg()
    with DummyProcess() as a, DummyProcess("--delay-ms", f"{delay_ms:g}") as b:
        pool = prepare_pool(a.target, "dummy")
        spec = LoadSpec(concurrency=concurrency, warmup=warmup, duration=duration)
        cfg_a = RunConfig(target=a.target, model="dummy", spec=spec, label="direct", pids=(a.proc.pid,))
        cfg_b = RunConfig(target=b.target, model="dummy", spec=spec, label=f"delayed {delay_ms:g} ms", pids=(b.proc.pid,))
        result = compare(cfg_a, cfg_b, pool, pool, rounds=rounds)
    diff = result["summary"]["diff_b_minus_a"]["p50_ms"]
    result["delay_check"] = {
        "delay_ms": delay_ms,
        "tolerance_ms": tolerance_ms,
        "diff_p50_ms": diff,
        "within": abs(diff["median"] - delay_ms) <= tolerance_ms,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    return result
