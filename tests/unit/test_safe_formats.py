"""Only non-executable formats are accepted; anything pickle-based is refused, by name or by content."""

from __future__ import annotations

import bz2
import functools
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
from onnx import TensorProto, helper

from server.control import safe_formats as sf
from server.errors import InvalidRequest


@functools.cache  # the same bytes every call: built once per process (the mutation pass forks after it)
def _onnx() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@functools.cache
def _xgboost(raw_format: str) -> bytes:
    import xgboost as xgb

    rng = np.random.default_rng(0)
    booster = xgb.train({"max_depth": 2, "nthread": 1}, xgb.DMatrix(rng.random((20, 3)), label=rng.random(20)), 2)
    return bytes(booster.save_raw(raw_format=raw_format))


@functools.cache
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
    "model.engine": (lambda: b"ptrt" + struct.pack("<II", 0x61, 0) + bytes(range(256)) * 4, sf.TENSORRT_PLAN),
}


@pytest.mark.parametrize("filename", sorted(SAFE))
def test_safe_formats_are_detected_from_their_bytes(filename):
    make, expected = SAFE[filename]
    data = make()
    assert sf.check_model(data, filename) == expected
    assert sf.detect_format(data) == expected  # from the bytes alone: no name needed, none trusted


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


# ---- pickles under any name: content decides (issue 15, class 7) ---------------------------------


class _Call:  # what a malicious pickle does on load: call something
    def __reduce__(self):
        return (str, ("loaded",))


def _without_header(data: bytes) -> bytes:
    """The same opcode stream without PROTO / FRAME (pickle.loads still runs it)."""
    import pickletools

    ops = list(pickletools.genops(data))
    kept = []
    for i, (op, _arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        if op.name not in ("PROTO", "FRAME"):
            kept.append(data[pos:end])
    return b"".join(kept)


PICKLE_STREAMS = {
    **{f"protocol {n}": pickle.dumps([_Call(), {"w": [1.0, 2.0]}], protocol=n) for n in range(6)},
    "protocol 4 without PROTO/FRAME": _without_header(pickle.dumps(_Call(), protocol=4)),
    "protocol 5 without PROTO/FRAME": _without_header(pickle.dumps([_Call(), b"x" * 300], protocol=5)),
    "protocol 0 by hand (GLOBAL)": b"cbuiltins\nstr\n(Vloaded\ntR.",
    "protocol 2 without PROTO": _without_header(pickle.dumps({"a": _Call()}, protocol=2)),
    "bigger than the sniffed prefix": pickle.dumps([_Call(), bytes(3 << 20)], protocol=4),
}
# every name a model may carry, and none at all
NAMES = ["model.plan", "model.engine", "model.trt", "model.onnx", "model.json", "model.ubj", "model.txt",
         "model.safetensors", "config.json", "weights.bin", ""]  # fmt: skip


def test_the_issue_bytes_are_a_pickle_without_header():
    data = PICKLE_STREAMS["protocol 4 without PROTO/FRAME"]
    assert data.hex().startswith("8c086275696c74696e7394")  # SHORT_BINUNICODE 'builtins', MEMOIZE: as in the issue
    assert pickle.loads(data) == "loaded"  # it really runs on load


@pytest.mark.parametrize("kind", sorted(PICKLE_STREAMS))
@pytest.mark.parametrize("filename", NAMES)
def test_a_pickle_stream_is_refused_under_every_name(kind, filename):
    data = PICKLE_STREAMS[kind]
    with pytest.raises(sf.UnsafeArtifact, match="pickle"):
        sf.detect_format(data, filename)
    with pytest.raises(sf.UnsafeArtifact, match="pickle"):
        sf.check_model(data, filename, declared=sf.TENSORRT_PLAN)


@pytest.mark.parametrize("filename", ["model.plan", "model.engine", "model.trt"])
def test_a_plan_name_without_the_plan_header_is_refused(filename):
    for data in (b"not a plan at all, just bytes" * 4, b"ftrt", bytes(64), b"\x00ftrt" + bytes(40)):
        with pytest.raises(sf.UnsafeArtifact):
            sf.check_model(data, filename)


@pytest.mark.parametrize("filename", sorted(SAFE))
def test_no_accepted_format_reads_as_a_pickle(filename):
    data = SAFE[filename][0]()
    assert not sf.is_pickle(data[: 1 << 20])


def test_safetensors_whose_header_length_reads_as_a_tiny_pickle_is_still_safetensors():
    # header length 0x2E4E = 11854: its first two bytes are "N." (None, STOP), a valid pickle
    tensor = np.zeros(4, dtype=np.float32)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (0x2E4E - len(header))
    data = struct.pack("<Q", len(header)) + header + tensor.tobytes()
    assert data[:2] == b"N." and sf.is_pickle(data)
    assert sf.check_model(data, "model.safetensors") == sf.SAFETENSORS


@pytest.mark.parametrize("filename", ["model.pkl", "model.pickle", "model.joblib", "model.pt", "model.pth", "model.ckpt", "model.sav", "model.dill", "model.cloudpickle", "MODEL.PKL"])
def test_a_pickle_extension_is_refused_even_when_the_bytes_are_valid_onnx(filename):
    """The name alone refuses: a loader picks its reader by extension, so `model.pkl` would be unpickled."""
    data = _onnx()
    assert sf.check_model(data, "model.onnx") == sf.ONNX  # the same bytes under a safe name pass
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(data, filename)
    assert filename in err.value.message and "pickle" in err.value.message


# ---- the edges of each check (the mutation pass of safe_formats.py) --------------------------------


def _onnx_model(ir_version=8, nodes=1, outputs=1, graph=True) -> bytes:
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])][:nodes], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])][:outputs],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    model.ir_version = ir_version
    if not graph:
        model.ClearField("graph")
    return model.SerializeToString()


