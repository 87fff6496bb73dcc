"""Only non-executable formats are accepted; anything pickle-based is refused, by name or by content."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import pickle
import struct
import zipfile
import zlib

import numpy as np
import pytest

from server.control import safe_formats as sf
from server.errors import InvalidRequest


def _onnx() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _xgboost(raw_format: str) -> bytes:
    import xgboost as xgb

    rng = np.random.default_rng(0)
    booster = xgb.train({"max_depth": 2, "nthread": 1}, xgb.DMatrix(rng.random((20, 3)), label=rng.random(20)), 2)
    return bytes(booster.save_raw(raw_format=raw_format))


def _lightgbm() -> bytes:
    import lightgbm as lgb

    rng = np.random.default_rng(0)
    params = {"objective": "regression", "num_threads": 1, "verbose": -1, "min_data_in_leaf": 2}
    return lgb.train(params, lgb.Dataset(rng.random((40, 3)), label=rng.random(40)), 2).model_to_string().encode()


def _safetensors() -> bytes:
    tensor = np.arange(6, dtype=np.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, tensor.nbytes]}, "__metadata__": {"a": "b"}}).encode()
    return struct.pack("<Q", len(header)) + header + tensor.tobytes()


SAFE = {
    "model.onnx": (_onnx, sf.ONNX),
    "model.json": (lambda: _xgboost("json"), sf.XGBOOST_JSON),
    "model.ubj": (lambda: _xgboost("ubj"), sf.XGBOOST_UBJ),
    "model.txt": (_lightgbm, sf.LIGHTGBM_TEXT),
    "model.safetensors": (_safetensors, sf.SAFETENSORS),
    "model.plan": (lambda: b"ftrt" + bytes(range(256)) * 4, sf.TENSORRT_PLAN),
}


@pytest.mark.parametrize("filename", sorted(SAFE))
def test_safe_formats_are_detected_from_their_bytes(filename):
    make, expected = SAFE[filename]
    data = make()
    assert sf.check_model(data, filename) == expected
    assert sf.detect_format(data) == expected or expected == sf.TENSORRT_PLAN  # a plan is opaque: magic or extension


class _Model:  # what people pickle
    def __init__(self):
        self.weights = [1.0, 2.0]


PICKLES = {
    "model.pkl": pickle.dumps(_Model(), protocol=4),
    "model.joblib": zlib.compress(pickle.dumps({"estimator": [1, 2, 3]})),
    "model.pt": pickle.dumps({"state_dict": {"w": [0.0] * 4}}, protocol=2),
    "model.pth": pickle.dumps({"state_dict": {"w": [0.0] * 4}}, protocol=5),
}


@pytest.mark.parametrize("filename", sorted(PICKLES))
def test_pickle_extensions_are_refused_naming_the_safe_alternative(filename):
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(PICKLES[filename], filename)
    message = err.value.message
    assert "pickle" in message and filename in message
    alternatives = {".pkl": "ONNX", ".joblib": "ONNX", ".pt": "safetensors", ".pth": "safetensors"}
    assert alternatives[filename[filename.rindex(".") :]] in message
    assert isinstance(err.value, InvalidRequest)  # INVALID_ARGUMENT / 400 on the transports


def _torch_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"w": 1}, protocol=2))
        zf.writestr("archive/data/0", b"\0" * 16)
        zf.writestr("archive/version", b"3\n")
    return buffer.getvalue()


DISGUISED = {
    "protocol 2-5 stream": pickle.dumps({"a": [1, 2]}, protocol=4),
    "protocol 0 stream": pickle.dumps({"a": [1, 2]}, protocol=0),
    "protocol 1 stream": pickle.dumps([1, 2, 3], protocol=1),
    "torch zip with data.pkl": _torch_zip(),
    "gzip pickle (joblib)": gzip.compress(pickle.dumps([1, 2, 3])),
    "zlib pickle (joblib)": zlib.compress(pickle.dumps([1, 2, 3])),
    "bz2 pickle (joblib)": bz2.compress(pickle.dumps([1, 2, 3])),
    "xz pickle (joblib)": lzma.compress(pickle.dumps([1, 2, 3])),
}


@pytest.mark.parametrize("case", sorted(DISGUISED))
@pytest.mark.parametrize("filename", ["model.onnx", "model.bin", "weights.safetensors", ""])
def test_pickle_content_under_another_name_is_refused(case, filename):
    with pytest.raises(sf.UnsafeArtifact, match="pickle"):
        sf.check_model(DISGUISED[case], filename)


def test_detection_never_unpickles(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    assert sf.is_pickle(payload)
    with pytest.raises(sf.UnsafeArtifact):
        sf.check_model(payload, "model.onnx")
    assert not marker.exists()


def test_unknown_bytes_and_plain_json_are_refused():
    with pytest.raises(sf.UnsafeArtifact, match="not a recognised safe format"):
        sf.check_model(b"\x00garbage" * 10, "model.onnx")
    with pytest.raises(sf.UnsafeArtifact, match="companion"):
        sf.check_model(b'{"vocab_size": 10}', "config.json")
    sf.check_companion(b'{"vocab_size": 10}', "config.json")
    with pytest.raises(sf.UnsafeArtifact):
        sf.check_companion(pickle.dumps({}), "tokenizer.json")


def test_a_declared_format_must_match_the_bytes():
    with pytest.raises(InvalidRequest, match="declared as onnx but its bytes are lightgbm-text"):
        sf.check_model(_lightgbm(), "model.txt", "onnx")
