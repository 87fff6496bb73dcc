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
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from server.control.registry import safe_formats as sf
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


# ---- compressed streams: every header joblib writes, only the head is read ------------------------

_PAYLOAD = pickle.dumps([_Call(), {"w": [1.0, 2.0]}], protocol=4)
COMPRESSED_PICKLES = {
    **{f"zlib level {level}": zlib.compress(_PAYLOAD, level) for level in (1, 4, 6, 9)},  # headers 78 01 / 5e / 9c / da
    "gzip": gzip.compress(_PAYLOAD),
    "bz2": bz2.compress(_PAYLOAD),
    "xz": lzma.compress(_PAYLOAD),
    "lzma alone (.lzma)": lzma.compress(_PAYLOAD, format=lzma.FORMAT_ALONE),  # starts with 5d
}


@pytest.mark.parametrize("kind", sorted(COMPRESSED_PICKLES))
def test_a_compressed_pickle_is_named_as_one_whatever_its_compression_header(kind):
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(COMPRESSED_PICKLES[kind], "model.bin")
    assert "it is a compressed pickle (the joblib dump format)" in err.value.message, err.value.message


_COMPRESSORS = {
    "gzip": gzip.compress,
    "zlib": zlib.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "lzma alone": functools.partial(lzma.compress, format=lzma.FORMAT_ALONE),
}


@pytest.mark.parametrize("kind", sorted(_COMPRESSORS))
def test_only_the_head_of_a_compressed_stream_is_read_so_a_damaged_tail_does_not_hide_the_pickle(kind):
    """Detection inflates the first MiB and no more (a decompression bomb is not inflated whole); a
    pickle there is refused as one even when the stream's end (its checksum) is damaged."""
    packed = _COMPRESSORS[kind](pickle.dumps([_Call(), bytes(3 << 20)], protocol=4))
    damaged = packed[:-4] + bytes(b ^ 0xFF for b in packed[-4:])
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(damaged, "model.bin")
    assert "it is a compressed pickle" in err.value.message, err.value.message


def test_a_compressed_stream_without_a_pickle_is_refused_as_not_a_model_naming_the_file():
    for data in (gzip.compress(b"just text"), zlib.compress(_onnx())):
        with pytest.raises(sf.UnsafeArtifact) as err:
            sf.check_model(data, "model.onnx")
        assert err.value.message == f"refusing model.onnx: compressed streams are not a model format; upload {sf.SAFE_LIST}"
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(gzip.compress(b"just text"))
    assert err.value.message.startswith("refusing artifact: compressed streams are not a model format")


# ---- LightGBM text: "tree" first, a version line within the first 4 KiB ------------------------------


def test_lightgbm_text_needs_both_its_tree_line_and_a_version_line_in_its_first_4_kib():
    model = _lightgbm()
    assert model.startswith(b"tree\n") and b"version=" in model[:4096]
    for data in (b"tree\nno version line\n" * 3, b"version=v4\nnot a tree first\n", b"tree\n" + b"#" * (4096 - 5 - 7) + b"version=v4\n"):
        with pytest.raises(sf.UnsafeArtifact, match="not a recognised safe format"):
            sf.detect_format(data)  # the last: its version line ends one byte past the first 4 KiB
    assert sf.detect_format(b"tree\n" + b"#" * (4096 - 5 - 8) + b"version=v4\n") == sf.LIGHTGBM_TEXT


# ---- safetensors: the header's length and every tensor's offsets must fit the file ------------------


