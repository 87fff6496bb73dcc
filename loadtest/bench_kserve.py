"""Issue 30's goals measured against KServe: Triton direct, inferplane and KServe side by side.

    python -m loadtest.bench_kserve --json benchmarks/kserve/run1.json [--rounds 2] [--concurrency 1,8,32]

Starts, on loopback, the real stack (``inferplane serve``, its Triton a supervised child: the default) and KServe's
model server (``loadtest.kserve_target``, from ``.venv-kserve``: ``make kserve-env``) on the same demo model
(``fraud_xgboost``'s XGBoost JSON booster). All stay up; one is loaded at a time. For each concurrency, closed loop,
each round runs every target once (the order rotated by one each round), so a drift of the machine falls on all.
Per target: infer/s, p50, p99 and the CPU of its serving processes per inference; per round the ratios
inferplane/KServe, and the goals' verdict on their median (c=1 ≥ 1.0×, c=8 and c=32 ≥ 2×). The answers of all
targets are compared on the request pool first. Writes the JSON, and the Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from loadtest.compare import spread

MODEL = "fraud_xgboost"
# issue 30: "c=1 throughput ≥ 1.0× KServe's, c=8 and c=32 ≥ 2×"
GOALS = {1: 1.0, 8: 2.0, 32: 2.0}
FIGURES = ("throughput_rps", "p50_ms", "p99_ms", "error_rate", "cpu_ms_per_inference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/kserve/results.json"), help="result file")
    ap.add_argument("--repository", type=Path, default=None, help="existing demo repository (default: build one beside --json)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument(
        "--kserve-variants", type=_names, default=["default", "quiet"],
        help="KServe configurations, each its own process and target: 'default' (KServe's shipped defaults: "
             "two log lines per call) and/or 'quiet' (latency logging off, log level WARNING)",
    )  # fmt: skip
    ap.add_argument("--kserve-python", type=Path, default=None, help="KServe's interpreter (default .venv-kserve/bin/python)")
    ap.add_argument(
        "--inprocess", action="store_true",
        help="also a second stack with Triton in the frontend's process (--triton-mode in-process), target "
             "'inferplane-inprocess', its ratios against KServe beside the default's",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    from loadtest.kserve_target import VARIANTS

    unknown = [v for v in args.kserve_variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown KServe variant(s) {unknown}; known: {sorted(VARIANTS)}")
    return args


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive integers")
    return values


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of distinct names")
    return names


def kserve_label(variant: str) -> str:
    return "kserve" if variant == "default" else f"kserve-{variant}"


def rotation(labels: list[str], round_index: int) -> list[str]:
    """The order of the targets in a round: each round starts one further along."""
    k = round_index % len(labels)
    return labels[k:] + labels[:k]


def serving_cpu_ms(run: dict, pid: int) -> float | None:
    """CPU milliseconds per inference of ``pid``'s process tree over the measured window."""
    per = ((run.get("cpu") or {}).get("pids") or {}).get(str(pid)) or {}
    calls = run.get("requests", 0) + run.get("errors_total", 0)
    return None if per.get("cpu_s") is None or not calls else per["cpu_s"] * 1000 / calls


def figures(run: dict, pid: int) -> dict:
    calls = run["requests"] + run["errors_total"]
    return {
        "throughput_rps": run["throughput_rps"],
        "p50_ms": run["latency_ms"]["p50"],
        "p99_ms": run["latency_ms"]["p99"],
        "error_rate": run["errors_total"] / calls if calls else None,
        "cpu_ms_per_inference": serving_cpu_ms(run, pid),
    }


def inferplane_labels(labels) -> list[str]:
    """The inferplane targets among ``labels``: ``inferplane`` (child Triton) and ``inferplane-inprocess``."""
    return [label for label in labels if label.startswith("inferplane")]


