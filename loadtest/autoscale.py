"""Fleet and autoscaling benchmarks against the embedded stack (local Triton replicas).

    python -m loadtest.autoscale [--quick] [--json benchmarks/autoscale/results.json] [--parts trace,predictive,zero,failover]
    python -m loadtest.autoscale --parts trace --trace-runs fixed_max,autoscaling --standby 3 --json …

All in one stack (``inferplane serve`` with local replicas started and stopped by its autoscaler),
open loop (latency from the scheduled send), on ``paced`` (``loadtest.paced_model``: each replica
answers one request at a time after ``--service-ms`` of sleep — an accelerator stand-in whose
capacity is replicas x 1000 / service_ms, so that on this 2-core machine more replicas really are
more capacity) and on the demo models for cold starts:

1. **trace** — a replayed trace: a ramp, a spike of 5x the base, a diurnal wave; with autoscaling
   (1..max replicas), fixed at the minimum (1) and fixed at the maximum: p99 of admitted requests,
   requests refused, replica-seconds (the serving replicas integrated over the run). Goal: p99
   within 1.5x of fixed-max at <= 60 % of its replica-seconds. ``--standby N`` adds, after those runs,
   the autoscaling run on a second stack with ``INFERPLANE_WARM_STANDBY=paced=N`` (Tritons holding
   paced loaded, out of rotation: a scale-up takes one instead of starting a process and loading):
   ``autoscaling_standby``, with the standbys' own Triton-seconds beside its replica-seconds (they hold
   the model's memory and a process while they wait, serving nothing).
2. **predictive** — the diurnal wave replayed for several periods with the forecast off (reactive,
   the profile learning meanwhile), then on: p99 over the rising half of each wave, replica-seconds.
3. **zero** — scale-from-zero first-answer latency per demo model (registry-deployed, so its
   artifact goes through the weight cache): with the cache (a hit) and cold (cache emptied: the
   artifact comes from the artifact store). Goal: <= 2 s for the tree and MLP models with the cache.
4. **failover** — closed-loop load on two replicas, ``kill -9`` of one: requests failed (goal 0), the
   time until the replica served again.

Prints one JSON document (and writes it with ``--json``). Never part of the test run; the machine
this runs on is shared, so the figures are noisy: compare the ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

INFER = "/inference.GRPCInferenceService/ModelInfer"
PACED = "paced"
DEMO = ("fraud_xgboost", "lightgbm_regressor", "mlp_classifier")


# ---- traces --------------------------------------------------------------------------------------


def trace_rate(t: float, base: float, peak: float, scale: float) -> float:
    """ramp (base -> peak), steady, spike x5 of base, then a diurnal wave; ``scale`` stretches time."""
    t = t / scale
    if t < 15:
        return base + (peak - base) * t / 15
    if t < 25:
        return peak
    if t < 30:
        return base
    if t < 36:
        return 5 * base
    if t < 40:
        return base
    return diurnal_rate(t - 40, base, peak, 20.0)


def diurnal_rate(t: float, low: float, high: float, period: float) -> float:
    return low + (high - low) * 0.5 * (1 - math.cos(2 * math.pi * t / period))


TRACE_S = 80.0  # of trace_rate at scale 1


def rising(t: float, period: float) -> bool:
    """The ramp half of a diurnal period (the forecast's job is to be early there)."""
    return (t % period) < period / 2


# ---- load -------------------------------------------------------------------------------------------


async def open_loop(target: str, payload: bytes, rate, duration: float, timeout: float = 10.0) -> list[tuple[float, float | None, str]]:
    """Requests at ``rate(t)`` per second for ``duration``: (scheduled t, latency or None, code) each."""
    channel = grpc.aio.insecure_channel(target)
    call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    out: list[tuple[float, float | None, str]] = []
    tasks: set = set()
    t0 = time.perf_counter() + 0.05

    async def one(offset: float) -> None:
        due = t0 + offset
        try:
            await call(payload, timeout=timeout)
            out.append((offset, time.perf_counter() - due, "OK"))
        except grpc.aio.AioRpcError as err:
            out.append((offset, None, err.code().name))

    offset = 0.0
    while offset < duration:
        wait = t0 + offset - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        task = asyncio.create_task(one(offset))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        offset += 1.0 / max(0.5, rate(offset))
    while tasks:
        await asyncio.gather(*list(tasks))
    await channel.close()
    return out


async def sample_replicas(api: "Api", endpoint: str, stop: asyncio.Event, every: float = 0.25, read=None) -> list[tuple[float, int]]:
    """(t, count) every ``every`` s until ``stop``: the serving replicas, or what ``read()`` counts."""
    read = read or (lambda: api.status(endpoint)["serving_replicas"])
    samples = []
    t0 = time.perf_counter()
    while not stop.is_set():
        try:
            samples.append((time.perf_counter() - t0, await asyncio.to_thread(read)))
        except Exception:  # noqa: BLE001 - a sample lost is a sample lost
            pass
        await asyncio.sleep(every)
    return samples


def replica_seconds(samples: list[tuple[float, int]], until: float) -> float:
    total = 0.0
    for (t, n), (t2, _) in zip(samples, samples[1:] + [(until, 0)]):
        total += n * max(0.0, min(t2, until) - t)
    return round(total, 1)


def pct(values, q) -> float | None:
    return None if not values else round(float(np.percentile(np.asarray(values) * 1000, q)), 2)


def summary(results, duration: float, where=lambda t: True) -> dict:
    ok = [lat for t, lat, code in results if code == "OK" and where(t)]
    codes: dict[str, int] = {}
    for t, _, code in results:
        if where(t):
            codes[code] = codes.get(code, 0) + 1
    return {"requests": sum(codes.values()), "codes": codes, "p50_ms": pct(ok, 50), "p99_ms": pct(ok, 99), "max_ms": pct(ok, 100)}


# ---- the stack and its API --------------------------------------------------------------------------


class Api:
    def __init__(self, stack):
        from server.protogen.inferplane.v1 import admin_pb2_grpc, autoscale_pb2_grpc

        self.stack = stack
        self.channel = grpc.insecure_channel(stack.grpc)
        self.autoscale = autoscale_pb2_grpc.AutoscaleStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def configure(self, endpoint: str, **fields) -> dict:
        from server.protogen.inferplane.v1 import autoscale_pb2 as apb

        answer = self.autoscale.Configure(apb.ConfigureAutoscaleRequest(endpoint=endpoint, config=apb.AutoscaleConfig(**fields)))
        return json.loads(answer.endpoints_json[0])

    def explain(self, endpoint: str) -> dict:
        from server.protogen.inferplane.v1 import autoscale_pb2 as apb

        return json.loads(self.autoscale.Explain(apb.ExplainAutoscaleRequest(endpoint=endpoint)).explain_json)

    def status(self, endpoint: str) -> dict:
        from server.protogen.inferplane.v1 import autoscale_pb2 as apb

        rows = [json.loads(s) for s in self.autoscale.Status(apb.AutoscaleStatusRequest()).endpoints_json]
        return next(r for r in rows if r["endpoint"] == endpoint)

    def wait(self, predicate, timeout: float = 120.0, what: str = "") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}")

    def wait_serving(self, endpoint: str, n: int) -> None:
        self.wait(lambda: self.status(endpoint)["serving_replicas"] == n and self.status(endpoint)["replicas"] == n, what=f"{endpoint} on {n} replicas")

    def standbys(self, endpoint: str) -> int:
        """The loaded standbys of ``endpoint`` waiting out of rotation."""
        return len(self.explain(endpoint)["executor"]["standby"].get(endpoint, []))


