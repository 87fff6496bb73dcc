"""Validation of inference requests against a signature (pure logic; the live matrix is in
tests/integration/test_spine.py)."""

import numpy as np
import pytest

from server.dataplane.codecs import bytes_element_count, serialize_bytes, to_numpy, from_numpy
from server.errors import InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2 as mc
from server.dataplane.signature import ModelSignature, TensorSpec
from server.dataplane.validation import check_parameters, validate_infer_request


def _signature(max_batch=8):
    config = mc.ModelConfig(name="m", backend="python", max_batch_size=max_batch)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[4])
    config.input.add(name="s", data_type=mc.TYPE_STRING, dims=[-1], optional=True)
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1])
    return ModelSignature.from_config(config, versions=["1", "2"])


def _request(shape=(2, 4), datatype="FP32", nbytes=None, name="x"):
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name=name, datatype=datatype, shape=list(shape))
    n = int(np.prod(shape)) * 4 if nbytes is None else nbytes
    req.raw_input_contents.append(b"\x00" * n)
    return req


def _violations(req, sig=None):
    with pytest.raises(InvalidRequest) as info:
        validate_infer_request(req, sig or _signature())
    return info.value.violations


def test_valid_request_passes():
    validate_infer_request(_request(), _signature())
    assert _signature().latest_version == "2"


@pytest.mark.parametrize(
    ("req", "field", "fragment"),
    [
        (_request(name="z"), "inputs[0].name", "unknown input 'z'"),
        (_request(datatype="FP64", nbytes=64), "input 'x' datatype", "expected FP32, got FP64"),
        (_request(shape=(2, 4, 1)), "input 'x' shape", "expected rank 2"),
        (_request(shape=(2, 5)), "input 'x' shape[1]", "expected 4, got 5"),
        (_request(shape=(9, 4)), "input 'x' shape[0]", "1..8"),
        (_request(shape=(0, 4)), "input 'x' shape[0]", "1..8"),
        (_request(nbytes=31), "raw_input_contents[0] (input 'x')", "expected 32 bytes"),
        (_request(nbytes=33), "raw_input_contents[0] (input 'x')", "got 33"),
    ],
)
def test_each_violation_names_tensor_field_expected_and_got(req, field, fragment):
    violations = _violations(req)
    assert violations[0].field == field
    assert fragment in violations[0].description


def test_missing_required_input():
    req = pb.ModelInferRequest(model_name="m")
    violations = _violations(req)
    assert violations[0].field == "input 'x'"
    assert "required input missing" in violations[0].description


def test_raw_count_mismatch():
    req = _request()
    req.raw_input_contents.append(b"1234")
    assert _violations(req)[0].field == "raw_input_contents"


def test_typed_contents_are_counted():
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    t.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    assert "expected 4 elements" in _violations(req)[0].description
    t.contents.fp32_contents.append(4.0)
    validate_infer_request(req, _signature())


def test_bytes_framing():
    good = serialize_bytes([b"ab", b"", b"xyz", b"q"])
    assert bytes_element_count(good) == 4
    req = _request()
    req.inputs.add(name="s", datatype="BYTES", shape=[2, 2])
    req.raw_input_contents.append(good)
    validate_infer_request(req, _signature())
    req.raw_input_contents[1] = good[:-1]
    assert "BYTES framing" in _violations(req)[0].description


def test_unknown_output_and_all_problems_reported():
    req = _request(shape=(2, 5), name="x")
    req.outputs.add(name="nope")
    fields = [v.field for v in _violations(req)]
    assert "outputs[0].name" in fields and "input 'x' shape[1]" in fields


def test_codec_round_trip():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    dt, shape, raw = from_numpy(arr)
    assert (dt, shape) == ("FP32", [3, 4])
    np.testing.assert_array_equal(to_numpy(raw, dt, shape), arr)
    strings = np.array([b"a", b"bc"], dtype=np.object_)
    dt, shape, raw = from_numpy(strings)
    assert dt == "BYTES" and list(to_numpy(raw, dt, shape)) == [b"a", b"bc"]


