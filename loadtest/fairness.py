"""Fairness and overload benchmarks: two tenants against the real stack with ``--auth on``.

    python -m loadtest.fairness [--service-ms 80 --instances 8] [--duration 10] [--json out.json]
    python -m loadtest.fairness --model mlp_classifier --service-us 4000 --slots 1   # a demo model

One run starts the stack (embedded Triton, a fresh tenancy database with tenants A and B on the
same plan), then measures, all open loop (latency from the scheduled send time) on one model.
The default model is ``paced`` (``loadtest.paced_model``): ``--instances`` instances that each
answer after ``--service-ms`` without using the CPU — an accelerator stand-in with a known
capacity, so that the model saturates before the two CPUs the load generator, the frontend and
Triton share. With a demo model, ``--service-us`` sets its Triton batching delay instead.

1. capacity: B alone, closed loop, many callers -> goodput C; unloaded latency: one caller.
2. fairness: B offers its share (C/2) alone; then B offers its share while A offers 10x its
   share (5C) — side by side: B's p99 and goodput with and without A, total goodput.
3. overload: A alone offers 5x capacity: goodput, admitted p99 vs unloaded, rejection latency
   p99, frontend RSS before and after.

Prints one JSON document (and writes it with ``--json``). Targets: B's p99 with A within 1.5x of
solo; total goodput >= 90% of C; under 5x overload goodput >= 90% of C, rejections p99 <= 5 ms,
admitted p99 <= 3x unloaded, RSS bounded. Never part of the test run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

INFER = "/inference.GRPCInferenceService/ModelInfer"
PEPPER = "fairness-benchmark"


def _pct(values: list[float], q: float) -> float | None:
    return None if not values else round(float(np.percentile(np.asarray(values) * 1000, q)), 3)


def _summary(name: str, rate: float | None, duration: float, ok: list[float], refused: list[float], codes: Counter) -> dict:
    return {
        "tenant": name,
        "offered_rps": rate,
        "goodput_rps": round(len(ok) / duration, 1),
        "ok": len(ok),
        "codes": dict(codes),
        "latency_ms": {"p50": _pct(ok, 50), "p99": _pct(ok, 99), "max": _pct(ok, 100)},
        "rejection_ms": {"p50": _pct(refused, 50), "p99": _pct(refused, 99)},
    }


async def _open_loop(call, payload: bytes, metadata, rate: float, duration: float, t0: float):
    ok: list[float] = []
    refused: list[float] = []
    codes: Counter = Counter()
    tasks: set = set()

    async def one(scheduled: float) -> None:
        try:
            await call(payload, metadata=metadata, timeout=10)
            ok.append(time.perf_counter() - scheduled)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as err:
            refused.append(time.perf_counter() - scheduled)
            codes[err.code().name] += 1

    n = int(rate * duration)
    i = 0
    while i < n:
        due = t0 + i / rate
        now = time.perf_counter()
        if due > now:
            await asyncio.sleep(due - now)
            continue
        while i < n and t0 + i / rate <= time.perf_counter():
            task = asyncio.create_task(one(t0 + i / rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
    while tasks:
        await asyncio.gather(*list(tasks))
    return ok, refused, codes


async def _closed_loop(call, payload: bytes, metadata, concurrency: int, duration: float):
    ok: list[float] = []
    codes: Counter = Counter()
    end = time.perf_counter() + duration

    async def caller() -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            try:
                await call(payload, metadata=metadata, timeout=10)
                ok.append(time.perf_counter() - t)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] += 1

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return ok, codes


def _payload(repository: Path, model: str, batch: int) -> bytes:
    from loadtest.paced_model import NAME as PACED, sample_features
    from model_repository.layout import load_validation
    from server.protogen.inference import grpc_service_pb2 as pb

    if model == PACED:
        x = sample_features(batch)
    else:
        x = np.ascontiguousarray(load_validation(repository / model)["features"][:batch], dtype=np.float32)
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


async def _measure(stack, keys: dict, model: str, payload: bytes, duration: float, concurrency: int) -> dict:
    import psutil

    channels = {t: grpc.aio.insecure_channel(stack.grpc) for t in keys}
    calls = {t: ch.unary_unary(INFER, request_serializer=None, response_deserializer=None) for t, ch in channels.items()}
    meta = {t: (("authorization", f"Bearer {k}"),) for t, k in keys.items()}
    frontend = psutil.Process(stack.process.pid)
    out: dict = {"model": model}
    gc.collect()
    gc.freeze()  # the load generator's own collections must not delay its scheduled sends
    gc_at_start = _gc_pauses(stack.metrics)
    try:
        await _closed_loop(calls["B"], payload, meta["B"], concurrency, 2.0)  # warm-up
        ok, _ = await _closed_loop(calls["B"], payload, meta["B"], 1, min(duration, 5.0))
        unloaded_p99 = _pct(ok, 99)
        ok, codes = await _closed_loop(calls["B"], payload, meta["B"], concurrency, duration)
        capacity = len(ok) / duration
        out["capacity"] = {"goodput_rps": round(capacity, 1), "closed_loop_concurrency": concurrency, "codes": dict(codes),
                           "unloaded_p50_ms": None, "unloaded_p99_ms": unloaded_p99, "saturated_p99_ms": _pct(ok, 99)}  # fmt: skip
        share = capacity / 2

        t0 = time.perf_counter() + 0.05
        solo = _summary("B", share, duration, *await _open_loop(calls["B"], payload, meta["B"], share, duration, t0))
        t0 = time.perf_counter() + 0.05
        (b_ok, b_ref, b_codes), (a_ok, a_ref, a_codes) = await asyncio.gather(
            _open_loop(calls["B"], payload, meta["B"], share, duration, t0),
            _open_loop(calls["A"], payload, meta["A"], 10 * share, duration, t0),
        )
        with_a = _summary("B", share, duration, b_ok, b_ref, b_codes)
        flood = _summary("A", 10 * share, duration, a_ok, a_ref, a_codes)
        total = (len(b_ok) + len(a_ok)) / duration
        out["fairness"] = {
            "B_solo": solo,
            "B_with_A": with_a,
            "A_flooding": flood,
            "B_p99_ratio_with_over_solo": None if not solo["latency_ms"]["p99"] else round(with_a["latency_ms"]["p99"] / solo["latency_ms"]["p99"], 2),
            "total_goodput_rps": round(total, 1),
            "total_goodput_over_capacity": round(total / capacity, 3),
        }

        rss_before = frontend.memory_info().rss
        t0 = time.perf_counter() + 0.05
        over = _summary("A", 5 * capacity, duration, *await _open_loop(calls["A"], payload, meta["A"], 5 * capacity, duration, t0))
        rss_after = frontend.memory_info().rss
        out["overload"] = {
            **over,
            "goodput_over_capacity": round(over["goodput_rps"] / capacity, 3),
            "admitted_p99_over_unloaded_p99": None if not unloaded_p99 else round(over["latency_ms"]["p99"] / unloaded_p99, 2),
            "frontend_rss_mb": {"before": round(rss_before / 2**20, 1), "after": round(rss_after / 2**20, 1)},
        }
        at_end = _gc_pauses(stack.metrics)
        out["frontend_gc_pauses"] = {  # while measuring (start-up's own collections left out)
            gen: {k: round(v - gc_at_start.get(gen, {}).get(k, 0), 1) for k, v in entry.items()} for gen, entry in at_end.items()
        }
    finally:
        for ch in channels.values():
            await ch.close()
    return out


def _gc_pauses(metrics_address: str) -> dict:
    """The frontend's garbage-collector pauses over the whole run (``inferplane_gc_pause_seconds``)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith("inferplane_gc_pause_seconds_"):
            continue
        name, value = line.rsplit(" ", 1)
        gen = name.split('generation="', 1)[1].split('"', 1)[0]
        entry = out.setdefault(f"gen{gen}", {"count": 0, "total_ms": 0.0, "over_5ms": 0})
        if name.startswith("inferplane_gc_pause_seconds_count"):
            entry["count"] = int(float(value))
        elif name.startswith("inferplane_gc_pause_seconds_sum"):
            entry["total_ms"] = round(float(value) * 1000, 1)
        elif 'le="0.005"' in name:
            entry["over_5ms"] = -int(float(value))
    for entry in out.values():
        entry["over_5ms"] += entry["count"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="paced", help="paced (default) or a demo model")
    parser.add_argument("--service-ms", type=float, default=80.0, help="paced: each instance's service time")
    parser.add_argument("--instances", type=int, default=8, help="paced: instances (capacity = instances / service time)")
    parser.add_argument("--jitter", type=float, default=0.25, help="paced: service times spread over +-this fraction (0: lockstep)")
    parser.add_argument("--batch", type=int, default=8, help="rows per request")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--concurrency", type=int, default=None, help="closed-loop callers for the capacity phase (default: 2 x slots)")
    parser.add_argument("--slots", type=int, default=None, help="admission slots per model (INFERPLANE_ADMISSION_SLOTS; default: --instances for paced, 1 otherwise)")
    parser.add_argument("--queue-delay-s", type=float, default=None, help="admission queue bound in seconds of drain (INFERPLANE_ADMISSION_QUEUE_DELAY_S; default: the server's, two rounds of slots)")
    parser.add_argument("--repository", type=Path, default=None, help="demo model repository (default: build one)")
    parser.add_argument(
        "--service-us", type=int, default=0,
        help="the model's Triton batching delay (max_queue_delay_microseconds) in this run's copy of the repository: "
        "service time that does not burn CPU, as on an accelerator; 0 keeps the model's own",
    )  # fmt: skip
    parser.add_argument("--no-gc-freeze", action="store_true", help="start the frontend with INFERPLANE_GC_FREEZE=false (to compare)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from loadtest.stack import start_stack, stop_stack
    from server.tenancy.store import TenancyStore

    with tempfile.TemporaryDirectory(prefix="fairness-") as tmp:
        work = Path(tmp)
        repository = args.repository
        if args.model == "paced":
            from loadtest.paced_model import build_paced_model

            repository = work / "model_repository"
            build_paced_model(repository, args.service_ms, args.instances, args.jitter)
            args.slots = args.slots or args.instances
        elif repository is None:
            from model_repository.demo import build_demo_repository

            repository = work / "model_repository"
            build_demo_repository(repository)
        else:
            import shutil

            shutil.copytree(repository, work / "model_repository")
            repository = work / "model_repository"
        args.slots = args.slots or 1
        if args.service_us and args.model != "paced":
            from model_repository.config_writer import read_config, write_config

            config = read_config(repository / args.model)
            config.dynamic_batching.max_queue_delay_microseconds = args.service_us
            write_config(config, repository / args.model)
        url = f"sqlite:///{work}/tenancy.db"
        store = TenancyStore(url)
        keys = {t: store.create_key(t, PEPPER.encode(), team=f"team-{t}", plan="standard")[1] for t in ("A", "B")}
        store.close()
        env = {
            "INFERPLANE_AUTH": "on",
            "INFERPLANE_DATABASE_URL": url,
            "INFERPLANE_KEY_PEPPER": PEPPER,
            "INFERPLANE_ADMISSION_SLOTS": str(args.slots),
            "INFERPLANE_LOG_LEVEL": "WARNING",
        }
        if args.no_gc_freeze:
            env["INFERPLANE_GC_FREEZE"] = "false"
        if args.queue_delay_s is not None:
            env["INFERPLANE_ADMISSION_QUEUE_DELAY_S"] = str(args.queue_delay_s)
        args.concurrency = args.concurrency or 2 * args.slots
        stack = start_stack(repository, work / "stack", "--workers", "1", env=env)
        try:
            result = asyncio.run(_measure(stack, keys, args.model, _payload(repository, args.model, args.batch), args.duration, args.concurrency))
        finally:
            stop_stack(stack)
    result["settings"] = {
        "model": args.model, "batch": args.batch, "duration_s": args.duration, "slots": args.slots,
        "queue_delay_s": args.queue_delay_s, "service_us": args.service_us, "gc_freeze": not args.no_gc_freeze,
        **({"service_ms": args.service_ms, "instances": args.instances, "jitter": args.jitter} if args.model == "paced" else {}),
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
