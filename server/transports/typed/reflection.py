"""gRPC server reflection (``grpc.reflection.v1alpha.ServerReflection``) that also lists the typed
services, which come and go at deploy time.

grpc_reflection's own servicer takes a fixed tuple of names and one descriptor pool; here the
fixed services answer from the generated code's pool (``server.protogen._pool.POOL``) and each
typed service from its own pool. A caller sees the typed services of the models granted to it
(with auth off: all); listing never fails on a bad key, it only leaves them out.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc

from server.errors import InferplaneError
from server.transports.grpc.inference import call_context
from server.transports.typed.service import TypedServices


class TypedReflection(reflection_pb2_grpc.ServerReflectionServicer):
    def __init__(self, service_names, pool, services: TypedServices):
        self._names = tuple(sorted(service_names))
        self._pool = pool
        self._services = services

    def _typed_pools(self, context) -> list:
        """The pools of the typed services this caller may see, after picking up newly loaded models."""
        self._services.sync()
        built = self._services.built()
        try:
            visible = set(self._services.dp.visible(call_context(context), sorted({b.schema.model for b in built})))
        except InferplaneError:  # no or a bad key: reflection shows only the fixed services
            return []
        return [b for b in built if b.schema.model in visible]

    async def ServerReflectionInfo(self, request_iterator, context):
        async for request in request_iterator:
            yield self._answer(request, context)

    def _answer(self, request, context) -> rpb.ServerReflectionResponse:
        kind = request.WhichOneof("message_request")
        if kind == "list_services":
            names = sorted({*self._names, *(b.schema.service for b in self._typed_pools(context))})
            return rpb.ServerReflectionResponse(
                list_services_response=rpb.ListServiceResponse(service=[rpb.ServiceResponse(name=n) for n in names]),
                original_request=request,
            )
        if kind in ("file_by_filename", "file_containing_symbol"):
            value = getattr(request, kind)
            lookup = "FindFileByName" if kind == "file_by_filename" else "FindFileContainingSymbol"
            for pool in [b.pool for b in self._typed_pools(context)] + [self._pool]:
                try:
                    return _files(getattr(pool, lookup)(value), request)
                except KeyError:
                    continue
            return _error(request, grpc.StatusCode.NOT_FOUND, f"{value} not found")
        if kind == "file_containing_extension":
            ext = request.file_containing_extension
            try:
                message = self._pool.FindMessageTypeByName(ext.containing_type)
                extension = self._pool.FindExtensionByNumber(message, ext.extension_number)
                return _files(self._pool.FindFileContainingSymbol(extension.full_name), request)
            except KeyError:
                return _error(request, grpc.StatusCode.NOT_FOUND, "extension not found")
        if kind == "all_extension_numbers_of_type":
            try:
                message = self._pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
            except KeyError:  # typed messages have no extensions either
                return _error(request, grpc.StatusCode.NOT_FOUND, "type not found")
            numbers = sorted(e.number for e in self._pool.FindAllExtensions(message))
            return rpb.ServerReflectionResponse(
                all_extension_numbers_response=rpb.ExtensionNumberResponse(base_type_name=message.full_name, extension_number=numbers),
                original_request=request,
            )
        return _error(request, grpc.StatusCode.INVALID_ARGUMENT, "unknown reflection request")


def _files(file_descriptor, request) -> rpb.ServerReflectionResponse:
    """The file and everything it imports, serialized."""
    seen: dict[str, object] = {}
    stack = [file_descriptor]
    while stack:
        fd = stack.pop()
        if fd.name in seen:
            continue
        seen[fd.name] = fd
        stack.extend(fd.dependencies)
    protos = []
    for fd in seen.values():
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        protos.append(proto.SerializeToString())
    return rpb.ServerReflectionResponse(
        file_descriptor_response=rpb.FileDescriptorResponse(file_descriptor_proto=protos), original_request=request
    )


def _error(request, code: grpc.StatusCode, message: str) -> rpb.ServerReflectionResponse:
    return rpb.ServerReflectionResponse(
        error_response=rpb.ErrorResponse(error_code=code.value[0], error_message=message), original_request=request
    )
