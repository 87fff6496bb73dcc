"""Soak: minutes of mixed valid and invalid load against the real stack; do memory or descriptors grow?

    python -m loadtest.soak [--minutes 10] [--concurrency 8] [--invalid 0.5] [--llm] [--json out.json]

Starts the stack (``loadtest/stack.py``: the demo models and the MiniLM embeddings, with
``--llm`` tiny_llama too), then keeps ``--concurrency`` callers busy for ``--minutes`` with a mix
over gRPC and REST: valid inferences of every model (unary, ModelStreamInfer, REST JSON, the
binary extension, KServe v1, OpenAI embeddings) and invalid ones (wrong shapes and datatypes,
damaged protobuf, text that is not UTF-8, lone surrogates, numbers too large for their field,
unknown model names — each one new). Every ``--sample-s`` seconds it samples the frontend's
and Triton's resident memory and open file descriptors (Triton's Python-backend stubs apart),
and the number of series on ``/metrics``.

After a warm-up (``--warmup-s``, default 15% of the run) each series gets a least-squares slope
(per minute) and the growth it implies over the measured window; a series "grows" when that
exceeds its tolerance (memory: 5% of its mean and 16 MiB; descriptors: 8; metric series: 50).
Prints one JSON document (``--json`` writes it): the samples, slopes, verdict per series and
overall, the answers by status, and whether Triton restarted. A server fault (INTERNAL, UNKNOWN,
5xx) or a Triton restart also fails the verdict. Never part of the test run; the 10-minute figure
goes in BENCHMARKS.md with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import struct
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

SVC = "/inference.GRPCInferenceService/"
TABULAR = {"mlp_classifier": 64, "fraud_xgboost": 32, "lightgbm_regressor": 16}
EMBEDDINGS = "minilm_embeddings"
LLM = "tiny_llama"
MIB = 1 << 20
DRIFT_FAMILIES = ("inferplane_drift_psi", "inferplane_drift_ks")
TOLERANCE = {"rss": (0.05, 16.0), "fds": (0.0, 8), "metric_series": (0.0, 50)}  # (relative to mean, absolute; memory in MiB)
FAULTS = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE"}


# ---- what each caller sends ----------------------------------------------------------------------


def _bytes_tensor(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def _tabular(model: str, rows: int, width: int | None = None, datatype: str = "FP32"):
    from server.protogen.inference import grpc_service_pb2 as pb

    width = width or TABULAR[model]
    x = np.random.default_rng(rows).random((rows, width)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="features", datatype=datatype, shape=[rows, width])
    request.raw_input_contents.append(x.tobytes())
    return request


def _texts(*texts: bytes):
    from server.protogen.inference import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name=EMBEDDINGS)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
    request.raw_input_contents.append(_bytes_tensor(*texts))
    return request


class Load:
    """The mix: each call picks one kind at random; ``invalid`` is the share of invalid kinds."""

    def __init__(self, grpc_address: str, http_address: str, invalid: float, llm: bool):
        self.grpc_address, self.http = grpc_address, http_address
        self.invalid = invalid
        self.llm = llm
        self.codes: Counter = Counter()  # "grpc:OK", "rest:400", ...
        self.faults: list[str] = []
        self.sent = 0
        self.unknown_names = 0

    async def start(self) -> None:
        import aiohttp

        self.channel = grpc.aio.insecure_channel(self.grpc_address)
        self.unary = self.channel.unary_unary(SVC + "ModelInfer", request_serializer=None, response_deserializer=None)
        self.stream = self.channel.stream_stream(SVC + "ModelStreamInfer", request_serializer=None, response_deserializer=None)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def close(self) -> None:
        await self.session.close()
        await self.channel.close()

    # valid ---------------------------------------------------------------------------------------

    async def grpc_valid(self) -> None:
        model = random.choice(list(TABULAR))
        await self._grpc(_tabular(model, random.randint(1, 8)).SerializeToString())

    async def grpc_text(self) -> None:
        await self._grpc(_texts(*(f"soak sentence {random.random()}".encode() for _ in range(random.randint(1, 4)))).SerializeToString())

    async def stream_valid(self) -> None:
        messages = [_tabular(random.choice(list(TABULAR)), 2).SerializeToString() for _ in range(random.randint(1, 4))]
        await self._stream(messages)

    async def rest_json(self) -> None:
        model = random.choice(list(TABULAR))
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, TABULAR[model]], "data": [0.5] * (2 * TABULAR[model])}]}
        await self._rest(f"/v2/models/{model}/infer", json.dumps(body).encode())

    async def rest_binary(self) -> None:
        data = _bytes_tensor(b"binary extension text")
        header = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": len(data)}}]}).encode()
        await self._rest(f"/v2/models/{EMBEDDINGS}/infer", header + data,
                         {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})  # fmt: skip

    async def rest_predict(self) -> None:
        await self._rest("/v1/models/lightgbm_regressor:predict", json.dumps({"instances": [[0.5] * 16] * 3}).encode())

    async def openai_embeddings(self) -> None:
        await self._rest("/v1/embeddings", json.dumps({"model": EMBEDDINGS, "input": ["soak", "test"]}).encode())

    async def openai_chat(self) -> None:
        body = {"model": LLM, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": random.random() < 0.5}
        await self._rest("/v1/chat/completions", json.dumps(body).encode())

    # invalid --------------------------------------------------------------------------------------

    async def grpc_bad_shape(self) -> None:
        model = random.choice(list(TABULAR))
        await self._grpc(_tabular(model, 2, width=TABULAR[model] + 1).SerializeToString())

    async def grpc_bad_datatype(self) -> None:
        await self._grpc(_tabular("fraud_xgboost", 2, datatype="X" * random.randint(1, 5000)).SerializeToString())

    async def grpc_unknown_model(self) -> None:
        self.unknown_names += 1
        request = _tabular("lightgbm_regressor", 1)
        request.model_name = f"soak-unknown-{random.getrandbits(64):x}"
        await self._grpc(request.SerializeToString())

    async def stream_unknown_and_bad(self) -> None:
        self.unknown_names += 1
        unknown = _tabular("lightgbm_regressor", 1)
        unknown.model_name = f"soak-stream-{random.getrandbits(64):x}"
        await self._stream([unknown.SerializeToString(), _texts(b"\xff\xfe").SerializeToString(), b"\xff\x00garbage",
                            _tabular("mlp_classifier", 1).SerializeToString()])  # fmt: skip

    async def grpc_garbage(self) -> None:
        data = bytearray(_tabular("mlp_classifier", 2).SerializeToString())
        for _ in range(3):
            data[random.randrange(len(data))] ^= random.randint(1, 255)
        await self._grpc(bytes(data))

    async def grpc_not_utf8(self) -> None:
        await self._grpc(_texts(b"fine", random.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])).SerializeToString())

    async def rest_bad_json(self) -> None:
        body = random.choice([b"{", b'{"inputs": "no"}', b'{"inputs":[{"name":"features","datatype":"FP32","shape":[1,16],"data":["\\ud800"]}]}',
                              b"[" * 5000, b'{"inputs":[{"name":"features","datatype":"FP32","shape":[1,16],"data":' + b"9" * 400 + b"}]}"])  # fmt: skip
        await self._rest("/v2/models/lightgbm_regressor/infer", body)

    async def openai_bad(self) -> None:
        body = random.choice([
            b'{"model":"minilm_embeddings","input":["\\udfff"]}',
            b'{"model":"minilm_embeddings","input":"x","dimensions":' + b"9" * 400 + b"}",
            b'{"model":"tiny_llama","prompt":"hi","max_tokens":' + str(2**65).encode() + b"}",
            b'{"model":"tiny_llama","prompt":"hi","seed":' + str(2**65).encode() + b',"max_tokens":2}',
            b'{"model":"tiny_llama","messages":[{"role":"user","content":"\\ud800"}],"temperature":NaN}',
        ])  # fmt: skip
        path = "/v1/embeddings" if b"minilm" in body else "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
        await self._rest(path, body)

    async def rest_huge_timeout(self) -> None:
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
        await self._rest("/v2/models/lightgbm_regressor/infer", json.dumps(body).encode(), {"x-request-timeout": random.choice(["1e10", "inf", "nan"])})

    # transport helpers ----------------------------------------------------------------------------------

    async def _grpc(self, raw: bytes) -> None:
        try:
            await self.unary(raw, timeout=60)
            code = "OK"
        except grpc.aio.AioRpcError as err:
            code = err.code().name
            if code in FAULTS:
                self.faults.append(f"grpc {code}: {(err.details() or '')[:200]}")
        self.codes[f"grpc:{code}"] += 1

    async def _stream(self, messages: list[bytes]) -> None:
        from server.protogen.inference import grpc_service_pb2 as pb

        try:
            async for raw in self.stream(iter(messages), timeout=60):
                response = pb.ModelStreamInferResponse.FromString(raw)
                code = response.error_message.split(":", 1)[0] if response.error_message else "OK"
                if code in FAULTS:
                    self.faults.append(f"stream {response.error_message[:200]}")
                self.codes[f"stream:{code if code.isupper() and ' ' not in code else 'TRITON_ERROR'}"] += 1
        except grpc.aio.AioRpcError as err:
            self.codes[f"stream:{err.code().name}"] += 1
            if err.code().name in FAULTS:
                self.faults.append(f"stream {err.code().name}: {(err.details() or '')[:200]}")

    async def _rest(self, path: str, body: bytes, headers: dict | None = None) -> None:
        async with self.session.post(f"http://{self.http}{path}", data=body, headers=headers or {"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status >= 500 and r.status != 504:
                self.faults.append(f"rest {r.status} {path}")
            self.codes[f"rest:{r.status}"] += 1

    def kinds(self):
        valid = [self.grpc_valid, self.grpc_text, self.stream_valid, self.rest_json, self.rest_binary, self.rest_predict, self.openai_embeddings]
        if self.llm:
            valid.append(self.openai_chat)
        invalid = [self.grpc_bad_shape, self.grpc_bad_datatype, self.grpc_unknown_model, self.stream_unknown_and_bad, self.grpc_garbage,
                   self.grpc_not_utf8, self.rest_bad_json, self.openai_bad, self.rest_huge_timeout]  # fmt: skip
        return valid, invalid

    async def caller(self, until: float) -> None:
        valid, invalid = self.kinds()
        while time.monotonic() < until:
            kind = random.choice(invalid if random.random() < self.invalid else valid)
            try:
                await kind()
            except Exception as err:  # noqa: BLE001 - a broken connection is a finding, not a crash of the soak
                self.codes[f"client:{type(err).__name__}"] += 1
                self.faults.append(f"{kind.__name__}: {type(err).__name__}: {err}"[:200])
            self.sent += 1


# ---- sampling -------------------------------------------------------------------------------------


def _processes(stack):
    """(frontend processes, tritonserver, Triton's Python-backend stubs) as psutil processes."""
    import psutil

    root = psutil.Process(stack.process.pid)
    triton = psutil.Process(stack.triton_pid())
    stubs = triton.children(recursive=True)
    below_triton = {triton.pid, *(p.pid for p in stubs)}
    frontend = [root, *(p for p in root.children(recursive=True) if p.pid not in below_triton)]
    return frontend, triton, stubs


def _rss_fds(processes) -> tuple[int, int]:
    import psutil

    rss = fds = 0
    for p in processes:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
        except psutil.Error:
            continue
    return rss, fds


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def _metrics(stack) -> list[tuple[str, float]]:
    text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
    return [(m.group(1), float(m.group(3))) for m in _SAMPLE.finditer(text)]


def sample(stack) -> dict:
    frontend, triton, stubs = _processes(stack)
    f_rss, f_fds = _rss_fds(frontend)
    t_rss, t_fds = _rss_fds([triton])
    s_rss, s_fds = _rss_fds(stubs)
    series = _metrics(stack)
    restarts = sum(v for name, v in series if name == "inferplane_triton_restarts_total")
    # drift gauges are one series per (model, declared feature), each appearing once the model's
    # drift window has its minimum rows: bounded by the signatures, counted apart from the trend
    drift = sum(1 for name, _ in series if name.startswith(DRIFT_FAMILIES))
    return {
        "frontend_rss": f_rss, "frontend_fds": f_fds, "triton_rss": t_rss, "triton_fds": t_fds,
        "stubs_rss": s_rss, "stubs_fds": s_fds, "metric_series": len(series) - drift, "drift_series": drift,
        "triton_pid": triton.pid, "triton_restarts": restarts,
    }  # fmt: skip


SERIES = ("frontend_rss", "frontend_fds", "triton_rss", "triton_fds", "stubs_rss", "stubs_fds", "metric_series")


def trend(times: list[float], values: list[float], kind: str) -> dict:
    """Least-squares slope (per minute) and the growth it implies over the window, against a tolerance."""
    t = np.asarray(times, dtype=float)
    v = np.asarray(values, dtype=float)
    if len(t) < 3:
        return {"slope_per_min": None, "growth": None, "tolerance": None, "verdict": "too few samples"}
    slope = float(np.polyfit(t, v, 1)[0])  # per second
    growth = slope * float(t[-1] - t[0])
    relative, absolute = TOLERANCE[kind]
    tolerance = max(relative * float(v.mean()), absolute)
    return {
        "slope_per_min": round(slope * 60, 3), "growth": round(growth, 1), "tolerance": round(tolerance, 1),
        "first": round(float(v[0]), 1), "last": round(float(v[-1]), 1), "mean": round(float(v.mean()), 1),
        "verdict": "grows" if growth > tolerance else "flat",
    }  # fmt: skip


async def soak(stack, minutes: float, concurrency: int, invalid: float, sample_s: float, warmup_s: float, llm: bool) -> dict:
    load = Load(stack.grpc, stack.http, invalid, llm)
    await load.start()
    t0 = time.monotonic()
    until = t0 + minutes * 60
    samples_taken: list[dict] = []

    async def sampler():
        while True:
            entry = await asyncio.to_thread(sample, stack)
            entry["t"] = round(time.monotonic() - t0, 2)
            entry["sent"] = load.sent
            samples_taken.append(entry)
            if time.monotonic() >= until:
                return
            await asyncio.sleep(sample_s)

    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*(load.caller(until) for _ in range(concurrency)))
        await sampling
    finally:
        sampling.cancel()
        await load.close()
    measured = [s for s in samples_taken if s["t"] >= warmup_s]
    trends = {}
    for name in SERIES:
        kind = "rss" if name.endswith("rss") else "fds" if name.endswith("fds") else "metric_series"
        scale = MIB if kind == "rss" else 1  # memory in MiB
        trends[name if kind != "rss" else f"{name}_mib"] = trend([s["t"] for s in measured], [s[name] / scale for s in measured], kind)
    restarted = samples_taken[-1]["triton_pid"] != samples_taken[0]["triton_pid"] or samples_taken[-1]["triton_restarts"] != samples_taken[0]["triton_restarts"]
    growing = sorted(n for n, tr in trends.items() if tr["verdict"] == "grows")
    for s in samples_taken:  # the samples in MiB too, like the trends
        for name in [n for n in SERIES if n.endswith("rss")]:
            s[f"{name}_mib"] = round(s.pop(name) / MIB, 1)
    elapsed = time.monotonic() - t0
    return {
        "verdict": "pass" if not growing and not load.faults and not restarted else "fail",
        "growing": growing,
        "triton_restarted": restarted,
        "server_faults": len(load.faults),
        "faults_sample": load.faults[:10],
        "requests": load.sent,
        "rps": round(load.sent / elapsed, 1),
        "unknown_model_names_sent": load.unknown_names,
        "answers": dict(sorted(load.codes.items())),
        "trends": trends,
        "samples": samples_taken,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop callers")
    parser.add_argument("--invalid", type=float, default=0.5, help="share of invalid requests (0..1)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup-s", type=float, default=None, help="samples before this are left out of the trend (default: 15%% of the run)")
    parser.add_argument("--llm", action="store_true", help="also serve tiny_llama and send chat completions")
    parser.add_argument("--repository", type=Path, default=None, help="a model repository to copy (default: build the demo models + MiniLM)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    random.seed(args.seed)
    warmup = args.warmup_s if args.warmup_s is not None else 0.15 * args.minutes * 60

    from loadtest.stack import start_stack, stop_stack

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        repository = work / "model_repository"
        if args.repository is not None:
            import shutil

            shutil.copytree(args.repository, repository)
        else:
            from model_repository.demo import build_demo_repository
            from model_repository.embeddings import build_embedding_model

            build_demo_repository(repository)
            build_embedding_model(repository)
            if args.llm:
                from server.control.rollout.llm_install import install_llm_models, scratch_registry

                registry = scratch_registry(work)  # the stack's registry (below): tiny_llama is deployed from it
                try:
                    install_llm_models(repository, registry, tiny=True)
                finally:
                    registry.close()
        # isolation none: the soak samples the one embedded Triton (its RSS, fds, restarts), as before issue 29
        env = {"INFERPLANE_AUTH": "off", "INFERPLANE_LOG_LEVEL": "WARNING", "INFERPLANE_DATABASE_URL": f"sqlite:///{work}/registry.db",
               "INFERPLANE_ARTIFACT_STORE": str(work / "artifacts"), "INFERPLANE_ISOLATION": "none"}  # fmt: skip
        stack = start_stack(repository, work / "stack", "--workers", "1", env=env)
        try:
            result = asyncio.run(soak(stack, args.minutes, args.concurrency, args.invalid, args.sample_s, warmup, args.llm))
        finally:
            stop_stack(stack)
    result["settings"] = {"minutes": args.minutes, "concurrency": args.concurrency, "invalid": args.invalid, "sample_s": args.sample_s,
                          "warmup_s": warmup, "llm": args.llm, "seed": args.seed, "cpus": os.cpu_count()}  # fmt: skip
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
