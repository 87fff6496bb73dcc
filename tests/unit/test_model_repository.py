"""model_repository: config round trip, deterministic demo build, metadata, adapters without Triton."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from model_repository import demo
from model_repository.adapters import _common
from model_repository.config_writer import ServingConfig, python_backend_config, read_config, to_text, write_config
from model_repository.layout import VERSION
from server.protogen.inference import model_config_pb2

SIGNATURES = {
    "mlp_classifier": ("features", 64, "probabilities", 10, "model.onnx"),
    "fraud_xgboost": ("features", 32, "probability", 1, "model.json"),
    "lightgbm_regressor": ("features", 16, "prediction", 1, "model.txt"),
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("repo")
    assert demo.build_demo_repository(out) == list(demo.DEMO_MODELS)
    return out


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- config ---------------------------------------------------------------------------------------


def test_config_round_trip(tmp_path):
    serving = ServingConfig(max_batch_size=32, preferred_batch_sizes=(8, 4), max_queue_delay_us=500, instances=2, response_cache=True)
    config = python_backend_config("m", {"features": [8]}, {"score": [1]}, serving, {"artifact": "model.onnx", "threads": "2"})
    path = write_config(config, tmp_path / "m")
    assert path == tmp_path / "m" / "config.pbtxt"
    parsed = read_config(tmp_path / "m")
    assert parsed == config
    assert read_config(path) == config
    assert parsed.backend == "python" and parsed.max_batch_size == 32
    assert list(parsed.dynamic_batching.preferred_batch_size) == [4, 8]
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 500
    assert parsed.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert parsed.instance_group[0].count == 2
    assert parsed.response_cache.enable
    assert parsed.parameters["artifact"].string_value == "model.onnx"
    assert parsed.input[0].data_type == model_config_pb2.TYPE_FP32 and list(parsed.input[0].dims) == [8]


def test_config_text_is_what_triton_reads():
    config = python_backend_config("m", {"features": [4]}, {"score": [1]})
    text = to_text(config)
    # Triton's parser wants enum names and field names from its model_config.proto.
    for line in ('name: "m"', 'backend: "python"', "data_type: TYPE_FP32", "kind: KIND_CPU", "max_batch_size: 64"):
        assert line in text
    assert "response_cache" not in text  # only written when enabled


def test_serving_config_defaults_and_validation():
    default = ServingConfig()
    assert default.max_batch_size == 64 and default.instances == 1 and not default.response_cache
    assert max(default.preferred_batch_sizes) <= default.max_batch_size
    with pytest.raises(ValueError):
        ServingConfig(max_batch_size=8, preferred_batch_sizes=(16,))
    with pytest.raises(ValueError):
        ServingConfig(instances=0)
    unbatched = python_backend_config("m", {"x": [1]}, {"y": [1]}, ServingConfig(max_batch_size=0, preferred_batch_sizes=()))
    assert not unbatched.HasField("dynamic_batching")


def test_write_config_needs_a_name(tmp_path):
    with pytest.raises(ValueError):
        write_config(model_config_pb2.ModelConfig(backend="python"), tmp_path)


# --- demo repository ------------------------------------------------------------------------------


def test_demo_build_is_deterministic(repo, tmp_path):
    demo.build_demo_repository(tmp_path)
    assert _digests(tmp_path) == _digests(repo)


@pytest.mark.parametrize("name", demo.DEMO_MODELS)
def test_demo_model_layout(repo, name):
    in_name, in_dim, out_name, out_dim, artifact = SIGNATURES[name]
    model_dir = repo / name
    config = read_config(model_dir)
    assert config.name == name and config.backend == "python" and config.max_batch_size == 64
    assert [(t.name, list(t.dims)) for t in config.input] == [(in_name, [in_dim])]
    assert [(t.name, list(t.dims)) for t in config.output] == [(out_name, [out_dim])]
    assert config.dynamic_batching.max_queue_delay_microseconds == 200
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["artifact"] == artifact and params["threads"] == "1"
    artifact_path = model_dir / VERSION / artifact
    assert params["artifact_sha256"] == _common.sha256_file(artifact_path)
    assert (model_dir / VERSION / "model.py").is_file() and (model_dir / VERSION / "_common.py").is_file()

    meta = demo.read_metadata(model_dir)
    assert meta["name"] == name and meta["sha256"] == params["artifact_sha256"]
    assert meta["artifact"] == f"{VERSION}/{artifact}" and meta["max_batch_size"] == 64
    assert isinstance(meta["training"]["seed"], int)
    (inp,) = meta["signature"]["inputs"]
    (out,) = meta["signature"]["outputs"]
    assert (inp["name"], inp["datatype"], inp["dims"]) == (in_name, "FP32", [in_dim])
    assert (out["name"], out["datatype"], out["dims"]) == (out_name, "FP32", [out_dim])

    validation = demo.load_validation(model_dir)
    features, expected = validation["features"], validation["expected"]
    assert features.dtype == np.float32 and features.shape == (256, in_dim)
    assert expected.dtype == np.float32 and expected.shape == (256, out_dim)
    low, high = inp["range"]
    assert low <= features.min() and features.max() <= high
    assert np.isfinite(expected).all()


def test_demo_models_are_not_trivial(repo):
    probs = demo.load_validation(repo / "mlp_classifier")["expected"]
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert len(set(probs.argmax(axis=1))) > 5
    fraud = demo.load_validation(repo / "fraud_xgboost")["expected"]
    assert ((fraud >= 0) & (fraud <= 1)).all() and fraud.std() > 0.01
    assert demo.load_validation(repo / "lightgbm_regressor")["expected"].std() > 1.0


def test_no_pickle_in_repository(repo):
    suffixes = {p.suffix for p in repo.rglob("*") if p.is_file()}
    assert suffixes <= {".pbtxt", ".py", ".onnx", ".json", ".txt", ".npz"}


# --- adapter helpers ------------------------------------------------------------------------------


def test_concat_and_split_round_trip():
    parts = [np.full((n, 3), i, dtype=np.float64) for i, n in enumerate([1, 4, 2])]
    batch, counts = _common.concat_batch(parts)
    assert batch.dtype == np.float32 and batch.shape == (7, 3) and counts == [1, 4, 2]
    pieces = _common.split_batch(batch[:, 0], counts, [1])
    assert [p.shape for p in pieces] == [(1, 1), (4, 1), (2, 1)]
    assert [float(p[0, 0]) for p in pieces] == [0.0, 1.0, 2.0]
    (single,) = _common.split_batch(np.zeros(5), [5], [1])
    assert single.shape == (5, 1) and single.dtype == np.float32


def test_verify_artifact(tmp_path):
    path = tmp_path / "model.txt"
    path.write_bytes(b"tree")
    digest = hashlib.sha256(b"tree").hexdigest()
    assert _common.verify_artifact(path, digest) == path
    assert _common.verify_artifact(path, digest.upper()) == path
    path.write_bytes(b"tref")  # one byte changed, digest kept
    with pytest.raises(_common.ArtifactMismatch, match="sha256"):
        _common.verify_artifact(path, digest)
    with pytest.raises(_common.ArtifactMismatch, match="no artifact_sha256"):
        _common.verify_artifact(path, "")
    with pytest.raises(_common.ArtifactMismatch, match="does not exist"):
        _common.verify_artifact(tmp_path / "missing.txt", digest)


# --- adapters run against a fake triton_python_backend_utils ---------------------------------------


class _FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class _FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self.error = list(output_tensors), error


class _FakeError:
    def __init__(self, message):
        self.message = message


def _fake_pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor = _FakeTensor
    module.InferenceResponse = _FakeResponse
    module.TritonError = _FakeError
    module.get_input_tensor_by_name = lambda request, name: next(t for t in request if t.name() == name)
    return module


def _load_adapter(model_dir: Path, monkeypatch):
    """Import ``NAME/1/model.py`` the way the Python backend does (version dir on sys.path)."""
    version_dir = model_dir / VERSION
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    monkeypatch.delitem(sys.modules, "_common", raising=False)
    monkeypatch.syspath_prepend(str(version_dir))
    spec = importlib.util.spec_from_file_location(f"adapter_{model_dir.name}", version_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parsed = read_config(model_dir)  # Triton hands the adapter this config as JSON
    config = {
        "parameters": {k: {"string_value": v.string_value} for k, v in parsed.parameters.items()},
        "input": [{"name": t.name, "dims": [str(d) for d in t.dims]} for t in parsed.input],
        "output": [{"name": t.name, "dims": [str(d) for d in t.dims]} for t in parsed.output],
    }
    args = {"model_config": json.dumps(config), "model_repository": str(model_dir), "model_version": VERSION}
    return module.TritonPythonModel(), args


@pytest.mark.parametrize("name", demo.DEMO_MODELS)
def test_adapter_one_call_per_batch(repo, name, monkeypatch):
    model, args = _load_adapter(repo / name, monkeypatch)
    model.initialize(args)
    validation = demo.load_validation(repo / name)
    in_name, _, out_name, _, _ = SIGNATURES[name]
    calls = []
    predict = model._predict
    model._predict = lambda batch: calls.append(batch.shape[0]) or predict(batch)
    sizes = [1, 7, 24]
    starts = np.cumsum([0, *sizes])
    requests = [[_FakeTensor(in_name, validation["features"][a:b])] for a, b in zip(starts[:-1], starts[1:])]
    responses = model.execute(requests)
    assert calls == [sum(sizes)]  # one model call for the whole batch
    outputs = [r.output_tensors[0] for r in responses]
    assert [o.name() for o in outputs] == [out_name] * 3
    assert [o.as_numpy().shape[0] for o in outputs] == sizes
    got = np.concatenate([o.as_numpy() for o in outputs])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, validation["expected"][: sum(sizes)], rtol=1e-4, atol=1e-5)
    model.finalize()


def test_adapter_batch_error_becomes_error_responses(repo, monkeypatch):
    model, args = _load_adapter(repo / "lightgbm_regressor", monkeypatch)
    model.initialize(args)
    bad = [[_FakeTensor("features", np.zeros((2, 3), np.float32))], [_FakeTensor("features", np.zeros((1, 3), np.float32))]]
    responses = model.execute(bad)
    assert len(responses) == 2
    assert all(r.error is not None and not r.output_tensors for r in responses)
    assert all(r.error.message for r in responses)


def test_adapter_refuses_tampered_artifact(repo, tmp_path, monkeypatch):
    import shutil

    model_dir = tmp_path / "fraud_xgboost"
    shutil.copytree(repo / "fraud_xgboost", model_dir)
    artifact = model_dir / VERSION / "model.json"
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0x01
    artifact.write_bytes(bytes(data))
    model, args = _load_adapter(model_dir, monkeypatch)
    with pytest.raises(RuntimeError, match="sha256"):
        model.initialize(args)
