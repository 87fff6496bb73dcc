"""The in-process Triton's pure conversions: Triton's JSON -> OIP protobuf, OIP requests -> the C
request plan, TRITONSERVER_Error codes -> domain errors (the same as the remote path's)."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest

from server import errors
from server.dataplane.triton_client import translate
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime import capi, capi_codec
from server.runtime.inprocess import InferResult, Output

# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", list(capi.ErrorCode))
def test_error_codes_map_like_the_remote_path(code):
    """Each TRITONSERVER_Error code becomes the error translate() makes of the status Triton's
    gRPC frontend answers with for it."""
    mine = capi_codec.domain_error(code, "boom")
    status = capi_codec.grpc_code(code)
    remote = translate(grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom"))
    assert type(mine) is type(remote)
    assert mine.message == remote.message
    assert mine.retry_after_s == remote.retry_after_s


def test_the_named_codes():
    assert isinstance(capi_codec.domain_error(capi.ErrorCode.UNAVAILABLE, "x"), errors.BackendUnavailable)
    assert capi_codec.domain_error(capi.ErrorCode.UNAVAILABLE, "x").retry_after_s == 1.0
    assert isinstance(capi_codec.domain_error(capi.ErrorCode.INVALID_ARG, "x"), errors.InvalidRequest)
    assert isinstance(capi_codec.domain_error(capi.ErrorCode.NOT_FOUND, "x"), errors.ModelNotFound)
    assert isinstance(capi_codec.domain_error(capi.ErrorCode.UNSUPPORTED, "x"), errors.Unimplemented)
    assert isinstance(capi_codec.domain_error(capi.ErrorCode.CANCELLED, "x"), errors.Cancelled)
    assert type(capi_codec.domain_error(capi.ErrorCode.INTERNAL, "x")) is errors.BackendError
    assert type(capi_codec.domain_error(99, "x")) is errors.BackendError  # a code this Triton does not have


def test_a_dead_stub_is_recognized_only_on_internal_errors():
    message = "Failed to process the request(s) for model 'm', message: Stub process 'm_0_0' is not healthy."
    assert capi_codec.is_stub_death(capi.ErrorCode.INTERNAL, message)
    assert capi_codec.is_stub_death(capi.ErrorCode.INTERNAL, "Failed to obtain the health mutex.")
    assert not capi_codec.is_stub_death(capi.ErrorCode.INVALID_ARG, message)
    assert not capi_codec.is_stub_death(capi.ErrorCode.INTERNAL, "division by zero in model.py")


def test_versions():
    assert capi_codec.parse_version("") == -1
    assert capi_codec.parse_version("3") == 3
    for bad in ("x", "-2", "1.5"):
        with pytest.raises(errors.InvalidRequest):
            capi_codec.parse_version(bad)


# ---- JSON answers -------------------------------------------------------------------------------


def test_model_metadata():
    doc = {
        "name": "m",
        "versions": ["1", "2"],
        "platform": "python",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [-1, 1]}],
    }
    out = capi_codec.model_metadata(doc)
    assert out == pb.ModelMetadataResponse(
        name="m",
        versions=["1", "2"],
        platform="python",
        inputs=[pb.ModelMetadataResponse.TensorMetadata(name="x", datatype="FP32", shape=[-1, 4])],
        outputs=[pb.ModelMetadataResponse.TensorMetadata(name="y", datatype="INT64", shape=[-1, 1])],
    )


def test_model_config_reads_triton_json_and_ignores_unknown_fields():
    doc = {
        "name": "m",
        "backend": "python",
        "max_batch_size": 64,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["32"], "is_shape_tensor": False}],
        "dynamic_batching": {"max_queue_delay_microseconds": 200, "a_field_of_a_newer_triton": 1},
        "parameters": {"k": {"string_value": "v"}},
    }
    config = capi_codec.model_config(doc).config
    assert config.name == "m" and config.max_batch_size == 64
    assert list(config.input[0].dims) == [32]  # int64 as a JSON string, as protobuf writes it
    assert config.dynamic_batching.max_queue_delay_microseconds == 200
    assert config.parameters["k"].string_value == "v"


def test_repository_index():
    doc = [{"name": "a", "version": "1", "state": "READY"}, {"name": "b"}, {"name": "c", "version": "2", "state": "UNAVAILABLE", "reason": "unloaded"}]
    out = capi_codec.repository_index(doc)
    assert [(m.name, m.version, m.state, m.reason) for m in out.models] == [("a", "1", "READY", ""), ("b", "", "", ""), ("c", "2", "UNAVAILABLE", "unloaded")]


STATS = {
    "model_stats": [
        {
            "name": "m",
            "version": "1",
            "last_inference": 1700000000000,
            "inference_count": 12,
            "execution_count": 3,
            "inference_stats": {
                "success": {"count": 12, "ns": 1000},
                "fail": {"count": 1, "ns": 7},
                "queue": {"count": 12, "ns": 400},
                "compute_input": {"count": 3, "ns": 30},
                "compute_infer": {"count": 3, "ns": 300},
                "compute_output": {"count": 3, "ns": 20},
                "cache_hit": {"count": 0, "ns": 0},
                "cache_miss": {"count": 0, "ns": 0},
            },
            "response_stats": {"0": {"compute_infer": {"count": 2, "ns": 9}, "compute_output": {"count": 2, "ns": 3}, "success": {"count": 2, "ns": 12},
                                     "fail": {"count": 0, "ns": 0}, "empty_response": {"count": 0, "ns": 0}, "cancel": {"count": 1, "ns": 5}}},
            "batch_stats": [{"batch_size": 4, "compute_input": {"count": 3, "ns": 30}, "compute_infer": {"count": 3, "ns": 300}, "compute_output": {"count": 3, "ns": 20}}],
            "memory_usage": [{"type": "CPU", "id": 0, "byte_size": 2048}],
        }
    ]
}  # fmt: skip


def test_statistics_known_fields():
    out = capi_codec.model_statistics_message(STATS)
    stat = out.model_stats[0]
    assert (stat.name, stat.version, stat.last_inference, stat.inference_count, stat.execution_count) == ("m", "1", 1700000000000, 12, 3)
    assert (stat.inference_stats.fail.count, stat.inference_stats.fail.ns) == (1, 7)
    assert stat.inference_stats.HasField("cache_hit")  # present though zero, as the C++ frontend sends it
    assert stat.batch_stats[0].batch_size == 4 and stat.batch_stats[0].compute_infer.ns == 300


def test_statistics_bytes_carry_what_the_project_proto_lacks():
    """memory_usage and response_stats, read back with Triton's full proto (tritonclient's)."""
    from tritonclient.grpc import service_pb2 as full

    raw = capi_codec.model_statistics(STATS)
    stat = full.ModelStatisticsResponse.FromString(raw).model_stats[0]
    assert stat.inference_count == 12 and stat.inference_stats.queue.ns == 400
    assert [(u.type, u.id, u.byte_size) for u in stat.memory_usage] == [("CPU", 0, 2048)]
    response = stat.response_stats["0"]
    assert (response.success.count, response.success.ns, response.cancel.count, response.compute_output.ns) == (2, 12, 1, 3)
    # and the project's proto reads the same bytes (the extra fields stay unknown)
    assert pb.ModelStatisticsResponse.FromString(raw).model_stats[0].inference_count == 12


# ---- requests -----------------------------------------------------------------------------------


def _request(**params) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="r")
    request.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    request.outputs.add(name="y")
    for key, (kind, value) in params.items():
        setattr(request.parameters[key], kind, value)
    return request


def test_plan_of_a_plain_request():
    plan = capi_codec.request_plan(_request())
    assert (plan.model_name, plan.model_version, plan.id, plan.outputs) == ("m", 2, "r", ["y"])
    assert [(t.name, t.datatype, t.shape) for t in plan.inputs] == [("x", "FP32", [2, 2])]
    assert plan.inputs[0].chunks == [np.arange(4, dtype=np.float32).tobytes()]


def test_plan_reads_triton_parameters():
    plan = capi_codec.request_plan(
        _request(
            sequence_id=("int64_param", 7),
            sequence_start=("bool_param", True),
            sequence_end=("bool_param", True),
            priority=("uint64_param", 3),
            timeout=("int64_param", 5000),
            triton_enable_empty_final_response=("bool_param", True),
            custom=("string_param", "v"),
            weight=("double_param", 0.5),
        )
    )
    assert plan.correlation_id == 7 and plan.flags == capi_codec.FLAG_SEQUENCE_START | capi_codec.FLAG_SEQUENCE_END
    assert plan.priority == 3 and plan.timeout_us == 5000 and plan.empty_final_response
    assert sorted(plan.parameters) == [("custom", "v"), ("weight", 0.5)]
    assert capi_codec.request_plan(_request(sequence_id=("string_param", "abc"))).correlation_id == "abc"


@pytest.mark.parametrize(
    "params, words",
    [
        ({"sequence_id": ("bool_param", True)}, "'sequence_id'"),
        ({"sequence_start": ("int64_param", 1)}, "'sequence_start'"),
        ({"priority": ("int64_param", -1)}, "'priority'"),
        ({"timeout": ("string_param", "1s")}, "'timeout'"),
        ({"triton_unknown": ("bool_param", True)}, "reserved"),
        ({"custom": ("uint64_param", 1)}, "'custom'"),
    ],
)
def test_bad_parameters_are_refused_like_triton_does(params, words):
    with pytest.raises(errors.InvalidRequest, match=words):
        capi_codec.request_plan(_request(**params))


def test_typed_contents_become_raw_bytes():
    request = pb.ModelInferRequest(model_name="m")
    t = request.inputs.add(name="x", datatype="INT16", shape=[3])
    t.contents.int_contents.extend([1, -2, 300])
    s = request.inputs.add(name="s", datatype="BYTES", shape=[2])
    s.contents.bytes_contents.extend([b"ab", b""])
    plan = capi_codec.request_plan(request)
    assert plan.inputs[0].chunks == [np.array([1, -2, 300], np.int16).tobytes()]
    assert plan.inputs[1].chunks == [struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)]


def test_missing_or_mixed_input_data_is_refused():
    request = _request()
    request.inputs.add(name="z", datatype="FP32", shape=[1])
    with pytest.raises(errors.InvalidRequest, match="unable to find data for input tensor 'z'"):
        capi_codec.request_plan(request)
    mixed = _request()
    mixed.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4])
    with pytest.raises(errors.InvalidRequest, match="contents field must not be specified"):
        capi_codec.request_plan(mixed)


def test_what_in_process_triton_does_not_offer():
    request = _request()
    request.outputs[0].parameters["classification"].int64_param = 3
    with pytest.raises(errors.Unimplemented):
        capi_codec.request_plan(request)
    shm = _request()
    shm.inputs[0].parameters["shared_memory_region"].string_param = "r"
    with pytest.raises(errors.InvalidRequest, match="shared-memory"):
        capi_codec.request_plan(shm)


# ---- answers ------------------------------------------------------------------------------------


def test_answer_bytes_are_what_protobuf_writes():
    result = InferResult(
        "m", "1", "r", {"flag": True, "n": 3, "s": "x", "d": 0.25},
        [Output("y", "FP32", [2, 1], np.array([1.5, 2.5], np.float32).tobytes()),
         Output("t", "BYTES", [1], memoryview(struct.pack("<I", 3) + b"abc!")[:7])],
    )  # fmt: skip
    message = result.to_message()
    assert pb.ModelInferResponse.FromString(result.to_bytes()) == message
    assert message.parameters["flag"].bool_param and message.parameters["n"].int64_param == 3
    assert message.parameters["d"].double_param == 0.25 and message.parameters["s"].string_param == "x"
    assert list(message.raw_output_contents) == [np.array([1.5, 2.5], np.float32).tobytes(), struct.pack("<I", 3) + b"abc"]
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [("y", "FP32", [2, 1]), ("t", "BYTES", [1])]


def test_elf_needed_reads_the_bundled_library():
    """The preload reads DT_NEEDED: libtritonserver needs libraries bundled beside it."""
    from server.runtime.triton_install import TritonInstallation, TritonNotInstalled

    try:
        install = TritonInstallation.find()
    except TritonNotInstalled:
        pytest.fail("the nvidia-pytriton wheel is a dependency of the project")
    needed = capi.elf_needed(capi.library_path(install))
    assert "libc.so.6" in needed
    assert any(name.startswith("libcurl") for name in needed)
