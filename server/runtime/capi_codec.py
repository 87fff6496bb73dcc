"""Pure conversions for the in-process Triton: its JSON answers -> the OIP protobuf messages Triton's
gRPC frontend would send, OIP requests -> what goes into a ``TRITONSERVER_InferenceRequest``, and
``TRITONSERVER_Error`` codes -> the domain errors of ``server.errors``.

Each conversion follows what Triton 2.51's own gRPC frontend does with the same JSON
(``src/grpc/grpc_server.cc``, ``infer_handler.cc`` in triton-inference-server/server r24.10), so a
caller cannot tell an in-process answer from a remote one. Nothing here touches the C library.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from server.dataplane.wire import tag, varint
from server.dataplane.backend_errors import backend_error, stub_died
from server.errors import InferplaneError, InvalidRequest, Unimplemented
from server.protogen.inference import grpc_service_pb2 as pb

# ---- errors -----------------------------------------------------------------------------------

# TRITONSERVER_Error_Code -> the gRPC status Triton's frontend answers with (GrpcStatusUtil::Create)
_GRPC_OF_CODE = {
    0: grpc.StatusCode.UNKNOWN,
    1: grpc.StatusCode.INTERNAL,
    2: grpc.StatusCode.NOT_FOUND,
    3: grpc.StatusCode.INVALID_ARGUMENT,
    4: grpc.StatusCode.UNAVAILABLE,
    5: grpc.StatusCode.UNIMPLEMENTED,
    6: grpc.StatusCode.ALREADY_EXISTS,
    7: grpc.StatusCode.CANCELLED,
}


def grpc_code(code: int) -> grpc.StatusCode:
    return _GRPC_OF_CODE.get(int(code), grpc.StatusCode.UNKNOWN)


def domain_error(code: int, message: str) -> InferplaneError:
    """The domain error for a Triton error: what the remote Triton's status for it translates to."""
    return backend_error(grpc_code(code), message)


def is_stub_death(code: int, message: str) -> bool:
    """An INTERNAL error that says the model's Python stub process died (killed, crashed)."""
    return stub_died(grpc_code(code), message)


def parse_version(version: str) -> int:
    """An OIP version string as the C API wants it (-1: the model's version policy decides)."""
    if not version:
        return -1
    try:
        value = int(version)
    except ValueError:
        raise InvalidRequest(f"failed to get model version from specified version string '{version}' (must be integral)") from None
    if value < 0:
        raise InvalidRequest(f"invalid model version '{version}'")
    return value


# ---- JSON answers -> protobuf ------------------------------------------------------------------


def server_metadata(doc: dict) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(name=doc.get("name", ""), version=doc.get("version", ""), extensions=doc.get("extensions", []))


def model_metadata(doc: dict) -> pb.ModelMetadataResponse:
    out = pb.ModelMetadataResponse(name=doc["name"], versions=doc.get("versions", []), platform=doc.get("platform", ""))
    for key, target in (("inputs", out.inputs), ("outputs", out.outputs)):
        for io in doc.get(key, []):
            target.add(name=io["name"], datatype=io["datatype"], shape=io.get("shape", []))
    return out


def _full_protos():
    """Triton's own complete ``inference.*`` messages (tritonclient's generated code, in protobuf's
    default pool; the project's protogen is a subset in a pool of its own). Answers are built with
    them, so their bytes carry every field the remote Triton's frontend sends (a config's
    ``optimization``, the statistics' ``memory_usage`` and ``response_stats``, ...)."""
    return service_pb2


def model_config_bytes(doc: dict) -> bytes:
    """The serialized ModelConfigResponse (Triton's JSON read as its gRPC frontend reads it)."""
    full = _full_protos().ModelConfigResponse()
    json_format.ParseDict({"config": doc}, full, ignore_unknown_fields=True)
    return full.SerializeToString()


def model_config(doc: dict) -> pb.ModelConfigResponse:
    """The project's ModelConfigResponse (fields it does not declare stay as unknown fields)."""
    return pb.ModelConfigResponse.FromString(model_config_bytes(doc))


def repository_index(doc: list) -> pb.RepositoryIndexResponse:
    out = pb.RepositoryIndexResponse()
    for entry in doc:
        out.models.add(name=entry["name"], version=entry.get("version", ""), state=entry.get("state", ""), reason=entry.get("reason", ""))
    return out


def model_statistics(doc: dict) -> bytes:
    """The serialized ModelStatisticsResponse, with everything Triton's gRPC frontend sends
    (its JSON keys are the proto's field names)."""
    full = _full_protos().ModelStatisticsResponse()
    json_format.ParseDict(doc, full, ignore_unknown_fields=True)
    return full.SerializeToString()


def model_statistics_message(doc: dict) -> pb.ModelStatisticsResponse:
    return pb.ModelStatisticsResponse.FromString(model_statistics(doc))


RAW_OUTPUT_TAG = tag(6, 2)  # ModelInferResponse.raw_output_contents


def raw_output_field(data) -> list:
    """The wire pieces of one ``raw_output_contents`` entry (tag, length, the data itself)."""
    return [RAW_OUTPUT_TAG, varint(len(data)), data]


# ---- OIP request -> C API request ---------------------------------------------------------------

