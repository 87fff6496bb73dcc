"""Request coalescing (pure asyncio, no sockets): every caller gets exactly its own rows back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching.coalescer import Coalescer, CoalescePolicy
from server.dataplane.batch_codec import CODEC, merge_key
from server.protogen.inference import grpc_service_pb2 as pb

FEATURES = 3


def _request(rows: int, seed: int, rid: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m", model_version="1", id=rid)
    req.inputs.add(name="x", datatype="FP32", shape=[rows, FEATURES])
    req.raw_input_contents.append(np.full((rows, FEATURES), seed, np.float32).tobytes() + b"")
    data = np.arange(rows * FEATURES, dtype=np.float32).reshape(rows, FEATURES) + seed * 1000
    req.raw_input_contents[0] = data.tobytes()
    return req


class EchoModel:
    """A stand-in for Triton: output y = 2 * x, row by row; counts calls and batch sizes."""

    def __init__(self, delay: float = 0.0, fail: Exception | None = None):
        self.delay = delay
        self.fail = fail
        self.calls: list[int] = []
        self.raw_seen: list[bytes] = []

    async def __call__(self, raw: bytes, timeout, request=None):
        self.raw_seen.append(raw)
        req = pb.ModelInferRequest.FromString(raw)
        rows = int(req.inputs[0].shape[0])
        self.calls.append(rows)
        await asyncio.sleep(self.delay)
        if self.fail:
            raise self.fail
        x = np.frombuffer(req.raw_input_contents[0], np.float32).reshape(rows, FEATURES)
        if (x < 0).any():  # a row this model cannot take: the whole call fails, as Triton's would
            from server.errors import BackendError

            raise BackendError("model failed on a negative feature")
        resp = pb.ModelInferResponse(model_name=req.model_name, model_version=req.model_version, id=req.id)
        resp.outputs.add(name="y", datatype="FP32", shape=[rows, FEATURES])
        resp.raw_output_contents.append((2 * x).tobytes())
        return resp.SerializeToString()


def _check(request: pb.ModelInferRequest, answer: bytes) -> None:
    resp = pb.ModelInferResponse.FromString(answer)
    rows = int(request.inputs[0].shape[0])
    x = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(rows, FEATURES)
    y = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(rows, FEATURES)
    assert list(resp.outputs[0].shape) == [rows, FEATURES]
    assert resp.id == request.id
    np.testing.assert_array_equal(y, 2 * x)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=24),
    gaps=st.lists(st.sampled_from([0.0, 0.0, 0.0001, 0.0005]), min_size=24, max_size=24),
    inflight=st.integers(1, 3),
    max_batch=st.integers(6, 40),
    delay=st.sampled_from([0.0, 0.0005, 0.002]),
)
def test_each_caller_gets_exactly_its_own_rows(sizes, gaps, inflight, max_batch, delay):
    async def scenario():
        model = EchoModel(delay)
        coalescer = Coalescer(model, CODEC)
        policy = CoalescePolicy(window_s=0.001, max_inflight=inflight, max_batch=max_batch)
        requests = [_request(n, i, rid=f"r{i}") for i, n in enumerate(sizes)]

        async def call(i, req):
            await asyncio.sleep(sum(gaps[:i]))
            return await coalescer.submit(req, req.SerializeToString(), policy, timeout=5)

        answers = await asyncio.gather(*(call(i, r) for i, r in enumerate(requests)))
        for req, answer in zip(requests, answers):
            _check(req, answer)
        assert sum(model.calls) == sum(sizes)
        assert max(model.calls) <= max(max_batch, max(sizes))
        return model

    asyncio.run(scenario())


async def test_concurrent_burst_is_merged_into_few_calls():
    model = EchoModel(delay=0.002)
    coalescer = Coalescer(model, CODEC)
    policy = CoalescePolicy(window_s=0.001, max_inflight=1, max_batch=64)
    requests = [_request(1, i) for i in range(32)]
    answers = await asyncio.gather(*(coalescer.submit(r, r.SerializeToString(), policy) for r in requests))
    for req, answer in zip(requests, answers):
        _check(req, answer)
    assert len(model.calls) <= 3  # the first goes alone, the rest ride together
    assert coalescer.merged_calls >= 1


async def test_a_lone_request_is_sent_at_once_and_untouched():
    model = EchoModel()
    coalescer = Coalescer(model, CODEC)
    req = _request(2, 7)
    raw = req.SerializeToString()
    _check(req, await coalescer.submit(req, raw, CoalescePolicy(window_s=10.0)))
    assert model.raw_seen == [raw]


async def test_the_window_never_outlasts_the_deadline():
    holds: list[float] = []

    async def recording_sleep(seconds):
        holds.append(seconds)
        await asyncio.sleep(0)

    release = asyncio.Event()

    async def blocked_send(raw, timeout, request=None):
        await release.wait()
        return await EchoModel()(raw, timeout)

    coalescer = Coalescer(blocked_send, CODEC, sleep=recording_sleep)
    policy = CoalescePolicy(window_s=0.5, max_inflight=1)
    first, second = _request(1, 1), _request(1, 2)
    t1 = asyncio.create_task(coalescer.submit(first, first.SerializeToString(), policy, timeout=10))
    await asyncio.sleep(0)
    t2 = asyncio.create_task(coalescer.submit(second, second.SerializeToString(), policy, timeout=0.01))
    await asyncio.sleep(0.001)
    release.set()
    _check(first, await t1)
    _check(second, await t2)
    assert holds and max(holds) <= 0.01 * 0.1 + 1e-9


async def test_a_failed_merged_call_fails_every_member_with_the_same_error():
    from server.errors import BackendUnavailable

    err = BackendUnavailable("triton went away")
    model = EchoModel(delay=0.001, fail=err)
    coalescer = Coalescer(model, CODEC)
    policy = CoalescePolicy(window_s=0.001, max_inflight=1)
    requests = [_request(1, i) for i in range(6)]
    results = await asyncio.gather(
        *(coalescer.submit(r, r.SerializeToString(), policy) for r in requests), return_exceptions=True
    )
    assert all(r is err for r in results)


async def test_a_cancelled_member_drops_out_and_the_rest_are_served():
    model = EchoModel(delay=0.003)
    coalescer = Coalescer(model, CODEC)
    policy = CoalescePolicy(window_s=0.002, max_inflight=1)
    requests = [_request(1, i) for i in range(5)]
    tasks = [asyncio.create_task(coalescer.submit(r, r.SerializeToString(), policy)) for r in requests]
    await asyncio.sleep(0)
    tasks[2].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    for i in (0, 1, 3, 4):
        _check(requests[i], results[i])
    assert sum(model.calls) == 4


def test_requests_that_cannot_merge():
    req = _request(1, 1)
    assert merge_key(req) is not None
    req.parameters["priority"].int64_param = 1
    assert merge_key(req) is None
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 3]).contents.fp32_contents.extend([1, 2, 3])
    assert merge_key(typed) is None
    assert CoalescePolicy.from_parameters({"inferplane.coalesce": "false"}, 64).enabled is False
    assert CoalescePolicy.from_parameters({}, 0).enabled is False
    policy = CoalescePolicy.from_parameters({"inferplane.coalesce_window_us": "250"}, 32)
    assert policy.enabled and policy.window_s == pytest.approx(0.00025) and policy.max_batch == 32


async def test_group_commit_merges_arrivals_while_a_call_is_in_flight_without_a_timer():
    model = EchoModel(delay=0.005)
    coalescer = Coalescer(model, CODEC)
    policy = CoalescePolicy(max_inflight=1, max_batch=64)  # window 0: no timer at all
    first = _request(1, 0)
    lone = asyncio.create_task(coalescer.submit(first, first.SerializeToString(), policy))
    await asyncio.sleep(0.001)  # the first is at the model now
    later = [_request(1, i) for i in range(1, 11)]
    answers = await asyncio.gather(lone, *(coalescer.submit(r, r.SerializeToString(), policy) for r in later))
    for req, answer in zip([first, *later], answers):
        _check(req, answer)
    assert model.calls == [1, 10]  # the lone one went at once, the ten that waited rode one call


async def test_pending_rows_beyond_max_batch_go_in_several_calls():
    model = EchoModel(delay=0.002)
    coalescer = Coalescer(model, CODEC)
    policy = CoalescePolicy(max_inflight=1, max_batch=8)
    requests = [_request(3, i) for i in range(7)]
    answers = await asyncio.gather(*(coalescer.submit(r, r.SerializeToString(), policy) for r in requests))
    for req, answer in zip(requests, answers):
        _check(req, answer)
    assert max(model.calls) <= 8 and sum(model.calls) == 21


async def test_a_failing_member_never_poisons_the_others():
    model = EchoModel(delay=0.002)
    coalescer = Coalescer(model, CODEC)
    policy = CoalescePolicy(max_inflight=1, max_batch=64)
    requests = [_request(2, i) for i in range(6)]
    bad = requests[3]
    bad.raw_input_contents[0] = (-np.ones((2, FEATURES), np.float32)).tobytes()
    results = await asyncio.gather(*(coalescer.submit(r, r.SerializeToString(), policy) for r in requests), return_exceptions=True)
    from server.errors import BackendError

    assert isinstance(results[3], BackendError)
    for i in (0, 1, 2, 4, 5):
        _check(requests[i], results[i])
    assert coalescer.retried_alone >= 2  # the merged call failed, its members went one by one


def test_in_flight_calls_default_to_the_models_instances():
    assert CoalescePolicy.from_parameters({}, 64, instances=3).max_inflight == 3
    assert CoalescePolicy.from_parameters({"inferplane.coalesce_max_inflight": "2"}, 64, instances=3).max_inflight == 2
    assert CoalescePolicy.from_parameters({}, 64).window_s == 0.0


async def test_a_lone_request_makes_its_call_in_the_callers_task():
    """At c=1 no task is created per request: the caller's own task sends (issue 30)."""
    senders = []

    async def send(raw, timeout, request=None):
        senders.append(asyncio.current_task())
        return await EchoModel()(raw, timeout)

    coalescer = Coalescer(send, CODEC)
    req = _request(1, 3)
    _check(req, await coalescer.submit(req, req.SerializeToString(), CoalescePolicy()))
    assert senders == [asyncio.current_task()]
    assert not coalescer._lanes  # the lane is gone once idle


async def test_requests_of_one_tick_still_merge_when_the_first_found_the_lane_idle():
    model = EchoModel()
    coalescer = Coalescer(model, CODEC)
    requests = [_request(1, i) for i in range(4)]
    answers = await asyncio.gather(*(coalescer.submit(r, r.SerializeToString(), CoalescePolicy()) for r in requests))
    for req, answer in zip(requests, answers):
        _check(req, answer)
    assert model.calls == [4]  # one call: the first waited out the tick and the rest joined it


async def test_the_first_cancelled_during_its_tick_does_not_strand_the_others():
    model = EchoModel()
    coalescer = Coalescer(model, CODEC)
    first, second = _request(1, 1), _request(1, 2)
    t1 = asyncio.create_task(coalescer.submit(first, first.SerializeToString(), CoalescePolicy()))
    t2 = asyncio.create_task(coalescer.submit(second, second.SerializeToString(), CoalescePolicy()))
    await asyncio.sleep(0)  # both are pending; the first waits out its tick
    t1.cancel()
    results = await asyncio.gather(t1, t2, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    _check(second, results[1])
    assert model.calls == [1]
