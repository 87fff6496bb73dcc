"""Where a single caller's latency goes: the per-stage budget at c=1 against Triton direct.

    python -m loadtest.stage_budget --out benchmarks/stage_budget [--model fraud_xgboost] [--requests 2000]

Starts the real stack (frontend + its child Triton; ``--triton-mode in-process`` for Triton in the
frontend's process, the direct baseline then a second stack's child) and sends, from one caller
in one thread, the same pre-serialized ModelInfer request alternately to Triton direct and to the
frontend with ``inferplane-timing`` set (``server.dataplane.stage_timing``), so both see the same
load at the same moments. Per target: the client-side round trip (p50, p99, mean); for the
frontend, each stage's mean and p50 from its ``server-timing`` trailer, the server's total, and
what the caller saw outside it (``outside``: the gRPC transport of the frontend's hop, client and
server side). Means are additive (stages sum to the total), medians are not.

Writes results.json and report.md (the table for BENCHMARKS.md) under ``--out``.
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
import time
from pathlib import Path

INFER = "/inference.GRPCInferenceService/ModelInfer"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(frontend: str, triton: str, model: str, requests: int, warmup: int, pool: list[bytes]) -> dict:
    """Alternate direct and frontend calls from one thread; the per-stage budget and both round trips."""
    import grpc

    from server.dataplane.stage_timing import SERVER_TIMING, TIMING_HEADER, parse

    timed = ((TIMING_HEADER, "1"),)
    with grpc.insecure_channel(triton) as direct_ch, grpc.insecure_channel(frontend) as front_ch:
        direct = direct_ch.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        front = front_ch.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        rtt_direct: list[float] = []
        rtt_front: list[float] = []
        stages: dict[str, list[float]] = {}
        for i in range(warmup + requests):
            body = pool[i % len(pool)]
            t0 = time.perf_counter()
            direct(body, timeout=30)
            t1 = time.perf_counter()
            _, call = front.with_call(body, metadata=timed, timeout=30)
            t2 = time.perf_counter()
            if i < warmup:
                continue
            rtt_direct.append((t1 - t0) * 1000)
            rtt_front.append((t2 - t1) * 1000)
            breakdown = parse(dict(call.trailing_metadata())[SERVER_TIMING])
            breakdown["outside"] = rtt_front[-1] - breakdown["total"]
            for name, ms in breakdown.items():
                stages.setdefault(name, []).append(ms)
    summary = lambda v: {"mean": statistics.fmean(v), "p50": _quantile(v, 0.5), "p99": _quantile(v, 0.99)}  # noqa: E731
    return {
        "model": model,
        "requests": requests,
        "direct": summary(rtt_direct),
        "frontend": summary(rtt_front),
        "added_p50_ms": _quantile(rtt_front, 0.5) - _quantile(rtt_direct, 0.5),
        "added_p99_ms": _quantile(rtt_front, 0.99) - _quantile(rtt_direct, 0.99),
        "stages": {name: summary(values) for name, values in stages.items()},
    }


def report(result: dict, command: str, load: str) -> str:
    d, f = result["direct"], result["frontend"]
    lines = [
        f"`{command}` — {result['model']}, {result['requests']} requests per target, c=1, alternating; load: {load}",
        "",
        "| target | p50 ms | p99 ms | mean ms |",
        "|---|---|---|---|",
        f"| Triton direct | {d['p50']:.3f} | {d['p99']:.3f} | {d['mean']:.3f} |",
        f"| frontend | {f['p50']:.3f} | {f['p99']:.3f} | {f['mean']:.3f} |",
        f"| added | {result['added_p50_ms']:.3f} | {result['added_p99_ms']:.3f} | {f['mean'] - d['mean']:.3f} |",
        "",
        "| stage | mean ms | p50 ms | share of the frontend's mean |",
        "|---|---|---|---|",
    ]
    for name, s in result["stages"].items():
        lines.append(f"| {name} | {s['mean']:.3f} | {s['p50']:.3f} | {s['mean'] / f['mean']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/stage_budget"))
    ap.add_argument("--model", default="fraud_xgboost")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repository", type=Path, default=None, help="existing demo repository (default: build one)")
    ap.add_argument("--triton-mode", choices=("process", "in-process"), default="process")
    ap.add_argument("--frontend", default=None, help="HOST:PORT of a running frontend (with --triton): start nothing")
    ap.add_argument("--triton", default=None, help="HOST:PORT of the Triton to compare against")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtest.stage_budget " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    from loadtest.runner import prepare_pool

    stacks = []
    try:
        if args.frontend is None:
            from loadtest.stack import start_stack

            repo = args.repository
            if repo is None:
                from model_repository.demo import build_demo_repository

                repo = args.out / "model_repository"
                build_demo_repository(repo)
            stacks.append(start_stack(repo, args.out / "stack", "--auth", "off"))
            triton, frontend = stacks[0].triton, stacks[0].grpc
            if args.triton_mode == "in-process":
                stacks.append(start_stack(repo, args.out / "stack-inprocess", "--auth", "off", "--triton-mode", "in-process"))
                frontend = stacks[1].grpc
        else:
            frontend, triton = args.frontend, args.triton
        pool = prepare_pool(f"grpc://{triton}", args.model, size=64)
        result = measure(frontend, triton, args.model, args.requests, args.warmup, pool)
    finally:
        from loadtest.stack import stop_stack

        for s in stacks:
            stop_stack(s)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result.update(
        command=command, load=load, triton_mode=args.triton_mode,
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    )  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result, command, load)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
