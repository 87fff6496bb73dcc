"""Baselines for the frontend's per-request cost: the least a Python gRPC hop can do.

    python -m loadtest.naive_proxy --port P --mode proxy  --triton HOST:PORT   # forward raw bytes, nothing else
    python -m loadtest.naive_proxy --port P --mode canned --triton HOST:PORT   # answer from memory after one forward

``proxy`` is the naive Python proxy the frontend is measured against (one grpc.aio server hop +
one grpc.aio client call, no parsing, validation, metrics or policy); ``canned`` is a bare grpc.aio
server (the client call happens once, then every request gets the remembered answer).

Knobs for the hop's floor (``loadtest.hop_floor``): ``--loop asyncio`` (default uvloop, as the
frontend), ``--option KEY=VALUE`` (a grpc channel argument, repeatable: on the server and on the
proxy's channel to Triton; an integer value is passed as one), ``--interceptor`` (a pass-through
``grpc.aio.ServerInterceptor``, as the frontend has its DomainErrorInterceptor).
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import uvloop

METHOD = "/inference.GRPCInferenceService/ModelInfer"


class _Forward(grpc.GenericRpcHandler):
    """Every unary method goes to Triton as bytes; ModelInfer may answer from memory (canned)."""

    def __init__(self, channel: grpc.aio.Channel, mode: str):
        self.channel = channel
        self.mode = mode
        self.remembered: list[bytes] = []

    def service(self, handler_call_details):
        method = handler_call_details.method
        forward = self.channel.unary_unary(method)
        canned = self.mode == "canned" and method == METHOD

        async def call(raw: bytes, context) -> bytes:
            if canned and self.remembered:
                return self.remembered[0]
            answer = await forward(raw)
            if canned:
                self.remembered.append(answer)
            return answer

        return grpc.unary_unary_rpc_method_handler(call)


class _PassThrough(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        return await continuation(handler_call_details)


def parse_option(text: str) -> tuple[str, int | str]:
    """``KEY=VALUE`` as a grpc channel argument (an integer value as an int)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, int(value) if value.lstrip("-").isdigit() else value


async def serve(port: int, mode: str, triton: str, options: list[tuple[str, int | str]] = (), interceptor: bool = False) -> None:
    server = grpc.aio.server(options=list(options), interceptors=(_PassThrough(),) if interceptor else None)
    server.add_generic_rpc_handlers((_Forward(grpc.aio.insecure_channel(triton, options=list(options)), mode),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"naive proxy ({mode}) ready on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--mode", choices=("proxy", "canned"), default="proxy")
    ap.add_argument("--triton", required=True, help="HOST:PORT of Triton's gRPC")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--option", type=parse_option, action="append", default=[], help="KEY=VALUE grpc channel argument (repeatable)")
    ap.add_argument("--interceptor", action="store_true", help="a pass-through server interceptor")
    args = ap.parse_args()
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    run(serve(args.port, args.mode, args.triton, args.option, args.interceptor))


if __name__ == "__main__":
    main()
