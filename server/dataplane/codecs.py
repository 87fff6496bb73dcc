"""One dtype table and the tensor codecs: raw bytes <-> numpy, BYTES framing.

Tensors travel as raw little-endian bytes; numpy views them with ``np.frombuffer`` and writes
them with ``tobytes()``. BYTES elements carry a 4-byte little-endian length prefix each. Nothing
here goes through Python lists, and an unknown datatype raises.
"""

from __future__ import annotations

import struct

import numpy as np

from server.errors import InvalidRequest

# wire datatype -> (numpy dtype or None, element size in bytes or None for variable)
_DTYPES: dict[str, tuple[np.dtype | None, int | None]] = {
    "BOOL": (np.dtype(np.bool_), 1),
    "UINT8": (np.dtype("<u1"), 1),
    "UINT16": (np.dtype("<u2"), 2),
    "UINT32": (np.dtype("<u4"), 4),
    "UINT64": (np.dtype("<u8"), 8),
    "INT8": (np.dtype("<i1"), 1),
    "INT16": (np.dtype("<i2"), 2),
    "INT32": (np.dtype("<i4"), 4),
    "INT64": (np.dtype("<i8"), 8),
    "FP16": (np.dtype("<f2"), 2),
    "FP32": (np.dtype("<f4"), 4),
    "FP64": (np.dtype("<f8"), 8),
    "BF16": (None, 2),  # no numpy dtype; passes through as bytes
    "BYTES": (np.dtype(np.object_), None),
}

# Triton model-config enum name -> wire datatype
CONFIG_TO_WIRE: dict[str, str] = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
    "TYPE_BF16": "BF16",
}

# which InferTensorContents field carries each datatype when a caller sends typed contents
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_LEN = struct.Struct("<I")


class UnknownDatatype(InvalidRequest):
    pass


def is_known(datatype: str) -> bool:
    return datatype in _DTYPES


def element_size(datatype: str) -> int | None:
    """Bytes per element, or None for BYTES (variable). Raises for an unknown datatype."""
    try:
        return _DTYPES[datatype][1]
    except KeyError:
        raise UnknownDatatype(f"unknown datatype {datatype!r}") from None


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        dtype = _DTYPES[datatype][0]
    except KeyError:
        raise UnknownDatatype(f"unknown datatype {datatype!r}") from None
    if dtype is None:
        raise UnknownDatatype(f"datatype {datatype} has no numpy equivalent")
    return dtype


def wire_datatype(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    for name, (candidate, _) in _DTYPES.items():
        if candidate is not None and candidate == dtype.newbyteorder("<"):
            return name
    raise UnknownDatatype(f"numpy dtype {dtype} has no wire datatype")


def bytes_element_count(raw: bytes | memoryview) -> int:
    """Count the elements of a length-prefixed BYTES buffer; raise if the framing is broken."""
    view = memoryview(raw)
    offset, count, end = 0, 0, len(view)
    while offset < end:
        if offset + 4 > end:
            raise InvalidRequest(f"BYTES framing: {end - offset} trailing bytes cannot hold a 4-byte length")
        (length,) = _LEN.unpack_from(view, offset)
        offset += 4 + length
        if offset > end:
            raise InvalidRequest(f"BYTES framing: element {count} claims {length} bytes, past the end")
        count += 1
    return count


def serialize_bytes(items) -> bytes:
    parts = []
    for item in items:
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(raw: bytes) -> list[bytes]:
    view, out, offset = memoryview(raw), [], 0
    while offset < len(view):
        (length,) = _LEN.unpack_from(view, offset)
        out.append(bytes(view[offset + 4 : offset + 4 + length]))
        offset += 4 + length
    return out


def to_numpy(raw: bytes, datatype: str, shape) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(deserialize_bytes(raw), dtype=np.object_).reshape(shape)
    return np.frombuffer(raw, dtype=numpy_dtype(datatype)).reshape(shape)


def output_arrays(response) -> dict[str, np.ndarray]:
    """A ModelInferResponse's outputs sent as raw contents, by name."""
    out = {}
    for i, tensor in enumerate(response.outputs):
        if i < len(response.raw_output_contents):
            out[tensor.name] = to_numpy(response.raw_output_contents[i], tensor.datatype, list(tensor.shape))
    return out


def from_numpy(array: np.ndarray) -> tuple[str, list[int], bytes]:
    datatype = wire_datatype(array.dtype)
    if datatype == "BYTES":
        return datatype, list(array.shape), serialize_bytes(array.reshape(-1))
    return datatype, list(array.shape), np.ascontiguousarray(array, dtype=numpy_dtype(datatype)).tobytes()
