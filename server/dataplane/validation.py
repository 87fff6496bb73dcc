"""Check an inference request against the model's declared signature, before any Triton call.

Only the header is inspected: names, datatypes, shapes and byte lengths. Tensor contents are
never decoded (BYTES tensors are walked for their length prefixes, nothing more), except the
BYTES inputs a model's signature declares as text (``ModelSignature.text_inputs``: the embedding
model's ``text``, the LLM engine's inputs), whose elements must be UTF-8 — a caller's mistake is
answered here, before any model sees it. Every problem found is reported, each naming the tensor,
the field, what was expected and what came (``server.errors`` caps how much of it is echoed).
"""

from __future__ import annotations

import math
import struct

from server.dataplane.codecs import CONTENTS_FIELD, bytes_element_count
from server.errors import InvalidRequest, Violation
from server.dataplane.signature import ModelSignature, TensorSpec

_MAX_LISTED = 3
_LEN = struct.Struct("<I")


# Triton's own request parameters and the value kinds it takes (the rest are passed to the model);
# Triton refuses others as INTERNAL, after the request reached it, so they are checked here
RESERVED_PARAMETERS = {
    "sequence_id": ("int64_param", "string_param"),
    "sequence_start": ("bool_param",),
    "sequence_end": ("bool_param",),
    "priority": ("int64_param", "uint64_param"),
    "timeout": ("int64_param",),
    "triton_enable_empty_final_response": ("bool_param",),
    "binary_data_output": ("bool_param",),
}


# the LLM engine's priority, set by the frontend from the caller's plan (server.dataplane.generation);
# refused from callers, who would otherwise give themselves the paid tiers' place in the engine's queue
# (model_repository/adapters/_llm_common.py reads it under the same name)
PRIORITY_PARAMETER = "inferplane_priority"
# the LoRA adapter of a generation (``model="base:adapter"``), set by the frontend once the caller's grant
# for it is checked; refused from callers like every other inferplane_ parameter
ADAPTER_PARAMETER = "inferplane_adapter"
FRONTEND_PARAMETER_PREFIX = "inferplane_"

# any other request parameter goes to the model, and Triton takes only these kinds for it
CUSTOM_PARAMETER_KINDS = ("int64_param", "bool_param", "string_param")
# tensor parameters: shared memory is not offered through the frontend (a region is Triton's, not
# the caller's: naming one would read or write memory another tenant registered)
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
TENSOR_PARAMETERS = {"classification": ("int64_param",), "binary_data_size": ("int64_param",), "binary_data": ("bool_param",)}
# tensor parameters that count something (top-k classes, bytes): a negative one reaches Triton as INTERNAL
COUNT_PARAMETERS = ("classification", "binary_data_size")


def _kind(value) -> str | None:
    return value.WhichOneof("parameter_choice")


def check_parameters(request, violations: list[Violation]) -> None:
    """Request and tensor parameters Triton would refuse (as INTERNAL, after the request reached it)."""
    for key, value in request.parameters.items():
        kinds = RESERVED_PARAMETERS.get(key, CUSTOM_PARAMETER_KINDS)
        kind = _kind(value)
        if not key:
            violations.append(Violation("parameters", "a parameter needs a name"))
        elif key.startswith(FRONTEND_PARAMETER_PREFIX):
            violations.append(Violation(f"parameters.{key}", "is set by the frontend, not by callers"))
        elif kind not in kinds:
            violations.append(Violation(f"parameters.{key}", f"expected {' or '.join(kinds)}, got {kind or 'no value'}"))
        elif key in ("priority", "timeout") and kind == "int64_param" and value.int64_param < 0:
            violations.append(Violation(f"parameters.{key}", f"must be >= 0, got {value.int64_param}"))
    for side, tensors in (("inputs", request.inputs), ("outputs", request.outputs)):
        for index, tensor in enumerate(tensors):
            for key, value in tensor.parameters.items():
                where = f"{side}[{index}].parameters.{key}"
                if key in SHARED_MEMORY_PARAMETERS:
                    violations.append(Violation(where, "shared memory is not offered through the frontend; send the tensor's bytes"))
                elif key in TENSOR_PARAMETERS and _kind(value) not in TENSOR_PARAMETERS[key]:
                    violations.append(Violation(where, f"expected {' or '.join(TENSOR_PARAMETERS[key])}, got {_kind(value) or 'no value'}"))
                elif key in COUNT_PARAMETERS and value.int64_param < 0:
                    violations.append(Violation(where, f"must be >= 0, got {value.int64_param}"))