def payload(model: str, repository: Path, rows: int = 1) -> bytes:
    from loadtest.paced_model import sample_features
    from model_repository.layout import load_validation
    from server.protogen.inference import grpc_service_pb2 as pb

    if model == PACED:
        x = sample_features(rows)
    else:
        x = np.ascontiguousarray(load_validation(repository / model)["features"][:rows], dtype=np.float32)
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="features", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def start(root: Path, service_ms: float, profile_period_s: float, lead_s: float, env: dict[str, str] | None = None):
    from loadtest.paced_model import build_paced_model
    from loadtest.stack import start_stack
    from model_repository.demo import build_demo_repository

    repository = root / "model_repository"
    build_demo_repository(repository)
    build_paced_model(repository, service_ms=service_ms, instances=1, jitter=0.2)
    demo_dirs = root / "demo"
    demo_dirs.mkdir()
    for name in DEMO:  # the registry's copies come from here; the stack serves only paced at start
        shutil.move(str(repository / name), demo_dirs / name)
    env = {
        "INFERPLANE_AUTH": "off",
        "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry.db",
        "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts"),
        "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.5",
        "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.5",
        "INFERPLANE_AUTOSCALE_PROFILE_PERIOD_S": f"{profile_period_s:g}",
        "INFERPLANE_AUTOSCALE_PROFILE_SLOT_S": f"{profile_period_s / 20:g}",
        "INFERPLANE_AUTOSCALE_LEAD_S": f"{lead_s:g}",
        "INFERPLANE_ADMISSION_QUEUE_DELAY_S": "2.0",  # queue up to 2 s of work instead of refusing early
        "INFERPLANE_ADMISSION_CODEL": "false",  # and keep it queued: no standing-queue drops (batching.overload_policy)
        "INFERPLANE_LOG_LEVEL": "WARNING",
        **(env or {}),
    }
    stack = start_stack(repository, root / "stack", env=env)
    return stack, repository, demo_dirs


