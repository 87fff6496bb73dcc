"""KServe v2 REST bodies <-> the Open Inference Protocol protobufs the data plane speaks.

Requests come as JSON (tensor ``data`` in the body) or with Triton's binary tensor extension
(``Inference-Header-Content-Length``: a JSON header, then each input's raw bytes in order, sized by
its ``parameters.binary_data_size``). Either way they become one ``ModelInferRequest`` whose
``raw_input_contents`` carries every input, so validation and forwarding are the gRPC path's.
Triton's ``ModelInferResponse`` goes back as JSON ``data`` or as binary outputs appended after
the JSON header (``binary_data`` per output, ``binary_data_output`` for the whole request).

Binary tensors stay bytes end to end (slices of the body in, ``raw_output_contents`` out). JSON
tensors are the one place a Python list exists, and it is turned into numpy in one step.
The KServe v1 convenience form (``{"instances": [...]}`` -> ``{"predictions": [...]}``) is
mapped through the model's signature onto the same request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from server.dataplane.codecs import CONTENTS_FIELD, deserialize_bytes, from_numpy, is_known, numpy_dtype, to_numpy
from server.transports import limits
from server.errors import InvalidRequest, Violation
from server.protogen.inference import grpc_service_pb2 as pb
from server.dataplane.signature import ModelSignature
from server.dataplane.codecs import serialize_bytes
from google.protobuf import json_format

HEADER_LENGTH = "Inference-Header-Content-Length"
_INT64 = (-(1 << 63), (1 << 63) - 1)
# parameters the HTTP transport consumes itself; never forwarded to Triton
_HTTP_ONLY_REQUEST = frozenset({"binary_data_output"})
_HTTP_ONLY_INPUT = frozenset({"binary_data_size"})
_HTTP_ONLY_OUTPUT = frozenset({"binary_data"})


def _bad(field_name: str, description: str) -> InvalidRequest:
    return InvalidRequest(f"{field_name}: {description}", [Violation(field_name, description)])


# ---- JSON ------------------------------------------------------------------------------------


def loads(body: bytes | memoryview, what: str = "request body") -> object:
    """Parse a JSON body; anything that is not JSON is an InvalidRequest, never a crash."""
    data = bytes(body)
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _bad(what, f"not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None
    limits.check_json(data, document)  # a lone surrogate escape ("\ud800"): 400 naming where, not a crash later
    return document


def dumps(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(where, f"expected a JSON object, got {_json_type(value)}")
    return value


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _string(value, where: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise _bad(where, f"expected a string, got {_json_type(value)}")
    return value


def _int64(value, where: str) -> int:
    if type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
        raise _bad(where, f"expected a 64-bit integer, got {value!r:.40}")
    return value


def _shape(value, where: str) -> list[int]:
    if not isinstance(value, list):
        raise _bad(where, f"expected an array of integers, got {_json_type(value)}")
    return [_int64(d, f"{where}[{i}]") for i, d in enumerate(value)]


def _set_parameters(target, parameters, where: str, skip: frozenset[str]) -> None:
    """Copy a JSON parameters object into a protobuf map<string, InferParameter>."""
    if parameters is None:
        return
    for key, value in _object(parameters, where).items():
        if key in skip:
            continue
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = _int64(value, f"{where}.{key}")
        elif isinstance(value, float):
            param.double_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise _bad(f"{where}.{key}", f"expected a boolean, number or string, got {_json_type(value)}")


def _parameters_json(parameters) -> dict:
    out = {}
    for key, param in parameters.items():
        kind = param.WhichOneof("parameter_choice")
        if kind is not None:
            out[key] = getattr(param, kind)
    return out


# ---- tensors: JSON data <-> numpy ------------------------------------------------------------

_KINDS = {"b": "BOOL", "i": "int", "u": "int", "f": "float"}


def json_array(data, datatype: str, where: str) -> np.ndarray:
    """A JSON tensor (flat or nested list) as a numpy array of ``datatype``, nesting kept as shape.

    Element types are checked (numbers for numeric tensors, integers within range for integer
    tensors, booleans for BOOL, strings for BYTES); the element count is not, the data plane's
    validation compares it with the declared shape like it does for gRPC.
    """
    if not isinstance(data, list):
        raise _bad(where, f"expected an array, got {_json_type(data)}")
    if datatype == "BYTES":
        array = _nested(data, object, where)
        flat = array.reshape(-1)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise _bad(where, f"BYTES elements must be strings, element {i} is {_json_type(item)}")
        return array
    if not is_known(datatype):
        raise _bad(where, f"unknown datatype {datatype!r}")
    if datatype == "BF16":
        raise _bad(where, "BF16 tensors must be sent as binary data (binary_data_size)")
    dtype = numpy_dtype(datatype)
    array = _nested(data, None, where)
    if array.size == 0:
        return array.astype(dtype)
    kind = _KINDS.get(array.dtype.kind)
    want = "BOOL" if dtype.kind == "b" else ("int" if dtype.kind in "iu" else "float")
    if kind is None or (kind != want and not (want == "float" and kind == "int")):
        expected = {"BOOL": "booleans", "int": "integers", "float": "numbers"}[want]
        raise _bad(where, f"{datatype} data must be {expected}, got {_describe_kind(array)}")
    if want == "int":
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise _bad(where, f"values out of range for {datatype} [{info.min}, {info.max}]")
    with np.errstate(over="ignore"):
        return array.astype(dtype, copy=False)


def _nested(data: list, dtype, where: str) -> np.ndarray:
    try:
        return np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise _bad(where, f"not a rectangular array of scalars ({str(err)[:120]})") from None


def _describe_kind(array: np.ndarray) -> str:
    return {"U": "strings", "O": "mixed or non-scalar values", "b": "booleans", "f": "non-integer numbers"}.get(
        array.dtype.kind, str(array.dtype)
    )


def raw_to_json(raw: bytes, datatype: str, where: str) -> list:
    """A tensor's raw bytes as a flat JSON list (row-major, like Triton's JSON outputs)."""
    if datatype == "BYTES":
        try:
            return [item.decode() for item in deserialize_bytes(raw)]
        except UnicodeDecodeError:
            raise _bad(where, "BYTES output is not UTF-8; request it with binary_data") from None
    if datatype == "BF16" or not is_known(datatype):
        raise _bad(where, f"{datatype} output cannot be sent as JSON; request it with binary_data")
    return np.frombuffer(raw, dtype=numpy_dtype(datatype)).tolist()


# ---- v2 infer request ------------------------------------------------------------------------


@dataclass
class OutputPlan:
    """Which outputs go back as binary: per requested output, else the request-wide default."""

    default_binary: bool = False
    binary: dict[str, bool] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


def header_length(value: str | None, body_length: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header: where the JSON header ends."""
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        length = -1
    if not 0 <= length <= body_length:
        raise _bad(HEADER_LENGTH, f"expected an integer in 0..{body_length} (the body's length), got {value!r:.40}")
    return length