def summarize_point(per_round: dict[str, list[dict]], kserve_labels: list[str]) -> dict:
    """One concurrency's figures (``per_round``: label -> that target's ``figures`` per round): each target's
    spread over the rounds; each inferplane target over each KServe and over Triton, KServe/Triton, per round
    with their spread."""
    out: dict = {"targets": {}, "ratios": {}}
    for label, rounds in per_round.items():
        out["targets"][label] = {name: spread([r[name] for r in rounds]) for name in FIGURES}
    ours = inferplane_labels(per_round)
    pairs = [(o, k) for o in ours for k in kserve_labels + ["triton"]] + [(k, "triton") for k in kserve_labels]
    for b, a in pairs:
        if a in per_round and b in per_round:
            ratio = {}
            for name in ("throughput_rps", "p50_ms", "p99_ms"):
                pairs_ab = zip((r[name] for r in per_round[a]), (r[name] for r in per_round[b]))
                ratio[name] = spread([vb / va if va and vb is not None else None for va, vb in pairs_ab])
            out["ratios"][f"{b}/{a}"] = ratio
    return out


def goal_verdict(concurrency: int, ratio: float | None) -> str:
    """``met`` / ``not met`` for the median throughput ratio inferplane/KServe at a concurrency with a goal."""
    goal = GOALS.get(concurrency)
    if goal is None:
        return "no goal"
    if ratio is None:
        return "n/a"
    return "met" if ratio >= goal else "not met"


