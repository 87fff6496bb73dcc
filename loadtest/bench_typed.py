"""Typed per-model API vs the raw OIP call: the same rows, the same stack, interleaved rounds.

    python -m loadtest.bench_typed --out benchmarks/typed [--models fraud_xgboost,mlp_classifier]
                                   [--concurrency 1,32] [--rounds 4] [--duration 3] [--batch 1]

Starts the real stack (embedded Triton + frontend) on a demo repository, then per model and
concurrency runs closed-loop rounds alternating A = OIP ``ModelInfer`` and B = the typed
``<Name>Service/Predict`` (``PredictBatch`` with ``--batch N``), both from pre-serialized bytes
over raw multicallables, so the client does the same (no) protobuf work for both and the
difference is the server's. The typed requests are built from the descriptor the server's
reflection hands out, as a generic client (grpcurl, Postman) would. Reports B/A ratios
(throughput, latencies, frontend CPU per request) with their spread over the rounds.

``--decode-only`` measures, in this process and without a server, the ways of reading a typed
request into a numpy row (the options behind server/transports/typed/codec.py) and the Python
cost per call of the typed handler vs the OIP one over a stand-in data plane (both are printed
before every full run too).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import operator
import os
import platform
import shlex
import sys
import time
import timeit
from pathlib import Path

import grpc
import numpy as np

from loadtest.compare import summarize
from loadtest.engine import LoadSpec, Stats, clock, run_engine
from loadtest.protocol import _CHANNEL_OPTIONS, GrpcDriver
from loadtest.runner import RunConfig, _timekeeper, assemble, prepare_pool
from loadtest.stack import start_stack, stop_stack

MODELS = ["fraud_xgboost", "mlp_classifier"]


class MethodDriver(GrpcDriver):
    """The OIP driver's raw-bytes unary calls, to any method path."""

    def __init__(self, target: str, method: str, **kw) -> None:
        super().__init__(target, **kw)
        self.method = method

    async def open(self) -> None:
        for _ in range(self.n_channels):
            ch = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            self._channels.append(ch)
            self._unary.append(ch.unary_unary(self.method, request_serializer=None, response_deserializer=None))
        await asyncio.gather(*(ch.channel_ready() for ch in self._channels))


async def _run(cfg: RunConfig, method: str, pool: list[bytes]) -> dict:
    driver = MethodDriver(cfg.target, method, timeout=cfg.timeout)
    await driver.open()
    stats, cpu = Stats(), {}
    spec = cfg.spec
    try:
        t0 = clock() + 0.05
        t_meas, t_end = t0 + spec.warmup, t0 + spec.warmup + spec.duration
        keeper = asyncio.ensure_future(_timekeeper(t0, t_meas, t_end, cfg.pids, cpu, stats, cfg, True))
        try:
            await run_engine(driver, pool, spec, t0, stats)
        finally:
            cpu["done"] = True
            await keeper
    finally:
        await driver.close()
    return assemble(cfg, stats, cpu)


