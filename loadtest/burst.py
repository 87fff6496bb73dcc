"""Overload far past capacity: how fast refusals come, whether each carries a retry hint, and whether
every call is counted (issue 15, class 6).

    python -m loadtest.burst [--callers 1024] [--seconds 10] [--channels 8] [--model fraud_xgboost]

Starts the stack (demo models, auth off, one model loaded), then ``--callers`` closed-loop grpc.aio
callers over ``--channels`` connections send one-row ModelInfer requests (5 s deadline) for
``--seconds``. Prints per status the count, p50/p99 latency, how many carried a retry hint
(``retry-after`` / ``grpc-retry-pushback-ms``), and the frontend's own ``inferplane_requests_total``
so uncounted calls show. Never part of the test run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from loadtest.stack import start_stack, stop_stack
from server.protogen.inference import grpc_service_pb2 as pb

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def _request(model: str, width: int) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=[1, width])
    req.raw_input_contents.append(np.ones((1, width), np.float32).tobytes())
    return req.SerializeToString()


async def _burst(target: str, raw: bytes, callers: int, seconds: float, channels: int) -> dict:
    chans = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    calls = [c.unary_unary(METHOD) for c in chans]
    codes: collections.Counter = collections.Counter()
    hinted: collections.Counter = collections.Counter()
    latency: dict[str, list[float]] = collections.defaultdict(list)
    end = time.perf_counter() + seconds

    async def caller(i: int) -> None:
        call = calls[i % channels]
        while time.perf_counter() < end:
            started = time.perf_counter()
            try:
                await call(raw, timeout=5.0)
                code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
                trailers = dict(err.trailing_metadata() or ())
                if "retry-after" in trailers or "grpc-retry-pushback-ms" in trailers:
                    hinted[code] += 1
            codes[code] += 1
            latency[code].append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(caller(i) for i in range(callers)))
    for c in chans:
        await c.close()
    out = {}
    for code, n in codes.most_common():
        v = sorted(latency[code])
        out[code] = {"count": n, "p50_ms": round(v[len(v) // 2], 2), "p99_ms": round(v[int(len(v) * 0.99)], 2), "with_retry_hint": hinted[code]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--callers", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--model", default="fraud_xgboost")
    ap.add_argument("--width", type=int, default=32, help="the model's features")
    ap.add_argument("--json", type=Path, help="also write the result document here")
    args = ap.parse_args(argv)
    from model_repository.demo import build_demo_repository

    work = Path(tempfile.mkdtemp(prefix="inferplane-burst-"))
    try:
        build_demo_repository(work / "model_repository")
        stack = start_stack(work / "model_repository", work, "--auth", "off", "--model", args.model,
                            env={"INFERPLANE_DATABASE_URL": f"sqlite:///{work}/registry.db"})  # fmt: skip
        try:
            answers = asyncio.run(_burst(stack.grpc, _request(args.model, args.width), args.callers, args.seconds, args.channels))
            text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
            counted = {line.split("code=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
                       for line in text.splitlines() if line.startswith("inferplane_requests_total{")}  # fmt: skip
        finally:
            stop_stack(stack)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = json.dumps({"callers": args.callers, "seconds": args.seconds, "answers": answers, "counted_by_the_frontend": counted}, indent=1)
    print(doc)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(doc + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
