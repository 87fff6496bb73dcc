"""Where a single caller's latency goes: the per-stage budget at c=1 against Triton direct.

    python -m loadtest.stage_budget --out benchmarks/stage_budget [--model fraud_xgboost] [--requests 2000]
        [--triton-mode in-process] [--baseline-root DIR]

Starts the real stack (frontend + its child Triton; ``--triton-mode in-process`` for Triton in the
frontend's process, the direct baseline then a second stack's child) and sends, from one caller
in one thread, the same pre-serialized ModelInfer request alternately to Triton direct and to the
frontend with ``inferplane-timing`` set (``server.dataplane.stage_timing``), so both see the same
load at the same moments. Per target: the client-side round trip (p50, p99, mean); for the
frontend, each stage's mean and p50 from its ``server-timing`` trailer, the server's total, and
what the caller saw outside it (``outside``: the gRPC transport of the frontend's hop, client and
server side). Means are additive (stages sum to the total), medians are not.

``--baseline-root DIR``: another checkout (e.g. the commit before a change) whose frontend is started
too (same interpreter, its code) and measured in the same rounds: a before / after in one run, as
ratios. With a child Triton both frontends then reach the first stack's Triton as an external one
(``--triton-url``: one Triton behind both); in process each has its own inside.

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


def measure(frontends: dict[str, str], triton: str, model: str, requests: int, warmup: int, pool: list[bytes],
            bare: dict[str, str] | None = None, shuffle: bool = False) -> dict:  # fmt: skip
    """One caller, one thread: each round sends the same request to Triton direct, to each
    frontend (``{label: HOST:PORT}``) and to each ``bare`` server (``{label: HOST:PORT}``: asked like
    Triton, no stage trailer; ``loadtest.hop_floor``'s bare grpc.aio servers), in an order that
    rotates every round (``shuffle``: a fresh random order each round, seeded — with many targets a
    rotation keeps each one's neighbours, and a call right after one to the same process or the same
    Triton finds it warm); per target the round trips, per frontend the stages of its ``server-timing``
    trailer."""
    import random

    import grpc

    from server.dataplane.stage_timing import SERVER_TIMING, TIMING_HEADER, parse

    timed = ((TIMING_HEADER, "1"),)
    bare = bare or {}
    channels = {"direct": grpc.insecure_channel(triton), **{label: grpc.insecure_channel(a) for label, a in {**bare, **frontends}.items()}}
    try:
        calls = {label: ch.unary_unary(INFER, request_serializer=None, response_deserializer=None) for label, ch in channels.items()}
        order = list(calls)
        rng = random.Random(0)
        rtt: dict[str, list[float]] = {label: [] for label in order}
        stages: dict[str, dict[str, list[float]]] = {label: {} for label in frontends}
        for i in range(warmup + requests):
            body = pool[i % len(pool)]
            k = i % len(order)
            if shuffle:
                rng.shuffle(order)
            for label in order if shuffle else order[k:] + order[:k]:
                t0 = time.perf_counter()
                if label not in frontends:
                    calls[label](body, timeout=30)
                    call = None
                else:
                    _, call = calls[label].with_call(body, metadata=timed, timeout=30)
                ms = (time.perf_counter() - t0) * 1000
                if i < warmup:
                    continue
                rtt[label].append(ms)
                if call is not None:
                    breakdown = parse(dict(call.trailing_metadata())[SERVER_TIMING])
                    breakdown["outside"] = ms - breakdown["total"]
                    for name, value in breakdown.items():
                        stages[label].setdefault(name, []).append(value)
    finally:
        for ch in channels.values():
            ch.close()
    direct = rtt["direct"]
    return {
        "model": model,
        "requests": requests,
        "targets": {label: _summary(values) for label, values in rtt.items()},
        "added_ms": {
            label: {"p50": _quantile(rtt[label], 0.5) - _quantile(direct, 0.5), "p99": _quantile(rtt[label], 0.99) - _quantile(direct, 0.99)}
            for label in [*bare, *frontends]
        },
        "stages": {label: {name: _summary(values) for name, values in per.items()} for label, per in stages.items()},
    }


def _summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "p50": _quantile(values, 0.5), "p99": _quantile(values, 0.99)}


def report(result: dict, command: str, load: str) -> str:
    targets, labels = result["targets"], list(result["stages"])
    lines = [
        f"`{command}` — {result['model']}, {result['requests']} requests per target, c=1, rotating order; load: {load}",
        "",
        "| target | p50 ms | p99 ms | mean ms | added p50 ms | added p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for label, t in targets.items():
        added = result["added_ms"].get(label)
        extra = f"{added['p50']:.3f} | {added['p99']:.3f}" if added else "— | —"
        lines.append(f"| {label} | {t['p50']:.3f} | {t['p99']:.3f} | {t['mean']:.3f} | {extra} |")
    if len(labels) == 2:
        a, b = labels
        lines.append(f"| {b} / {a} | {targets[b]['p50'] / targets[a]['p50']:.3f} | {targets[b]['p99'] / targets[a]['p99']:.3f} | {targets[b]['mean'] / targets[a]['mean']:.3f} | | |")
    lines += ["", "| stage | " + " | ".join(f"{label} mean ms | {label} p50 ms" for label in labels) + " |", "|---|" + "---|---|" * len(labels)]
    names = list(dict.fromkeys(name for label in labels for name in result["stages"][label]))
    for name in names:
        cells = []
        for label in labels:
            s = result["stages"][label].get(name)
            cells.append(f"{s['mean']:.3f} | {s['p50']:.3f}" if s else "— | —")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
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
    ap.add_argument("--baseline-root", type=Path, default=None, help="another checkout: its frontend measured beside this one's (label 'baseline')")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()  # a baseline frontend runs in another directory
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
            repo = Path(repo).resolve()
            mode = ("--triton-mode", "in-process") if args.triton_mode == "in-process" else ()
            first = start_stack(repo, args.out / "stack", "--auth", "off")
            stacks.append(first)
            triton = first.triton  # the direct baseline: a tritonserver child either way
            frontends = {}
            if args.baseline_root is not None and not mode:
                # before / after on one Triton: both frontends reach the first stack's Triton as an
                # external one (the same interpreter; the baseline runs the other checkout's code)
                shared = ("--triton-url", first.triton)
                root = args.baseline_root.resolve()
                stacks.append(start_stack(repo, args.out / "stack-baseline", "--auth", "off", *shared, python=sys.executable, cwd=root))
                frontends["baseline"] = stacks[-1].grpc
                stacks.append(start_stack(repo, args.out / "stack-candidate", "--auth", "off", *shared))
                frontends["frontend"] = stacks[-1].grpc
            elif args.baseline_root is not None:  # in process: each frontend has its Triton inside
                root = args.baseline_root.resolve()
                stacks.append(start_stack(repo, args.out / "stack-baseline", "--auth", "off", *mode, python=sys.executable, cwd=root))
                frontends["baseline"] = stacks[-1].grpc
            if "frontend" in frontends:
                pass
            elif mode:
                stacks.append(start_stack(repo, args.out / "stack-inprocess", "--auth", "off", *mode))
                frontends["frontend"] = stacks[-1].grpc
            else:
                frontends["frontend"] = first.grpc
        else:
            frontends, triton = {"frontend": args.frontend}, args.triton
        pool = prepare_pool(f"grpc://{triton}", args.model, size=64)
        result = measure(frontends, triton, args.model, args.requests, args.warmup, pool)
    finally:
        from loadtest.stack import stop_stack

        for s in stacks:
            stop_stack(s)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result.update(
        command=command, load=load, triton_mode=args.triton_mode, baseline_root=str(args.baseline_root or ""),
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