# ---- parts -----------------------------------------------------------------------------------------


TRACE_RUNS = ("fixed_max", "fixed_min", "autoscaling")


async def run_trace(api: Api, stack, repository: Path, args, runs=TRACE_RUNS, label: str = "") -> dict:
    """The trace replayed once per run of ``runs`` (``label``: a suffix of the result keys)."""
    capacity = 1000.0 / args.service_ms  # per replica
    base, peak = 0.4 * capacity, 0.8 * args.max_replicas * capacity
    duration = TRACE_S * args.scale
    body = payload(PACED, repository)
    quick = {"scale_down_window_s": 5.0 * args.scale, "down_cooldown_s": 2.0 * args.scale, "scale_up_window_s": 0.0, "predictive": False}
    out = {"per_replica_capacity_rps": capacity, "base_rps": base, "peak_rps": peak, "spike_rps": 5 * base, "duration_s": duration}
    bounds_of = {
        "fixed_max": dict(min_replicas=args.max_replicas, max_replicas=args.max_replicas),
        "fixed_min": dict(min_replicas=1, max_replicas=1),
        "autoscaling": dict(min_replicas=1, max_replicas=args.max_replicas),
    }
    for name in runs:
        bounds = bounds_of[name]
        api.configure(PACED, target=args.target_inflight, **bounds, **quick)
        api.wait_serving(PACED, bounds["min_replicas"])
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_replicas(api, PACED, stop))
        waiting = asyncio.create_task(sample_replicas(api, PACED, stop, every=0.5, read=lambda: api.standbys(PACED))) if label else None
        results = await open_loop(stack.grpc, body, lambda t: trace_rate(t, base, peak, args.scale), duration)
        stop.set()
        samples = await sampler
        key = name + label
        out[key] = {**summary(results, duration), "replica_seconds": replica_seconds(samples, duration),
                    "max_replicas_seen": max((n for _, n in samples), default=0)}  # fmt: skip
        if waiting is not None:  # loaded Tritons out of rotation: the standbys' cost, not serving
            out[key]["standby_seconds"] = replica_seconds(await waiting, duration)
        if name == "autoscaling":  # how long each scale-up took: start the replica (or take a standby), load the model, live
            explained = api.explain(PACED)
            out[key]["scale_up_s"] = scale_up_seconds(explained["decisions"])
            out[key]["from_warm"] = explained["executor"]["from_warm"]
        print(f"trace {key}: {json.dumps(out[key])}", flush=True)
    return out


