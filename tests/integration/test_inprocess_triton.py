"""Triton in the test's own process through its C API (``InProcessTriton``), beside a real remote
Triton (``TritonSupervisor``) over the same repository: the same answers, byte for byte; the same
control answers; decoupled streams, BYTES tensors, a killed model stub, and a clean shutdown.

One in-process Triton lives at a time in a process (libtritonserver keeps process-wide state), so
the lifecycle test, which starts and stops its own, runs first; the others share one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import pytest_asyncio
from google.protobuf import json_format

from model_repository.config_writer import read_config, write_config
from model_repository.demo import load_validation
from server import errors
from server.dataplane import codecs
from server.dataplane.triton_client import TritonClient
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime.inprocess import FINAL_PARAMETER, InProcessTriton
from server.runtime.supervisor import TritonSupervisor

pytestmark = pytest.mark.integration

TABULAR = ("fraud_xgboost", "mlp_classifier", "lightgbm_regressor")
VICTIM = "lightgbm_victim"  # its stub gets killed
STATS_MODEL = "mlp_stats"  # fresh statistics on both Tritons
LLM, EMBEDDINGS = "tiny_llama", "minilm_embeddings"


def _copy_model(repo: Path, source: str, name: str) -> None:
    shutil.copytree(repo / source, repo / name)
    config = read_config(repo / name)
    config.name = name
    write_config(config, repo / name)


@pytest.fixture(scope="module")
def repository(demo_repository, tmp_path_factory) -> Path:
    from model_repository.embeddings import build_embedding_model
    from server.control.rollout.llm_install import install_llm_models

    out = tmp_path_factory.mktemp("inprocess") / "model_repository"
    out.mkdir()
    for model in TABULAR:
        shutil.copytree(demo_repository / model, out / model)
    _copy_model(out, "lightgbm_regressor", VICTIM)
    _copy_model(out, "mlp_classifier", STATS_MODEL)
    install_llm_models(out, tiny=True)  # registered in a scratch registry beside the repository, deployed from it
    build_embedding_model(out)
    return out


def _request(model: str, features: np.ndarray, request_id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="features", datatype="FP32", shape=list(features.shape))
    request.raw_input_contents.append(np.ascontiguousarray(features, np.float32).tobytes())
    return request


def _rows(repo: Path, model: str, n: int = 8) -> np.ndarray:
    return load_validation(repo / model)["features"][:n].astype(np.float32)


def _stubs(prefix: str) -> list[psutil.Process]:
    """This process's Python-backend stubs of one server (alive or zombie)."""
    found = []
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE and child.name().startswith("triton_python"):
                found.append(child)
            elif any(arg.startswith(prefix) for arg in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _stub_of(prefix: str, model: str) -> psutil.Process:
    """The live stub process that runs ``model``."""
    for child in _stubs(prefix):
        try:
            if any(f"/{model}/" in arg for arg in child.cmdline()):
                return child
        except psutil.ZombieProcess:
            continue
    raise AssertionError(f"no stub process for {model}")


# ---- lifecycle (its own server; runs first) -----------------------------------------------------


async def test_lifecycle_start_load_unload_stop_leaves_nothing(repository, tmp_path):
    environment = {key: os.environ.get(key) for key in ("PATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS")}
    triton = await InProcessTriton.start(repository, tmp_path / "lifecycle", models=("fraud_xgboost",))
    prefix = triton.shm_prefix
    try:
        assert await triton.server_live() and await triton.server_ready()
        ready = {m.name for m in await triton.repository_index(ready_only=True)}
        assert ready == {"fraud_xgboost"}
        features = _rows(repository, "fraud_xgboost")
        answer = await triton.infer(_request("fraud_xgboost", features))
        np.testing.assert_allclose(np.frombuffer(answer.raw_output_contents[0], np.float32), load_validation(repository / "fraud_xgboost")["expected"][:8].ravel(), rtol=1e-5)
        stub = _stub_of(prefix, "fraud_xgboost")
        assert list(Path("/dev/shm").glob(prefix + "*")), "the Python backend's regions carry this server's prefix"

        await triton.unload_model("fraud_xgboost")
        await triton.wait_unloaded("fraud_xgboost")
        assert not stub.is_running(), "the unloaded model's stub exited and was reaped"
        with pytest.raises(errors.InferplaneError):
            await triton.infer(_request("fraud_xgboost", features))
        await triton.load_model("fraud_xgboost")
        assert (await triton.infer(_request("fraud_xgboost", features))).raw_output_contents[0] == answer.raw_output_contents[0]
    finally:
        await triton.stop()
    assert _stubs(prefix) == [], "no stub processes (nor zombies) after stop"
    assert list(Path("/dev/shm").glob(prefix + "*")) == [], "no shared-memory regions after stop"
    assert {key: os.environ.get(key) for key in environment} == environment, "the stubs' environment is taken back"
    assert not await triton.server_live()
    with pytest.raises(errors.BackendUnavailable):
        await triton.infer(_request("fraud_xgboost", features))


# ---- the shared servers -------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def remote(repository, tmp_path_factory):
    """A real tritonserver process on the same repository, and the data plane's client to it."""
    supervisor = TritonSupervisor(repository, tmp_path_factory.mktemp("remote_triton"))
    await supervisor.start()
    client = TritonClient(supervisor.grpc_target)
    client.connect()
    await asyncio.gather(*(client.load_model(m) for m in (*TABULAR, STATS_MODEL)))
    yield client
    await client.close()
    await supervisor.stop()


@pytest_asyncio.fixture(scope="module")
async def triton(repository, tmp_path_factory):
    server = await InProcessTriton.start(repository, tmp_path_factory.mktemp("inprocess_triton"), models=(*TABULAR, VICTIM, STATS_MODEL))
    yield server
    prefix = server.shm_prefix
    await server.stop()
    assert _stubs(prefix) == [] and list(Path("/dev/shm").glob(prefix + "*")) == []


@pytest.mark.parametrize("model", TABULAR)
async def test_same_answers_as_the_remote_triton(triton, remote, repository, model):
    request = _request(model, _rows(repository, model), request_id=f"same-{model}")
    raw = request.SerializeToString()
    mine, theirs = await triton.infer_raw(raw, timeout=30), await remote.infer_raw(raw, timeout=30)
    assert pb.ModelInferResponse.FromString(mine) == pb.ModelInferResponse.FromString(theirs)
    assert mine == theirs, "the serialized answers are the same bytes"
    # the parsed-request fast paths answer the same
    assert await triton.infer(request) == pb.ModelInferResponse.FromString(mine)
    assert await triton.infer_bytes(request) == mine


async def test_requested_outputs_versions_and_typed_contents(triton, remote, repository):
    features = _rows(repository, "mlp_classifier", 3)
    request = _request("mlp_classifier", features)
    request.model_version = "1"
    request.outputs.add(name="probabilities")
    typed = pb.ModelInferRequest(model_name="mlp_classifier")
    tensor = typed.inputs.add(name="features", datatype="FP32", shape=list(features.shape))
    tensor.contents.fp32_contents.extend(features.ravel().tolist())
    for message in (request, typed):
        assert await triton.infer_raw(message.SerializeToString()) == await remote.infer_raw(message.SerializeToString())


async def test_a_stream_of_plain_requests_equals_the_remote_triton(triton, remote, repository):
    """ModelStreamInfer with a non-decoupled model: each answer carries triton_final_response=true,
    and a request Triton refuses gets an in-stream error, as from Triton's gRPC frontend."""
    requests = [_request("fraud_xgboost", _rows(repository, "fraud_xgboost", n), f"s{n}") for n in (1, 2, 3)]
    requests.append(_request("fraud_xgboost", np.zeros((1, 5), np.float32), "wrong-shape"))

    async def collect(call) -> dict[str, pb.ModelStreamInferResponse]:
        for request in requests:
            await call.write(request.SerializeToString())
        await call.done_writing()
        answers = [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]
        return {r.infer_response.id: r for r in answers}

    mine, theirs = await collect(triton.stream_raw(timeout=30)), await collect(remote.stream_raw(timeout=30))
    assert mine.keys() == theirs.keys() == {"s1", "s2", "s3", "wrong-shape"}
    for key in ("s1", "s2", "s3"):
        assert mine[key] == theirs[key], key
        assert mine[key].infer_response.parameters[FINAL_PARAMETER].bool_param is True
    assert mine["wrong-shape"].error_message == theirs["wrong-shape"].error_message != ""


async def test_control_answers_equal_the_remote_triton(triton, remote):
    for method, message in (
        ("ModelMetadata", pb.ModelMetadataRequest(name="fraud_xgboost")),
        ("ModelConfig", pb.ModelConfigRequest(name="lightgbm_regressor", version="1")),
        ("ServerLive", pb.ServerLiveRequest()),
        ("ModelReady", pb.ModelReadyRequest(name="mlp_classifier")),
    ):
        raw = message.SerializeToString()
        kind = {"ModelMetadata": pb.ModelMetadataResponse, "ModelConfig": pb.ModelConfigResponse, "ServerLive": pb.ServerLiveResponse, "ModelReady": pb.ModelReadyResponse}[method]
        assert kind.FromString(await triton.unary_raw(method, raw)) == kind.FromString(await remote.unary_raw(method, raw)), method
    assert await triton.model_config("fraud_xgboost") == await remote.model_config("fraud_xgboost")
    mine = {m.name: (m.version, m.state) for m in await triton.repository_index()}
    theirs = {m.name: (m.version, m.state) for m in await remote.repository_index()}
    for name in (*TABULAR, STATS_MODEL):
        assert mine[name] == theirs[name] == ("1", "READY"), name
    assert mine.keys() == theirs.keys(), "the same repository, the same index"
    assert {m.name for m in await triton.repository_index(ready_only=True)} == {*TABULAR, VICTIM, STATS_MODEL}


async def test_statistics_equal_the_remote_triton(triton, remote, repository):
    """The same three requests to a fresh model on both: the same counts, in Triton's full proto."""
    from tritonclient.grpc import service_pb2 as full

    request = _request(STATS_MODEL, _rows(repository, "mlp_classifier", 2)).SerializeToString()
    for _ in range(3):  # one at a time: one execution each on both
        await triton.infer_raw(request)
        await remote.infer_raw(request)
    ask = pb.ModelStatisticsRequest(name=STATS_MODEL).SerializeToString()

    async def statistics(server):
        # a Triton counts an execution once its backend released the request, which can come just after
        # the response: asked again (bounded by tries) until the third execution is counted
        for _ in range(100):
            answer = full.ModelStatisticsResponse.FromString(await server.unary_raw("ModelStatistics", ask))
            if answer.model_stats and answer.model_stats[0].execution_count >= 3:
                break
            await asyncio.sleep(0.02)
        return answer

    mine, theirs = await statistics(triton), await statistics(remote)
    for answer in (mine, theirs):  # durations and times differ between two servers; counts do not
        for stat in answer.model_stats:
            stat.last_inference = 0
            for duration in _durations(stat):
                duration.ns = 0
    assert mine == theirs
    assert mine.model_stats[0].inference_count == 6 and mine.model_stats[0].execution_count == 3


def _durations(message):
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            values = list(value.values())
        else:
            values = [value] if hasattr(value, "ListFields") else list(value)
        for item in values:
            if field.message_type.name == "StatisticDuration":
                yield item
            elif hasattr(item, "ListFields"):
                yield from _durations(item)


async def test_load_with_a_config_override(triton):
    config = json_format.MessageToDict(await triton.model_config(STATS_MODEL), preserving_proto_field_name=True)
    config["parameters"]["inferplane.note"] = {"string_value": "overridden"}
    await triton.load_model(STATS_MODEL, config=json.dumps(config))
    assert (await triton.model_config(STATS_MODEL)).parameters["inferplane.note"].string_value == "overridden"


async def test_many_concurrent_requests_each_get_their_own_answer(triton, repository):
    """Callers with different rows and ids, three models at once: nobody gets another's answer."""
    jobs = []
    for model in TABULAR:
        data = load_validation(repository / model)
        for i in range(60):
            rows = data["features"][i : i + 1 + i % 3].astype(np.float32)
            jobs.append((model, f"{model}-{i}", rows, data["expected"][i : i + 1 + i % 3]))
    answers = await asyncio.gather(*(triton.infer(_request(m, rows, rid), timeout=60) for m, rid, rows, _ in jobs))
    for (model, rid, rows, expected), answer in zip(jobs, answers):
        assert answer.id == rid and answer.model_name == model
        assert list(answer.outputs[0].shape)[0] == len(rows)
        got = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


async def test_a_merged_request_without_copies(triton, repository):
    """infer_tensors: several callers' buffers as chunks of one input, one Triton request."""
    from server.runtime.capi_codec import Tensor

    data = load_validation(repository / "fraud_xgboost")
    parts = [data["features"][i * 4 : i * 4 + 4].astype(np.float32).tobytes() for i in range(5)]
    result = await triton.infer_tensors("fraud_xgboost", [Tensor("features", "FP32", [20, 32], parts)])
    np.testing.assert_allclose(np.frombuffer(result.outputs[0].data, np.float32), data["expected"][:20].ravel(), rtol=1e-5)


async def test_errors_are_domain_errors(triton, repository):
    features = _rows(repository, "fraud_xgboost", 2)
    with pytest.raises(errors.ModelNotFound):
        await triton.infer(_request("no_such_model", features))
    with pytest.raises(errors.InvalidRequest, match="unexpected shape"):
        await triton.infer(_request("fraud_xgboost", features[:, :31]))
    with pytest.raises(errors.InvalidRequest):
        await triton.infer_raw(b"\xff\xff not protobuf")
    with pytest.raises(errors.Unimplemented):
        await triton.unary_raw("NoSuchMethod", b"")
    with pytest.raises(errors.ModelNotFound):
        await triton.unary_raw("ModelConfig", pb.ModelConfigRequest(name="no_such_model").SerializeToString())
    # a caller who goes away: the request is cancelled in Triton, and the server goes on
    task = asyncio.ensure_future(triton.infer(_request("fraud_xgboost", features)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len((await triton.infer(_request("fraud_xgboost", features))).raw_output_contents) == 1


async def test_bytes_inputs_embeddings(triton):
    await triton.load_model(EMBEDDINGS)
    try:
        texts = [b"a cat sat on the mat", b"", "naïve café".encode()]
        raw = pb.ModelInferRequest(model_name=EMBEDDINGS, id="emb")
        raw.inputs.add(name="text", datatype="BYTES", shape=[3, 1])
        raw.raw_input_contents.append(codecs.serialize_bytes(texts))
        typed = pb.ModelInferRequest(model_name=EMBEDDINGS, id="emb")
        typed.inputs.add(name="text", datatype="BYTES", shape=[3, 1]).contents.bytes_contents.extend(texts)
        a, b = await triton.infer(raw), await triton.infer(typed)
        assert a == b
        outputs = {o.name: (o, a.raw_output_contents[i]) for i, o in enumerate(a.outputs)}
        vectors = np.frombuffer(outputs["embedding"][1], np.float32).reshape(3, -1)
        assert list(outputs["embedding"][0].shape) == [3, vectors.shape[1]]
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)
        tokens = np.frombuffer(outputs["tokens"][1], np.int32)
        assert tokens[0] > tokens[1]  # the empty text has only the special tokens
    finally:
        await triton.unload_model(EMBEDDINGS)


def _llm_request(request_id: str, prompt: str, max_tokens: int, **params) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=LLM, id=request_id)
    for name, value in (("text_input", prompt), ("parameters", json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}))):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        request.raw_input_contents.append(codecs.serialize_bytes([value.encode()]))
    for key, value in params.items():
        request.parameters[key].bool_param = value
    return request