def decode_infer_request(
    body: bytes, header_len: int | None, model_name: str, model_version: str = ""
) -> tuple[pb.ModelInferRequest, OutputPlan]:
    """A KServe v2 REST infer body (JSON, or JSON + binary tensors) as a ModelInferRequest."""
    view = memoryview(body)
    split = len(view) if header_len is None else header_len
    doc = _object(loads(view[:split]), "request body")
    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version)
    request.id = _string(doc.get("id"), "id")
    _set_parameters(request.parameters, doc.get("parameters"), "parameters", _HTTP_ONLY_REQUEST)
    plan = OutputPlan(default_binary=_flag(doc.get("parameters"), "binary_data_output", "parameters"))

    inputs = doc.get("inputs", [])
    if not isinstance(inputs, list):
        raise _bad("inputs", f"expected an array, got {_json_type(inputs)}")
    offset = split
    for index, item in enumerate(inputs):
        where = f"inputs[{index}]"
        item = _object(item, where)
        tensor = request.inputs.add()
        tensor.name = _string(item.get("name"), f"{where}.name")
        tensor.datatype = _string(item.get("datatype"), f"{where}.datatype")
        tensor.shape.extend(_shape(item.get("shape", []), f"{where}.shape"))
        params = item.get("parameters")
        _set_parameters(tensor.parameters, params, f"{where}.parameters", _HTTP_ONLY_INPUT)
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            size = _int64(size, f"{where}.parameters.binary_data_size")
            if "data" in item:
                raise _bad(where, "give either data or parameters.binary_data_size, not both")
            if size < 0 or offset + size > len(view):
                raise _bad(
                    f"{where}.parameters.binary_data_size",
                    f"{size} bytes do not fit in the {len(view) - offset} binary bytes left in the body",
                )
            request.raw_input_contents.append(bytes(view[offset : offset + size]))
            offset += size
        elif "data" in item:
            array = json_array(item["data"], tensor.datatype, f"{where}.data")
            request.raw_input_contents.append(from_numpy(array.reshape(-1))[2])
        else:
            raise _bad(where, f"input '{tensor.name}' has neither data nor parameters.binary_data_size")
    if offset != len(view):
        raise _bad(
            HEADER_LENGTH,
            f"{len(view) - offset} bytes after the JSON header are not claimed by any input's binary_data_size",
        )

    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list):
        raise _bad("outputs", f"expected an array, got {_json_type(outputs)}")
    for index, item in enumerate(outputs):
        where = f"outputs[{index}]"
        item = _object(item, where)
        output = request.outputs.add(name=_string(item.get("name"), f"{where}.name"))
        _set_parameters(output.parameters, item.get("parameters"), f"{where}.parameters", _HTTP_ONLY_OUTPUT)
        flag = _flag(item.get("parameters"), "binary_data", f"{where}.parameters", default=None)
        if flag is not None:
            plan.binary[output.name] = flag
    return request, plan


