"""Issue 15, class 1: a batch with bad members never takes the shared Triton down.

Against the real stack, for every adapter (ONNX Runtime, XGBoost, LightGBM, the MiniLM
embeddings, the LLM engine): hypothesis draws a batch of valid and invalid members, sends them
at once (so Triton's dynamic batcher hands them to one ``execute``) directly to Triton and
through the frontend, and checks that each good member gets its right answer, each bad one its
own INVALID_ARGUMENT, and then that the whole server is well: Triton is the same process,
``inferplane_triton_restarts_total`` did not move, both servers are ready, a valid request answers.

The first test is the issue's reproduction: one valid and one non-UTF-8 text at once made both
INTERNAL and then tritonserver died with SIGSEGV (the embedding adapter sent one TritonError
object in every response of the batch; the stub freed its shared-memory copy on the second send).
"""

from __future__ import annotations

import asyncio
import json
import struct

import aiohttp
import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_repository.layout import load_validation
from server.protogen.inference import grpc_service_pb2 as pb
from tests.stack_health import assert_healthy, baseline

pytestmark = pytest.mark.integration

EMBEDDINGS = "minilm_embeddings"
LLM = "tiny_llama"
TABULAR = {"mlp_classifier": 64, "fraud_xgboost": 32, "lightgbm_regressor": 16}
SVC = "/inference.GRPCInferenceService/"
HYPOTHESIS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bytes_tensor(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


async def _infer_all(address: str, requests: list[pb.ModelInferRequest]) -> list[tuple[grpc.StatusCode, object]]:
    """Send every request at once; (code, response or details) for each, in order."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(SVC + "ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip

        async def one(request):
            try:
                return grpc.StatusCode.OK, await call(request, timeout=60)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()

        return list(await asyncio.gather(*(one(r) for r in requests)))


def _output(response: pb.ModelInferResponse, name: str, dtype=np.float32) -> np.ndarray:
    index = [o.name for o in response.outputs].index(name)
    shape = list(response.outputs[index].shape)
    return np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(shape)


# ---- the reproduction ----------------------------------------------------------------


def _text_request(*texts: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=EMBEDDINGS)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
    request.raw_input_contents.append(_bytes_tensor(*texts))
    return request


@pytest.mark.parametrize("target", ["triton", "frontend"])
def test_one_valid_and_one_non_utf8_text_at_once(llm_stack, target):
    before = baseline(llm_stack)
    address = llm_stack.triton if target == "triton" else llm_stack.grpc
    for _round in range(5):
        good, bad = asyncio.run(_infer_all(address, [_text_request(b"hello world"), _text_request(b"\xff\xfe bad")]))
        assert good[0] == grpc.StatusCode.OK, good
        assert _output(good[1], "embedding").shape == (1, 384)
        assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in bad[1], bad
    assert_healthy(llm_stack, before, _text_request(b"still here"))


def test_the_same_over_the_rest_binary_extension(llm_stack):
    before = baseline(llm_stack)

    def body(text: bytes) -> tuple[bytes, dict]:
        data = _bytes_tensor(text)
        header = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1],
                                         "parameters": {"binary_data_size": len(data)}}]}).encode()  # fmt: skip
        return header + data, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}

    async def both():
        async with aiohttp.ClientSession() as s:
            async def post(text):
                data, headers = body(text)
                async with s.post(f"http://{llm_stack.http}/v2/models/{EMBEDDINGS}/infer", data=data, headers=headers) as r:
                    return r.status, await r.read()

            return await asyncio.gather(post(b"hello world"), post(b"\xc3\x28"))

    for _round in range(5):
        (good_status, _), (bad_status, bad_body) = asyncio.run(both())
        assert good_status == 200
        assert bad_status == 400 and json.loads(bad_body)["code"] == "INVALID_ARGUMENT"
    assert_healthy(llm_stack, before, _text_request(b"still here"))


# ---- tabular adapters: ONNX Runtime, XGBoost, LightGBM ---------------------------------------

_TABULAR_MEMBER = st.one_of(
    st.tuples(st.just("good"), st.integers(1, 4)),
    st.tuples(st.just("nan"), st.integers(1, 3)),  # NaN / inf values: a valid request (missing values)
    st.tuples(st.just("wide"), st.integers(1, 3)),  # one feature too many
    st.tuples(st.just("short"), st.integers(1, 3)),  # raw bytes shorter than the shape
    st.tuples(st.just("fp64"), st.integers(1, 3)),  # the wrong datatype
    st.tuples(st.just("empty"), st.just(0)),  # zero rows
)


def _tabular_request(model: str, width: int, kind: str, rows: int, features: np.ndarray, start: int):
    request = pb.ModelInferRequest(model_name=model)
    if kind == "good":
        x = features[start : start + rows]
    elif kind == "nan":
        x = np.full((rows, width), np.nan, np.float32)
        x[:, ::2] = np.inf
    elif kind == "wide":
        x = np.zeros((rows, width + 1), np.float32)
    else:
        x = np.zeros((rows, width), np.float32)
    datatype = "FP64" if kind == "fp64" else "FP32"
    raw = x.astype(np.float64).tobytes() if kind == "fp64" else x.tobytes()
    request.inputs.add(name="features", datatype=datatype, shape=list(x.shape))
    request.raw_input_contents.append(raw[:-4] if kind == "short" else raw)
    return request


@pytest.mark.parametrize("target", ["triton", "frontend"])
@pytest.mark.parametrize("model", sorted(TABULAR))
@HYPOTHESIS
@given(members=st.lists(_TABULAR_MEMBER, min_size=2, max_size=8), start=st.integers(0, 40))
def test_tabular_batches_with_bad_members(stack, model, target, members, start):
    before = baseline(stack)
    validation = load_validation(stack.repository / model)
    features = np.ascontiguousarray(validation["features"], dtype=np.float32)
    expected = np.asarray(validation["expected"], dtype=np.float32)
    requests = [_tabular_request(model, TABULAR[model], kind, rows, features, start) for kind, rows in members]
    address = stack.triton if target == "triton" else stack.grpc
    results = asyncio.run(_infer_all(address, requests))
    for (kind, rows), (code, answer) in zip(members, results):
        if kind in ("good", "nan"):
            assert code == grpc.StatusCode.OK, (kind, code, answer)
            out = answer.raw_output_contents[0]
            got = np.frombuffer(out, np.float32).reshape(list(answer.outputs[0].shape))
            assert got.shape[0] == rows
            if kind == "good":
                np.testing.assert_allclose(got.reshape(rows, -1), expected[start : start + rows].reshape(rows, -1), rtol=1e-5, atol=1e-6)
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (kind, code, answer)
    assert_healthy(stack, before)


# ---- the embedding adapter -------------------------------------------------------------------

_GOOD_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_TEXT_MEMBER = st.one_of(
    st.tuples(st.just("good"), _GOOD_TEXT.map(lambda t: t.encode("utf-8"))),
    st.tuples(st.just("good"), st.sampled_from([b"", b"a\x00b", "naïve café ✓".encode()])),
    st.tuples(st.just("bad"), st.sampled_from([b"\xff", b"\xc3\x28", b"ok\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])),
    st.tuples(st.just("bad"), st.binary(min_size=1, max_size=20).filter(lambda b: not _is_utf8(b))),
)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


_SOLO: dict[bytes, np.ndarray] = {}


def _solo(address: str, text: bytes) -> np.ndarray:
    if text not in _SOLO:
        [(code, answer)] = asyncio.run(_infer_all(address, [_text_request(text)]))
        assert code == grpc.StatusCode.OK, answer
        _SOLO[text] = _output(answer, "embedding")
    return _SOLO[text]


@pytest.mark.parametrize("target", ["triton", "frontend"])
@HYPOTHESIS
@given(members=st.lists(_TEXT_MEMBER, min_size=2, max_size=8))
def test_embedding_batches_with_bad_members(llm_stack, target, members):
    before = baseline(llm_stack)
    address = llm_stack.triton if target == "triton" else llm_stack.grpc
    results = asyncio.run(_infer_all(address, [_text_request(text) for _kind, text in members]))
    for (kind, text), (code, answer) in zip(members, results):
        if kind == "good":
            assert code == grpc.StatusCode.OK, (text, code, answer)
            np.testing.assert_allclose(_output(answer, "embedding"), _solo(llm_stack.triton, text), atol=1e-4)
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in answer, (text, code, answer)
    assert_healthy(llm_stack, before, _text_request(b"still here"))


# ---- the LLM engine (decoupled: one ModelStreamInfer stream per member) --------------------------

_GOOD_PARAMS = {"max_tokens": 2, "temperature": 0.0}
_LLM_BAD = [
    {"parameters": b"not json"},
    {"parameters": b"[1, 2]"},
    {"messages": b"\xff\xfe not utf-8"},
    {"text_input": b"\xc3\x28"},
    {"messages": b'[{"role": "user", "content": "\\ud800"}]'},
    {"messages": b'{"role": "user"}'},
    {"parameters": json.dumps({"seed": 2**65, "temperature": 1.0, "max_tokens": 2}).encode()},
    {"parameters": json.dumps({"max_tokens": 10**400}).encode()},
    {"parameters": b'{"temperature": NaN, "max_tokens": 2}'},
    {"parameters": json.dumps({"stop": ["\ud800"], "max_tokens": 2}).encode()},
    {"text_input": b"hello", "messages": b'[{"role": "user", "content": "hi"}]'},
    {},
]
_LLM_MEMBER = st.one_of(
    st.tuples(st.just("good"), _GOOD_TEXT.filter(lambda t: t.strip()).map(lambda t: {"text_input": t.encode()})),
    st.tuples(st.just("good"), st.just({"messages": json.dumps([{"role": "user", "content": "hi"}]).encode()})),
    st.tuples(st.just("bad"), st.sampled_from(_LLM_BAD)),
)


def _llm_request(inputs: dict[str, bytes], index: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=LLM, id=f"member-{index}")
    if "parameters" not in inputs and inputs:
        inputs = {**inputs, "parameters": json.dumps(_GOOD_PARAMS).encode()}
    for name, value in inputs.items():
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        request.raw_input_contents.append(_bytes_tensor(value))
    return request


async def _stream_each(address: str, requests: list[pb.ModelInferRequest]) -> list[list[pb.ModelStreamInferResponse]]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(SVC + "ModelStreamInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                                     response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip

        async def one(request):
            responses = []
            stream = call(iter([request]), timeout=120)
            async for response in stream:
                responses.append(response)
                final = response.infer_response.parameters.get("triton_final_response")
                if response.error_message or (final is not None and final.bool_param):
                    break
            stream.cancel()
            return responses

        return list(await asyncio.gather(*(one(r) for r in requests)))


@pytest.mark.parametrize("target", ["triton", "frontend"])
@HYPOTHESIS
@given(members=st.lists(_LLM_MEMBER, min_size=2, max_size=6))
def test_llm_engine_batches_with_bad_members(llm_stack, target, members):
    before = baseline(llm_stack)
    address = llm_stack.triton if target == "triton" else llm_stack.grpc
    requests = [_llm_request(inputs, i) for i, (_kind, inputs) in enumerate(members)]
    results = asyncio.run(_stream_each(address, requests))
    for (kind, inputs), responses in zip(members, results):
        errors = [r.error_message for r in responses if r.error_message]
        if kind == "good":
            assert responses and not errors, (inputs, errors)
        else:
            assert errors, (inputs, responses)
            # the caller's mistake, said as such: the engine's prefix, or the frontend's code
            assert "invalid request" in errors[0] or errors[0].startswith("INVALID_ARGUMENT"), (inputs, errors)
    assert_healthy(llm_stack, before, _text_request(b"still here"))