async def test_decoupled_stream_carries_the_final_flag_once(triton):
    await triton.load_model(LLM)
    try:
        stream = triton.stream_raw(timeout=60)
        await stream.write(_llm_request("g1", "Once upon a time", 6).SerializeToString())
        await stream.write(_llm_request("g2", "The river", 4, triton_enable_empty_final_response=True).SerializeToString())
        await stream.write(_request("no_such_model", np.zeros((1, 4), np.float32), "bad").SerializeToString())
        await stream.done_writing()
        seen: dict[str, list] = {}
        async for raw in stream:
            response = pb.ModelStreamInferResponse.FromString(raw)
            answer = response.infer_response
            seen.setdefault(answer.id, []).append((response.error_message, answer.parameters[FINAL_PARAMETER].bool_param if FINAL_PARAMETER in answer.parameters else None, answer))
        assert set(seen) == {"g1", "g2", "bad"}
        assert seen["bad"][0][0] and len(seen["bad"]) == 1, "a refused request gets one in-stream error; the stream goes on"
        for rid, tokens in (("g1", 6), ("g2", 4)):
            finals = [final for _err, final, _a in seen[rid]]
            assert finals.count(True) == 1 and finals[-1] is True, (rid, finals)
            assert all(not err for err, _f, _a in seen[rid])
            texts = [a for _e, _f, a in seen[rid] if a.outputs]
            assert len(texts) >= 2, "tokens stream in several responses"
            info = json.loads(bytes(texts[-1].raw_output_contents[[o.name for o in texts[-1].outputs].index("info")])[4:])
            assert info["finish_reason"] == "length" and info["completion_tokens"] == tokens
        with pytest.raises(errors.Unimplemented, match="decoupled"):
            await triton.infer(_llm_request("u", "x", 2))
        # the stream's deadline: an error from the iteration, the pending generation cancelled
        slow = triton.stream_raw(timeout=0.05)
        await slow.write(_llm_request("long", "A long story", 200).SerializeToString())
        with pytest.raises(errors.DeadlineExceeded):
            async for _ in slow:
                pass
    finally:
        await triton.unload_model(LLM)