def typed_classes(address: str, model: str):
    """(Request, Row, BatchRequest, service name) from the server's reflection, in a private pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stem = "".join(w[:1].upper() + w[1:] for w in model.replace("-", "_").replace(".", "_").split("_") if w)
    package = f"inferplane.models.{model}.v1"
    service = f"{package}.{stem}Service"
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)]), timeout=30)
    pool = descriptor_pool.DescriptorPool()
    for raw in answer.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))

    def cls(kind):
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{stem}{kind}"))

    return cls("Request"), cls("Row"), cls("BatchRequest"), service


def typed_pool(address: str, model: str, rows: np.ndarray, batch: int, size: int) -> tuple[list[bytes], str]:
    request, row, batch_request, service = typed_classes(address, model)
    names = [f.name for f in request.DESCRIPTOR.fields]
    pool = []
    for i in range(size):
        chunk = rows[(i * batch) % len(rows) :][:batch]
        if len(chunk) < batch:
            chunk = np.concatenate([chunk, rows[: batch - len(chunk)]])
        if batch == 1:
            pool.append(request(**dict(zip(names, chunk[0].tolist()))).SerializeToString())
        else:
            pool.append(batch_request(rows=[row(**dict(zip(names, r.tolist()))) for r in chunk]).SerializeToString())
    return pool, f"/{service}/{'Predict' if batch == 1 else 'PredictBatch'}"


def decode_options(model_dir: Path, number: int = 20000) -> dict:
    """µs per request of each way to read a typed request into a float32 row (no server)."""
    from server.control.typed import typed_schema
    from server.control.typed.declared_signature import check_signature
    from server.transports.typed.service import build

    meta = json.loads((model_dir / "inferplane.json").read_text())
    schema = typed_schema.from_signature(meta["name"], check_signature(meta["signature"]))
    _, codec = build(schema)
    rows = np.load(model_dir / "validation.npz")["features"]
    names = [f.name for f in schema.request_fields]
    raw = codec.Request(**dict(zip(names, rows[0].tolist()))).SerializeToString()
    fields = codec.Request.DESCRIPTOR.fields
    request_cls = codec.Request

    def by_getattr():
        m = request_cls.FromString(raw)
        return np.array([getattr(m, n) for n in names], dtype=np.float32)

    def by_listfields():
        m = request_cls.FromString(raw)
        listed = m.ListFields()
        return np.fromiter((v for _, v in listed), dtype=np.float32, count=len(fields))

    getter = operator.attrgetter(*names)

    def by_attrgetter():
        m = request_cls.FromString(raw)
        return np.fromiter(getter(m), dtype=np.float32, count=len(names))

    def by_wire_layout():
        return codec.wire.row(raw)

    def full_decode():  # what Predict does: wire layout + range checks
        return codec.decode(raw, batch=False)

    out = {}
    for name, fn in (("getattr per field", by_getattr), ("ListFields + np.fromiter", by_listfields),
                     ("attrgetter + np.fromiter", by_attrgetter), ("wire layout view", by_wire_layout),
                     ("codec.decode (layout + checks)", full_decode)):  # fmt: skip
        np.testing.assert_allclose(np.ravel(fn() if name != "codec.decode (layout + checks)" else fn()[0][0]), rows[0], rtol=0)
        best = min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6
        out[name] = round(best, 3)
    batch = codec.BatchRequest(rows=[codec.Row(**dict(zip(names, r.tolist()))) for r in rows[:32]]).SerializeToString()
    out["PredictBatch 32 rows: wire layout"] = round(min(timeit.repeat(lambda: codec.wire.rows(batch), number=number // 10, repeat=5)) / (number // 10) * 1e6, 3)
    out["PredictBatch 32 rows: message path (attrgetter)"] = round(
        min(timeit.repeat(lambda: codec.read(list(codec.BatchRequest.FromString(batch).rows), True), number=number // 10, repeat=5)) / (number // 10) * 1e6, 3
    )
    return {"model": meta["name"], "fields": len(names), "us_per_request": out}


def handler_cost(model_dir: Path, calls: int = 20000) -> dict:
    """µs of frontend Python per call of the typed Predict handler and of OIP ModelInfer, in this
    process, over a stand-in data plane that answers at once (what the typed transport adds,
    without the network, gRPC or Triton — steadier than the stack's figures on a busy machine)."""
    import gc
    import types

    from server.control.typed import typed_schema
    from server.control.typed.declared_signature import check_signature
    from server.protogen.inference import grpc_service_pb2 as pb
    from server.transports.grpc.inference import InferenceService
    from server.transports.typed.service import TypedServices

    meta = json.loads((model_dir / "inferplane.json").read_text())
    schema = typed_schema.from_signature(meta["name"], check_signature(meta["signature"]))
    row = np.load(model_dir / "validation.npz")["features"][:1].astype(np.float32)
    out = schema.outputs[0]
    answer = pb.ModelInferResponse(model_name=schema.model, model_version="1")
    answer.outputs.add(name=out.name, datatype=out.datatype, shape=[1, *out.dims])
    answer.raw_output_contents.append(np.zeros(out.dims, np.float32).tobytes())
    answer_bytes = answer.SerializeToString()

    signature = types.SimpleNamespace(max_batch_size=64)

    class StandIn:  # the DataPlane surface the two handlers use
        def signature(self, name):
            return signature

        def authorize(self, ctx, name):
            return None

        async def infer(self, request, raw=None, timeout=None, ctx=None):
            _ = raw if raw is not None else request.SerializeToString()
            return answer_bytes

    catalog = types.SimpleNamespace(revision=1, served=lambda: [schema], is_deployed=lambda name: True, sync=lambda: False)
    context = types.SimpleNamespace(invocation_metadata=lambda: (), time_remaining=lambda: 30.0, set_trailing_metadata=lambda md: None)
    dp = StandIn()
    typed = TypedServices(dp, catalog)
    typed.refresh()
    predict = typed.service(types.SimpleNamespace(method=f"/{schema.service}/Predict")).unary_unary
    codec = typed.built()[0].codec
    typed_raw = codec.Request(**dict(zip([f.name for f in schema.request_fields], row[0].tolist()))).SerializeToString()
    request = pb.ModelInferRequest(model_name=schema.model)
    request.inputs.add(name="features", datatype="FP32", shape=[1, row.shape[1]])
    request.raw_input_contents.append(row.tobytes())
    oip_raw = request.SerializeToString()
    oip = InferenceService(dp).model_infer

    async def per_call(fn, raw) -> float:
        for _ in range(1000):
            await fn(raw, context)
        t0 = time.perf_counter()
        for _ in range(calls):
            await fn(raw, context)
        return (time.perf_counter() - t0) / calls * 1e6

    async def measure() -> dict:
        best = {"typed": float("inf"), "oip": float("inf")}
        for _ in range(5):  # interleaved, best of 5
            best["typed"] = min(best["typed"], await per_call(predict, typed_raw))
            best["oip"] = min(best["oip"], await per_call(oip, oip_raw))
        return best

    gc.freeze()  # as the frontend does after start-up
    best = asyncio.run(measure())
    return {"model": schema.model, "typed_us": round(best["typed"], 2), "oip_us": round(best["oip"], 2),
            "typed_extra_us": round(best["typed"] - best["oip"], 2)}  # fmt: skip


def _frontend_cpu_ms(run: dict, frontend: int, triton: int) -> float | None:
    pids = (run.get("cpu") or {}).get("pids", {})
    tree, sub = pids.get(str(frontend), {}), pids.get(str(triton), {})
    if tree.get("cpu_s") is None or sub.get("cpu_s") is None or not run.get("requests"):
        return None
    return (tree["cpu_s"] - sub["cpu_s"]) * 1000 / (run["requests"] + run.get("errors_total", 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/typed"))
    ap.add_argument("--repository", type=Path, default=None, help="existing demo repository (default: build one)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=1, help="rows per call (typed: PredictBatch)")
    ap.add_argument("--decode-only", action="store_true", help="only the in-process decode options (no server)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m loadtest.bench_typed " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    repo = args.repository
    if repo is None:
        from model_repository.demo import build_demo_repository

        repo = args.out / "model_repository"
        build_demo_repository(repo)
    results: dict = {
        "command": command, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "decode": [decode_options(repo / m) for m in args.models.split(",")],
        "handler": [handler_cost(repo / m) for m in args.models.split(",")], "models": {},
    }  # fmt: skip
    for d in results["decode"]:
        print(f"decode {d['model']} ({d['fields']} fields): " + ", ".join(f"{k} {v} µs" for k, v in d["us_per_request"].items()), flush=True)
    for h in results["handler"]:
        print(f"handler {h['model']}: typed Predict {h['typed_us']} µs, OIP ModelInfer {h['oip_us']} µs per call (stand-in data plane)", flush=True)
    if args.decode_only:
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
        return 0
    stack = start_stack(repo, args.out / "stack", "--workers", "1", "--auth", "off")
    try:
        triton, frontend = stack.triton_pid(), stack.process.pid
        target = f"grpc://{stack.grpc}"
        for model in args.models.split(","):
            rows = np.load(repo / model / "validation.npz")["features"].astype(np.float32)
            pool_oip = prepare_pool(target, model, data="validation", repository=str(repo), batch=args.batch, size=256)
            pool_typed, method = typed_pool(stack.grpc, model, rows, args.batch, 256)
            per_model = {}
            for conc in [int(c) for c in args.concurrency.split(",")]:
                spec = LoadSpec(concurrency=conc, warmup=args.warmup, duration=args.duration)
                cfg_a = RunConfig(target, model, spec, batch=args.batch, pids=(frontend, triton), label="oip")
                cfg_b = RunConfig(target, model, spec, batch=args.batch, pids=(frontend, triton), label="typed")
                runs_a, runs_b = [], []
                for _ in range(args.rounds):  # interleaved: A, B, A, B, ...
                    runs_a.append(asyncio.run(_run(cfg_a, "/inference.GRPCInferenceService/ModelInfer", pool_oip)))
                    runs_b.append(asyncio.run(_run(cfg_b, method, pool_typed)))
                errors = sum(r["errors_total"] for r in runs_a + runs_b)
                summary = summarize(runs_a, runs_b)
                cpu_a = [_frontend_cpu_ms(r, frontend, triton) for r in runs_a]
                cpu_b = [_frontend_cpu_ms(r, frontend, triton) for r in runs_b]
                ratio_cpu = [b / a if a and b else None for a, b in zip(cpu_a, cpu_b)]
                per_model[f"c={conc}"] = {"summary": summary, "frontend_cpu_ms": {"oip": cpu_a, "typed": cpu_b, "ratio": ratio_cpu}, "errors": errors}
                r = summary["ratio_b_over_a"]
                med = sorted(x for x in ratio_cpu if x is not None)
                print(
                    f"{model} c={conc} batch={args.batch}: typed/oip throughput {r['throughput_rps']['median']:.3f} "
                    f"[{r['throughput_rps']['min']:.3f}-{r['throughput_rps']['max']:.3f}], p50 {r['p50_ms']['median']:.3f}, "
                    f"p99 {r['p99_ms']['median']:.3f}, frontend CPU/request {med[len(med) // 2] if med else float('nan'):.3f}; "
                    f"oip {summary['a']['throughput_rps']['median']:.0f} rps, typed {summary['b']['throughput_rps']['median']:.0f} rps; errors {errors}",
                    flush=True,
                )
            results["models"][model] = per_model
    finally:
        stop_stack(stack)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out / 'results.json'} ({command})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
