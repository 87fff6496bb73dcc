"""Protobuf wire helpers for requests the data plane passes on as bytes: varints, tags, a field read
without parsing the message, fields overridden by appending them (a parser keeps a scalar's last
occurrence). The only varint code outside the generated modules."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (an int64 negative: ten bytes of two's complement, as protobuf writes it)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_varint(raw: bytes, i: int) -> tuple[int, int]:
    """The varint at ``raw[i:]`` and the offset after it (IndexError when it is cut off)."""
    shift = result = 0
    while True:
        byte = raw[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def request_model(raw: bytes) -> str:
    """Field 1 (``model_name`` / ``name``) of a serialized request, read without parsing the rest
    (its last occurrence, as a parser keeps: ``rename`` appends one)."""
    i, n = 0, len(raw)
    name = None
    try:
        while i < n:
            key, i = read_varint(raw, i)
            field_number, wire = key >> 3, key & 7
            if wire == 2:
                length, i = read_varint(raw, i)
                if field_number == 1:
                    name = raw[i : i + length]
                i += length
            elif wire == 0:
                _, i = read_varint(raw, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            else:
                return ""
    except IndexError:
        return ""
    return "" if name is None else name.decode("utf-8", "replace")


def pin_version(raw: bytes, version: str) -> bytes:
    """The same ModelInferRequest with ``model_version`` (field 2) set, without re-serializing it."""
    data = version.encode()
    return raw + b"\x12" + varint(len(data)) + data


def rename(raw: bytes, name: str, version: str = "") -> bytes:
    """The same ModelInferRequest / ModelInferResponse with fields 1 (model_name) and 2
    (model_version) overridden."""
    data = name.encode()
    return pin_version(raw + b"\x0a" + varint(len(data)) + data, version)
