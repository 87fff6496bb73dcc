"""Scale decision -> serving: a cold start vs an empty warm Triton vs a loaded standby vs a Triton of a
remote pool (issue 29), side by side in one run.

    python -m loadtest.warm_pool [--repeats 3] [--json benchmarks/warm_pool/results.json]

Per mode a stack serves fraud_xgboost: ``cold`` (no warm pool: the executor starts a Triton and loads
the model), ``empty`` (``INFERPLANE_WARM_POOL=1``: it takes a started, empty Triton and loads the
model), ``standby`` (``INFERPLANE_WARM_STANDBY=fraud_xgboost=1``: it takes a Triton holding the model
loaded, out of rotation, and puts it into rotation), ``remote`` (a local cluster,
server.runtime.local_cluster: three Tritons reading the one repository, one control-plane replica and
one frontend with one worker, the registry a SQLite file; the leader's remote executor places the
endpoint on an idle Triton of the pool, which loads it: no process starts). Each repeat sets the
endpoint from one replica to two through the Autoscale API and times the call's return to the moment
the frontend counts two serving replicas (``remote``: the frontend carries both calls to the leader),
checks the new copy's answer is bit-exact with the first one's (straight to its Triton), then goes
back to one (and waits for the pool to refill; ``remote``: for two idle Tritons). Reported per mode:
each repeat, the median, the executor's own ``provision_s``, and whether the member taken existed
before (``remote``: a Triton that was up without the model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient

from loadtest.stack import start_stack, stop_stack
from model_repository.demo import build_demo_repository
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc
from server.runtime.local_cluster import LocalCluster

MODEL = "fraud_xgboost"
QUICK = {"scale_down_window_s": 0.0, "down_cooldown_s": 0.0, "target": 1000.0, "predictive": False}
MODES = {  # mode -> the embedded stack's environment; remote: a local cluster instead (run_remote)
    "cold": {},
    "empty": {"INFERPLANE_WARM_POOL": "1"},
    "standby": {"INFERPLANE_WARM_STANDBY": f"{MODEL}=1"},
    "remote": {},
}
REMOTE_TRITONS = 3
FAST = {"INFERPLANE_AUTH": "off", "INFERPLANE_AUTOSCALE_INTERVAL_S": "0.1", "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2"}


class Api:
    """The Autoscale API of a frontend (``target``: its gRPC address)."""

    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target)
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


def hosts(explain: dict) -> list[dict]:
    """The local executor's replicas hosting the model."""
    return [r for r in explain["executor"]["replicas"] if MODEL in r["models"]]


def waiting(explain: dict) -> set:
    """The pids of the warm pool's members (empty and standbys)."""
    executor = explain["executor"]
    return set(executor["warm"]) | {p for pids in executor["standby"].values() for p in pids}


def remote_hosts(explain: dict) -> list[dict]:
    """The remote executor's Tritons hosting the model."""
    return [t for t in explain["executor"]["tritons"] if MODEL in t["models"]]


def idle(explain: dict) -> set:
    """The ids of the pool's Tritons that are up without the model and done unloading it: those a scale-up
    can take at once. (The Explain drops the model from a Triton once its unload is asked for; the Python
    stub's exit takes a second or two more, and a load asked for meanwhile waits for a later reconciler round.)"""
    tritons = explain["executor"]["tritons"]
    return {t["id"] for t in tritons if t["state"] == "up" and MODEL not in t["models"] and not unloading(t["target"])}


def unloading(target: str) -> bool:
    """The Triton at ``target`` is still loading or unloading the model (asked straight)."""
    with grpcclient.InferenceServerClient(target) as client:
        index = client.get_model_repository_index(client_timeout=10).models
    return any(m.name == MODEL and m.state in ("LOADING", "UNLOADING") for m in index)


def settled(explain: dict) -> bool:
    """No scaling action in flight: the last decision taken (holds aside) is done, or none since the configure.
    (A scale-down's end, a Triton stopping, comes after the replica leaves the listing; a scale-up decided
    before it waits for it.)"""
    last = explain["last_decisions"][-1:]
    return not last or last[0]["action"] in ("done", "failed", "configure")