def _flag(parameters, key: str, where: str, default: bool | None = False) -> bool | None:
    if not isinstance(parameters, dict) or key not in parameters:
        return default
    value = parameters[key]
    if not isinstance(value, bool):
        raise _bad(f"{where}.{key}", f"expected a boolean, got {_json_type(value)}")
    return value


# ---- v2 infer response -----------------------------------------------------------------------


def output_raw(response: pb.ModelInferResponse, index: int) -> bytes:
    """Output ``index``'s bytes, from raw_output_contents or (rarely) typed contents."""
    if response.raw_output_contents:
        return response.raw_output_contents[index]
    out = response.outputs[index]
    if out.datatype == "BYTES":
        return serialize_bytes(out.contents.bytes_contents)
    field_name = CONTENTS_FIELD.get(out.datatype)
    values = getattr(out.contents, field_name) if field_name else ()
    return np.asarray(values, dtype=numpy_dtype(out.datatype)).tobytes()


def encode_infer_response(raw: bytes, plan: OutputPlan) -> tuple[bytes, int | None]:
    """Triton's ModelInferResponse bytes as a v2 REST body; the header length when binary follows."""
    response = pb.ModelInferResponse.FromString(raw)
    outputs, blobs = [], []
    for index, out in enumerate(response.outputs):
        entry: dict = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        params = _parameters_json(out.parameters)
        data = output_raw(response, index)
        if plan.is_binary(out.name):
            params["binary_data_size"] = len(data)
            blobs.append(data)
        else:
            entry["data"] = raw_to_json(data, out.datatype, f"outputs[{index}] ('{out.name}')")
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    doc: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    params = _parameters_json(response.parameters)
    if params:
        doc["parameters"] = params
    doc["outputs"] = outputs
    header = dumps(doc)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


# ---- KServe v1 convenience form --------------------------------------------------------------