@pytest.mark.parametrize(
    ("case", "data"),
    [
        ("ir_version 1", _onnx_model(ir_version=1)),
        ("nodes, no output", _onnx_model(outputs=0)),
        ("an output, no node", _onnx_model(nodes=0)),
    ],
)
def test_an_onnx_model_needs_a_version_a_graph_and_something_in_it(case, data):
    assert sf.detect_format(data) == sf.ONNX, case


@pytest.mark.parametrize(
    ("case", "data"),
    [
        ("ir_version 0", _onnx_model(ir_version=0)),
        ("no graph", _onnx_model(graph=False)),
        ("an empty graph", _onnx_model(nodes=0, outputs=0)),
    ],
)
def test_protobuf_that_is_not_a_usable_onnx_model_is_refused(case, data):
    with pytest.raises(sf.UnsafeArtifact, match="not a recognised safe format"):
        sf.detect_format(data)


def test_a_plan_header_of_exactly_24_bytes_is_a_plan():
    assert sf.detect_format(b"ptrt" + bytes(20)) == sf.TENSORRT_PLAN
    with pytest.raises(sf.UnsafeArtifact):
        sf.detect_format(b"ptrt" + bytes(19))


def test_a_stream_cut_short_is_a_pickle_only_with_two_opcodes_of_evidence():
    assert sf.is_pickle(b"\x80\x04B\x10\x00")  # PROTO, then BINBYTES cut inside its length
    assert sf.is_pickle(b"\x80\x04N\xff")  # two whole opcodes before an unknown byte at the very end
    assert not sf.is_pickle(b"\x80")  # one opcode byte alone is no evidence
    assert not sf.is_pickle(b"B\x10")
    assert not sf.is_pickle(b"N\xff")