def validate_infer_request(request, signature: ModelSignature) -> None:
    """Raise InvalidRequest (with one Violation per problem) unless the request fits the signature."""
    if _plainly_valid(request, signature):
        return
    violations = infer_request_violations(request, signature)
    if violations:
        _raise(signature, violations)


def _plainly_valid(request, signature: ModelSignature) -> bool:
    """The common request, accepted in one pass with no message built: no request, tensor or output
    parameters, every input in ``raw_input_contents``, known, once, of its declared datatype (not
    BYTES, not text), rank and dims, one batch size within ``max_batch_size``, exactly its bytes; every
    required input present, every output known. True only where :func:`infer_request_violations`
    finds nothing (``tests/unit/test_validation_fast_path.py``); anything else — an error, or merely
    an unusual request — takes that full check, whose messages are unchanged."""
    if request.parameters:
        return False
    raw = request.raw_input_contents
    inputs = request.inputs
    if not raw or len(raw) != len(inputs):
        return False
    specs = signature.inputs
    max_batch = signature.max_batch_size
    text = signature.text_inputs
    batch = None
    seen = set()
    for index, tensor in enumerate(inputs):
        name = tensor.name
        spec = specs.get(name)
        if spec is None or name in seen or name in text or tensor.parameters:
            return False
        seen.add(name)
        size = spec.element_size  # None for BYTES: its framing is the full check's
        if tensor.datatype != spec.datatype or size is None:
            return False
        shape = tensor.shape
        dims = spec.dims
        count = 1
        if max_batch > 0:
            if len(shape) != len(dims) + 1:
                return False
            rows = shape[0]
            if not 1 <= rows <= max_batch or (batch is not None and rows != batch):
                return False
            batch = count = rows
            got = shape[1:]
        else:
            if len(shape) != len(dims):
                return False
            got = shape
        for have, want in zip(got, dims):
            if have < 0 or (want != -1 and have != want):
                return False
            count *= have
        if len(raw[index]) != count * size:
            return False
    if len(seen) < len(signature.required) or not signature.required <= seen:
        return False
    outputs = signature.outputs
    for output in request.outputs:
        if output.name not in outputs or output.parameters:
            return False
    return True


def infer_request_violations(request, signature: ModelSignature) -> list[Violation]:
    """Every problem of the request against the signature (empty: it fits)."""
    violations: list[Violation] = []
    check_parameters(request, violations)
    raw = request.raw_input_contents
    use_raw = len(raw) > 0
    if use_raw and len(raw) != len(request.inputs):
        violations.append(
            Violation(
                "raw_input_contents",
                f"expected {len(request.inputs)} entries, one per input, got {len(raw)}",
            )
        )
        return violations
    seen: set[str] = set()
    batch: int | None = None
    for index, tensor in enumerate(request.inputs):
        spec = signature.inputs.get(tensor.name)
        if spec is None:
            violations.append(
                Violation(
                    f"inputs[{index}].name",
                    f"unknown input '{tensor.name}': model '{signature.name}' takes {sorted(signature.inputs)}",
                )
            )
            continue
        if tensor.name in seen:
            violations.append(Violation(f"inputs[{index}].name", f"input '{tensor.name}' given twice"))
            continue
        seen.add(tensor.name)
        before = len(violations)
        batch = _check_header(tensor, spec, signature, batch, violations)
        if len(violations) == before:
            _check_payload(index, tensor, spec, raw[index] if use_raw else None, violations)
        if len(violations) == before and spec.name in signature.text_inputs:
            _check_text(index, tensor, spec, raw[index] if use_raw else None, violations)
    for name in sorted(signature.required - seen):
        spec = signature.inputs[name]
        violations.append(
            Violation(
                f"input '{name}'",
                f"required input missing: expected {spec.datatype} {signature.expected_shape(spec)}",
            )
        )
    for index, output in enumerate(request.outputs):
        if output.name not in signature.outputs:
            violations.append(
                Violation(
                    f"outputs[{index}].name",
                    f"unknown output '{output.name}': model '{signature.name}' gives {sorted(signature.outputs)}",
                )
            )
    return violations