def trace_ratios(out: dict) -> None:
    """Each autoscaling run's p99 and replica-seconds over fixed-max's (of the same run)."""
    fixed_max = out.get("fixed_max")
    if fixed_max is None:
        return
    for key in [k for k in out if k.startswith("autoscaling") and isinstance(out[k], dict)]:
        out[f"{key}_p99_over_fixed_max"] = _ratio(out[key]["p99_ms"], fixed_max["p99_ms"])
        out[f"{key}_replica_seconds_over_fixed_max"] = _ratio(out[key]["replica_seconds"], fixed_max["replica_seconds"])


async def run_trace_standby(root: Path, args) -> dict:
    """The autoscaling run again on a stack of its own that keeps ``args.standby`` standbys of paced."""
    from loadtest.stack import stop_stack

    (root / "standby").mkdir()
    stack, repository, _ = start(root / "standby", args.service_ms, args.period, args.lead, env={"INFERPLANE_WARM_STANDBY": f"{PACED}={args.standby}"})
    api = Api(stack)
    try:
        api.configure(PACED, min_replicas=1, max_replicas=args.max_replicas, target=args.target_inflight)
        api.wait(lambda: api.standbys(PACED) == args.standby, timeout=180, what=f"{args.standby} standbys of {PACED}")
        return await run_trace(api, stack, repository, args, runs=("autoscaling",), label="_standby")
    finally:
        api.channel.close()
        stop_stack(stack)


async def run_predictive(api: Api, stack, repository: Path, args) -> dict:
    capacity = 1000.0 / args.service_ms
    low, high = 0.3 * capacity, 0.85 * args.max_replicas * capacity
    period = args.period
    body = payload(PACED, repository)
    windows = {"scale_down_window_s": period / 8, "down_cooldown_s": period / 20, "scale_up_window_s": 0.0}
    out = {"period_s": period, "periods": args.periods, "low_rps": low, "high_rps": high, "lead_s": args.lead}
    for name, predictive in (("reactive", False), ("predictive", True)):
        api.configure(PACED, min_replicas=1, max_replicas=args.max_replicas, target=args.target_inflight, predictive=predictive, **windows)
        api.wait_serving(PACED, 1)
        # start each run at the same phase of the profile's period (the forecast is by time of "day")
        await asyncio.sleep((-time.time()) % period)
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_replicas(api, PACED, stop))
        duration = period * args.periods
        results = await open_loop(stack.grpc, body, lambda t: diurnal_rate(t, low, high, period), duration)
        stop.set()
        samples = await sampler
        learned = [r for r in results if r[0] >= period]  # the first period teaches the profile
        out[name] = {
            "ramp": summary(learned, duration, lambda t: rising(t, period)),
            "all": summary(learned, duration),
            "replica_seconds": replica_seconds([(t, n) for t, n in samples if t >= period], duration) if samples else None,
        }
        print(f"diurnal {name}: {json.dumps(out[name])}", flush=True)
    out["predictive_ramp_p99_over_reactive"] = _ratio(out["predictive"]["ramp"]["p99_ms"], out["reactive"]["ramp"]["p99_ms"])
    out["predictive_replica_seconds_over_reactive"] = _ratio(out["predictive"]["replica_seconds"], out["reactive"]["replica_seconds"])
    explained = api.explain(PACED)
    out["forecast_sample"] = explained["forecast"][-10:]
    return out


