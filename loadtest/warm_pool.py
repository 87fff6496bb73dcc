"""Scale decision -> serving, from a warm pool vs a cold start (issue 29), side by side in one run.

    python -m loadtest.warm_pool [--repeats 3] [--json benchmarks/warm_pool/results.json]

For ``INFERPLANE_WARM_POOL`` 0 and 1 a stack serves fraud_xgboost; each repeat sets the endpoint
from one replica to two through the Autoscale API and times the call's return to the moment the
frontend counts two serving replicas (the executor starts or takes a Triton, loads the model,
waits for ready, adds it to the rotation), then goes back to one (and, warm, waits for the pool to
refill). Reported per mode: each repeat, the median, and the executor's own ``provision_s``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from loadtest.stack import start_stack, stop_stack
from model_repository.demo import build_demo_repository
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc

MODEL = "fraud_xgboost"
QUICK = {"scale_down_window_s": 0.0, "down_cooldown_s": 0.0, "target": 1000.0, "predictive": False}


class Api:
    def __init__(self, stack):
        self.channel = grpc.insecure_channel(stack.grpc)
        self.stub = autoscale_pb2_grpc.AutoscaleStub(self.channel)

    def configure(self, **fields) -> None:
        self.stub.Configure(apb.ConfigureAutoscaleRequest(endpoint=MODEL, config=apb.AutoscaleConfig(**{**QUICK, **fields})))

    def explain(self) -> dict:
        return json.loads(self.stub.Explain(apb.ExplainAutoscaleRequest(endpoint=MODEL)).explain_json)

    def wait(self, predicate, timeout: float = 120.0) -> None:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if predicate(self.explain()):
                return
            time.sleep(0.02)
        raise TimeoutError(json.dumps(self.explain()["executor"]))


def hosts(explain: dict) -> int:
    return sum(MODEL in r["models"] for r in explain["executor"]["replicas"])


def run_mode(root: Path, repository: Path, warm: int, repeats: int) -> dict:
    workdir = root / f"stack-warm{warm}"
    env = {"INFERPLANE_WARM_POOL": str(warm), "INFERPLANE_AUTH": "off", "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.1",
           "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2",
           "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts")}  # fmt: skip
    stack = start_stack(repository, workdir, "--model", MODEL, env=env)
    api = Api(stack)
    out: dict = {"warm_pool": warm, "scale_up_s": [], "provision_s": [], "took_warm": []}
    try:
        api.configure(min_replicas=1, max_replicas=1)
        for _ in range(repeats):
            api.wait(lambda e: hosts(e) == 1 and len(e["executor"]["warm"]) == warm)
            before = set(api.explain()["executor"]["warm"])
            began = time.monotonic()
            api.configure(min_replicas=2, max_replicas=2)
            api.wait(lambda e: e["serving_replicas"] == 2)
            out["scale_up_s"].append(round(time.monotonic() - began, 3))
            explain = api.explain()
            out["provision_s"].append(explain["provision_s"])
            out["took_warm"].append(any(r["pid"] in before for r in explain["executor"]["replicas"]))
            api.configure(min_replicas=1, max_replicas=1)
        out["median_scale_up_s"] = statistics.median(out["scale_up_s"])
        print(json.dumps(out), flush=True)
        return out
    finally:
        api.channel.close()
        stop_stack(stack)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="inferplane-warm-"))
    try:
        repository = root / "model_repository"
        build_demo_repository(repository)
        modes = [run_mode(root, repository, warm, args.repeats) for warm in (0, 1)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cold, warm = modes
    out = {"modes": modes, "warm_over_cold": round(warm["median_scale_up_s"] / cold["median_scale_up_s"], 3),
           "machine": "shared, loaded 2-core machine"}  # fmt: skip
    print(json.dumps({"warm_over_cold": out["warm_over_cold"]}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