def _check_header(tensor, spec: TensorSpec, signature: ModelSignature, batch, violations) -> int | None:
    where = f"input '{spec.name}'"
    if tensor.datatype != spec.datatype:
        violations.append(
            Violation(f"{where} datatype", f"expected {spec.datatype}, got {tensor.datatype or '(empty)'}")
        )
        return batch
    shape = list(tensor.shape)
    expected = signature.expected_shape(spec)
    if len(shape) != len(expected):
        violations.append(
            Violation(f"{where} shape", f"expected rank {len(expected)} {expected}, got rank {len(shape)} {shape}")
        )
        return batch
    if signature.max_batch_size > 0:
        size = shape[0]
        if not 1 <= size <= signature.max_batch_size:
            violations.append(
                Violation(
                    f"{where} shape[0]",
                    f"batch size must be 1..{signature.max_batch_size} (max_batch_size), got {size}",
                )
            )
        elif batch is not None and size != batch:
            violations.append(
                Violation(f"{where} shape[0]", f"batch size {size} differs from the other inputs' {batch}")
            )
        else:
            batch = size
    offset = 1 if signature.max_batch_size > 0 else 0
    for axis, (got, want) in enumerate(zip(shape[offset:], spec.dims), start=offset):
        if got < 0 or (want != -1 and got != want):
            violations.append(
                Violation(f"{where} shape[{axis}]", f"expected {want if want != -1 else '>= 0'}, got {got} (shape {shape}, expected {expected})")
            )
    return batch


def _check_payload(index: int, tensor, spec: TensorSpec, raw: bytes | None, violations) -> None:
    count = math.prod(tensor.shape)
    where = f"input '{spec.name}'"
    if raw is not None:
        if spec.datatype == "BYTES":
            try:
                got = bytes_element_count(raw)
            except InvalidRequest as err:
                violations.append(Violation(f"raw_input_contents[{index}] ({where})", err.message))
                return
            if got != count:
                violations.append(
                    Violation(
                        f"raw_input_contents[{index}] ({where})",
                        f"expected {count} BYTES elements for shape {list(tensor.shape)}, got {got}",
                    )
                )
            return
        expected = count * spec.element_size
        if len(raw) != expected:
            violations.append(
                Violation(
                    f"raw_input_contents[{index}] ({where})",
                    f"expected {expected} bytes ({count} x {spec.datatype} for shape {list(tensor.shape)}), got {len(raw)}",
                )
            )
        return
    field = CONTENTS_FIELD.get(spec.datatype)
    if field is None:
        violations.append(Violation(f"{where} contents", f"{spec.datatype} must be sent in raw_input_contents"))
        return
    got = len(getattr(tensor.contents, field))
    if got != count:
        violations.append(
            Violation(
                f"{where} contents.{field}",
                f"expected {count} elements for shape {list(tensor.shape)}, got {got}",
            )
        )


def _check_text(index: int, tensor, spec: TensorSpec, raw: bytes | None, violations) -> None:
    """Every element of a text input is UTF-8 (the framing was checked already)."""
    if raw is not None:
        where = f"raw_input_contents[{index}] ({'input ' + repr(spec.name)})"
        elements = _elements(raw)
    else:
        where = f"input '{spec.name}' contents.bytes_contents"
        elements = iter(tensor.contents.bytes_contents)
    for number, element in enumerate(elements):
        try:
            str(element, "utf-8")
        except UnicodeDecodeError as err:
            violations.append(
                Violation(where, f"element {number} is not valid UTF-8 (byte {err.start}): input '{spec.name}' takes text")
            )
            return


def _elements(raw: bytes):
    """The elements of a well-framed BYTES buffer, as memoryviews (no copies)."""
    view, offset = memoryview(raw), 0
    while offset < len(view):
        (length,) = _LEN.unpack_from(view, offset)
        yield view[offset + 4 : offset + 4 + length]
        offset += 4 + length


def _raise(signature: ModelSignature, violations: list[Violation]) -> None:
    listed = "; ".join(f"{v.field}: {v.description}" for v in violations[:_MAX_LISTED])
    more = f" (+{len(violations) - _MAX_LISTED} more)" if len(violations) > _MAX_LISTED else ""
    raise InvalidRequest(f"model '{signature.name}': {listed}{more}", violations)
