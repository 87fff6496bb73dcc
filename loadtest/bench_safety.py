"""What safety filters cost: the same embedding model served three times by one stack — no policy,
a rule policy (PII redaction + a keyword block list), and rules plus the model-based classifier — under
the same closed loop of real gRPC ModelInfer calls.

    python -m loadtest.bench_safety --out benchmarks/safety [--concurrency 1,8] [--rounds 4] [--duration 3]

One stack (embedded Triton + frontend), so the three endpoints share a process, a Triton and the
machine's drift; rounds are interleaved (plain, rules, classifier, plain, ...), each figure is the
median over rounds, and every ratio is against "plain" measured in the same round. The classifier is a
deployed model (``safety_classifier``): its cost includes its own Triton call per request. Writes
results.json and report.md (figures are for BENCHMARKS.md when measured on a quiet machine).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

ENDPOINTS = {"plain": "embed_plain", "rules": "embed_rules", "classifier": "embed_classifier"}
RULES = {
    "rules": [
        {"name": "pii", "kind": "pii", "types": ["email", "phone", "card", "iban"], "action": "redact"},
        {"name": "deny", "kind": "keywords", "words": ["project zeus", "internal only"], "action": "block"},
    ]
}
CLASSIFIER = {"model": "safety_classifier", "threshold": 0.8, "action": "block"}
TEXTS = [
    "please summarise the quarterly report and send it to jane.doe@example.com before friday",
    "what is the capital of france and how many people live there",
    "my card 4111 1111 1111 1111 was charged twice, can you check the last invoice",
    "write a short poem about the sea at night for my daughter",
]


def build_repository(out: Path) -> Path:
    from model_repository.config_writer import read_config, write_config
    from model_repository.embeddings import NAME, build_embedding_model
    from model_repository.safety_classifier import build_safety_classifier

    source = out / "_source"
    if not (source / NAME).is_dir():
        build_embedding_model(source)
    repo = out / "model_repository"
    shutil.rmtree(repo, ignore_errors=True)
    for name in ENDPOINTS.values():
        shutil.copytree(source / NAME, repo / name, copy_function=os.link)
        (repo / name / "config.pbtxt").unlink()
        config = read_config(source / NAME)
        config.name = name
        write_config(config, repo / name)
    build_safety_classifier(repo)
    return repo


def _request(model: str, text: str) -> bytes:
    from server.protogen.inference import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    raw = text.encode()
    req.raw_input_contents.append(len(raw).to_bytes(4, "little") + raw)
    return req.SerializeToString()


async def _closed_loop(target: str, model: str, concurrency: int, duration: float, warmup: float) -> dict:
    import grpc

    channel = grpc.aio.insecure_channel(target)
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=None)
    bodies = [_request(model, t) for t in TEXTS]
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + duration

    async def worker(i: int) -> None:
        nonlocal errors
        n = i
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                return
            try:
                await call(bodies[n % len(bodies)], timeout=30)
            except grpc.aio.AioRpcError:
                errors += 1
            t1 = time.perf_counter()
            if t0 >= measure_from:
                latencies.append(t1 - t0)
            n += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    await channel.close()
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")  # noqa: E731
    return {"throughput_rps": len(latencies) / duration, "p50_ms": pick(0.5), "p99_ms": pick(0.99), "errors": errors}


def main(argv: list[str] | None = None) -> int:
    from loadtest.stack import start_stack, stop_stack

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/safety"))
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 s at c=4 (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup, args.concurrency = 2, 1.0, 0.5, "4"
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtest.bench_safety " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    repo = build_repository(args.out)
    policies = {ENDPOINTS["rules"]: {"input": RULES}, ENDPOINTS["classifier"]: {"input": {**RULES, "classifier": CLASSIFIER}}}
    env = {"INFERPLANE_SAFETY": json.dumps(policies), "INFERPLANE_DRIFT_SAMPLE_RATIO": "0", "INFERPLANE_DATABASE_URL": f"sqlite:///{args.out.resolve()}/bench.db"}
    stack = start_stack(repo, args.out / "stack", "--auth", "off", "--workers", "1", env=env)
    results: dict = {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "concurrency": {},
    }
    try:
        for conc in [int(c) for c in args.concurrency.split(",")]:
            runs: dict[str, list[dict]] = {label: [] for label in ENDPOINTS}
            for _ in range(args.rounds):
                for label, model in ENDPOINTS.items():
                    runs[label].append(asyncio.run(_closed_loop(stack.grpc, model, conc, args.duration, args.warmup)))
            results["concurrency"][conc] = _summary(runs)
            line = ", ".join(f"{k} p50 {v['p50_ms']:.2f} ms (x{v['p50_ratio']:.3f}) {v['throughput_rps']:.0f} rps" for k, v in results["concurrency"][conc].items())
            print(f"c={conc}: {line}", flush=True)
    finally:
        stop_stack(stack)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report = render(results)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0


def _summary(runs: dict[str, list[dict]]) -> dict:
    out = {}
    base = runs["plain"]
    for label, rs in runs.items():
        p50 = [r["p50_ms"] / b["p50_ms"] for r, b in zip(rs, base) if b["p50_ms"]]
        rps = [r["throughput_rps"] / b["throughput_rps"] for r, b in zip(rs, base) if b["throughput_rps"]]
        out[label] = {
            "throughput_rps": statistics.median(r["throughput_rps"] for r in rs),
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
            "p50_ratio": statistics.median(p50) if p50 else float("nan"),
            "throughput_ratio": statistics.median(rps) if rps else float("nan"),
            "errors": sum(r["errors"] for r in rs),
        }
    return out


def render(results: dict) -> str:
    lines = [
        f"Command: `{results['command']}` ({results['date']}, {results['machine']['cpus']} CPUs)", "",
        "| c | filters | rps | rps ratio vs plain | p50 ms | p50 ratio vs plain | p99 ms | errors |", "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for conc, rows in results["concurrency"].items():
        for label, r in rows.items():
            lines.append(
                f"| {conc} | {label} | {r['throughput_rps']:.0f} | {r['throughput_ratio']:.3f} | {r['p50_ms']:.2f} | {r['p50_ratio']:.3f} "
                f"| {r['p99_ms']:.2f} | {r['errors']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
