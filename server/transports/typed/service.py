"""The typed per-model gRPC services, served dynamically: one generic handler for all of them.

Each served schema (``server.control.typed.typed_catalog``) is built into its own descriptor pool
(a non-breaking change replaces a file of the same name, which one pool could not hold) with
message classes from the message factory, and answers ``/<package>.<Name>Service/Predict`` and
``/PredictBatch`` on raw bytes: the request is decoded straight into tensors
(``server.transports.typed.codec``), goes through ``DataPlane.infer`` — the one pipeline, so
auth, quotas, admission, coalescing and traffic splits apply as to an OIP call — and Triton's
answer is encoded back. As on ModelInfer, a call enters the process's in-flight bound before it
decodes anything (``server.dataplane.loop_gate``), and one with ``inferplane-timing`` metadata gets
its stages in the ``server-timing`` trailer (``server.dataplane.stage_timing``; ``auth`` twice: the
typed check before decode and the pipeline's). The services follow the catalog: it is checked (one integer compare) on
every call, and a call to an unknown typed method first asks it for newly loaded models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool

from server.control.typed.typed_catalog import SchemaCatalog
from server.control.typed.typed_schema import PACKAGE_ROOT, TypedSchema
from server.dataplane.dataplane import DataPlane
from server.dataplane.routing import ARM_HEADER, VERSION_HEADER
from server.dataplane.stage_timing import SERVER_TIMING
from server.errors import BackendError, InferplaneError, InvalidRequest, Violation
from server.protogen.inference import grpc_service_pb2 as pb
from server.transports.grpc.context import abort, call_context
from server.transports.typed.codec import Codec
from server.control.typed import typed_proto

log = logging.getLogger(__name__)

PREFIX = f"/{PACKAGE_ROOT}."


@dataclass
class Built:
    schema: TypedSchema
    pool: descriptor_pool.DescriptorPool
    codec: Codec
    source: object  # the ModelSignature a derived schema came from (None: the registry's)


def build(schema: TypedSchema) -> tuple[descriptor_pool.DescriptorPool, Codec]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(typed_proto.file_descriptor(schema))
    return pool, Codec(schema, pool)


class TypedServices(grpc.GenericRpcHandler):
    def __init__(self, dataplane: DataPlane, catalog: SchemaCatalog):
        self.dp = dataplane
        self.catalog = catalog
        self._built: dict[tuple[str, int], Built] = {}
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self._revision = -1

    # ---- following the catalog ------------------------------------------------------------

    def refresh(self) -> None:
        if self._revision == self.catalog.revision:
            return
        revision = self.catalog.revision
        built: dict[tuple[str, int], Built] = {}
        for schema in self.catalog.served():
            key = (schema.model, schema.major)
            old = self._built.get(key)
            if old is not None and old.schema == schema:
                built[key] = old
                continue
            try:
                pool, codec = build(schema)
            except Exception:  # one bad schema must not take the others down
                log.exception("building the typed API of %s %s failed", schema.model, schema.label)
                continue
            source = None if self.catalog.is_deployed(schema.model) else self.dp.signature(schema.model)
            built[key] = Built(schema, pool, codec, source)
        methods: dict[str, grpc.RpcMethodHandler] = {}
        for b in built.values():
            methods[f"/{b.schema.service}/Predict"] = self._handler(b, batch=False)
            methods[f"/{b.schema.service}/PredictBatch"] = self._handler(b, batch=True)
        self._built, self._methods, self._revision = built, methods, revision

    def sync(self) -> None:
        self.catalog.sync()
        self.refresh()

    def built(self) -> list[Built]:
        self.refresh()
        return list(self._built.values())

    # ---- grpc.GenericRpcHandler -------------------------------------------------------------

    def service(self, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(PREFIX):
            return None
        self.refresh()
        handler = self._methods.get(method)
        if handler is None:
            self.sync()  # a model loaded since: derive its schema now
            handler = self._methods.get(method)
        return handler

    def _handler(self, built: Built, batch: bool) -> grpc.RpcMethodHandler:
        async def call(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                return await self._predict(built, raw, context, batch)
            except InferplaneError as err:
                await abort(context, err)
            except Exception:  # a bug must answer a status, never crash the call's task
                log.exception("typed %s call to %s failed", "PredictBatch" if batch else "Predict", built.schema.model)
                await abort(context, BackendError("internal error in the typed API"))

        return grpc.unary_unary_rpc_method_handler(call)

    async def _predict(self, built: Built, raw: bytes, context, batch: bool) -> bytes:
        with self.dp.admission:  # refused before decode past the process's in-flight bound
            ctx = call_context(context, timed=True)
            timer = ctx.timing  # None unless the caller sent inferplane-timing (server.dataplane.stage_timing)
            answer, n, batched = await self._infer(built, raw, ctx, batch)
        typed = built.codec.encode(pb.ModelInferResponse.FromString(answer[0]), n, batch, batched)
        answered = ((VERSION_HEADER, answer[1]), (ARM_HEADER, answer[2]))  # who answered
        if timer is not None:
            timer.mark("encode")
            answered = (*answered, (SERVER_TIMING, timer.header()))
        context.set_trailing_metadata(answered)
        return typed

    async def _infer(self, built: Built, raw: bytes, ctx, batch: bool):
        """The typed request decoded and sent through the pipeline: ((answer, version, arm), rows, batched)."""
        name = built.schema.model
        if built.source is not None and self.dp.signature(name) is not built.source:
            self.sync()  # the model was reloaded: its schema may have changed (next calls use it)
        self.dp.authorize(ctx, name)  # before decoding: a caller the model is hidden from learns nothing of its fields
        if ctx.timing is not None:
            ctx.timing.mark("auth")  # the pipeline's own auth stage follows: a parsed header sums the two
        arrays, n = built.codec.decode(raw, batch)
        signature = self.dp.signature(name)
        batched = signature is None or signature.max_batch_size > 0
        if signature is not None:
            if not batched and n != 1:
                raise InvalidRequest(f"model '{name}' takes no batch dimension: send one row", [Violation("rows", f"expected 1 row, got {n}")])
            if batched and n > signature.max_batch_size:
                raise InvalidRequest(
                    f"model '{name}' takes at most {signature.max_batch_size} rows per call",
                    [Violation("rows", f"expected 1..{signature.max_batch_size} rows (max_batch_size), got {n}")],
                )
        request = built.codec.infer_request(arrays, batched)
        if ctx.timing is not None:
            ctx.timing.mark("decode")
        return await self.dp.infer(request, None, ctx.timeout, ctx), n, batched
