"""The standard comparison: direct Triton vs through the frontend, for every demo model.

    python -m loadtest.bench_frontend --out benchmarks/frontend [--workers N] [--quick]

Starts the real stack (embedded Triton + frontend) on loopback, then for each demo model runs
closed-loop `compare` rounds (A = direct Triton, B = frontend, interleaved) at concurrency 1, 8
and 32, an open-loop rate sweep of both targets (PNG), and NVIDIA's perf_analyzer against both
for one case. Writes results.json, the PNGs and report.md (the tables for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from loadtest.compare import compare
from loadtest.engine import LoadSpec
from loadtest.perf_analyzer import run_perf_analyzer
from loadtest.runner import RunConfig, prepare_pool
from loadtest.stack import start_stack, stop_stack
from loadtest.sweep import plot, sweep

MODELS = ["fraud_xgboost", "mlp_classifier", "lightgbm_regressor"]


def _frontend_cpu_ms(run: dict, frontend_pid: int, triton_pid: int) -> float | None:
    """Frontend-only CPU per request: its process tree minus the Triton subtree under it."""
    pids = (run.get("cpu") or {}).get("pids", {})
    tree, triton = pids.get(str(frontend_pid), {}), pids.get(str(triton_pid), {})
    if tree.get("cpu_s") is None or triton.get("cpu_s") is None or not run.get("requests"):
        return None
    return (tree["cpu_s"] - triton["cpu_s"]) * 1000 / (run["requests"] + run.get("errors_total", 0))


def _set_parameter(repo: Path, key: str, value: str) -> None:
    from model_repository.config_writer import read_config, write_config

    for model_dir in sorted(p for p in repo.iterdir() if (p / "config.pbtxt").exists()):
        config = read_config(model_dir)
        config.parameters[key].string_value = value
        write_config(config, model_dir)


def _median(values):
    vals = sorted(v for v in values if v is not None)
    return vals[len(vals) // 2] if vals else None


def _fmt(value, digits=2):
    return "n/a" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/frontend"))
    ap.add_argument("--repository", type=Path, default=None, help="existing demo repository (default: build one)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rates", default="", help="open-loop sweep rates (default: from the c=32 direct throughput)")
    ap.add_argument("--no-coalesce", action="store_true", help="turn request coalescing off in every model's config")
    ap.add_argument("--quick", action="store_true", help="1 round, 1 s runs, one model (a smoke run)")
    ap.add_argument(
        "--triton-mode", choices=("process", "in-process"), default="process",
        help="the frontend under test: its Triton a child over gRPC, or in its process (the direct baseline stays a tritonserver child)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup, args.models = 1, 1.0, 0.5, MODELS[0]
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtest.bench_frontend " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    repo = args.repository
    if repo is None:
        from model_repository.demo import build_demo_repository

        repo = args.out / "model_repository"
        build_demo_repository(repo)
    if args.no_coalesce:
        if args.repository is not None:  # never edit the caller's repository
            import shutil

            repo = Path(shutil.copytree(args.repository, args.out / "model_repository", dirs_exist_ok=True))
        _set_parameter(repo, "inferplane.coalesce", "false")
    extra = ["--workers", str(args.workers), "--auth", "off"]
    if args.workers > 1:
        from server.runtime.supervisor import free_port

        extra += ["--grpc-port", str(free_port()), "--http-port", str(free_port())]
    stack = start_stack(repo, args.out / "stack", *extra)
    tested = stack
    if args.triton_mode == "in-process":  # a second stack: the frontend under test, Triton inside it
        tested = start_stack(repo, args.out / "stack-inprocess", *extra, "--triton-mode", "in-process")
    results: dict = {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "workers": args.workers,
        "coalesce": not args.no_coalesce,
        "triton_mode": args.triton_mode,
        "out": str(args.out),
        "models": {},
    }
    try:
        triton_pid, frontend_pid = stack.triton_pid(), stack.process.pid
        direct, front = f"grpc://{stack.triton}", f"grpc://{tested.grpc}"
        # the frontend's CPU: its tree minus Triton's; in process, Triton's work is the frontend's own
        front_pids = (frontend_pid, triton_pid) if tested is stack else (tested.process.pid,)
        for model in args.models.split(","):
            pool_a = prepare_pool(direct, model, data="validation", repository=str(repo), size=256)
            pool_b = prepare_pool(front, model, data="validation", repository=str(repo), size=256)
            per_model: dict = {"compare": {}}
            for conc in [int(c) for c in args.concurrency.split(",")]:
                spec = LoadSpec(concurrency=conc, warmup=args.warmup, duration=args.duration)
                cfg_a = RunConfig(direct, model, spec, pids=(triton_pid,), label="triton")
                cfg_b = RunConfig(front, model, spec, pids=front_pids, label="frontend")
                outcome = compare(cfg_a, cfg_b, pool_a, pool_b, rounds=args.rounds)
                outcome["frontend_cpu_ms_per_request"] = _median(
                    [_frontend_cpu_ms(r, frontend_pid, triton_pid) for r in outcome["runs_b"]]
                    if tested is stack
                    else [((r.get("cpu") or {}).get("total_cpu_ms_per_request")) for r in outcome["runs_b"]]
                )
                outcome["triton_cpu_ms_per_request_direct"] = _median(
                    [((r.get("cpu") or {}).get("total_cpu_ms_per_request")) for r in outcome["runs_a"]]
                )
                per_model["compare"][conc] = outcome
                s = outcome["summary"]
                print(
                    f"{model} c={conc}: triton {s['a']['throughput_rps']['median']:.0f} rps, "
                    f"frontend {s['b']['throughput_rps']['median']:.0f} rps "
                    f"(x{s['ratio_b_over_a']['throughput_rps']['median']:.2f}), "
                    f"p50 +{s['diff_b_minus_a']['p50_ms']['median']:.2f} ms, "
                    f"p99 +{s['diff_b_minus_a']['p99_ms']['median']:.2f} ms",
                    flush=True,
                )
            top = per_model["compare"][max(per_model["compare"])]["summary"]["a"]["throughput_rps"]["median"]
            rates = [float(r) for r in args.rates.split(",") if r] or [round(top * f) for f in (0.2, 0.4, 0.6, 0.8)]
            base = LoadSpec(rate=rates[0], warmup=args.warmup, duration=args.duration)
            swept = sweep(
                [RunConfig(direct, model, base, label="triton"), RunConfig(front, model, base, label="frontend")],
                [pool_a, pool_b],
                rates=rates,
            )
            png = plot(swept, args.out / f"sweep_{model}.png", title=f"{model}: open-loop rate sweep")
            per_model["sweep"] = {"rates": rates, "png": png.name, "series": swept["series"]}
            results["models"][model] = per_model
        pa_model = args.models.split(",")[0]
        pa_args = ["--stability-percentage", "50", "--max-trials", "6"]
        results["perf_analyzer"] = {
            "model": pa_model,
            "concurrency": 8,
            "triton": run_perf_analyzer(direct, pa_model, concurrency_range="8", measurement_interval_ms=3000, extra_args=pa_args),
            "frontend": run_perf_analyzer(front, pa_model, concurrency_range="8", measurement_interval_ms=3000, extra_args=pa_args),
        }
    finally:
        if tested is not stack:
            stop_stack(tested)
        stop_stack(stack)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report = render(results)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0


def render(results: dict) -> str:
    lines = [f"Command: `{results['command']}` ({results['date']}, {results['machine']['cpus']} CPUs, "
             f"{results['machine']['platform']}, frontend workers: {results['workers']}, "
             f"coalescing: {'on' if results.get('coalesce', True) else 'off'}, "
             f"frontend's Triton: {results.get('triton_mode', 'process')})", ""]
    lines += [
        "| model | c | Triton rps | frontend rps | ratio (min–max) | p50 Triton / frontend ms | p99 Triton / frontend ms | frontend CPU ms/req | Triton CPU ms/req (direct) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, per_model in results["models"].items():
        for conc, outcome in per_model["compare"].items():
            s = outcome["summary"]
            ratio = s["ratio_b_over_a"]["throughput_rps"]
            lines.append(
                f"| {model} | {conc} | {_fmt(s['a']['throughput_rps']['median'], 0)} | {_fmt(s['b']['throughput_rps']['median'], 0)} "
                f"| {_fmt(ratio['median'])} ({_fmt(ratio['min'])}–{_fmt(ratio['max'])}) "
                f"| {_fmt(s['a']['p50_ms']['median'])} / {_fmt(s['b']['p50_ms']['median'])} "
                f"| {_fmt(s['a']['p99_ms']['median'])} / {_fmt(s['b']['p99_ms']['median'])} "
                f"| {_fmt(outcome['frontend_cpu_ms_per_request'], 3)} | {_fmt(outcome['triton_cpu_ms_per_request_direct'], 3)} |"
            )
    lines += ["", "Open-loop sweeps (latency from the scheduled send time):", ""]
    lines += ["| model | rate | Triton p50 / p99 ms | frontend p50 / p99 ms |", "|---|---|---|---|"]
    for model, per_model in results["models"].items():
        sw = per_model["sweep"]
        for i, rate in enumerate(sw["rates"]):
            a, b = sw["series"]["triton"][i], sw["series"]["frontend"][i]
            lines.append(
                f"| {model} | {rate:.0f} | {_fmt(a['latency_ms']['p50'])} / {_fmt(a['latency_ms']['p99'])} "
                f"| {_fmt(b['latency_ms']['p50'])} / {_fmt(b['latency_ms']['p99'])} |"
            )
        lines.append(f"\n![{model} sweep]({results.get('out', 'benchmarks/frontend')}/{sw['png']})\n")
    pa = results.get("perf_analyzer")
    if pa:
        lines += ["", f"perf_analyzer vs this tool, {pa['model']}, concurrency {pa['concurrency']}:", "",
                  "| target | perf_analyzer rps | p50 ms | p99 ms | loadtest rps (c=8 median) | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
        ours = results["models"].get(pa["model"], {}).get("compare", {}).get(8)
        for key, side in (("triton", "a"), ("frontend", "b")):
            p = pa[key]
            o = ours["summary"][side] if ours else None
            lines.append(
                f"| {key} | {_fmt(p['throughput_rps'], 0)} | {_fmt(p['latency_ms']['p50'])} | {_fmt(p['latency_ms']['p99'])} "
                f"| {_fmt(o['throughput_rps']['median'], 0) if o else 'n/a'} | {_fmt(o['p50_ms']['median']) if o else 'n/a'} "
                f"| {_fmt(o['p99_ms']['median']) if o else 'n/a'} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
