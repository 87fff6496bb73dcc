"""Validation of inference requests against a signature (pure logic; the live matrix is in
tests/integration/test_spine.py)."""

import numpy as np
import pytest

from server.dataplane.codecs import bytes_element_count, serialize_bytes, to_numpy, from_numpy
from server.errors import InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2 as mc
from server.dataplane.signature import ModelSignature
from server.dataplane.validation import validate_infer_request


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
    from server.dataplane.dataplane import pin_version

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