def _zip(*members: tuple[str, bytes], directory: str = "") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        if directory:
            zf.writestr(zipfile.ZipInfo(directory), b"")
        for name, data in members:
            zf.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "member"),
    [
        (_zip(("archive/DATA.PKL", b"not even a pickle")), "archive/DATA.PKL"),  # by name, any case
        (_zip(("model/state.pickle", b"x")), "model/state.pickle"),
        (_zip(("archive/version", b"3\n"), ("archive/weights", pickle.dumps([1, 2], protocol=2))), "archive/weights"),  # by content
    ],
)
def test_a_zip_holding_a_pickle_names_the_member(data, member):
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(data, "model.bin")
    assert f"holding the pickle '{member}'" in err.value.message


def test_a_zip_without_a_pickle_is_still_not_a_model():
    with pytest.raises(sf.UnsafeArtifact, match="zip archives are not a model format"):
        sf.check_model(_zip(("archive/version", b"3\n"), ("archive/empty", b""), directory="archive/sub/"), "model.bin")


TORCH_ADVICE = "export the network to ONNX (torch.onnx.export) or save its weights with safetensors (safetensors.torch.save_file)"
XGB_ADVICE = "save the booster as XGBoost JSON or UBJ (booster.save_model('model.json'))"
LGB_ADVICE = "save the booster as LightGBM text (booster.save_model('model.txt'))"
SKL_ADVICE = "convert the estimator to ONNX (skl2onnx.to_onnx) or use XGBoost JSON / LightGBM text"


@pytest.mark.parametrize(
    ("filename", "hint", "advice"),
    [
        ("model.pt", "", TORCH_ADVICE),
        ("", "a PyTorch checkpoint (pickle)", TORCH_ADVICE),
        ("", "a zip archive holding the pickle 'archive/data.pkl'", TORCH_ADVICE),
        ("best.ckpt", "", TORCH_ADVICE),
        ("weights.bin", "", TORCH_ADVICE),
        ("MODEL.PT", "", TORCH_ADVICE),
        ("xgb_model.pkl", "", XGB_ADVICE),
        ("my_xgboost.sav", "", XGB_ADVICE),
        ("lgb.pkl", "", LGB_ADVICE),
        ("lightgbm_model.pkl", "", LGB_ADVICE),
        ("model.joblib", "", SKL_ADVICE),
        ("sklearn_pipeline.pkl", "", SKL_ADVICE),
        ("model.pkl", "", f"save the model as {sf.SAFE_LIST}"),
    ],
)
def test_the_advice_fits_what_the_file_looks_like(filename, hint, advice):
    assert sf.alternative(filename, hint) == advice
    assert sf.alternative() == f"save the model as {sf.SAFE_LIST}"


def test_a_companion_is_checked_under_its_own_name_and_named_when_refused():
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_companion(_onnx(), "tokenizer.onnx")
    assert err.value.message == "companion file tokenizer.onnx must be JSON or safetensors, got onnx"
    with pytest.raises(sf.UnsafeArtifact, match="refusing tokenizer.pkl"):
        sf.check_companion(b'{"vocab": {}}', "tokenizer.pkl")  # JSON bytes, but a pickle name
    sf.check_companion(b'{"vocab": {}}', "tokenizer.json")


@pytest.mark.parametrize("filename", ["chat_template.jinja", "merges.txt", "VOCAB.TXT"])
def test_a_chat_template_or_vocabulary_companion_is_plain_utf8_text(filename):
    sf.check_companion("{% for m in messages %}{{ m['content'] }} é{% endfor %}\n".encode(), filename)
    for bad, why in ((pickle.dumps({"a": 1}), "plain text"), (b"a\x00b", "plain text"), (b"\xff\xfe\xfa", "UTF-8")):
        with pytest.raises(sf.UnsafeArtifact, match=why):
            sf.check_companion(bad, filename)


def test_a_companion_without_a_text_suffix_must_still_be_json_or_safetensors():
    sf.check_companion(b'{"a": 1}', "tokenizer.model")
    with pytest.raises(sf.UnsafeArtifact):
        sf.check_companion(b"plain words", "tokenizer.model")
    with pytest.raises(sf.UnsafeArtifact, match="must be JSON or safetensors, got onnx"):
        sf.check_companion(_onnx(), "tokenizer.json")
