"""What tracing costs: the standard frontend benchmark's closed loop with tracing off, at 1 % and at 100 %.

    python -m loadtest.bench_tracing --out benchmarks/tracing [--models fraud_xgboost] [--concurrency 8,32] [--rounds 4]

Starts four real stacks (embedded Triton + frontend) on the same demo repository: tracing off (no OTLP
endpoint), ``INFERPLANE_TRACE_SAMPLE_RATIO=0.01`` (with and without Triton's own trace mode) and ``=1.0``,
exporting to a real OTLP/HTTP receiver on loopback in a process of its own (``loadtest.otlp_sink``;
Triton's trace mode exports there too). Rounds are interleaved (off, 1 %, 1 % no-triton, 100 %, off, …) so the machine's drift hits all three alike; each figure is the
median over rounds and the ratio is against "off" measured in the same rounds. Writes results.json and
report.md. Goal (issue 19): at 1 % the throughput ratio stays >= 0.95.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

from loadtest.engine import LoadSpec
from loadtest.runner import RunConfig, prepare_pool, run
from loadtest.stack import start_stack, stop_stack

# label -> (sample ratio, Triton's trace mode on); "1% no-triton": the frontend's share of the 1 % cost
SETTINGS = {"off": (None, False), "1%": ("0.01", True), "1% no-triton": ("0.01", False), "100%": ("1.0", True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/tracing"))
    ap.add_argument("--repository", type=Path, default=None)
    ap.add_argument("--models", default="fraud_xgboost")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 s at c=8 (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup, args.concurrency = 2, 1.0, 0.5, "8"
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtest.bench_tracing " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    repo = args.repository
    if repo is None:
        from model_repository.demo import build_demo_repository

        repo = args.out / "model_repository"
        build_demo_repository(repo)
    # the OTLP sink runs in a process of its own, so decoding spans does not slow this load generator
    sink = subprocess.Popen([sys.executable, "-m", "loadtest.otlp_sink"], stdout=subprocess.PIPE, text=True)
    endpoint = f"http://127.0.0.1:{sink.stdout.readline().split()[1]}"
    stacks = {}
    try:
        for i, (label, (ratio, triton)) in enumerate(SETTINGS.items()):
            env = {"INFERPLANE_DRIFT_SAMPLE_RATIO": "0"}  # measure tracing alone
            if ratio is not None:
                env |= {"INFERPLANE_OTLP_ENDPOINT": endpoint, "INFERPLANE_TRACE_SAMPLE_RATIO": ratio, "INFERPLANE_TRITON_TRACING": str(triton).lower()}
            stacks[label] = start_stack(repo, args.out / f"stack_{i}", "--auth", "off", "--workers", "1", env=env)
        results: dict = {
            "command": command,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "models": {},
        }
        for model in args.models.split(","):
            pools = {label: prepare_pool(f"grpc://{s.grpc}", model, data="validation", repository=str(repo), size=256) for label, s in stacks.items()}
            per_model = {}
            for conc in [int(c) for c in args.concurrency.split(",")]:
                spec = LoadSpec(concurrency=conc, warmup=args.warmup, duration=args.duration)
                runs: dict[str, list[dict]] = {label: [] for label in stacks}
                for _ in range(args.rounds):
                    for label, s in stacks.items():
                        runs[label].append(run(RunConfig(f"grpc://{s.grpc}", model, spec, label=label), pools[label]))
                per_model[conc] = _summary(runs)
                line = ", ".join(f"{k} {v['throughput_rps']:.0f} rps (x{v['ratio_vs_off']:.3f}) p99 {v['p99_ms']:.2f} ms" for k, v in per_model[conc].items())
                print(f"{model} c={conc}: {line}", flush=True)
            results["models"][model] = per_model
        with urllib.request.urlopen(f"{endpoint}/stats", timeout=10) as response:
            results["spans_received"] = json.loads(response.read())["spans"]
    finally:
        for s in stacks.values():
            stop_stack(s)
        sink.terminate()
        sink.wait(10)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report = render(results)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0


def _summary(runs: dict[str, list[dict]]) -> dict:
    out = {}
    base = [r["throughput_rps"] for r in runs["off"]]
    for label, rs in runs.items():
        ratios = [r["throughput_rps"] / b for r, b in zip(rs, base) if b]
        out[label] = {
            "throughput_rps": statistics.median(r["throughput_rps"] for r in rs),
            "p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rs),
            "p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rs),
            "ratio_vs_off": statistics.median(ratios) if ratios else float("nan"),
            "ratio_min": min(ratios) if ratios else float("nan"),
            "ratio_max": max(ratios) if ratios else float("nan"),
            "errors": sum(r.get("errors_total", 0) for r in rs),
        }
    return out


def render(results: dict) -> str:
    lines = [f"Command: `{results['command']}` ({results['date']}, {results['machine']['cpus']} CPUs); spans received: {results.get('spans_received')}", "",
             "| model | c | tracing | rps | ratio vs off (min–max) | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, per_model in results["models"].items():
        for conc, rows in per_model.items():
            for label, r in rows.items():
                lines.append(
                    f"| {model} | {conc} | {label} | {r['throughput_rps']:.0f} | {r['ratio_vs_off']:.3f} ({r['ratio_min']:.3f}–{r['ratio_max']:.3f}) "
                    f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