def register_and_deploy(api: Api, stack, demo_dirs: Path, model: str) -> str:
    from server.protogen.inferplane.v1 import admin_pb2

    meta = json.loads((demo_dirs / model / "inferplane.json").read_text())
    signature = dict(meta["signature"])
    if "max_batch_size" in meta:
        signature["max_batch_size"] = meta["max_batch_size"]
    name = f"zero_{model}"
    api.admin.RegisterModel(admin_pb2.RegisterModelRequest(
        name=name, artifact=(demo_dirs / model / meta["artifact"]).read_bytes(), filename=meta["artifact"],
        signature_json=json.dumps(signature), validation_npz=(demo_dirs / model / meta["validation"]).read_bytes(),
    ))  # fmt: skip
    request = urllib.request.Request(
        f"http://{stack.http}/v1/models/deploy", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": name, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}).encode(),
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as r:
        location = r.headers["Location"]
    end = time.monotonic() + 120
    while time.monotonic() < end:
        with urllib.request.urlopen(f"http://{stack.http}{location}", timeout=30) as r:
            op = json.loads(r.read())
        if op["status"] != "provisioning":
            if op["status"] != "ready":
                raise RuntimeError(f"deploy of {name} failed: {op['error']}")
            return name
        time.sleep(0.2)
    raise RuntimeError(f"deploy of {name} did not finish")


async def run_zero(api: Api, stack, demo_dirs: Path, workdir: Path, args) -> dict:
    out: dict = {}
    cache_dir = workdir / "weight-cache"
    for model in DEMO:
        name = register_and_deploy(api, stack, demo_dirs, model)
        meta_rows = payload(model, demo_dirs)
        from server.protogen.inference import grpc_service_pb2 as pb

        request = pb.ModelInferRequest.FromString(meta_rows)
        request.model_name = name
        body = request.SerializeToString()
        timings: dict[str, list[float]] = {"weight_cache_hit": [], "cold_artifact_store": []}
        channel = grpc.aio.insecure_channel(stack.grpc)
        call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        for attempt in range(args.zero_repeats):
            for kind in ("weight_cache_hit", "cold_artifact_store"):
                # predictive off: the first answer after a wake by a request is what is measured, and a forecast
                # of the attempts' own traffic would keep the endpoint from zero (or wake it ahead of the request)
                api.configure(
                    name, scale_to_zero_after_s=1.0, scale_down_window_s=0.0, down_cooldown_s=0.0, cold_start_budget_s=60.0, predictive=False,
                )  # fmt: skip
                api.wait(lambda: api.status(name)["state"] == "asleep", what=f"{name} at zero")
                if kind == "cold_artifact_store":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                started = time.perf_counter()
                await call(body, timeout=60)
                timings[kind].append(time.perf_counter() - started)
                api.configure(name, scale_to_zero_after_s=0)  # stay up until the next attempt
        await channel.close()
        cold_starts = api.explain(name)["cold_starts"]
        out[model] = {
            kind: {"median_s": round(float(np.median(v)), 3), "all_s": [round(x, 3) for x in v]} for kind, v in timings.items()
        } | {"loads": [{"seconds": c["seconds"], "weight_cache": c["weight_cache"]} for c in cold_starts]}
        print(f"zero {model}: {json.dumps(out[model])}", flush=True)
    return out


async def run_failover(api: Api, stack, repository: Path, args) -> dict:
    model = PACED
    api.configure(model, min_replicas=2, max_replicas=2, target=1000.0, predictive=False)
    api.wait_serving(model, 2)
    victim = next(r for r in api.explain(model)["executor"]["replicas"] if r["id"] != "local-0" and model in r["models"])
    body = payload(model, repository)
    channel = grpc.aio.insecure_channel(stack.grpc)
    call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    codes: dict[str, int] = {}
    stop = time.perf_counter() + args.failover_s
    killed_at = time.perf_counter() + args.failover_s / 3

    async def caller() -> None:
        while time.perf_counter() < stop:
            try:
                await call(body, timeout=10)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] = codes.get(err.code().name, 0) + 1

    async def killer() -> float | None:
        await asyncio.sleep(max(0.0, killed_at - time.perf_counter()))
        os.kill(victim["pid"], signal.SIGKILL)
        t = time.perf_counter()
        while time.perf_counter() < stop + 30:
            replicas = await asyncio.to_thread(lambda: api.explain(model)["executor"]["replicas"])
            back = next((r for r in replicas if r["id"] == victim["id"]), None)
            if back and back["pid"] not in (None, victim["pid"]) and api.status(model)["serving_replicas"] == 2:
                return round(time.perf_counter() - t, 2)
            await asyncio.sleep(0.1)
        return None

    results = await asyncio.gather(killer(), *(caller() for _ in range(args.failover_callers)))
    await channel.close()
    return {"callers": args.failover_callers, "codes": codes, "failed": sum(v for k, v in codes.items() if k != "OK"),
            "replica_back_in_s": results[0]}  # fmt: skip