def decode_instances(body: bytes, signature: ModelSignature, model_version: str = "") -> list[pb.ModelInferRequest]:
    """``{"instances": [...]}`` as ModelInferRequests: one batched request, or one per instance
    when the model takes no batch dimension (``max_batch_size`` 0).

    A single-input model takes each instance as that input's row; otherwise each instance is an
    object input name -> row. Shapes come from the rows, so a short row fails the data plane's
    validation exactly as a short gRPC tensor does.
    """
    doc = _object(loads(body), "request body")
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        raise _bad("instances", f"expected a non-empty array, got {_json_type(instances)}")
    if all(isinstance(row, dict) for row in instances):
        names = list(dict.fromkeys(name for row in instances for name in row))
    elif len(signature.inputs) == 1:
        (only,) = signature.inputs
        names, instances = [only], [{only: row} for row in instances]
    else:
        raise _bad(
            "instances",
            f"model '{signature.name}' takes {len(signature.inputs)} inputs {sorted(signature.inputs)}: "
            "each instance must be an object input name -> row",
        )
    for i, row in enumerate(instances):
        missing = [name for name in names if name not in row]
        if missing:
            raise _bad(f"instances[{i}]", f"missing {missing} (other instances give them)")
    groups = [instances] if signature.max_batch_size > 0 else [[row] for row in instances]
    requests = []
    for group in groups:
        request = pb.ModelInferRequest(model_name=signature.name, model_version=model_version)
        for name in names:
            tensor = request.inputs.add(name=name)
            spec = signature.inputs.get(name)
            if spec is None:  # the data plane's validation names the unknown input
                request.raw_input_contents.append(b"")
                continue
            rows = [row[name] for row in group]
            array = json_array(rows if signature.max_batch_size > 0 else rows[0], spec.datatype, f"instances[].{name}")
            tensor.datatype = spec.datatype
            tensor.shape.extend(array.shape)
            request.raw_input_contents.append(from_numpy(array)[2])
        requests.append(request)
    return requests


def encode_predictions(raws: list[bytes], batched: bool) -> list:
    """Triton's responses as KServe v1 predictions: one per instance, a row (single output) or
    an object output name -> row."""
    predictions: list = []
    for raw in raws:
        response = pb.ModelInferResponse.FromString(raw)
        arrays = {}
        for index, out in enumerate(response.outputs):
            array = to_numpy(output_raw(response, index), out.datatype, list(out.shape))
            if out.datatype == "BYTES":
                array = np.vectorize(lambda b: b.decode(errors="replace"), otypes=[object])(array)
            arrays[out.name] = array if batched else array[np.newaxis]
        count = len(next(iter(arrays.values()))) if arrays else 0
        if len(arrays) == 1:
            predictions.extend(next(iter(arrays.values())).tolist())
        else:
            predictions.extend({name: a[i].tolist() for name, a in arrays.items()} for i in range(count))
    return predictions


# ---- metadata --------------------------------------------------------------------------------


def model_metadata_json(raw: bytes) -> dict:
    meta = pb.ModelMetadataResponse.FromString(raw)

    def tensors(items) -> list[dict]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": tensors(meta.inputs),
        "outputs": tensors(meta.outputs),
    }


def model_config_json(raw: bytes) -> dict:
    """The model config as Triton's REST API shows it: proto field names, 64-bit integers as numbers."""
    config = pb.ModelConfigResponse.FromString(raw).config
    return _numbers(config, json_format.MessageToDict(config, preserving_proto_field_name=True))


def statistics_json(raw: bytes) -> dict:
    """Model statistics as Triton's REST API shows them (``GET /v2/models[/{name}]/stats``)."""
    stats = pb.ModelStatisticsResponse.FromString(raw)
    return _numbers(stats, json_format.MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))


_INT64_TYPES = {3, 4, 6, 16, 18}  # FieldDescriptor TYPE_INT64, UINT64, FIXED64, SFIXED64, SINT64


def _numbers(message, doc: dict) -> dict:
    """Undo json_format's int64-as-string, walking the message's descriptor."""
    for fd in message.DESCRIPTOR.fields:
        key = fd.name
        if key not in doc:
            continue
        value = getattr(message, key)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.message_type is not None:
                doc[key] = {k: _numbers(value[k], doc[key][k]) for k in doc[key]}
            elif value_fd.type in _INT64_TYPES:
                doc[key] = {k: int(v) for k, v in doc[key].items()}
        elif fd.message_type is not None:
            if _is_repeated(fd):
                doc[key] = [_numbers(m, d) for m, d in zip(value, doc[key])]
            else:
                doc[key] = _numbers(value, doc[key])
        elif fd.type in _INT64_TYPES:
            doc[key] = [int(v) for v in doc[key]] if _is_repeated(fd) else int(doc[key])
    return doc


def _is_repeated(fd) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)
    return is_repeated if isinstance(is_repeated, bool) else fd.label == fd.LABEL_REPEATED
