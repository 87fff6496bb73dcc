"""The demo models on the real embedded Triton: outputs equal validation.npz, tampered artifacts refuse to load."""

from __future__ import annotations

import ctypes
import queue
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from model_repository import demo
from model_repository.config_writer import read_config, write_config
from model_repository.layout import VERSION

import tritonclient.grpc as tritonclient_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from server.runtime.triton_install import TritonInstallation, TritonNotInstalled  # noqa: E402
from tests.conftest import copy_demo_models  # noqa: E402

pytestmark = pytest.mark.integration

TAMPERED = "tampered_lightgbm"
READY_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _add_tampered_copy(repo: Path) -> None:
    """A copy of lightgbm_regressor with one artifact byte changed and the config digest kept."""
    target = repo / TAMPERED
    shutil.copytree(repo / "lightgbm_regressor", target)
    config = read_config(target)
    config.name = TAMPERED
    write_config(config, target)
    artifact = target / VERSION / config.parameters["artifact"].string_value
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0x01
    artifact.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def repo(demo_repository, tmp_path_factory) -> Path:
    out = copy_demo_models(demo_repository, tmp_path_factory.mktemp("model_repository"))
    _add_tampered_copy(out)
    return out


@pytest.fixture(scope="module")
def client(repo, tmp_path_factory):
    try:
        triton = TritonInstallation.find()
    except TritonNotInstalled as exc:  # nvidia-pytriton is a dependency: its absence is a failure
        pytest.fail(str(exc))
    workdir = tmp_path_factory.mktemp("triton")
    backends = triton.prepare_backends(workdir)
    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    log_path = workdir / "tritonserver.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [
            str(triton.binary), f"--model-repository={repo}", "--model-control-mode=explicit",
            "--disable-auto-complete-config", f"--backend-directory={backends}",
            f"--cache-directory={triton.caches}", f"--grpc-port={grpc_port}", f"--http-port={http_port}",
            f"--metrics-port={metrics_port}", "--exit-timeout-secs=5",
        ],
        env=triton.environment(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
    )
    grpc_client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"tritonserver exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if grpc_client.is_server_ready():
                    break
            except InferenceServerException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tritonserver not ready in {READY_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.1)
        yield grpc_client
    finally:
        grpc_client.close()
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def loaded(client):
    for name in demo.DEMO_MODELS:
        client.load_model(name)
    return client


def _infer(client, name: str, rows: np.ndarray) -> np.ndarray:
    inp = tritonclient_grpc.InferInput("features", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    result = client.infer(name, [inp])
    (output,) = result.get_response().outputs
    return result.as_numpy(output.name)


@pytest.mark.parametrize("name", demo.DEMO_MODELS)
def test_one_full_batch_matches_validation(loaded, repo, name):
    validation = demo.load_validation(repo / name)
    rows = validation["features"][:64]
    got = _infer(loaded, name, rows)
    assert got.dtype == np.float32 and got.shape == validation["expected"][:64].shape
    assert np.allclose(got, validation["expected"][:64], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", demo.DEMO_MODELS)
def test_concurrent_requests_match_validation(loaded, repo, name):
    """All 256 rows as concurrent requests of uneven sizes; Triton batches them, adapters split back."""
    validation = demo.load_validation(repo / name)
    features, expected = validation["features"], validation["expected"]
    sizes = [1, 3, 64, 7, 16, 2, 33, 50, 5, 11, 64]
    assert sum(sizes) == len(features)
    starts = np.cumsum([0, *sizes])
    results: queue.Queue = queue.Queue()
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        inp = tritonclient_grpc.InferInput("features", [int(b - a), features.shape[1]], "FP32")
        inp.set_data_from_numpy(features[a:b])
        loaded.async_infer(name, [inp], callback=lambda result, error, i=i: results.put((i, result, error)))
    pieces: dict[int, np.ndarray] = {}
    for _ in sizes:
        i, result, error = results.get(timeout=30)
        assert error is None, error
        (output,) = result.get_response().outputs
        pieces[i] = result.as_numpy(output.name)
    got = np.concatenate([pieces[i] for i in range(len(sizes))])
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", demo.DEMO_MODELS)
def test_triton_reports_the_declared_signature(loaded, repo, name):
    meta = demo.read_metadata(repo / name)
    served = loaded.get_model_metadata(name)
    assert [(t.name, t.datatype, list(t.shape)) for t in served.inputs] == [
        (t["name"], t["datatype"], [-1, *t["dims"]]) for t in meta["signature"]["inputs"]
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in served.outputs] == [
        (t["name"], t["datatype"], [-1, *t["dims"]]) for t in meta["signature"]["outputs"]
    ]


def _counts(client, name: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(name).model_stats[0]
    return stats.inference_count, stats.execution_count


def test_dynamic_batcher_merges_requests_into_one_execute(loaded, repo):
    """64 one-row requests at once: Triton hands execute() several at a time, the answers stay per request."""
    name = "fraud_xgboost"
    validation = demo.load_validation(repo / name)
    before = _counts(loaded, name)
    results: queue.Queue = queue.Queue()
    for i in range(64):
        inp = tritonclient_grpc.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(validation["features"][i : i + 1])
        loaded.async_infer(name, [inp], callback=lambda result, error, i=i: results.put((i, result, error)))
    got = np.zeros((64, 1), np.float32)
    for _ in range(64):
        i, result, error = results.get(timeout=30)
        assert error is None, error
        got[i] = result.as_numpy("probability")[0]
    assert np.allclose(got, validation["expected"][:64], rtol=1e-4, atol=1e-5)
    # Triton updates its statistics just after it answers: read them until all 64 are counted
    deadline = time.monotonic() + 10
    while True:
        inferences, executions = (after - start for after, start in zip(_counts(loaded, name), before))
        if inferences >= 64 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert inferences == 64
    assert executions < 64


def test_tampered_artifact_fails_to_load(client):
    with pytest.raises(InferenceServerException, match="sha256"):
        client.load_model(TAMPERED)
    assert not client.is_model_ready(TAMPERED)