@dataclass(frozen=True)
class View:
    """How a kind of stack's Explain shows the replicas hosting the model and the members a scale-up can take."""

    hosts: Callable[[dict], list[dict]]  # each with "id", "target" and the ``key`` field
    waiting: Callable[[dict], set]  # the ``key``s of the members waiting
    key: str
    pool: int  # how many members wait before each scale-up


def answer(target: str) -> bytes:
    x = grpcclient.InferInput("features", [4, 32], "FP32")
    x.set_data_from_numpy(np.random.default_rng(29).random((4, 32), dtype=np.float32))
    with grpcclient.InferenceServerClient(target) as client:
        return client.infer(MODEL, [x], client_timeout=30).as_numpy("probability").tobytes()


def scale_ups(api: Api, view: View, repeats: int, out: dict) -> dict:
    """The repeats: one replica (and the pool full) -> two serving, timed; the new copy bit-exact; back to one."""
    api.configure(min_replicas=1, max_replicas=1)
    for _ in range(repeats):
        api.wait(lambda e: len(view.hosts(e)) == 1 and len(view.waiting(e)) == view.pool and settled(e), timeout=300.0)
        before = view.waiting(api.explain())
        began = time.monotonic()
        api.configure(min_replicas=2, max_replicas=2)
        api.wait(lambda e: e["serving_replicas"] == 2)
        out["scale_up_s"].append(round(time.monotonic() - began, 3))
        api.wait(settled)  # the scale-up's own provision_s is written once its action is done
        explain = api.explain()
        out["provision_s"].append(explain["provision_s"])
        out["took_warm"].append(any(r[view.key] in before for r in view.hosts(explain)))
        first, second = sorted(view.hosts(explain), key=lambda r: r["id"])
        out["bit_exact"].append(answer(first["target"]) == answer(second["target"]))
        api.configure(min_replicas=1, max_replicas=1)
    out["median_scale_up_s"] = statistics.median(out["scale_up_s"])
    print(json.dumps(out), flush=True)
    return out


def run_mode(root: Path, repository: Path, mode: str, repeats: int) -> dict:
    out: dict = {"mode": mode, "env": MODES[mode], "scale_up_s": [], "provision_s": [], "took_warm": [], "bit_exact": []}
    if mode == "remote":
        return asyncio.run(run_remote(root / "cluster-remote", repository, repeats, out))
    workdir = root / f"stack-{mode}"
    env = {**MODES[mode], **FAST, "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db",
           "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts")}  # fmt: skip
    stack = start_stack(repository, workdir, "--model", MODEL, env=env)
    api = Api(stack.grpc)
    try:
        return scale_ups(api, View(hosts, waiting, "pid", 1 if MODES[mode] else 0), repeats, out)
    finally:
        api.channel.close()
        stop_stack(stack)


async def run_remote(workdir: Path, repository: Path, repeats: int, out: dict) -> dict:
    """The repeats against a local cluster's frontend (run in a thread: this loop supervises the cluster's processes)."""
    env = {**FAST, "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts"), "INFERPLANE_DATA_DIR": str(workdir / "data")}
    cluster = LocalCluster(f"sqlite:///{workdir}/registry.db", None, repository, workdir, controls=1, frontends=1, workers=1, env=env,
                           tritons=REMOTE_TRITONS)  # fmt: skip
    out["env"] = {"tritons": REMOTE_TRITONS, "controls": 1, "frontends": 1, "workers": 1, "database": "sqlite"}
    try:
        await cluster.start()
        api = Api(next(m.grpc for m in cluster.members if m.role == "frontend"))
        try:
            return await asyncio.to_thread(scale_ups, api, View(remote_hosts, idle, "id", REMOTE_TRITONS - 1), repeats, out)
        finally:
            api.channel.close()
    finally:
        await cluster.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="inferplane-warm-"))
    try:
        repository = root / "model_repository"
        build_demo_repository(repository)
        modes = {mode: run_mode(root, repository, mode, args.repeats) for mode in args.modes.split(",")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cold = modes.get("cold", {}).get("median_scale_up_s")
    ratios = {f"{m}_over_cold": round(r["median_scale_up_s"] / cold, 3) for m, r in modes.items() if cold and m != "cold"}
    out = {"modes": list(modes.values()), **ratios, "load_average": [round(x, 2) for x in os.getloadavg()],
           "machine": "shared, loaded 2-core machine"}  # fmt: skip
    print(json.dumps(ratios), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