def _fmt(value, digits=2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render(results: dict) -> str:
    labels = results["targets"]
    kserve = [label for label in labels if label.startswith("kserve")]
    lines = [f"Command: `{results['command']}` ({results['date']}, {results['machine']['cpus']} CPUs, "
             f"load average before/after: {results['uptime_before']} / {results['uptime_after']})", ""]  # fmt: skip
    head = "| c | " + " | ".join(f"{t} infer/s · p50 · p99 ms" for t in labels)
    ratios = [f"{o}/{k}" for o in inferplane_labels(labels) for k in kserve]
    head += " | " + " | ".join(f"{r} infer/s (min–max) · goal" for r in ratios) + " |"
    lines += [head, "|" + "---|" * (1 + len(labels) + len(ratios))]
    for conc, point in results["points"].items():
        row = [str(conc)]
        for label in labels:
            t = point["targets"][label]
            row.append(f"{_fmt(t['throughput_rps']['median'], 0)} · {_fmt(t['p50_ms']['median'])} · {_fmt(t['p99_ms']['median'])}")
        for name in ratios:
            r = point["ratios"][name]["throughput_rps"]
            goal = GOALS.get(int(conc))
            row.append(f"{_fmt(r['median'])} ({_fmt(r['min'])}–{_fmt(r['max'])}) · "
                       f"{goal_verdict(int(conc), r['median'])}{f' (≥ {goal:.1f})' if goal else ''}")  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| c | " + " | ".join(f"{t} CPU ms/inference" for t in labels) + " |", "|" + "---|" * (1 + len(labels))]
    for conc, point in results["points"].items():
        lines.append(f"| {conc} | " + " | ".join(_fmt(point["targets"][t]["cpu_ms_per_inference"]["median"], 3) for t in labels) + " |")
    return "\n".join(lines) + "\n"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return " ".join(f"{v:.2f}" for v in os.getloadavg())


def check_answers(targets: dict[str, str], pools: dict[str, list[bytes]], count: int = 32) -> dict:
    """Every target's outputs on the first ``count`` pool items against Triton direct's: the largest difference."""
    import grpc
    import numpy as np

    from server.protogen.inference import grpc_service_pb2 as pb

    def answers(address: str, pool: list[bytes]) -> np.ndarray:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b,
                                       response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip
            out = []
            for item in pool[:count]:
                reply = call(item, timeout=10)
                raw = reply.raw_output_contents[0] if reply.raw_output_contents else None
                out.append(np.frombuffer(raw, np.float32) if raw else np.asarray(reply.outputs[0].contents.fp32_contents, np.float32))
            return np.concatenate(out)

    reference = answers(targets["triton"], pools["triton"])
    return {label: float(np.max(np.abs(answers(address, pools[label]) - reference))) for label, address in targets.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from loadtest import kserve_target
    from loadtest.engine import LoadSpec
    from loadtest.runner import RunConfig, prepare_pool, run
    from loadtest.stack import start_stack, stop_stack

    command = "python -m loadtest.bench_kserve " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    workdir = args.json.parent
    workdir.mkdir(parents=True, exist_ok=True)
    repo = args.repository
    if repo is None:
        from model_repository.demo import build_demo_repository

        repo = workdir / "model_repository"
        build_demo_repository(repo)
    results: dict = {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "uptime_before": _uptime(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": args.model,
        "load": {"mode": "closed", "rounds": args.rounds, "warmup_s": args.warmup, "duration_s": args.duration},
        "goals": {str(c): g for c, g in GOALS.items()},
    }
    python = {"python": args.kserve_python} if args.kserve_python else {}
    kservers, stack, inproc = [], None, None
    try:
        for variant in args.kserve_variants:
            kservers.append(kserve_target.start(repo / args.model, workdir / "stack", variant=variant, **python))
        stack = start_stack(repo, workdir / "stack", "--auth", "off")
        triton_pid = stack.triton_pid()
        targets = {"triton": stack.triton, "inferplane": stack.grpc}
        pids = {"triton": triton_pid, "inferplane": stack.process.pid}
        if args.inprocess:  # the same repository, Triton inside the frontend's process: one gRPC hop
            inproc = start_stack(repo, workdir / "stack-inprocess", "--auth", "off", "--triton-mode", "in-process")
            targets["inferplane-inprocess"] = inproc.grpc
            pids["inferplane-inprocess"] = inproc.process.pid
        for ks in kservers:
            targets[kserve_label(ks.variant)] = ks.grpc
            pids[kserve_label(ks.variant)] = ks.process.pid
        results["targets"] = list(targets)
        results["servers"] = {
            "triton": "the stack's tritonserver child, its own gRPC port (the model's Python-backend adapter)",
            "inferplane": "inferplane serve --auth off: 1 worker, its Triton a supervised child over loopback gRPC (the default)",
            **({"inferplane-inprocess": "inferplane serve --auth off --triton-mode in-process: 1 worker, libtritonserver "
                "in the frontend's process"} if args.inprocess else {}),
            **{kserve_label(ks.variant): f"kserve.ModelServer, 1 process, variant {ks.variant!r}: "
               f"{' '.join(kserve_target.VARIANTS[ks.variant][0]) or 'shipped defaults'}" for ks in kservers},  # fmt: skip
        }
        results["kserve_versions"] = kservers[0].versions if kservers else {}
        pools = {label: prepare_pool(f"grpc://{address}", args.model, data="validation", repository=str(repo), size=256)
                 for label, address in targets.items()}  # fmt: skip
        results["max_abs_diff_vs_triton"] = check_answers(targets, pools)
        print("answers, largest difference from Triton direct:", results["max_abs_diff_vs_triton"], flush=True)
        results["points"], results["runs"] = {}, {}
        for conc in args.concurrency:
            spec = LoadSpec(concurrency=conc, warmup=args.warmup, duration=args.duration)
            runs: dict[str, list[dict]] = {label: [] for label in targets}
            for i in range(args.rounds):
                for label in rotation(list(targets), i):
                    cfg = RunConfig(f"grpc://{targets[label]}", args.model, spec, pids=(pids[label],), label=label)
                    runs[label].append(run(cfg, pools[label]))
            per_round = {label: [figures(r, pids[label]) for r in rs] for label, rs in runs.items()}
            point = summarize_point(per_round, [k for k in targets if k.startswith("kserve")])
            results["points"][str(conc)] = point
            results["runs"][str(conc)] = runs
            print(f"c={conc}: " + ", ".join(f"{label} {point['targets'][label]['throughput_rps']['median']:.0f}/s"
                                             for label in targets), flush=True)  # fmt: skip
    finally:
        for each in (stack, inproc):
            if each is not None:
                stop_stack(each)
        for ks in kservers:
            kserve_target.stop(ks)
    results["uptime_after"] = _uptime()
    args.json.write_text(json.dumps(results, indent=1, default=str))
    table = render(results)
    args.json.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
