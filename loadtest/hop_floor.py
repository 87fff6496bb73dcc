"""The floor of one Python gRPC hop at c=1: is "≤ 0.4 ms added p50" reachable with any grpc.aio hop?

    python -m loadtest.hop_floor --out benchmarks/hop_floor [--model fraud_xgboost] [--requests 2000]
        [--repository DIR] [--variants canned,proxy,...]

Starts the real stack (frontend + its child Triton, auth off) and, beside it, bare grpc.aio servers
(``loadtest.naive_proxy``, one process each) answering the same ModelInfer:

- ``canned*``: from memory (after one forward) — the floor of one Python gRPC server hop, nothing else;
- ``proxy*``: the request's bytes forwarded to the stack's Triton with a grpc.aio client — the floor of
  the child-Triton design (two hops, no parsing, no policy);

each in variants of the options that could lower the hop (:data:`VARIANTS`: the event loop, grpc's
``optimization_target``, ``SO_REUSEPORT``, the frontend's message-size options, a pass-through
interceptor as the frontend has). One caller in one thread sends the same pre-serialized request to
Triton direct, every bare server and the frontend (asked twice: with ``inferplane-timing`` for its
stages, and without, as a caller would) in a fresh random order every round (``loadtest.stage_budget.measure``;
``--rotate``: a fixed order rotated, whose neighbours bias the figures), so all see the same machine at
the same moments: the ratios are the result, not the absolute figures. ``*-copy`` variants are the
default again in another process: the spread between two identical servers in the run.

Writes results.json and report.md under ``--out``.
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
import time
from pathlib import Path

from loadtest.stage_budget import measure

READY = "ready on "

# label -> naive_proxy arguments (beside --mode, --triton, --port). ``*-copy``: the default again, in
# its own process — how far two identical servers differ in the run (its noise band for the others)
VARIANTS: dict[str, tuple[str, ...]] = {
    "canned": (),
    "canned-copy": (),
    "canned-asyncio": ("--loop", "asyncio"),
    "canned-latency": ("--option", "grpc.optimization_target=latency"),
    "canned-interceptor": ("--interceptor",),
    "proxy": (),
    "proxy-copy": (),
    "proxy-asyncio": ("--loop", "asyncio"),
    "proxy-latency": ("--option", "grpc.optimization_target=latency"),
    "proxy-throughput": ("--option", "grpc.optimization_target=throughput"),
    "proxy-noreuseport": ("--option", "grpc.so_reuseport=0"),
    "proxy-msgsize": ("--option", f"grpc.max_receive_message_length={64 << 20}", "--option", f"grpc.max_send_message_length={65 << 20}"),
    "proxy-interceptor": ("--interceptor",),
}


def variant_command(label: str, triton: str) -> list[str]:
    """The ``loadtest.naive_proxy`` command of a variant (its mode is its label's first word)."""
    mode = label.split("-", 1)[0]
    return [sys.executable, "-m", "loadtest.naive_proxy", "--port", "0", "--mode", mode, "--triton", triton, *VARIANTS[label]]


def _start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd} exited with {proc.wait()}:\n{log.read_text()[-3000:]}")
        if READY in line:
            return proc, line.split(READY, 1)[1].strip()
    proc.kill()
    raise RuntimeError(f"{cmd} not ready in 120 s")


def report(result: dict, command: str, load: str) -> str:
    """The table for BENCHMARKS.md: per target its round trip, what it adds over Triton direct, and
    its p50 against the default ``canned`` / ``proxy`` (the variant's effect, same run)."""
    targets, added = result["targets"], result["added_ms"]
    lines = [
        f"`{command}` — {result['model']}, {result['requests']} requests per target, c=1, {result.get('order', 'rotating')} order; load: {load}",
        "",
        "| target | p50 ms | p99 ms | mean ms | added p50 ms | added p99 ms | p50 / its default's |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, t in targets.items():
        a = added.get(label)
        base = label.split("-", 1)[0]
        ratio = f"{t['p50'] / targets[base]['p50']:.3f}" if base in ("canned", "proxy") and base != label and base in targets else ""
        if label.startswith("frontend") and "frontend" in targets and label != "frontend":
            ratio = f"{t['p50'] / targets['frontend']['p50']:.3f}"
        extra = f"{a['p50']:.3f} | {a['p99']:.3f}" if a else "— | —"
        lines.append(f"| {label} | {t['p50']:.3f} | {t['p99']:.3f} | {t['mean']:.3f} | {extra} | {ratio} |")
    stages = result["stages"].get("frontend", {})
    if stages:
        lines += ["", "| frontend stage | mean ms | p50 ms |", "|---|---|---|"]
        lines += [f"| {name} | {s['mean']:.3f} | {s['p50']:.3f} |" for name, s in stages.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/hop_floor"))
    ap.add_argument("--model", default="fraud_xgboost")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repository", type=Path, default=None, help="existing demo repository (default: build one)")
    ap.add_argument("--rotate", dest="shuffle", action="store_false", help="rotate a fixed order (stage_budget's) instead of a fresh random order each round")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    wanted = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants: {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    command = "python -m loadtest.hop_floor " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    from loadtest.runner import prepare_pool
    from loadtest.stack import start_stack, stop_stack

    repo = args.repository
    if repo is None:
        from model_repository.demo import build_demo_repository

        repo = args.out / "model_repository"
        build_demo_repository(repo)
    stack = start_stack(Path(repo).resolve(), args.out / "stack", "--auth", "off")
    procs: list[subprocess.Popen] = []
    try:
        bare = {}
        for label in wanted:
            proc, where = _start(variant_command(label, stack.triton), args.out / "stack" / f"{label}.log")  # beside the stack's (not kept)
            procs.append(proc)
            bare[label] = where
        bare["frontend-untimed"] = stack.grpc  # the frontend as a caller asks it: no stage timer
        pool = prepare_pool(f"grpc://{stack.triton}", args.model, size=64)
        load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        result = measure({"frontend": stack.grpc}, stack.triton, args.model, args.requests, args.warmup, pool, bare=bare, shuffle=args.shuffle)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        stop_stack(stack)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result.update(
        order="shuffled" if args.shuffle else "rotating", command=command, load_before=load_before, load=load, variants={label: list(VARIANTS[label]) for label in wanted},
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    )  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result, command, f"{load_before} → {load}")
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