def test_pin_version_overrides_without_reserializing():
    from server.dataplane.wire import pin_version

    req = _request()
    req.model_version = "1"
    for version in ("2", "1" * 200):
        pinned = pb.ModelInferRequest.FromString(pin_version(req.SerializeToString(), version))
        assert pinned.model_version == version
        assert pinned.raw_input_contents == req.raw_input_contents


def test_signature_counts_instances_and_sizes_admission_by_them():
    from server.dataplane.pipeline import model_slots

    config = mc.ModelConfig(name="m", backend="python", max_batch_size=0)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[-1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[-1])
    assert ModelSignature.from_config(config).instances == 1  # no instance group: Triton's one
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=3)
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=2)
    signature = ModelSignature.from_config(config)
    assert signature.instances == 5

    assert model_slots(signature) == 5  # the default the pipeline sizes a model's queue by
    config.max_batch_size = 4  # coalescing on by default: its in-flight batches (one per instance) x their size
    assert model_slots(ModelSignature.from_config(config)) == 5 * 4
    config.parameters["inferplane.coalesce_max_inflight"].string_value = "2"
    assert model_slots(ModelSignature.from_config(config)) == 2 * 4
    del config.parameters["inferplane.coalesce_max_inflight"]
    config.parameters["inferplane.coalesce"].string_value = "false"  # each instance batches up to 4
    assert model_slots(ModelSignature.from_config(config)) == 5 * 4


def test_parameters_triton_would_refuse_are_refused_here_naming_the_parameter():
    from server.dataplane.validation import check_parameters

    request = pb.ModelInferRequest(model_name="m")
    request.parameters["sequence_id"].double_param = 1.5  # int64 or string only
    request.parameters["priority"].int64_param = -1
    request.parameters["my_knob"].uint64_param = 3  # a custom parameter: int64, bool or string only
    request.parameters["ok_knob"].string_param = "fine"
    request.parameters["timeout"].int64_param = 1000
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.parameters["shared_memory_region"].string_param = "someone_elses_region"
    request.outputs.add(name="y").parameters["classification"].string_param = "3"
    violations = []
    check_parameters(request, violations)
    fields = {v.field for v in violations}
    assert fields == {
        "parameters.sequence_id", "parameters.priority", "parameters.my_knob",
        "inputs[0].parameters.shared_memory_region", "outputs[0].parameters.classification",
    }  # fmt: skip
    good = pb.ModelInferRequest(model_name="m")
    good.parameters["sequence_id"].string_param = "abc"
    good.parameters["sequence_start"].bool_param = True
    violations = []
    check_parameters(good, violations)
    assert violations == []


def test_negative_counts_on_tensors_are_refused_naming_the_tensor():
    """Triton answers a negative ``classification`` (top-k) or ``binary_data_size`` with INTERNAL."""
    from server.dataplane.validation import check_parameters

    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).parameters["binary_data_size"].int64_param = -1
    request.outputs.add(name="y").parameters["classification"].int64_param = -3
    request.outputs.add(name="z").parameters["classification"].int64_param = 0  # zero: no classification
    violations = []
    check_parameters(request, violations)
    assert [(v.field, v.description) for v in violations] == [
        ("inputs[0].parameters.binary_data_size", "must be >= 0, got -1"),
        ("outputs[0].parameters.classification", "must be >= 0, got -3"),
    ]


def test_the_engine_priority_parameter_is_the_frontends_not_the_callers():
    """A caller naming it (raw OIP to an LLM) would give itself the paid tiers' place in the engine's queue."""
    from server.dataplane.validation import PRIORITY_PARAMETER, check_parameters

    request = pb.ModelInferRequest(model_name="llm")
    request.parameters[PRIORITY_PARAMETER].int64_param = 0
    request.parameters["inferplane_anything"].string_param = "x"
    violations = []
    check_parameters(request, violations)
    assert {v.field for v in violations} == {f"parameters.{PRIORITY_PARAMETER}", "parameters.inferplane_anything"}
    assert all("set by the frontend" in v.description for v in violations)


