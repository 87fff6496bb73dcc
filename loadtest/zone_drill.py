"""Zone drill (issue 29): ``kill -9`` of every Triton of zone a under load, and how long p99 takes to
come back within 2x its steady value.

    python -m loadtest.zone_drill [--threads 4] [--steady-s 10] [--after-s 20] [--runs 1] [--keep-down] [--grace-s 10] [--json benchmarks/zone_drill/results.json]

The stack of ``tests/integration/test_zones.py`` (loopback only): local replicas in zones a and b
(``INFERPLANE_LOCAL_ZONES=a,b``), the frontend in zone a, one warm Triton, the LLM isolation mode,
the two tree models; fraud_xgboost made tier 1 (two replicas, one per zone, on Tritons of their own).
``--threads`` closed-loop gRPC callers of fraud_xgboost (no retries; crash_isolation's ``Caller``)
run ``--steady-s`` seconds, then every zone-a Triton (the replicas the executor lists in zone a, the
shared one and the tier-1 copy's) is killed with SIGKILL, and the callers run ``--after-s`` more:
bounded in time, and in count by the closed loop.

Figures (each request's latency is its answer's time minus its send time, counted in the 1-s window
of its answer): the steady p99 is the median of the per-window p99s of the whole windows before the
kill; windows after it are aligned on the kill; ``within_2x_s`` is the end of the first window after
the kill whose p99 is within 2x steady (a window without an answer is not), ``stays_within_2x_s``
the end of the first window from which every later one is. ``errors`` are failed calls after the kill
(the admitted requests lost: 0 is the requirement); ``zone_a_back_s`` is when the executor listed
both copies serving again (the supervisor's restart of zone a's Tritons and the copy's reload).

``--keep-down``: zone a does not come back — every restart of its Tritons is killed as soon as it has a
process, until the run ends — so after ``--grace-s`` (``INFERPLANE_ZONE_DOWN_GRACE_S``) the copies are
placed again in zone b; ``recreated_s`` is when fraud_xgboost had two copies serving in zone b.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from loadtest.crash_isolation import Caller
from loadtest.stack import start_stack, stop_stack
from model_repository.demo import build_demo_repository
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc

FRAUD = "fraud_xgboost"
MODELS = (FRAUD, "lightgbm_regressor")
ENV = {
    "INFERPLANE_LOCAL_ZONES": "a,b", "INFERPLANE_ZONE": "a", "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2",
    "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.2", "INFERPLANE_ISOLATION": "llm", "INFERPLANE_WARM_POOL": "1", "INFERPLANE_AUTH": "off",
}  # fmt: skip
FACTOR = 2.0  # "p99 back within 2x its steady value"


def p99_ms(latencies: list[float]) -> float | None:
    return round(float(np.percentile(latencies, 99)) * 1000, 2) if latencies else None


def windows(sent: list[float], done: list[float], start: float, end: float, width: float = 1.0) -> list[dict]:
    """The answers whose time falls in [start, end), per window of ``width`` from ``start``: count and p99."""
    out = []
    for k in range(int(round((end - start) / width))):
        lo = start + k * width
        lat = [d - s for s, d in zip(sent, done) if lo <= d < lo + width]
        out.append({"from_s": round(k * width, 3), "answers": len(lat), "p99_ms": p99_ms(lat)})
    return out


def recovery(steady_p99_ms: float, after: list[dict], width: float = 1.0) -> dict:
    """From the windows after the kill (aligned on it): when p99 first came within ``FACTOR`` x steady,
    and from when it stayed there (None: not within the run)."""
    ok = [w["p99_ms"] is not None and w["p99_ms"] <= FACTOR * steady_p99_ms for w in after]
    first = next((k for k, good in enumerate(ok) if good), None)
    stays = next((k for k in range(len(ok)) if all(ok[k:])), None)
    return {
        "within_2x_s": None if first is None else round((first + 1) * width, 3),
        "stays_within_2x_s": None if stays is None else round((stays + 1) * width, 3),
        "worst_p99_ms": max((w["p99_ms"] for w in after if w["p99_ms"] is not None), default=None),
    }


def measure(sent: list[float], done: list[float], began: float, killed: float, ended: float) -> dict:
    """The steady p99 (median of the whole 1-s windows before the kill) and the recovery after it."""
    whole = int(killed - began)
    before = windows(sent, done, killed - whole, killed)
    after = windows(sent, done, killed, killed + int(ended - killed))
    steady = statistics.median([w["p99_ms"] for w in before if w["p99_ms"] is not None])
    return {"steady_p99_ms": steady, **recovery(steady, after), "before": before, "after": after}


def _explain(stack) -> dict:
    with grpc.insecure_channel(stack.grpc) as channel:
        answer = autoscale_pb2_grpc.AutoscaleStub(channel).Explain(apb.ExplainAutoscaleRequest(endpoint=FRAUD), timeout=30)
    return json.loads(answer.explain_json)


def _hosts(stack) -> list[dict]:
    return [r for r in _explain(stack)["executor"]["replicas"] if FRAUD in r["models"]]


def _until(check, timeout: float) -> bool:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            if check():
                return True
        except grpc.RpcError:  # the observer's own connection right after a kill: ask again
            pass
        time.sleep(0.2)
    return False


def tier_one(stack) -> None:
    """fraud_xgboost on two replicas, one per zone (what test_zones' first test arranges)."""
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = autoscale_pb2_grpc.AutoscaleStub(channel)
        stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=apb.AutoscaleConfig(min_replicas=1, max_replicas=1)))
        stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=FRAUD, config=apb.AutoscaleConfig(tier=1)))
    if not _until(lambda: _explain(stack)["serving_replicas"] == 2 and sorted(r["zone"] for r in _hosts(stack)) == ["a", "b"], 120):
        raise RuntimeError(f"fraud_xgboost did not reach two replicas in zones a and b: {_hosts(stack)}")


