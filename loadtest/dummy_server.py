"""A minimal OIP v2 gRPC server for testing and calibrating the load generator.

It answers ModelInfer / ModelStreamInfer with a fixed response (bytes, no parsing), and
ModelMetadata with a small FP32 signature. Knobs: extra delay per request, failing every n-th
request with INVALID_ARGUMENT, and one stall (holding every request) to test coordinated
omission. `python -m loadtest.dummy_server --port 0` prints `PORT <n>` once serving; `DummyProcess`
starts it so (the unit tests' servers, `python -m loadtest delay-check`).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc

from loadtest.protocol import SERVICE


class DummyBehaviour:
    def __init__(
        self,
        *,
        delay_ms: float = 0.0,
        fail_every: int = 0,
        stall_after_s: float | None = None,
        stall_ms: float = 0.0,
        input_shape: tuple[int, ...] = (-1, 4),
    ) -> None:
        self.delay = delay_ms / 1000.0
        self.fail_every = fail_every
        self.stall_after = stall_after_s
        self.stall = stall_ms / 1000.0
        self.input_shape = input_shape
        self.count = 0
        self.started = time.monotonic()
        self._stall_until: float | None = None


def _responses():
    from server.protogen.inference import grpc_service_pb2 as pb

    resp = pb.ModelInferResponse(model_name="dummy", id="")
    out = resp.outputs.add()
    out.name = "output__0"
    out.datatype = "FP32"
    out.shape.extend([1, 1])
    resp.raw_output_contents.append(b"\x00\x00\x80\x3f")
    stream_resp = pb.ModelStreamInferResponse(infer_response=resp)
    return resp.SerializeToString(), stream_resp.SerializeToString()


def make_handler(b: DummyBehaviour) -> grpc.GenericRpcHandler:
    from server.protogen.inference import grpc_service_pb2 as pb
    from server.protogen.inference import model_config_pb2 as mc

    infer_bytes, stream_bytes = _responses()

    async def _gate() -> str | None:
        """Applies stall/delay; returns an error message if this request must fail."""
        b.count += 1
        n = b.count
        if b.stall_after is not None and b._stall_until is None:
            if time.monotonic() - b.started >= b.stall_after:
                b._stall_until = time.monotonic() + b.stall
        if b._stall_until is not None:
            wait = b._stall_until - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        if b.delay:
            await asyncio.sleep(b.delay)
        if b.fail_every and n % b.fail_every == 0:
            return f"request {n} rejected by dummy server"
        return None

    async def model_infer(request: bytes, context) -> bytes:
        err = await _gate()
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        return infer_bytes

    async def model_stream_infer(request_iterator, context):
        async for _ in request_iterator:
            err = await _gate()
            if err is not None:
                yield pb.ModelStreamInferResponse(error_message=err).SerializeToString()
            else:
                yield stream_bytes

    async def model_metadata(request: bytes, context) -> bytes:
        req = pb.ModelMetadataRequest.FromString(request)
        md = pb.ModelMetadataResponse(name=req.name or "dummy", versions=["1"], platform="dummy")
        t = md.inputs.add()
        t.name, t.datatype = "input__0", "FP32"
        t.shape.extend(b.input_shape)
        o = md.outputs.add()
        o.name, o.datatype = "output__0", "FP32"
        o.shape.extend([-1, 1])
        return md.SerializeToString()

    async def model_config(request: bytes, context) -> bytes:
        # Enough of a config for perf_analyzer: batching on dim 0, one FP32 input/output.
        req = pb.ModelConfigRequest.FromString(request)
        cfg = pb.ModelConfigResponse()
        c = cfg.config
        c.name, c.platform, c.backend = req.name or "dummy", "dummy", "dummy"
        batched = len(b.input_shape) > 0 and b.input_shape[0] == -1
        c.max_batch_size = 64 if batched else 0
        i = c.input.add()
        i.name, i.data_type = "input__0", mc.TYPE_FP32
        i.dims.extend(b.input_shape[1:] if batched else b.input_shape)
        o = c.output.add()
        o.name, o.data_type = "output__0", mc.TYPE_FP32
        o.dims.extend([1])
        return cfg.SerializeToString()

    async def server_ok(request: bytes, context) -> bytes:
        return b"\x08\x01"  # ServerLive/ServerReady/ModelReady: {live|ready: true}

    async def server_metadata(request: bytes, context) -> bytes:
        return pb.ServerMetadataResponse(name="dummy", version="2.51.0").SerializeToString()

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ModelConfig": grpc.unary_unary_rpc_method_handler(model_config),
            "ServerLive": grpc.unary_unary_rpc_method_handler(server_ok),
            "ServerReady": grpc.unary_unary_rpc_method_handler(server_ok),
            "ModelReady": grpc.unary_unary_rpc_method_handler(server_ok),
            "ServerMetadata": grpc.unary_unary_rpc_method_handler(server_metadata),
            "ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(model_stream_infer),
            "ModelMetadata": grpc.unary_unary_rpc_method_handler(model_metadata),
        },
    )


async def start(behaviour: DummyBehaviour | None = None, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Start on 127.0.0.1:port (0 = any free port); returns (server, bound port)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((make_handler(behaviour or DummyBehaviour()),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


class DummyProcess:
    """`python -m loadtest.dummy_server` in a subprocess on a free loopback port (``args``: its knobs,
    e.g. ``"--delay-ms", "2"``); ``target`` is its grpc:// address once started."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.dummy_server", "--port", "0", *args],
            cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"dummy server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.target = f"grpc://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "DummyProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--stall-after-s", type=float, default=None)
    ap.add_argument("--stall-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    b = DummyBehaviour(
        delay_ms=args.delay_ms, fail_every=args.fail_every, stall_after_s=args.stall_after_s, stall_ms=args.stall_ms
    )

    async def serve() -> None:
        server, port = await start(b, args.port)
        print(f"PORT {port}", flush=True)
        await server.wait_for_termination()

    try:
        import uvloop

        uvloop.run(serve())
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