async def test_a_killed_model_stub_answers_unavailable_then_serves_again(triton, repository):
    """kill -9 of a model's stub: callers in flight and after get UNAVAILABLE (retry in 1 s) while
    the model reloads itself; other models keep serving; then the model serves again."""
    features = _rows(repository, "lightgbm_regressor")
    expected = load_validation(repository / "lightgbm_regressor")["expected"][:8].ravel()
    request = _request(VICTIM, features)
    await triton.infer(request)
    stub = _stub_of(triton.shm_prefix, VICTIM)
    restarts = triton.stub_restarts
    in_flight = [asyncio.ensure_future(triton.infer(request, timeout=30)) for _ in range(4)]
    os.kill(stub.pid, signal.SIGKILL)
    failures: list[errors.InferplaneError] = []
    for outcome in await asyncio.gather(*in_flight, return_exceptions=True):
        if isinstance(outcome, BaseException):
            failures.append(outcome)
    served = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            answer = await triton.infer(request, timeout=30)
        except errors.InferplaneError as err:
            failures.append(err)
            # meanwhile another model is not affected
            assert len((await triton.infer(_request("fraud_xgboost", _rows(repository, "fraud_xgboost", 2)))).raw_output_contents) == 1
            await asyncio.sleep(0.2)
            continue
        if failures:
            served = answer
            break
        await asyncio.sleep(0.05)
    assert failures, "the dead stub was never noticed"
    assert all(isinstance(f, errors.BackendUnavailable) and f.retry_after_s == 1.0 for f in failures), failures
    assert served is not None, f"not serving again: {failures[-3:]}"
    np.testing.assert_allclose(np.frombuffer(served.raw_output_contents[0], np.float32), expected, rtol=1e-5)
    assert triton.stub_restarts == restarts + 1
    assert _stub_of(triton.shm_prefix, VICTIM).pid != stub.pid