def _st(header: bytes | dict, body: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def test_the_smallest_safetensors_files_are_safetensors():
    assert len(_st(b"{}")) == 10 and sf.detect_format(_st(b"{}")) == sf.SAFETENSORS  # no tensors: 10 bytes
    empty = {"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}  # a tensor of no elements
    assert sf.detect_format(_st(empty)) == sf.SAFETENSORS
    full = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert sf.detect_format(_st(full, bytes(8))) == sf.SAFETENSORS  # the last tensor ends at the file's end


@pytest.mark.parametrize(
    ("case", "data"),
    [
        ("header length past the file's end", _st(b"{}", length=100)),
        ("a tensor past the body's end", _st({"w": {"dtype": "F32", "shape": [7], "data_offsets": [0, 28]}}, bytes(24))),
        ("a tensor past the end, after __metadata__", _st({"__metadata__": {"a": "b"}, "w": {"dtype": "F32", "shape": [7], "data_offsets": [0, 28]}}, bytes(24))),
        ("an entry without a dtype", _st({"w": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4))),
        ("an entry without offsets", _st({"w": {"dtype": "F32", "shape": [1]}}, bytes(4))),
        ("an entry that is a string", _st({"w": "dtype data_offsets"}, bytes(4))),
        ("a header that is not JSON", _st(b"{not json}", bytes(4))),
        ("a header that does not open with {", _st(b' {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', bytes(4))),
        ("offsets that run backwards", _st({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4))),
    ],
)
def test_a_safetensors_header_that_does_not_fit_its_file_is_not_safetensors(case, data):
    with pytest.raises(sf.UnsafeArtifact):
        sf.detect_format(data, "model.safetensors")


# ---- what a refusal says: the file by its name ("artifact" without one), what it is, what to do ------

_PICKLE_RISK = "and pickle runs arbitrary code when loaded"


@pytest.mark.parametrize(
    ("data", "filename", "message"),
    [
        (PICKLE_STREAMS["protocol 4"], "model.onnx", f"refusing model.onnx: it is a pickle opcode stream, {_PICKLE_RISK}; save the model as {sf.SAFE_LIST}"),
        (PICKLE_STREAMS["protocol 4"], "", f"refusing artifact: it is a pickle opcode stream, {_PICKLE_RISK}; save the model as {sf.SAFE_LIST}"),
        (PICKLE_STREAMS["protocol 4"], "xgb_model.bst", f"refusing xgb_model.bst: it is a pickle opcode stream, {_PICKLE_RISK}; {XGB_ADVICE}"),
        (_onnx(), "xgb_model.pkl", f"refusing xgb_model.pkl: it is a Python pickle, {_PICKLE_RISK}; {XGB_ADVICE}"),
        (_onnx(), "model.joblib", f"refusing model.joblib: it is a joblib (pickle) dump, {_PICKLE_RISK}; {SKL_ADVICE}"),
        (_torch_zip(), "checkpoint.zip", f"refusing checkpoint.zip: it is a zip archive holding the pickle 'archive/data.pkl' (the PyTorch save format), {_PICKLE_RISK}; {TORCH_ADVICE}"),
        (_torch_zip(), "", f"refusing artifact: it is a zip archive holding the pickle 'archive/data.pkl' (the PyTorch save format), {_PICKLE_RISK}; {TORCH_ADVICE}"),
        (COMPRESSED_PICKLES["gzip"], "", f"refusing artifact: it is a compressed pickle (the joblib dump format), {_PICKLE_RISK}; {SKL_ADVICE}"),
        (COMPRESSED_PICKLES["gzip"], "lgb.gz", f"refusing lgb.gz: it is a compressed pickle (the joblib dump format), {_PICKLE_RISK}; {LGB_ADVICE}"),
        (_zip(("archive/version", b"3\n")), "", f"refusing artifact: zip archives are not a model format; upload {sf.SAFE_LIST}"),
        (_zip(("archive/version", b"3\n")), "model.zip", f"refusing model.zip: zip archives are not a model format; upload {sf.SAFE_LIST}"),
        (b"\x00garbage" * 10, "", f"refusing artifact: not a recognised safe format; upload {sf.SAFE_LIST}"),
        (b"\x00garbage" * 10, "model.onnx", f"refusing model.onnx: not a recognised safe format; upload {sf.SAFE_LIST}"),
    ],
)
def test_a_refusal_names_the_file_what_it_is_and_what_to_save_instead(data, filename, message):
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_model(data, filename)
    assert err.value.message == message


def test_plain_json_and_a_wrong_declaration_name_the_file_or_call_it_artifact():
    companion_only = f"is plain JSON: JSON is accepted only as a companion file (config, tokenizer) of a safetensors model; the model itself must be {sf.SAFE_LIST}"
    for filename, named in (("config.json", "config.json"), ("", "artifact")):
        with pytest.raises(sf.UnsafeArtifact) as err:
            sf.check_model(b'{"vocab_size": 10}', filename)
        assert err.value.message == f"{named} {companion_only}"
        with pytest.raises(InvalidRequest) as err:
            sf.check_model(_lightgbm(), filename, "onnx")
        assert err.value.message == f"{named} was declared as onnx but its bytes are lightgbm-text"
    assert sf.check_model(_lightgbm(), "", "lightgbm-text") == sf.LIGHTGBM_TEXT


def test_json_is_recognised_by_its_bytes_or_its_name_and_xgboost_json_needs_learner_and_version():
    assert sf.detect_format(b"[1, 2]") == sf.JSON  # a JSON array: a companion
    assert sf.detect_format(b' {"vocab": {}}', "tokenizer.json") == sf.JSON  # leading space: the name says JSON
    with pytest.raises(sf.UnsafeArtifact, match="not a recognised safe format"):
        sf.detect_format(b' {"vocab": {}}', "tokenizer.txt")
    assert sf.detect_format(b'{"version": [2, 0, 0]}') == sf.JSON  # a version alone is no booster
    assert sf.detect_format(b'{"learner": {}}') == sf.JSON
    assert sf.detect_format(b'{"learner": {}, "version": [2, 0, 0]}') == sf.XGBOOST_JSON


# ---- a local file: read whole up to STREAM_ABOVE, above it recognised by its header -----------------


@pytest.mark.parametrize("filename", sorted(SAFE))
def test_a_small_file_is_checked_like_its_bytes_under_its_own_name(tmp_path, filename):
    make, expected = SAFE[filename]
    path = tmp_path / filename
    path.write_bytes(make())
    assert sf.check_model_file(path) == expected
    assert sf.check_model_file(str(path), "renamed" + path.suffix) == expected


def test_a_small_file_named_as_a_pickle_is_refused_by_its_own_name(tmp_path):
    path = tmp_path / "model.pkl"
    path.write_bytes(_onnx())
    with pytest.raises(sf.UnsafeArtifact, match="refusing model.pkl: it is a Python pickle"):
        sf.check_model_file(path)
    with pytest.raises(sf.UnsafeArtifact, match="refusing upload.pt: it is a PyTorch checkpoint"):
        sf.check_model_file(path, "upload.pt")  # the name the caller gave, not the temporary file's


@pytest.fixture
def streamed(monkeypatch):
    """Every file of more than 16 bytes takes the large-file path (as one over 256 MiB does)."""
    monkeypatch.setattr(sf, "STREAM_ABOVE", 16)


@pytest.fixture
def never_read_whole(monkeypatch):
    """A large safetensors file or plan is recognised by its header: reading it whole fails the test."""

    def read_whole(path):
        raise AssertionError(f"{path} was read whole")

    monkeypatch.setattr(Path, "read_bytes", read_whole)


def test_a_large_safetensors_file_is_recognised_by_its_header_and_checked_against_the_declaration(tmp_path, streamed, never_read_whole):
    path = tmp_path / "big.safetensors"
    path.write_bytes(_safetensors())
    assert sf.check_model_file(path) == sf.SAFETENSORS
    assert sf.check_model_file(path, declared=sf.SAFETENSORS) == sf.SAFETENSORS
    with pytest.raises(InvalidRequest) as err:
        sf.check_model_file(path, declared=sf.ONNX)
    assert err.value.message == "big.safetensors was declared as onnx but its bytes are safetensors"


def test_a_large_tensorrt_plan_is_recognised_by_its_header_and_checked_against_the_declaration(tmp_path, streamed, never_read_whole):
    path = tmp_path / "big.plan"
    path.write_bytes(b"ptrt" + bytes(range(256)) * 8)
    assert sf.check_model_file(path) == sf.TENSORRT_PLAN
    assert sf.check_model_file(path, "model.engine", declared=sf.TENSORRT_PLAN) == sf.TENSORRT_PLAN
    with pytest.raises(InvalidRequest) as err:
        sf.check_model_file(path, declared=sf.ONNX)
    assert err.value.message == "big.plan was declared as onnx but its bytes are tensorrt-plan"


@pytest.mark.parametrize("filename", ["big.pkl", "big.PT", "big.joblib"])
def test_a_large_file_named_as_a_pickle_is_refused_by_its_name_whatever_its_header(tmp_path, streamed, filename):
    for data in (_safetensors(), b"ptrt" + bytes(64), _onnx()):
        path = tmp_path / filename
        path.write_bytes(data)
        with pytest.raises(sf.UnsafeArtifact) as err:
            sf.check_model_file(path)
        assert err.value.message.startswith(f"refusing {filename}: it is a") and _PICKLE_RISK in err.value.message


def test_a_large_file_of_any_other_format_is_read_whole_and_checked_like_its_bytes(tmp_path, streamed):
    cases = {"model.onnx": (_onnx(), sf.ONNX), "model.txt": (_lightgbm(), sf.LIGHTGBM_TEXT), "model.json": (_xgboost("json"), sf.XGBOOST_JSON)}
    for filename, (data, expected) in cases.items():
        (tmp_path / filename).write_bytes(data)
        assert sf.check_model_file(tmp_path / filename) == expected
    with pytest.raises(InvalidRequest, match="model.txt was declared as onnx but its bytes are lightgbm-text"):
        sf.check_model_file(tmp_path / "model.txt", declared=sf.ONNX)
    (tmp_path / "weights.bin").write_bytes(PICKLE_STREAMS["bigger than the sniffed prefix"])
    with pytest.raises(sf.UnsafeArtifact, match="refusing weights.bin: it is a pickle opcode stream"):
        sf.check_model_file(tmp_path / "weights.bin")


@pytest.mark.parametrize(
    ("case", "data"),
    [
        ("shorter than a length", b"\x02\x00\x00\x00\x00"),
        ("header length past the file's end", _st(b"{}" + b" " * 30, length=100)),  # what is there parses: {}
        ("header length under 2", _st(b"{", b"}" + bytes(30), length=1)),
        ("a tensor past the body's end", _st({"w": {"dtype": "F32", "shape": [7], "data_offsets": [0, 28]}}, bytes(24))),
        ("a pickle behind a safetensors-looking name", PICKLE_STREAMS["protocol 4"]),
    ],
)
def test_a_large_file_whose_safetensors_header_does_not_fit_is_not_safetensors(tmp_path, streamed, case, data):
    path = tmp_path / "big.safetensors"
    path.write_bytes(data)
    with pytest.raises(sf.UnsafeArtifact):
        sf.check_model_file(path)


def test_a_large_safetensors_file_with_the_smallest_header_is_safetensors(tmp_path, streamed, never_read_whole):
    path = tmp_path / "big.safetensors"
    path.write_bytes(_st(b"{}", bytes(32)))  # a 2-byte header, no tensors, above the threshold
    assert sf.check_model_file(path) == sf.SAFETENSORS
    path.write_bytes(_st({"w": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]}}, bytes(32)))  # ends at the end
    assert sf.check_model_file(path) == sf.SAFETENSORS
    path.write_bytes(_st({"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}))  # the header ends at the file's end
    assert sf.check_model_file(path) == sf.SAFETENSORS


def test_a_small_file_is_checked_against_its_declared_format(tmp_path):
    path = tmp_path / "model.txt"
    path.write_bytes(_lightgbm())
    assert sf.check_model_file(path, declared=sf.LIGHTGBM_TEXT) == sf.LIGHTGBM_TEXT
    with pytest.raises(InvalidRequest, match="model.txt was declared as onnx but its bytes are lightgbm-text"):
        sf.check_model_file(path, declared=sf.ONNX)


def test_bytes_without_a_name_are_called_artifact_and_empty_bytes_are_no_pickle(capsys):
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.detect_format(b"\x00garbage" * 10)
    assert err.value.message == f"refusing artifact: not a recognised safe format; upload {sf.SAFE_LIST}"
    assert not sf.is_pickle(b"")
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.detect_format(b"", "model.onnx")
    assert err.value.message == f"refusing model.onnx: not a recognised safe format; upload {sf.SAFE_LIST}"


def test_walking_a_pickle_writes_nothing_to_the_servers_output(capsys):
    with pytest.raises(sf.UnsafeArtifact):
        sf.check_model(PICKLE_STREAMS["protocol 4"], "model.onnx")
    assert sf.is_pickle(PICKLE_STREAMS["protocol 2"])
    assert capsys.readouterr() == ("", "")  # pickletools' listing is discarded, never printed


def test_xgboost_ubj_names_its_learner_within_its_first_32_bytes():
    assert sf.detect_format(b"{" + b"#" * 24 + b"learner" + b"\xff") == sf.XGBOOST_UBJ  # ends at byte 32
    with pytest.raises(sf.UnsafeArtifact, match="not a recognised safe format"):
        sf.detect_format(b"{" + b"#" * 25 + b"learner" + b"\xff")  # ends one byte later
@pytest.mark.parametrize("filename", ["chat_template.jinja", "merges.txt", "VOCAB.TXT"])
def test_a_chat_template_or_vocabulary_companion_is_plain_utf8_text(filename):
    sf.check_companion("{% for m in messages %}{{ m['content'] }} é{% endfor %}\n".encode(), filename)
    for bad, why in ((pickle.dumps({"a": 1}), "plain text"), (b"a\x00b", "plain text"), (b"\xff\xfe\xfa", "UTF-8")):
        with pytest.raises(sf.UnsafeArtifact, match=why):
            sf.check_companion(bad, filename)


@pytest.mark.parametrize("filename", ["chat_template.jinja", "merges.txt"])
def test_a_text_companion_that_is_a_protocol_0_pickle_is_refused(filename):
    """A protocol-0 pickle is printable ASCII with no NUL byte (valid UTF-8 text): only the pickle
    check stands between it and a loader that unpickles a 'vocabulary'."""
    stream = pickle.dumps({"a": 1}, protocol=0)
    assert b"\x00" not in stream and stream.decode("utf-8")
    with pytest.raises(sf.UnsafeArtifact) as err:
        sf.check_companion(stream, filename)
    assert err.value.message == f"companion file {filename} must be plain text"


def test_a_companion_without_a_text_suffix_must_still_be_json_or_safetensors():
    sf.check_companion(b'{"a": 1}', "tokenizer.model")
    with pytest.raises(sf.UnsafeArtifact):
        sf.check_companion(b"plain words", "tokenizer.model")
    with pytest.raises(sf.UnsafeArtifact, match="must be JSON or safetensors, got onnx"):
        sf.check_companion(_onnx(), "tokenizer.json")
