"""Concurrency or rate sweeps against one or more targets, plotted as latency vs throughput."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from loadtest.runner import RunConfig, run


def sweep(
    cfgs: list[RunConfig],
    pools: list[list[bytes]],
    *,
    concurrencies: list[int] | None = None,
    rates: list[float] | None = None,
    quiet: bool = True,
    on_point: Callable[[RunConfig, dict], None] | None = None,
) -> dict:
    """Runs every load level against every target (levels outer, targets inner, so the
    targets' points at one level are measured close together in time)."""
    if (concurrencies is None) == (rates is None):
        raise ValueError("give exactly one of concurrencies or rates")
    levels = concurrencies if concurrencies is not None else rates
    series: dict[str, list[dict]] = {c.label or c.target: [] for c in cfgs}
    for level in levels:
        for cfg, pool in zip(cfgs, pools):
            if concurrencies is not None:
                spec = replace(cfg.spec, concurrency=int(level), rate=None)
            else:
                spec = replace(cfg.spec, concurrency=None, rate=float(level))
            c = replace(cfg, spec=spec)
            r = run(c, pool, quiet=quiet)
            series[cfg.label or cfg.target].append(r)
            if on_point is not None:
                on_point(c, r)
    return {
        "kind": "concurrency" if concurrencies is not None else "rate",
        "levels": list(levels),
        "model": cfgs[0].model if cfgs else None,
        "series": series,
    }


def plot(result: dict, path: str | Path, *, title: str | None = None) -> Path:
    """p50 (solid) and p99 (dashed) latency vs achieved throughput, one color per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, points) in enumerate(result["series"].items()):
        color = colors[i % len(colors)]
        x = [p["throughput_rps"] for p in points]
        ax.plot(x, [p["latency_ms"]["p50"] for p in points], "o-", color=color, label=f"{name} p50")
        ax.plot(x, [p["latency_ms"]["p99"] for p in points], "s--", color=color, label=f"{name} p99")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or f"{result.get('model') or ''} latency vs throughput ({result['kind']} sweep)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