def scale_up_seconds(decisions: list[dict]) -> list[float]:
    """The durations of the finished scale-ups among the autoscaler's decisions ("up to N in X.XXs")."""
    found = (re.fullmatch(r"up to \d+ in ([0-9.]+)s", d.get("reason", "")) for d in decisions if d.get("action") == "done")
    return [float(m.group(1)) for m in found if m]


def _ratio(a, b):
    return None if not a or not b else round(a / b, 3)


async def main_async(args) -> dict:
    from loadtest.stack import stop_stack

    root = Path(tempfile.mkdtemp(prefix="inferplane-autoscale-"))
    stack, repository, demo_dirs = start(root, args.service_ms, args.period, args.lead)
    api = Api(stack)
    out: dict = {"service_ms": args.service_ms, "max_replicas": args.max_replicas, "target_inflight": args.target_inflight}
    parts = args.parts.split(",")
    try:
        if "trace" in parts:
            out["trace"] = await run_trace(api, stack, repository, args, runs=args.trace_runs.split(","))
        if "predictive" in parts:
            out["predictive"] = await run_predictive(api, stack, repository, args)
        if "failover" in parts:
            out["failover"] = await run_failover(api, stack, repository, args)
            print(f"failover: {json.dumps(out['failover'])}", flush=True)
        if "zero" in parts:
            out["zero"] = await run_zero(api, stack, demo_dirs, root / "stack" / "run", args)
    finally:
        api.channel.close()
        stop_stack(stack)
    try:
        if "trace" in parts and args.standby:  # after the first stack stopped: the two never share the cores
            out["trace"]["standby"] = args.standby
            out["trace"].update({k: v for k, v in (await run_trace_standby(root, args)).items() if k.endswith("_standby")})
        if "trace" in parts:
            trace_ratios(out["trace"])
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="trace,predictive,failover,zero")
    p.add_argument("--service-ms", type=float, default=20.0, help="paced model: one request per replica per this long")
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--target-inflight", type=float, default=0.7, help="autoscaling target: requests in flight per replica")
    p.add_argument("--scale", type=float, default=1.0, help="stretch the trace's time (1: 80 s)")
    p.add_argument("--trace-runs", default=",".join(TRACE_RUNS), help="which of the trace's runs, in order")
    p.add_argument("--standby", type=int, default=0, help="also the autoscaling run on a stack keeping N standbys of paced (0: not)")
    p.add_argument("--period", type=float, default=30.0, help="the diurnal wave's period (s): the forecast's compressed day")
    p.add_argument("--periods", type=int, default=4)
    p.add_argument("--lead", type=float, default=4.0, help="how far ahead the forecast looks (s)")
    p.add_argument("--zero-repeats", type=int, default=3)
    p.add_argument("--failover-s", type=float, default=12.0)
    p.add_argument("--failover-callers", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="a short run to see that everything works")
    p.add_argument("--keep", action="store_true", help="keep the temporary stack folder")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    unknown = set(args.trace_runs.split(",")) - set(TRACE_RUNS)
    if unknown:
        p.error(f"--trace-runs: unknown {', '.join(sorted(unknown))} (of {', '.join(TRACE_RUNS)})")
    if args.quick:
        args.scale, args.periods, args.period, args.zero_repeats, args.failover_s = 0.4, 2, 16.0, 1, 6.0
    out = asyncio.run(main_async(args))
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