def _two_inputs(x_rows: int, s_rows: int) -> pb.ModelInferRequest:
    req = _request(shape=(x_rows, 4))
    req.inputs.add(name="s", datatype="BYTES", shape=[s_rows, 1])
    req.raw_input_contents.append(serialize_bytes([b"a"] * s_rows))
    return req


def test_inputs_of_one_request_must_share_one_batch_size():
    validate_infer_request(_two_inputs(2, 2), _signature())  # the same shape[0]: one batch of 2
    violations = _violations(_two_inputs(2, 3))
    assert [v.field for v in violations] == ["input 's' shape[0]"]
    assert "batch size 3 differs from the other inputs' 2" in violations[0].description


# ---- every violation says exactly what was wrong (the caller reads these; the mutation pass checks them) ----


def _text_signature(max_batch=4):
    inputs = {
        "text": TensorSpec("text", "BYTES", (1,)),
        "blob": TensorSpec("blob", "BYTES", (1,), optional=True),
        "h": TensorSpec("h", "FP16", (2,), optional=True),
        "v": TensorSpec("v", "FP32", (-1,), optional=True),
    }
    return ModelSignature("t", max_batch, inputs, {"y": TensorSpec("y", "FP32", (1,))}, frozenset({"1"}), text_inputs=frozenset({"text"}))


def _raw(req, name, datatype, shape, data):
    req.inputs.add(name=name, datatype=datatype, shape=list(shape))
    req.raw_input_contents.append(data)
    return req


def _pairs(req, sig):
    return [(v.field, v.description) for v in _violations(req, sig)]


def _t(*inputs):
    req = pb.ModelInferRequest(model_name="t")
    for name, datatype, shape, data in inputs:
        _raw(req, name, datatype, shape, data)
    return req


TEXT_OK = ("text", "BYTES", (1, 1), serialize_bytes([b"hello"]))


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (_request(datatype=""), [("input 'x' datatype", "expected FP32, got (empty)")]),
        (_request(shape=(2, 4, 1)), [("input 'x' shape", "expected rank 2 [-1, 4], got rank 3 [2, 4, 1]")]),
        (_request(shape=(9, 4)), [("input 'x' shape[0]", "batch size must be 1..8 (max_batch_size), got 9")]),
        (_request(shape=(2, 5)), [("input 'x' shape[1]", "expected 4, got 5 (shape [2, 5], expected [-1, 4])")]),
        (_request(nbytes=31), [("raw_input_contents[0] (input 'x')", "expected 32 bytes (8 x FP32 for shape [2, 4]), got 31")]),
        (_request(name="z"), [("inputs[0].name", "unknown input 'z': model 'm' takes ['s', 'x']"), ("input 'x'", "required input missing: expected FP32 [-1, 4]")]),
    ],
)
def test_each_violation_reads_exactly(req, expected):
    assert [(v.field, v.description) for v in _violations(req)] == expected


def test_a_batch_may_fill_max_batch_size_exactly():
    validate_infer_request(_request(shape=(8, 4)), _signature())
    validate_infer_request(_request(shape=(1, 4)), _signature(max_batch=1))
    assert [v.field for v in _violations(_request(shape=(2, 4)), _signature(max_batch=1))] == ["input 'x' shape[0]"]


def test_a_model_without_batching_checks_every_axis_against_its_dims():
    sig = _signature(max_batch=0)
    validate_infer_request(_request(shape=(4,)), sig)
    assert _pairs(_request(shape=(5,)), sig) == [("input 'x' shape[0]", "expected 4, got 5 (shape [5], expected [4])")]
    assert _pairs(_request(shape=(1, 4)), sig) == [("input 'x' shape", "expected rank 1 [4], got rank 2 [1, 4]")]


