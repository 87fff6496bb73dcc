"""The moving parts of one in-process Triton request: the Python object that lives while Triton
holds the request (``_Call``), Triton's callbacks into Python (``Callbacks``: they run on Triton's
threads and make no C calls; see ``server.runtime.inprocess``), and the answer (``InferResult``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime import capi, capi_codec
from server.runtime.capi import ffi
from server.runtime.capi_codec import RequestPlan

if TYPE_CHECKING:
    import asyncio
    import collections

    from server.errors import InferplaneError

FINAL_PARAMETER = "triton_final_response"
CPU = capi.MEMORY_CPU

# an uninitialized bytes object for Triton to write an output into (the documented way to fill
# a bytes object before anyone sees it); ctypes.pythonapi calls keep the GIL
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


@dataclass(slots=True)
class Output:
    name: str
    datatype: str
    shape: list[int]
    data: bytes  # the buffer Triton wrote (a memoryview slice when Triton used less than it asked for)


@dataclass(slots=True)
class InferResult:
    """One Triton response: what the gRPC frontend puts into a ModelInferResponse."""

    model_name: str
    model_version: str
    id: str
    parameters: dict
    outputs: list[Output]

    def to_message(self) -> pb.ModelInferResponse:
        msg = self._header()
        msg.raw_output_contents.extend(o.data if type(o.data) is bytes else bytes(o.data) for o in self.outputs)
        return msg

    def to_bytes(self) -> bytes:
        """The serialized ModelInferResponse; each output's bytes are copied once."""
        parts = [self._header().SerializeToString()]
        for o in self.outputs:  # field 6 is the message's last: appending it is what protobuf writes
            parts += capi_codec.raw_output_field(o.data)
        return b"".join(parts)

    def _header(self) -> pb.ModelInferResponse:
        msg = pb.ModelInferResponse(model_name=self.model_name, model_version=self.model_version, id=self.id)
        for key, value in self.parameters.items():
            _set_parameter(msg.parameters[key], value)
        for o in self.outputs:
            msg.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
        return msg


def _set_parameter(param: pb.InferParameter, value) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = value


class CallOwner(Protocol):
    """What a call, Triton's callbacks for it and its stream reach on the server that submitted it
    (``server.runtime.inprocess.InProcessTriton``), declared here so that nothing names it back."""

    _loop: asyncio.AbstractEventLoop
    _released: collections.deque[_Call]
    _sweep_posted: bool

    def _on_response(self, call: _Call, response, flags: int) -> None: ...

    def _sweep(self) -> None: ...

    def _submit(self, call: _Call) -> None: ...

    def _cancel(self, call: _Call) -> None: ...

    def _refuse_if_healing(self, model: str) -> None: ...

    def _failure(self, model: str, err: capi.TritonError) -> InferplaneError: ...


class CallStream(Protocol):
    """What the server hands a streamed call's answers to (``server.runtime.inprocess_stream.InProcessStream``)."""

    def _deliver(self, call: _Call, result, final: bool) -> None: ...

    def _abort(self, err: InferplaneError) -> None: ...


class _Call:
    """One Triton request in flight: kept alive (and its ``handle`` valid) until Triton has
    released the request *and* sent its final response."""

    __slots__ = ("owner", "handle", "request", "keep", "buffers", "future", "stream", "plan", "final", "released", "timer")

    def __init__(self, owner: CallOwner, plan: RequestPlan):
        self.owner = owner
        self.handle = ffi.new_handle(self)
        self.request = None  # the C request, until deleted after its release
        self.keep: list = []  # the input buffers Triton reads
        self.buffers: dict[int, bytes] = {}  # output storage, by the index given to Triton as buffer_userp
        self.future: asyncio.Future | None = None
        self.stream: CallStream | None = None
        self.plan = plan
        self.final = False
        self.released = False
        self.timer = None


class Callbacks:
    """The C callbacks, created once per process; they run on Triton's threads and make no C calls."""

    def __init__(self, library: capi.Library):
        lib = library.lib
        internal = capi.ErrorCode.INTERNAL

        @ffi.callback("TRITONSERVER_ResponseAllocatorAllocFn_t")
        def alloc(allocator, name, size, memory_type, memory_type_id, userp, buffer, buffer_userp, actual_type, actual_id):
            try:
                actual_type[0] = CPU
                actual_id[0] = 0
                if size == 0:
                    buffer[0] = ffi.NULL
                    buffer_userp[0] = ffi.NULL
                    return ffi.NULL
                call = ffi.from_handle(userp)
                storage = _new_bytes(None, size)
                index = len(call.buffers) + 1  # 0 would be NULL: "not ours"
                while index in call.buffers:
                    index += 1
                call.buffers[index] = storage
                buffer[0] = ffi.from_buffer(storage)
                buffer_userp[0] = ffi.cast("void*", index)
                return ffi.NULL
            except BaseException as err:  # noqa: BLE001 - must never unwind into C
                return lib.TRITONSERVER_ErrorNew(internal, f"output allocation failed: {err}".encode())

        @ffi.callback("TRITONSERVER_ResponseAllocatorReleaseFn_t")
        def release_buffer(allocator, buffer, buffer_userp, size, memory_type, memory_type_id):
            return ffi.NULL  # the storage is a Python object, referenced by the answer (or dropped with it)

        @ffi.callback("TRITONSERVER_InferenceResponseCompleteFn_t")
        def response(response, flags, userp):
            owner = ffi.from_handle(userp).owner
            try:
                owner._loop.call_soon_threadsafe(owner._on_response, ffi.from_handle(userp), response, flags)
            except RuntimeError:  # the loop is closed: nobody waits for this answer any more
                if response != ffi.NULL:
                    lib.TRITONSERVER_InferenceResponseDelete(response)

        @ffi.callback("TRITONSERVER_InferenceRequestReleaseFn_t")
        def release_request(request, flags, userp):
            call = ffi.from_handle(userp)
            call.released = True
            owner = call.owner
            owner._released.append(call)
            if not owner._sweep_posted:  # one hop for all the requests released meanwhile
                owner._sweep_posted = True
                try:
                    owner._loop.call_soon_threadsafe(owner._sweep)
                except RuntimeError:  # the loop is closed
                    pass

        self.alloc, self.release_buffer, self.response, self.release_request = alloc, release_buffer, response, release_request



def _parameter_value(kind: int, value):
    if kind == capi.PARAMETER_BOOL:
        return bool(ffi.cast("bool*", value)[0])
    if kind == capi.PARAMETER_INT:
        return int(ffi.cast("int64_t*", value)[0])
    if kind == capi.PARAMETER_DOUBLE:
        return float(ffi.cast("double*", value)[0])
    if kind == capi.PARAMETER_STRING:
        return ffi.string(ffi.cast("const char*", value)).decode()
    raise capi.TritonError(capi.ErrorCode.UNSUPPORTED, "Response parameter of type 'TRITONSERVER_PARAMETER_BYTES' is not currently supported")


_callbacks: "Callbacks | None" = None


def callbacks(library: capi.Library) -> "Callbacks":
    """The process's callbacks (created once: their C function pointers must outlive every server)."""
    global _callbacks
    if _callbacks is None:
        _callbacks = Callbacks(library)
    return _callbacks
