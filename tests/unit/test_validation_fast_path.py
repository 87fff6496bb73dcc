"""The validation's one-pass fast path (``server.dataplane.validation._plainly_valid``) against the
full check: whatever request it accepts, the full check finds nothing wrong with (property-based,
over requests built near the signature and mutated field by field), and it does accept the common
request (else it would save nothing). Pure logic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.dataplane.signature import ModelSignature
from server.dataplane.validation import _plainly_valid, infer_request_violations, validate_infer_request
from server.errors import InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2 as mc


def _signature(max_batch: int, text: bool = False) -> ModelSignature:
    config = mc.ModelConfig(name="m", backend="python", max_batch_size=max_batch)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[4])
    config.input.add(name="k", data_type=mc.TYPE_INT64, dims=[-1, 2])
    config.input.add(name="s", data_type=mc.TYPE_STRING, dims=[1], optional=True)
    config.input.add(name="o", data_type=mc.TYPE_FP16, dims=[3], optional=True)
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
    if text:
        config.parameters["inferplane.text_inputs"].string_value = "s"
    return ModelSignature.from_config(config, versions=["1"])


SIGNATURES = [_signature(8), _signature(0), _signature(1), _signature(4, text=True)]
SIZES = {"FP32": 4, "INT64": 8, "FP16": 2, "BYTES": 1, "FP64": 8}
DIMS = {"x": [4], "k": [3, 2], "s": [1], "o": [3]}
TYPES = {"x": "FP32", "k": "INT64", "s": "BYTES", "o": "FP16"}


BENDS = (
    "drop input", "extra input", "datatype", "dims", "dim off by one", "rank", "batch", "batch apart",
    "bytes", "tensor parameter", "raw missing", "raw short", "request parameter", "output unknown", "output parameter",
)  # fmt: skip


@st.composite
def requests(draw):
    """A valid request for one of SIGNATURES, or one with a single field bent (``BENDS``), so the
    fast path meets both outcomes for every check it makes."""
    signature = draw(st.sampled_from(SIGNATURES))
    bend = draw(st.sampled_from((None,) * 5 + BENDS))
    rows = draw(st.integers(1, 3))
    names = ["x", "k", *draw(st.lists(st.sampled_from(["s", "o"]), max_size=2, unique=True))]
    if bend == "drop input":
        names.pop(draw(st.integers(0, len(names) - 1)))
    if bend == "extra input":
        names.append(draw(st.sampled_from(["x", "o", "zz"])))
    names = draw(st.permutations(names))
    target = draw(st.integers(0, max(0, len(names) - 1)))
    batched = signature.max_batch_size > 0
    req = pb.ModelInferRequest(model_name="m")
    raws = []
    for i, name in enumerate(names):
        bent = bend if i == target else None
        datatype = draw(st.sampled_from(["FP64", "BYTES", "FP32", ""])) if bent == "datatype" else TYPES.get(name, "FP32")
        dims = list(DIMS.get(name, [2]))
        if name == "k" and draw(st.booleans()):
            dims = [draw(st.integers(0, 4)), 2]  # its variable dimension
        if bent == "dims":
            dims = [draw(st.integers(-1, 5)) for _ in range(draw(st.integers(0, 3)))]
        if bent == "dim off by one":
            dims[-1] += draw(st.sampled_from([1, -1]))
        size = rows
        if bent == "batch":
            size = draw(st.sampled_from([0, 9, -1]))
        if bent == "batch apart":
            size = rows + 1
        shape = ([size] if batched else []) + dims
        if bent == "rank":
            shape = shape[1:] if draw(st.booleans()) and shape else [*shape, 1]
        tensor = req.inputs.add(name=name, datatype=datatype, shape=shape)
        count = 1
        for d in shape:
            count *= max(d, 0)
        if datatype == "BYTES":
            raws.append(b"\x01\x00\x00\x00a" * count)
        else:
            nbytes = count * SIZES.get(datatype, 4) + (draw(st.sampled_from([1, -1])) if bent == "bytes" else 0)
            raws.append(b"\x00" * max(0, nbytes))
        if bent == "tensor parameter":
            tensor.parameters["classification"].int64_param = draw(st.integers(-1, 2))
    if bend == "raw short":
        req.raw_input_contents.extend(raws[:-1])
    elif bend != "raw missing":
        req.raw_input_contents.extend(raws)
    if bend == "request parameter":
        req.parameters[draw(st.sampled_from(["priority", "inferplane_priority", "custom"]))].int64_param = draw(st.integers(-1, 1))
    outputs = draw(st.lists(st.just("y"), max_size=1)) + (["nope"] if bend == "output unknown" else [])
    for name in outputs:
        output = req.outputs.add(name=name)
        if bend == "output parameter":
            output.parameters["shared_memory_region"].string_param = "r"
    return req, signature


def _eligible(req, signature) -> bool:
    """What the fast path is for: no parameters anywhere, every input in raw_input_contents, none BYTES or text."""
    return (
        not req.parameters
        and len(req.raw_input_contents) == len(req.inputs) > 0
        and not any(t.parameters or t.datatype == "BYTES" or t.name in signature.text_inputs for t in req.inputs)
        and not any(o.parameters for o in req.outputs)
    )


@settings(max_examples=600, deadline=None)
@given(requests())
def test_the_fast_path_accepts_exactly_the_valid_requests_it_is_for(case):
    """Sound (what it accepts, the full check finds nothing wrong with) and complete over its domain
    (a valid request without parameters, BYTES or text inputs is accepted: else it saves nothing)."""
    req, signature = case
    valid = infer_request_violations(req, signature) == []
    assert _plainly_valid(req, signature) == (valid and _eligible(req, signature))


def _valid(signature, rows=2, k_rows=3):
    req = pb.ModelInferRequest(model_name="m")
    batch = [rows] if signature.max_batch_size > 0 else []
    req.inputs.add(name="x", datatype="FP32", shape=batch + [4])
    req.inputs.add(name="k", datatype="INT64", shape=batch + [k_rows, 2])
    n = rows if batch else 1
    req.raw_input_contents.extend([b"\x00" * n * 16, b"\x00" * n * k_rows * 16])
    return req


@pytest.mark.parametrize(
    ("signature", "rows", "k_rows"),
    [(SIGNATURES[0], 1, 3), (SIGNATURES[0], 8, 3), (SIGNATURES[0], 2, 0), (SIGNATURES[2], 1, 1), (SIGNATURES[1], 1, 3)],
    ids=["one row", "max_batch_size rows", "a variable dimension of 0", "max_batch_size 1", "unbatched"],
)
def test_the_edges_of_valid_take_the_fast_path(signature, rows, k_rows):
    req = _valid(signature, rows, k_rows)
    assert infer_request_violations(req, signature) == [] and _plainly_valid(req, signature)


def test_a_negative_count_parameter_is_never_waved_through():
    req = _valid(SIGNATURES[0])
    req.inputs[1].parameters["classification"].int64_param = -1
    assert not _plainly_valid(req, SIGNATURES[0])
    with pytest.raises(InvalidRequest, match="must be >= 0"):
        validate_infer_request(req, SIGNATURES[0])


@pytest.mark.parametrize("signature", SIGNATURES[:2], ids=["batched", "unbatched"])
def test_the_common_request_takes_the_fast_path(signature):
    req = pb.ModelInferRequest(model_name="m")
    batch = [2] if signature.max_batch_size > 0 else []
    req.inputs.add(name="x", datatype="FP32", shape=batch + [4])
    req.inputs.add(name="k", datatype="INT64", shape=batch + [3, 2])
    req.raw_input_contents.extend([b"\x00" * (2 if batch else 1) * 16, b"\x00" * (2 if batch else 1) * 48])
    req.outputs.add(name="y")
    assert _plainly_valid(req, signature) and infer_request_violations(req, signature) == []
    validate_infer_request(req, signature)
    req.raw_input_contents[1] = b"\x00" * 7  # one byte count off: the full check's message, unchanged
    assert not _plainly_valid(req, signature)
    with pytest.raises(InvalidRequest, match=r"raw_input_contents\[1\] \(input 'k'\): expected"):
        validate_infer_request(req, signature)