def test_a_variable_axis_takes_zero_but_not_a_negative_size():
    sig = _text_signature()
    validate_infer_request(_t(TEXT_OK, ("v", "FP32", (1, 0), b"")), sig)
    assert _pairs(_t(TEXT_OK, ("v", "FP32", (1, -1), b"")), sig) == [
        ("input 'v' shape[1]", "expected >= 0, got -1 (shape [1, -1], expected [-1, -1])")
    ]


def test_bytes_payloads_name_the_framing_or_the_count():
    sig = _text_signature()
    framed = serialize_bytes([b"a", b"b"])
    assert _pairs(_t(TEXT_OK, ("blob", "BYTES", (1, 1), framed)), sig) == [
        ("raw_input_contents[1] (input 'blob')", "expected 1 BYTES elements for shape [1, 1], got 2")
    ]
    assert _pairs(_t(TEXT_OK, ("blob", "BYTES", (1, 1), b"\x05\x00")), sig) == [
        ("raw_input_contents[1] (input 'blob')", "BYTES framing: 2 trailing bytes cannot hold a 4-byte length")
    ]


def test_typed_contents_name_their_field_and_half_floats_must_come_raw():
    sig = _text_signature()
    req = _t()
    req.inputs.add(name="text", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"hi")
    req.inputs.add(name="h", datatype="FP16", shape=[1, 2])
    v = req.inputs.add(name="v", datatype="FP32", shape=[1, 3])
    v.contents.fp32_contents.extend([1.0, 2.0])
    assert _pairs(req, sig) == [
        ("input 'h' contents", "FP16 must be sent in raw_input_contents"),
        ("input 'v' contents.fp32_contents", "expected 3 elements for shape [1, 3], got 2"),
    ]


def test_a_text_input_must_be_utf8_and_other_bytes_need_not_be():
    sig = _text_signature()
    bad = serialize_bytes([b"ok", b"caf\xe9"])
    assert _pairs(_t(("text", "BYTES", (2, 1), bad)), sig) == [
        ("raw_input_contents[0] (input 'text')", "element 1 is not valid UTF-8 (byte 3): input 'text' takes text")
    ]
    validate_infer_request(_t(TEXT_OK, ("blob", "BYTES", (1, 1), serialize_bytes([b"\xff\xfe"]))), sig)  # not text: opaque
    req = _t()
    req.inputs.add(name="text", datatype="BYTES", shape=[2, 1]).contents.bytes_contents.extend([b"\xff", b"ok"])
    assert _pairs(req, sig) == [("input 'text' contents.bytes_contents", "element 0 is not valid UTF-8 (byte 0): input 'text' takes text")]
    validate_infer_request(_t(("text", "BYTES", (3, 1), serialize_bytes([b"a", "é".encode(), b""]))), sig)


def test_a_text_input_with_a_broken_frame_reports_the_frame_only():
    sig = _text_signature()
    assert _pairs(_t(("text", "BYTES", (1, 1), serialize_bytes([b"\xff"]) + b"\x01")), sig) == [
        ("raw_input_contents[0] (input 'text')", "BYTES framing: 1 trailing bytes cannot hold a 4-byte length")
    ]


def test_a_bad_input_does_not_stop_the_check_of_the_next():
    sig = _text_signature()
    shape_bad = ("v", "FP32", (1, -1), b"")
    assert [f for f, _ in _pairs(_t(("nope", "FP32", (1,), b""), TEXT_OK, shape_bad), sig)] == ["inputs[0].name", "input 'v' shape[1]"]
    assert _pairs(_t(TEXT_OK, TEXT_OK, shape_bad), sig) == [
        ("inputs[1].name", "input 'text' given twice"),
        ("input 'v' shape[1]", "expected >= 0, got -1 (shape [1, -1], expected [-1, -1])"),
    ]


def test_raw_contents_must_be_one_per_input_and_outputs_must_exist():
    req = _request()
    req.raw_input_contents.append(b"1234")
    assert _pairs(req, _signature()) == [("raw_input_contents", "expected 1 entries, one per input, got 2")]
    req = _request()
    req.outputs.add(name="nope")
    assert _pairs(req, _signature()) == [("outputs[0].name", "unknown output 'nope': model 'm' gives ['y']")]


