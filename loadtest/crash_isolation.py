"""Crash isolation of the embedded default (issue 29): kill -9 of one Triton under light load, per
isolation mode, side by side in one run.

    python -m loadtest.crash_isolation [--modes none,llm,each,llm+standby,llm+standby-tree,llm+standby-all] [--json benchmarks/crash_isolation/results.json]

For each mode (``INFERPLANE_ISOLATION``; ``+standby``: and ``INFERPLANE_WARM_STANDBY=tiny_llama=1``, a
loaded standby of the LLM that takes its replica's place when its Triton dies; ``+standby-tree``:
``fraud_xgboost=1`` instead, which also gives fraud_xgboost a replica Triton of its own, out of the
embedded one; ``+standby-all``: both) a stack serves the three tabular demo models and tiny_llama;
closed-loop callers (one per endpoint: tritonclient for the tabular models, the openai SDK for the
LLM, no retries) run while two drills happen in turn: ``kill -9`` of the Triton hosting the LLM, then
of the Triton hosting fraud_xgboost. Per drill: errors per endpoint from the kill until the crashed
endpoint answers again plus 2 s, and the seconds from the kill to its first answer after its first
failure (its serving again): the first answer to a call the caller *sent* after the kill (and after
its first failure, if any) — an answer computed before the kill and read after it is not a
recovery. Per mode: the
stack's start time (process start to its ready line) and the resident memory of its Tritons (the
``tritonserver`` processes and their Python-backend stubs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import openai
import psutil
import tritonclient.grpc as grpcclient

from loadtest.stack import start_stack, stop_stack
from model_repository.config_writer import read_config
from model_repository.demo import build_demo_repository
from server.control.rollout.llm_install import install_llm_models
from server.protogen.inferplane.v1 import autoscale_pb2 as apb
from server.protogen.inferplane.v1 import autoscale_pb2_grpc

LLM = "tiny_llama"
TABULAR = ("fraud_xgboost", "lightgbm_regressor", "mlp_classifier")
STANDBY = {"standby": f"{LLM}=1", "standby-tree": "fraud_xgboost=1", "standby-all": f"{LLM}=1,fraud_xgboost=1"}  # a mode's +EXTRA


def build(root: Path) -> Path:
    repository = root / "model_repository"
    build_demo_repository(repository)
    install_llm_models(repository, tiny=True, work=root)  # registered in a scratch registry beside it, deployed from there
    return repository


def _input(repository: Path, model: str) -> tuple[str, int]:
    spec = read_config(repository / model).input[0]
    return spec.name, int(spec.dims[-1])


class Caller(threading.Thread):
    """One closed-loop caller of one endpoint; every answer and failure is timestamped."""

    def __init__(self, stack, repository: Path, model: str):
        super().__init__(daemon=True)
        self.stack, self.model = stack, model
        self.input = None if model == LLM else _input(repository, model)
        self.stop = threading.Event()
        self.ok: list[float] = []
        self.sent: list[float] = []  # when each answered call (ok[i]) was sent
        self.errors: list[float] = []

    def call_once(self, client) -> None:
        if self.model == LLM:
            client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0)
            return
        name, width = self.input
        x = grpcclient.InferInput(name, [1, width], "FP32")
        x.set_data_from_numpy(np.random.default_rng(3).random((1, width), dtype=np.float32))
        client.infer(self.model, [x], client_timeout=30)

    def client(self):
        if self.model == LLM:
            return openai.OpenAI(base_url=f"http://{self.stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
        return grpcclient.InferenceServerClient(self.stack.grpc)

    def run(self) -> None:
        client = self.client()
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                self.call_once(client)
                self.sent.append(sent)
                self.ok.append(time.monotonic())
            except Exception:  # noqa: BLE001 - every failure counts
                self.errors.append(time.monotonic())
                time.sleep(0.05)
        client.close()


def executor(stack) -> dict:
    with grpc.insecure_channel(stack.grpc) as channel:
        answer = autoscale_pb2_grpc.AutoscaleStub(channel).Explain(apb.ExplainAutoscaleRequest(endpoint="fraud_xgboost"))
    return json.loads(answer.explain_json)["executor"]


def replicas(stack) -> list[dict]:
    return executor(stack)["replicas"]


def triton_memory_mb(stack) -> float:
    total = 0
    for child in psutil.Process(stack.process.pid).children(recursive=True):
        try:
            if child.name() == "tritonserver" or "triton_python_backend_stub" in child.name():
                total += child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return round(total / (1 << 20), 1)


def drill(stack, callers: dict[str, Caller], model: str) -> dict:
    """kill -9 of the Triton hosting ``model``; errors per endpoint and the time to its next answer."""
    (host,) = [r for r in replicas(stack) if model in r["models"]]
    waiting = executor(stack)["standby"].get(model, [])  # the loaded standbys of the model at the kill
    killed = time.monotonic()
    os.kill(host["pid"], signal.SIGKILL)
    crashed = callers[model]
    deadline = killed + 120
    while time.monotonic() < deadline and _back(crashed, killed) is None:
        time.sleep(0.05)
    back = _back(crashed, killed)
    time.sleep(2.0)
    until = time.monotonic()
    return {
        "killed": model, "replica": host["id"], "hosted": host["models"], "standby_at_kill": len(waiting),
        "serving_again_s": None if back is None else round(back - killed, 2), "taken_over": executor(stack)["taken_over"],
        "errors": {m: sum(1 for t in c.errors if killed <= t <= until) for m, c in callers.items()},
        "answered": {m: sum(1 for t in c.ok if killed <= t <= until) for m, c in callers.items()},
    }  # fmt: skip


def _back(caller: Caller, killed: float) -> float | None:
    """When the endpoint answered a call sent after the kill and after its first failure after it (if
    any). The caller is one closed loop: the call in flight at the kill ends (an answer computed
    before it, one retried elsewhere, or a failure) before the next is sent, so an answer to a call
    sent after the kill is the endpoint serving again — never a late answer of the dead process."""
    failed = next((t for t in caller.errors if t >= killed), killed)
    return next((done for sent, done in zip(list(caller.sent), list(caller.ok)) if sent >= failed), None)


def run_mode(root: Path, repository: Path, mode: str) -> dict:
    workdir = root / f"stack-{mode.replace('+', '-')}"
    isolation, _, extra = mode.partition("+")
    standby = {"INFERPLANE_WARM_STANDBY": STANDBY[extra]} if extra else {}
    env = {**standby, "INFERPLANE_ISOLATION": isolation, "INFERPLANE_AUTH": "off", "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2",
           "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts")}  # fmt: skip
    began = time.monotonic()
    stack = start_stack(repository, workdir, env=env)
    start_s = round(time.monotonic() - began, 2)
    try:
        with grpc.insecure_channel(stack.grpc) as channel:
            config = apb.AutoscaleConfig(min_replicas=1, max_replicas=1)
            autoscale_pb2_grpc.AutoscaleStub(channel).Configure(apb.ConfigureAutoscaleRequest(endpoint="fraud_xgboost", config=config))
        if standby:  # the standbys loaded before the drills
            until = time.monotonic() + 120
            wanted = [part.split("=")[0] for part in STANDBY[extra].split(",")]
            while not all(executor(stack)["standby"].get(m) for m in wanted) and time.monotonic() < until:
                time.sleep(0.2)
        tritons = len(replicas(stack)) + sum(len(p) for p in executor(stack)["standby"].values())
        out = {"mode": mode, "start_s": start_s, "tritons": tritons, "triton_memory_mb": triton_memory_mb(stack)}
        callers = {m: Caller(stack, repository, m) for m in [*TABULAR, LLM]}
        for c in callers.values():
            c.start()
        time.sleep(3.0)
        out["drills"] = [drill(stack, callers, LLM)]
        time.sleep(2.0)
        out["drills"].append(drill(stack, callers, "fraud_xgboost"))
        for c in callers.values():
            c.stop.set()
        for c in callers.values():
            c.join(60)
        print(json.dumps(out), flush=True)
        return out
    finally:
        stop_stack(stack)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="none,llm,each,llm+standby")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="inferplane-crash-"))
    try:
        repository = build(root)
        out = {"modes": [run_mode(root, repository, mode) for mode in args.modes.split(",")], "machine": "shared, loaded 2-core machine",
               "load_average": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
