"""Overload benchmark (issue 30): goodput, admitted latency and refusal latency past capacity.

    python -m loadtest.overload [--model fraud_xgboost] [--seconds 3] [--processes 2]
        [--callers 1024] [--protocols grpc,rest,rest-json] [--paced MS,N] [--server-root DIR]
        [--baseline-root DIR] [--variant LABEL:KEY=VALUE,...] [--json OUT]

Starts the stack (demo models, auth off, ``--model`` loaded; ``--server-root``: another checkout's
code and interpreter, e.g. ``/work/main`` for the before figures — the load generator is this one
either way; ``--paced 20,4``: the paced model, 4 instances x 20 ms, which saturates before the frontend
does, so the figures are the queueing policy's and not the shared CPU's), then per protocol, every phase spread over ``--processes`` load-generator processes so
the client is not the bottleneck. ``--baseline-root DIR`` (another checkout, its ``.venv`` or this
interpreter) and each ``--variant LABEL:KEY=VALUE,...`` (this code with those ``INFERPLANE_*``
settings) are measured in the same run: per protocol, each target's own stack in turn (one stack at
a time, so they never share the CPU), the baseline first:

1. capacity: closed loop at 32 callers (``--capacity-callers``; paced: its slots and as many waiting,
   within the queue's bound) → ``capacity_rps`` (answered requests per second);
2. open loop (fixed rate, 5 s deadline) at 0.8×, 1.5× and 3× that capacity → goodput (answered
   per second) as a fraction of capacity, the admitted requests' p99 (from their scheduled time:
   coordinated omission counted), the error codes;
3. ``--callers`` closed-loop callers (1024) → the refusals' latency (send → status) and codes;
4. the same callers honouring each refusal's retry hint (``retry-after``: they wait it out before
   their next call) → ``backoff_refusal_p99_ms``, ``backoff_goodput_fraction``: the refusal latency
   with a client that does what the hint asks, rather than one that resends at once.

Reports per protocol ``goodput_fraction`` at 1.5× / 3×, ``admitted_p99_vs_80pct`` (admitted p99
over the 0.8× p99) and ``refusal_p99_ms``. Short runs; never part of the test run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from loadtest.engine import LoadSpec
from loadtest.paced_model import NAME as PACED
from loadtest.paced_model import build_paced_model
from loadtest.runner import RunConfig, prepare_pool, run
from loadtest.stack import start_stack, stop_stack
from model_repository.demo import build_demo_repository

LOADS = (0.8, 1.5, 3.0)


def _target(stack, protocol: str) -> str:
    return f"grpc://{stack.grpc}" if protocol == "grpc" else f"http://{stack.http}"


def _phase(cfg_base: dict, spec: LoadSpec, pool: list) -> dict:
    return run(RunConfig(spec=spec, **cfg_base), pool)


def _row(result: dict) -> dict:
    keep = ("mode", "concurrency", "rate", "offered_rps", "throughput_rps", "latency_ms", "error_latency_ms", "errors", "send_lag_ms")
    return {k: result[k] for k in keep if k in result}


def measure(stack, protocol: str, model: str, seconds: float, processes: int, callers: int, capacity_callers: int = 32) -> dict:
    target = _target(stack, protocol)
    rest_json = protocol == "rest-json"
    pool = prepare_pool(target, model, rest_json=rest_json, size=64)
    base = {"target": target, "model": model, "processes": processes, "channels": 4, "timeout": 5.0, "rest_json": rest_json}
    # closed loop within the queue's bound: a refused caller retries at once, and a refusal storm measures CPU, not capacity
    capacity = _phase(base, LoadSpec(concurrency=capacity_callers, warmup=0.5, duration=seconds), pool)
    cap = capacity["throughput_rps"]
    out = {"protocol": protocol, "capacity_rps": cap, "capacity": _row(capacity), "loads": {}}
    for load in LOADS:
        result = _phase(base, LoadSpec(rate=load * cap, warmup=0.5, duration=seconds, max_inflight=4096), pool)
        out["loads"][f"{load:g}x"] = _row(result)
    burst = _phase({**base, "channels": 8}, LoadSpec(concurrency=callers, warmup=0.5, duration=seconds), pool)
    out["burst"] = _row(burst)
    # the same callers honouring the refusals' retry hint (as the README asks a client to): the refusals'
    # latency when the refused do not come straight back, and what the frontend serves meanwhile
    backoff = _phase({**base, "channels": 8}, LoadSpec(concurrency=callers, warmup=0.5, duration=seconds, honor_retry_after=True), pool)
    out["burst_backoff"] = {**_row(backoff), "backoffs": backoff.get("backoffs", 0)}
    p99_80 = out["loads"]["0.8x"]["latency_ms"]["p99"]
    out["summary"] = {
        **{f"goodput_fraction_{k}": round(v["throughput_rps"] / cap, 3) for k, v in out["loads"].items() if k != "0.8x"},
        **{f"admitted_p99_ms_{k}": v["latency_ms"]["p99"] for k, v in out["loads"].items()},
        **{f"admitted_p99_vs_80pct_{k}": round(v["latency_ms"]["p99"] / p99_80, 2) if p99_80 else None
           for k, v in out["loads"].items() if k != "0.8x"},  # fmt: skip
        "refusal_p99_ms": burst.get("error_latency_ms", {}).get("p99"),
        "refusal_p50_ms": burst.get("error_latency_ms", {}).get("p50"),
        "burst_codes": {"OK": burst["requests"], **{c: e["count"] for c, e in burst["errors"].items()}},
        "backoff_refusal_p99_ms": backoff.get("error_latency_ms", {}).get("p99"),
        "backoff_goodput_fraction": round(backoff["throughput_rps"] / cap, 3) if cap else None,
        "backoff_codes": {"OK": backoff["requests"], **{c: e["count"] for c, e in backoff["errors"].items()}},
    }
    return out


def _python(root: Path) -> str | None:
    venv = root / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else None  # without its own venv: this interpreter, run from that root


def _targets(args) -> list[tuple[str, Path | None, dict[str, str]]]:
    """(label, server root, extra env) of every stack this run measures."""
    targets = []
    if args.baseline_root:
        targets.append(("baseline", args.baseline_root, {}))
    if args.variant:
        for spec in args.variant:
            label, _, pairs = spec.partition(":")
            targets.append((label, args.server_root, dict(p.split("=", 1) for p in pairs.split(",") if p)))
    else:
        targets.append((args.label or "candidate", args.server_root, {}))
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="fraud_xgboost")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--callers", type=int, default=1024)
    ap.add_argument("--protocols", default="grpc", help="comma-separated: grpc, rest (binary), rest-json")
    ap.add_argument("--paced", default="", help="SERVICE_MS,INSTANCES: add the paced model (loadtest.paced_model) and load it instead")
    ap.add_argument("--capacity-callers", type=int, default=None, help="closed-loop callers of the capacity phase (default 32; paced: 2 x instances)")
    ap.add_argument("--server-root", type=Path, default=None, help="run the frontend from this checkout (its .venv)")
    ap.add_argument("--baseline-root", type=Path, default=None, help="also measure this checkout's frontend, in the same run")
    ap.add_argument("--variant", action="append", default=[], help="LABEL:KEY=VALUE,...: this code with these env settings (repeatable)")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="inferplane-overload-"))
    try:
        build_demo_repository(work / "model_repository")
        if args.paced:  # a model that saturates before the frontend does: the queueing policy, not the CPU
            service_ms, instances = args.paced.split(",")
            build_paced_model(work / "model_repository", float(service_ms), int(instances), jitter=0.2)
            args.model = PACED
            args.capacity_callers = args.capacity_callers or 2 * int(instances)  # its slots, and as many waiting
        rows = []
        for protocol in (p.strip() for p in args.protocols.split(",")):
            for label, root, extra in _targets(args):
                run_dir = work / f"{label}-{protocol}"
                env = {"INFERPLANE_DATABASE_URL": f"sqlite:///{run_dir}/registry.db", **extra}
                stack = start_stack(work / "model_repository", run_dir, "--auth", "off", "--model", args.model, env=env,
                                    python=_python(root) if root else None, cwd=root)  # fmt: skip
                try:
                    row = measure(stack, protocol, args.model, args.seconds, args.processes, args.callers, args.capacity_callers or 32)
                finally:
                    stop_stack(stack)
                rows.append({"label": label, "server_root": str(root or "."), "env": extra, **row})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"label": args.label, "paced": args.paced, "server_root": str(args.server_root or "."), "model": args.model, "seconds": args.seconds,
              "processes": args.processes, "callers": args.callers, "rows": rows}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(json.dumps([{"label": r["label"], "protocol": r["protocol"], "capacity_rps": round(r["capacity_rps"]), **r["summary"]} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