def test_the_error_message_lists_three_violations_then_counts_the_rest():
    req = _request(shape=(2, 5))
    for name in ("o1", "o2"):
        req.outputs.add(name=name)
    with pytest.raises(InvalidRequest) as err:
        validate_infer_request(req, _signature())
    assert err.value.message == (
        "model 'm': input 'x' shape[1]: expected 4, got 5 (shape [2, 5], expected [-1, 4]); "
        "outputs[0].name: unknown output 'o1': model 'm' gives ['y']; outputs[1].name: unknown output 'o2': model 'm' gives ['y']"
    )
    req.outputs.add(name="o3")
    req.outputs.add(name="o4")
    with pytest.raises(InvalidRequest) as err:
        validate_infer_request(req, _signature())
    assert err.value.message.endswith("gives ['y'] (+2 more)") and len(err.value.violations) == 5


def _parameters(**kinds):
    request = pb.ModelInferRequest(model_name="m")
    for key, (kind, value) in kinds.items():
        setattr(request.parameters[key], kind, value)
    violations = []
    check_parameters(request, violations)
    return [(v.field, v.description) for v in violations]


def test_each_refused_parameter_reads_exactly():
    assert _parameters(**{"": ("int64_param", 1)}) == [("parameters", "a parameter needs a name")]
    assert _parameters(inferplane_adapter=("string_param", "a")) == [("parameters.inferplane_adapter", "is set by the frontend, not by callers")]
    assert _parameters(sequence_start=("int64_param", 1)) == [("parameters.sequence_start", "expected bool_param, got int64_param")]
    assert _parameters(priority=("double_param", 1.0)) == [("parameters.priority", "expected int64_param or uint64_param, got double_param")]
    request = pb.ModelInferRequest(model_name="m")
    request.parameters["knob"].SetInParent()  # named, but no value
    violations = []
    check_parameters(request, violations)
    assert [(v.field, v.description) for v in violations] == [("parameters.knob", "expected int64_param or bool_param or string_param, got no value")]
    assert _parameters(timeout=("int64_param", -5)) == [("parameters.timeout", "must be >= 0, got -5")]
    assert _parameters(priority=("int64_param", 0), timeout=("int64_param", 0), other=("int64_param", -1)) == []


def test_tensor_parameters_refuse_shared_memory_and_wrong_kinds():
    request = pb.ModelInferRequest(model_name="m")
    x = request.inputs.add(name="x")
    x.parameters["shared_memory_byte_size"].int64_param = 16
    x.parameters["my_tag"].double_param = 1.0  # not a known tensor parameter: the model's business
    out = request.outputs.add(name="y")
    out.parameters["binary_data"].int64_param = 1
    out.parameters["classification"].int64_param = 2
    out.parameters["binary_data_size"].SetInParent()
    violations = []
    check_parameters(request, violations)
    assert sorted((v.field, v.description) for v in violations) == [  # a map: no order to rely on
        ("inputs[0].parameters.shared_memory_byte_size", "shared memory is not offered through the frontend; send the tensor's bytes"),
        ("outputs[0].parameters.binary_data", "expected bool_param, got int64_param"),
        ("outputs[0].parameters.binary_data_size", "expected int64_param, got no value"),
    ]


def test_parameters_are_checked_as_part_of_the_request():
    req = _request()
    req.parameters["inferplane_priority"].int64_param = 0
    assert [v.field for v in _violations(req)] == ["parameters.inferplane_priority"]


def test_each_text_element_is_checked_on_its_own_bytes():
    """The element ends where its length says: the next element's length prefix (200 = 0xc8, not UTF-8 alone) is not part of it."""
    validate_infer_request(_t(("text", "BYTES", (2, 1), serialize_bytes([b"ok", b"x" * 200]))), _text_signature())
