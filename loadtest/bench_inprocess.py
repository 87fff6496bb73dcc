"""What the second hop costs: Triton's own gRPC vs Python proxies in front of it, and in-process Triton.

    python -m loadtest.bench_inprocess [--model fraud_xgboost] [--concurrency 32] [--rounds 4]
                                       [--duration 5] [--warmup 1] [--json out.json]
    python -m loadtest.bench_inprocess --micro          # what each C API step costs, no sockets

Starts, each in a process of its own, on loopback:

* **(a) triton**: ``tritonserver`` under ``TritonSupervisor`` (its gRPC is the baseline);
* **(b) grpc-proxy**: a bare grpc.aio raw-bytes proxy forwarding each ModelInfer to (a) over gRPC
  (``loadtest.naive_proxy --mode proxy``);
* **(c) inprocess**: the same kind of grpc.aio server with Triton *in its process*
  (``server.runtime.inprocess.InProcessTriton``), one Triton request per caller's request
  (``InProcessTriton.infer_bytes``: ``infer`` with the answer serialized, as a raw-bytes handler
  returns it);
* **(d) group-commit**: as (c), but requests present at the same time become one Triton request:
  while a call is in flight, arrivals wait and join the next call; a lone request goes at once.
  Inputs are not copied (each caller's bytes are one more ``AppendInputData`` chunk of the merged
  input); the answer is split back by rows, one copy per caller. A sketch to prove the gain (it
  assumes every caller of a model sends the same inputs, as this load does); the data plane's
  real one validates and groups by signature.

then drives each with the project's load generator (closed loop, ``--concurrency`` callers, the
model's validation rows), in interleaved rounds a, b, c, d, a, b, ..., and prints each target's
median throughput, latency and CPU per request (its process tree: Triton's stubs included) with
the ratio to (a) in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVICE = "/inference.GRPCInferenceService/"
METHOD = SERVICE + "ModelInfer"
READY = "bench-inprocess ready on "


# ---- the in-process proxies (run as `--serve MODE`) ---------------------------------------------


class GroupCommit:
    """One model's merged calls: at most ``max_inflight`` Triton requests at a time; whoever
    arrives meanwhile joins the next one (up to ``max_rows`` rows)."""

    def __init__(self, triton, model: str, max_rows: int, max_inflight: int = 1):
        self.triton, self.model, self.max_rows, self.max_inflight = triton, model, max_rows, max_inflight
        self.waiting: list = []
        self.inflight = 0
        self.calls = self.rows = 0

    async def infer(self, request) -> bytes:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((request, future))
        if self.inflight < self.max_inflight:
            self._launch()
        return await future

    def _launch(self) -> None:
        batch, rows = [], 0
        while self.waiting:
            request, future = self.waiting[0]
            n = request.inputs[0].shape[0]
            if batch and rows + n > self.max_rows:
                break
            self.waiting.pop(0)
            batch.append((request, future, rows, n))
            rows += n
        if batch:
            self.inflight += 1
            asyncio.get_running_loop().create_task(self._call(batch, rows))

    async def _call(self, batch: list, rows: int) -> None:
        from server.protogen.inference import grpc_service_pb2 as pb
        from server.runtime.capi_codec import Tensor, raw_output_field

        try:
            first = batch[0][0]
            tensors = [
                Tensor(t.name, t.datatype, [rows, *t.shape[1:]], [member[0].raw_input_contents[i] for member in batch])
                for i, t in enumerate(first.inputs)
            ]
            result = await self.triton.infer_tensors(self.model, tensors, model_version=first.model_version)
            self.calls += 1
            self.rows += rows
            row_bytes = [len(o.data) // rows for o in result.outputs]
            for request, future, start, n in batch:
                head = pb.ModelInferResponse(model_name=result.model_name, model_version=result.model_version, id=request.id)
                parts = [b""]
                for o, size in zip(result.outputs, row_bytes):
                    head.outputs.add(name=o.name, datatype=o.datatype, shape=[n, *o.shape[1:]])
                    parts += raw_output_field(memoryview(o.data)[start * size : (start + n) * size])
                parts[0] = head.SerializeToString()
                if not future.done():
                    future.set_result(b"".join(parts))
        except BaseException as err:  # noqa: BLE001 - every member gets the failure
            for _request, future, _start, _n in batch:
                if not future.done():
                    future.set_exception(err if isinstance(err, Exception) else RuntimeError(repr(err)))
        finally:
            self.inflight -= 1
            if self.waiting:
                self._launch()


async def _serve(mode: str, repository: Path, workdir: Path, model: str, port: int, max_inflight: int) -> None:
    import grpc

    if os.environ.get("BENCH_SWITCH_INTERVAL"):  # an experiment knob: how long a thread may hold the GIL
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))

    from server.errors import InferplaneError, grpc_status
    from server.protogen.inference import grpc_service_pb2 as pb
    from server.runtime.inprocess import InProcessTriton

    triton = await InProcessTriton.start(repository, workdir, models=(model,))
    config = await triton.model_config(model)
    merger = GroupCommit(triton, model, max(1, config.max_batch_size), max_inflight)

    async def infer(raw: bytes, context) -> bytes:
        try:
            request = pb.ModelInferRequest.FromString(raw)
            if mode == "group-commit" and request.model_name == model:
                return await merger.infer(request)
            return await triton.infer_bytes(request, timeout=context.time_remaining())
        except InferplaneError as err:
            status = grpc_status(err)
            await context.abort(status.code, status.details, status.trailing_metadata)

    def other(method: str):  # ModelMetadata, ModelConfig, ...: through unary_raw
        async def call(raw: bytes, context) -> bytes:
            try:
                return await triton.unary_raw(method, raw)
            except InferplaneError as err:
                status = grpc_status(err)
                await context.abort(status.code, status.details, status.trailing_metadata)

        return call

    class Handler(grpc.GenericRpcHandler):
        def service(self, details):
            if details.method == METHOD:
                return grpc.unary_unary_rpc_method_handler(infer)
            if details.method.startswith(SERVICE):
                return grpc.unary_unary_rpc_method_handler(other(details.method[len(SERVICE) :]))
            return None

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Handler(),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"{READY}127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)
    stats = pb.ModelStatisticsResponse.FromString(triton.statistics(model)).model_stats[0]
    print(f"triton: {stats.inference_count} rows in {stats.execution_count} executions", flush=True)
    if merger.calls:
        print(f"group commit: {merger.rows} rows in {merger.calls} calls ({merger.rows / merger.calls:.1f} rows/call)", flush=True)
    await triton.stop()


# ---- micro-benchmark of the C API steps ---------------------------------------------------------


async def _micro(repository: Path, workdir: Path, model: str, n: int) -> dict:
    import numpy as np

    from server.protogen.inference import grpc_service_pb2 as pb
    from server.runtime import capi_codec
    from server.runtime.capi import ffi
    from server.runtime.inprocess import InProcessTriton, _Call

    triton = await InProcessTriton.start(repository, workdir, models=(model,))
    try:
        md = pb.ModelMetadataResponse.FromString(await triton.unary_raw("ModelMetadata", pb.ModelMetadataRequest(name=model).SerializeToString()))
        request = pb.ModelInferRequest(model_name=model, id="micro")
        for t in md.inputs:
            shape = [1 if d < 0 else d for d in t.shape]
            request.inputs.add(name=t.name, datatype=t.datatype, shape=shape)
            request.raw_input_contents.append(np.zeros(shape, np.float32).tobytes())
        lib, server = triton._lib, triton._server
        out: dict = {}

        def timed(label, fn, reps=n):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[label] = (time.perf_counter() - t0) / reps * 1e6

        live = ffi.new("bool*")
        timed("TRITONSERVER_ServerIsLive (one C call)", lambda: lib.TRITONSERVER_ServerIsLive(server, live))
        timed("request_plan(pb.ModelInferRequest) (pure Python)", lambda: capi_codec.request_plan(request))
        plan = capi_codec.request_plan(request)

        def build_and_delete():
            call = _Call(triton, plan)
            holder = ffi.new("TRITONSERVER_InferenceRequest**")
            lib.TRITONSERVER_InferenceRequestNew(holder, server, triton._name(model), -1)
            triton._describe(holder[0], plan, call.keep)
            lib.TRITONSERVER_InferenceRequestDelete(holder[0])

        timed("build a C request (New, SetId, AddInput, AppendInputData, ...) + Delete", build_and_delete)
        holder = ffi.new("TRITONSERVER_InferenceRequest**")
        lib.TRITONSERVER_InferenceRequestNew(holder, server, triton._name(model), -1)
        timed("one cffi call (InferenceRequestSetId; the GIL is let go and taken back)", lambda: lib.TRITONSERVER_InferenceRequestSetId(holder[0], b"x"))
        lib.TRITONSERVER_InferenceRequestDelete(holder[0])
        result = await triton.infer_tensors(model, plan.inputs)
        timed("InferResult.to_bytes (serialized answer)", result.to_bytes)
        timed("InferResult.to_message (pb.ModelInferResponse)", result.to_message)
        for _ in range(50):
            await triton.infer(request)
        t0 = time.perf_counter()
        for _ in range(min(n, 500)):
            await triton.infer(request)
        out["c=1 round trip through Triton (InProcessTriton.infer)"] = (time.perf_counter() - t0) / min(n, 500) * 1e6
        t0 = time.perf_counter()
        total = 4000
        await asyncio.gather(*(triton.infer(request) for _ in range(total)))
        out[f"{total} requests at once (gather): us per request"] = (time.perf_counter() - t0) / total * 1e6
        return out
    finally:
        await triton.stop()


# ---- the driver ---------------------------------------------------------------------------------


def _start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd} exited with {proc.wait()}:\n{log.read_text()[-3000:]}")
        for mark in (READY, "naive proxy (proxy) ready on "):
            if line.startswith(mark):
                return proc, line[len(mark) :].strip()
    proc.kill()
    raise RuntimeError(f"{cmd} not ready in 120 s")


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fraud_xgboost")
    ap.add_argument("--repository", type=Path, default=None, help="an existing demo repository (default: build one)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--targets", default="triton,grpc-proxy,inprocess,group-commit")
    ap.add_argument("--max-inflight", type=int, default=1, help="group commit: Triton calls in flight per model")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--micro", action="store_true", help="time the C API steps in this process and exit")
    ap.add_argument("--serve", choices=("inprocess", "group-commit"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import uvloop

    work = Path(tempfile.mkdtemp(prefix="bench_inprocess_"))
    repo = args.repository
    if repo is None and not args.serve:
        from model_repository.demo import build_demo_repository

        repo = work / "model_repository"
        build_demo_repository(repo)
    if args.serve:
        uvloop.run(_serve(args.serve, args.repository, args.workdir, args.model, args.port, args.max_inflight))
        return 0
    if args.micro:
        costs = uvloop.run(_micro(repo, work / "micro", args.model, 20000))
        for label, us in costs.items():
            print(f"{us:9.2f} us  {label}")
        return 0
    return _compare(args, repo, work)


def _compare(args, repo: Path, work: Path) -> int:
    from loadtest.engine import LoadSpec
    from loadtest.runner import RunConfig, prepare_pool, run
    from server.runtime.supervisor import TritonSupervisor

    command = "python -m loadtest.bench_inprocess " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    wanted = args.targets.split(",")
    supervisor = TritonSupervisor(repo, work / "triton")
    procs: dict[str, subprocess.Popen] = {}
    targets: dict[str, tuple[str, tuple[int, ...]]] = {}

    async def start_triton():
        await supervisor.start()
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(supervisor.grpc_target)
        client.load_model(args.model)
        client.close()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start_triton())
    try:
        targets["triton"] = (f"grpc://{supervisor.grpc_target}", (supervisor.pid,))
        if "grpc-proxy" in wanted:
            procs["grpc-proxy"], where = _start(
                [sys.executable, "-m", "loadtest.naive_proxy", "--port", "0", "--mode", "proxy", "--triton", supervisor.grpc_target],
                work / "grpc-proxy.log",
            )
            targets["grpc-proxy"] = (f"grpc://{where}", (procs["grpc-proxy"].pid, supervisor.pid))
        for mode in ("inprocess", "group-commit"):
            if mode in wanted:
                procs[mode], where = _start(
                    [sys.executable, "-m", "loadtest.bench_inprocess", "--serve", mode, "--repository", str(repo),
                     "--workdir", str(work / mode), "--model", args.model, "--max-inflight", str(args.max_inflight)],
                    work / f"{mode}.log",
                )  # fmt: skip
                targets[mode] = (f"grpc://{where}", (procs[mode].pid,))
        order = [t for t in ("triton", "grpc-proxy", "inprocess", "group-commit") if t in targets]
        pool = prepare_pool(targets["triton"][0], args.model, data="validation", repository=str(repo), size=256)
        spec = LoadSpec(concurrency=args.concurrency, warmup=args.warmup, duration=args.duration)
        runs: dict[str, list[dict]] = {t: [] for t in order}
        for i in range(args.rounds):
            for name in order:
                target, pids = targets[name]
                result = run(RunConfig(target, args.model, spec, pids=pids, label=name), pool)
                runs[name].append(result)
                cpu = (result.get("cpu") or {}).get("total_cpu_ms_per_request")
                print(f"round {i + 1} {name:13s} {result['throughput_rps']:8.0f} rps  p50 {result['latency_ms']['p50']:6.2f} ms  "
                      f"p99 {result['latency_ms']['p99']:6.2f} ms  cpu {cpu if cpu is None else round(cpu, 3)} ms/req  errors {result['errors_total']}", flush=True)  # fmt: skip
    finally:
        notes = {name: _stop(proc).strip() for name, proc in procs.items()}
        loop.run_until_complete(supervisor.stop())
        loop.close()
    report = _report(runs, order, notes, command)
    print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "runs": runs, "notes": notes}, indent=1, default=str))
    return 0


def _median(values):
    vals = sorted(v for v in values if v is not None)
    return vals[len(vals) // 2] if vals else None


def _report(runs: dict, order: list[str], notes: dict, command: str) -> str:
    lines = [f"Command: `{command}` ({os.cpu_count()} CPUs; a shared machine: figures are noisy)", ""]
    lines += ["| target | rps (median) | ratio to triton (median, min-max) | p50 ms | p99 ms | CPU ms/req (its tree) |", "|---|---|---|---|---|---|"]
    base = runs["triton"]
    for name in order:
        rs = runs[name]
        ratios = [r["throughput_rps"] / b["throughput_rps"] for r, b in zip(rs, base) if b["throughput_rps"]]
        cpu = _median([(r.get("cpu") or {}).get("total_cpu_ms_per_request") for r in rs])
        lines.append(
            f"| {name} | {_median([r['throughput_rps'] for r in rs]):.0f} | {_median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {_median([r['latency_ms']['p50'] for r in rs]):.2f} | {_median([r['latency_ms']['p99'] for r in rs]):.2f} "
            f"| {'n/a' if cpu is None else f'{cpu:.3f}'} |"
        )
    for name, note in notes.items():
        if note:
            lines.append(f"\n{name}: {note.splitlines()[-1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
