"""The adapters' batch logic (``model_repository/adapters/_common.py``) without Triton: every
request gets its own answer or its own error object, whatever the rest of the batch holds.

The real-Triton half of this (batches of good and bad members against every adapter, then a
health check of the whole server) is ``tests/integration/test_hardening.py``; this pins the
pure logic, with a stand-in for ``triton_python_backend_utils``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_repository.adapters import _common
from model_repository.adapters._llm_common import RequestError, SamplingParams, check_text


class FakePbUtils:
    """Just enough of the Python backend's utils module, recording every TritonError made."""

    def __init__(self):
        self.errors = []
        outer = self

        class TritonError:
            INVALID_ARG = 3
            INTERNAL = 6

            def __init__(self, message, code=None):
                self.message, self.code = message, code
                outer.errors.append(self)

        class Tensor:
            def __init__(self, name, array):
                self.name, self.array = name, np.asarray(array)

            def as_numpy(self):
                return self.array

        class InferenceResponse:
            def __init__(self, output_tensors, error=None):
                self.output_tensors, self.error = output_tensors, error

        self.TritonError, self.Tensor, self.InferenceResponse = TritonError, Tensor, InferenceResponse

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.get(name)


class Settings:
    input_name, input_dims = "features", [4]
    output_name, output_dims = "y", [1]


def _request(pb, array):
    return {"features": pb.Tensor("features", array)} if array is not None else {}


def _predict(batch):
    if np.isnan(batch).any():
        raise ValueError("the model cannot take NaN")  # a member that fails inside the model
    return batch.sum(axis=1, keepdims=True)


# a member: good rows, rows the model fails on, the wrong width, the wrong rank, text, missing
_MEMBER = st.one_of(
    st.tuples(st.just("good"), st.integers(1, 4)),
    st.tuples(st.just("nan"), st.integers(1, 3)),
    st.tuples(st.just("width"), st.integers(1, 3)),
    st.tuples(st.just("rank"), st.integers(1, 3)),
    st.tuples(st.just("text"), st.integers(1, 3)),
    st.tuples(st.just("missing"), st.just(1)),
)


def _array(kind, rows, rng):
    if kind in ("good", "nan"):
        a = rng.random((rows, 4)).astype(np.float32)
        if kind == "nan":
            a[0, 0] = np.nan
        return a
    if kind == "width":
        return rng.random((rows, 5)).astype(np.float32)
    if kind == "rank":
        return rng.random((rows, 2, 2)).astype(np.float32)
    if kind == "text":
        return np.array([b"x"] * rows, dtype=np.object_)
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(_MEMBER, min_size=1, max_size=8), st.integers(0, 2**32 - 1))
def test_every_member_gets_its_own_answer_or_its_own_error(members, seed):
    pb = FakePbUtils()
    rng = np.random.default_rng(seed)
    arrays = [_array(kind, rows, rng) for kind, rows in members]
    responses = _common.execute_batched([_request(pb, a) for a in arrays], pb, Settings, _predict)
    assert len(responses) == len(members)
    for (kind, rows), array, response in zip(members, arrays, responses):
        if kind == "good":
            assert response.error is None
            np.testing.assert_allclose(response.output_tensors[0].array, array.sum(axis=1, keepdims=True), rtol=1e-6)
        else:
            assert response.error is not None and response.output_tensors == []
            expected = pb.TritonError.INTERNAL if kind == "nan" else pb.TritonError.INVALID_ARG
            assert response.error.code == expected, response.error.message
    errors = [r.error for r in responses if r.error is not None]
    # the crash of issue 15: one TritonError object sent in several responses
    assert len({id(e) for e in errors}) == len(errors)


def test_a_model_failure_on_the_whole_batch_answers_each_request_once():
    pb = FakePbUtils()

    def broken(batch):
        raise RuntimeError("the session died")

    requests = [_request(pb, np.ones((2, 4), np.float32)) for _ in range(5)]
    responses = _common.execute_batched(requests, pb, Settings, broken)
    assert [r.error.code for r in responses] == [pb.TritonError.INTERNAL] * 5
    assert len({id(r.error) for r in responses}) == 5
    assert all("the session died" in r.error.message for r in responses)


def test_error_messages_are_capped():
    pb = FakePbUtils()
    response = _common.error_response(pb, "x" * 100_000)
    assert len(response.error.message) < _common.MAX_ERROR_CHARS + 64


def test_a_pyo3_panic_is_one_requests_error_not_the_batchs():
    class PanicException(BaseException):  # what a Rust tokenizer raises: not an Exception
        pass

    pb = FakePbUtils()

    def parse(request):
        if request == "bad":
            raise PanicException("tokenizer panicked")
        return request

    responses = _common.answer_each(["ok", "bad", "ok"], pb, parse, lambda items: items, lambda r: pb.InferenceResponse([r]))
    assert [r.error is None for r in responses] == [True, False, True]


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"seed": 2**65}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": int("9" * 400)}, "max_tokens"),
        ({"temperature": int("9" * 400)}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("inf")}, "top_p"),
        ({"deadline_ms": 1e300}, "deadline_ms"),
        ({"stop": ["ok", "\ud800"]}, "stop[1]"),
    ],
)
def test_engine_parameters_out_of_range_are_request_errors_naming_the_field(doc, field):
    with pytest.raises(RequestError, match=field.replace("[", r"\[").replace("]", r"\]")) as err:
        SamplingParams.parse(doc, 16)
    assert len(str(err.value)) < 200  # a 400-digit number is not echoed


def test_lone_surrogates_are_request_errors():
    assert check_text("fine ✓", "x") == "fine ✓"
    with pytest.raises(RequestError, match="lone surrogate"):
        check_text("a\udfffb", "messages[0].content")