FLAG_SEQUENCE_START, FLAG_SEQUENCE_END = 1, 2
RESERVED_PARAMETERS = ("triton_enable_empty_final_response",)

_CONTENTS_DTYPES = {
    "BOOL": ("bool_contents", np.bool_),
    "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "INT8": ("int_contents", np.int8),
    "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
}


@dataclass(slots=True)
class Tensor:
    """One input: its data as one or more buffers Triton reads in order (no copy is made)."""

    name: str
    datatype: str
    shape: list[int]
    chunks: list  # bytes-like objects


@dataclass(slots=True)
class RequestPlan:
    """Everything one ``TRITONSERVER_InferenceRequest`` is built from."""

    model_name: str
    model_version: int
    id: str = ""
    flags: int = 0
    correlation_id: int | str | None = None
    priority: int | None = None
    timeout_us: int | None = None
    parameters: list[tuple[str, object]] = field(default_factory=list)  # (key, bool | int | str | float)
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    empty_final_response: bool = False


def _choice(param: pb.InferParameter) -> str | None:
    return param.WhichOneof("parameter_choice")


def request_plan(request: pb.ModelInferRequest) -> RequestPlan:
    """What Triton's gRPC frontend would put into the C request (SetInferenceRequestMetadata and
    InferGRPCToInput), with its error messages; ``raw_input_contents`` are used as they are."""
    plan = RequestPlan(request.model_name, parse_version(request.model_version), request.id)
    for key, param in request.parameters.items():
        kind = _choice(param)
        if key == "sequence_id":
            if kind == "int64_param":
                plan.correlation_id = param.int64_param
            elif kind == "string_param":
                plan.correlation_id = param.string_param
            else:
                raise InvalidRequest("invalid value type for 'sequence_id' parameter, expected int64_param or string_param.")
        elif key in ("sequence_start", "sequence_end"):
            if kind != "bool_param":
                raise InvalidRequest(f"invalid value type for '{key}' parameter, expected bool_param.")
            if param.bool_param:
                plan.flags |= FLAG_SEQUENCE_START if key == "sequence_start" else FLAG_SEQUENCE_END
        elif key == "priority":
            if kind == "int64_param":
                if param.int64_param < 0:
                    raise InvalidRequest("invalid value for 'priority', expected value >= 0.")
                plan.priority = param.int64_param
            elif kind == "uint64_param":
                plan.priority = param.uint64_param
            else:
                raise InvalidRequest("invalid value type for 'priority' parameter, expected int64_param or uint64_param.")
        elif key == "timeout":
            if kind != "int64_param":
                raise InvalidRequest("invalid value type for 'timeout' parameter, expected int64_param.")
            plan.timeout_us = param.int64_param
        elif key.startswith("triton_"):
            if key not in RESERVED_PARAMETERS:
                raise InvalidRequest(
                    "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
                    "starting with 'triton_' are allowed: " + " ".join(RESERVED_PARAMETERS)
                )
            if kind != "bool_param":
                raise InvalidRequest(f"invalid value type for '{key}' parameter, expected bool_param.")
            plan.empty_final_response = param.bool_param
        elif kind in ("int64_param", "bool_param", "string_param", "double_param"):
            plan.parameters.append((key, getattr(param, kind)))
        else:
            raise InvalidRequest(f"invalid value type for '{key}' parameter, expected int64_param, bool_param, or string_param.")

    raw = request.raw_input_contents
    index = 0
    for tensor in request.inputs:
        if "shared_memory_region" in tensor.parameters:
            raise InvalidRequest(f"input '{tensor.name}': shared-memory inputs are not supported by the in-process Triton")
        if tensor.HasField("contents"):
            if len(raw):
                raise InvalidRequest(
                    f"contents field must not be specified when using raw_input_contents for '{tensor.name}' for model '{request.model_name}'"
                )
            data = contents_bytes(tensor)
        elif index < len(raw):
            data = raw[index]
            index += 1
        else:
            raise InvalidRequest(f"unable to find data for input tensor '{tensor.name}' for model '{request.model_name}' in request.")
        plan.inputs.append(Tensor(tensor.name, tensor.datatype, list(tensor.shape), [data]))
    for out in request.outputs:
        if "classification" in out.parameters:
            raise Unimplemented(f"output '{out.name}': classification outputs are not supported by the in-process Triton")
        if "shared_memory_region" in out.parameters:
            raise InvalidRequest(f"output '{out.name}': shared-memory outputs are not supported by the in-process Triton")
        plan.outputs.append(out.name)
    return plan


def contents_bytes(tensor) -> bytes:
    """A tensor sent as typed ``contents`` as the raw bytes Triton reads (little-endian, BYTES
    elements with a 4-byte length prefix), the way Triton's gRPC frontend serializes them."""
    contents = tensor.contents
    if tensor.datatype == "BYTES":
        return b"".join(struct.pack("<I", len(item)) + item for item in contents.bytes_contents)
    spec = _CONTENTS_DTYPES.get(tensor.datatype)
    if spec is None:
        raise InvalidRequest(f"input '{tensor.name}': datatype {tensor.datatype} cannot be sent as contents")
    name, dtype = spec
    return np.asarray(getattr(contents, name), dtype=dtype).tobytes()