def _kill(replicas: list[dict], ids: set[str]) -> None:
    for r in replicas:
        if r["id"] in ids and r["pid"] is not None:
            try:
                os.kill(r["pid"], signal.SIGKILL)
            except ProcessLookupError:  # gone already
                pass


def drill(stack, repository: Path, threads: int, steady_s: float, after_s: float, keep_down: bool = False) -> dict:
    zone_a = [r for r in _explain(stack)["executor"]["replicas"] if r["zone"] == "a"]
    callers = [Caller(stack, repository, FRAUD) for _ in range(threads)]
    began = time.monotonic()
    for c in callers:
        c.start()
    time.sleep(steady_s)
    killed = time.monotonic()
    _kill(zone_a, {r["id"] for r in zone_a})
    pids = {r["id"]: r["pid"] for r in zone_a}
    back = recreated = None
    while time.monotonic() < killed + after_s:
        try:
            listed = _explain(stack)
            if keep_down:
                _kill(listed["executor"]["replicas"], set(pids))
                in_b = [r for r in listed["executor"]["replicas"] if r["zone"] == "b" and FRAUD in r["models"] and r["state"] == "up"]
                if recreated is None and len(in_b) == 2 and listed["serving_replicas"] >= 2:
                    recreated = time.monotonic()
            elif back is None:
                fresh = all(r["pid"] not in (None, pids[r["id"]]) for r in listed["executor"]["replicas"] if r["id"] in pids)
                if fresh and listed["serving_replicas"] == 2:
                    back = time.monotonic()
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    ended = time.monotonic()
    for c in callers:
        c.stop.set()
    for c in callers:
        c.join(60)
    sent = [s for c in callers for s in c.sent]
    done = [d for c in callers for d in c.ok]
    return {
        "killed": [{"id": r["id"], "models": r["models"]} for r in zone_a], "threads": threads, "steady_s": steady_s, "after_s": after_s,
        "answers": len(done), "errors": sum(1 for c in callers for t in c.errors if t >= killed),
        "errors_before_kill": sum(1 for c in callers for t in c.errors if t < killed),
        "keep_down": keep_down, "zone_a_back_s": None if back is None else round(back - killed, 2),
        "recreated_s": None if recreated is None else round(recreated - killed, 2), **measure(sent, done, began, killed, ended),
    }  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--after-s", type=float, default=20.0)
    p.add_argument("--runs", type=int, default=1, help="drills, each on a fresh stack")
    p.add_argument("--keep-down", action="store_true", help="zone a does not come back: its Tritons' restarts are killed too")
    p.add_argument("--grace-s", type=float, default=10.0, help="INFERPLANE_ZONE_DOWN_GRACE_S")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="inferplane-zones-"))
    runs = []
    try:
        demo = root / "demo"
        build_demo_repository(demo)
        repository = root / "model_repository"
        for name in MODELS:
            shutil.copytree(demo / name, repository / name)
        for i in range(args.runs):
            workdir = root / f"stack-{i}"
            env = {**ENV, "INFERPLANE_ZONE_DOWN_GRACE_S": str(args.grace_s), "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts")}
            stack = start_stack(repository, workdir, env=env)
            try:
                tier_one(stack)
                run = {"load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
                run.update(drill(stack, repository, args.threads, args.steady_s, args.after_s, args.keep_down))
                print(json.dumps({k: v for k, v in run.items() if k not in ("before", "after")}), flush=True)
                runs.append(run)
            finally:
                stop_stack(stack)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"runs": runs, "machine": "shared, loaded 2-core machine", "load_average": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
