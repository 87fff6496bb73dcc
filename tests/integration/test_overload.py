"""Overload on the real stack: a saturated model refuses with RESOURCE_EXHAUSTED / 429 and a retry
hint (its queue TTL, ``inferplane.queue_ttl_ms``), while another model on the same frontend keeps
answering. Behaviour only, no timing: the paced model (one instance, 1 s a request) holds its
one slot far longer than its 30 ms queue budget, so whoever waits behind it is refused."""

from __future__ import annotations

import json
import queue
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import openai
import pytest
from google.rpc import error_details_pb2, status_pb2

from loadtest.paced_model import FEATURES, build_paced_model, sample_features
from model_repository.config_writer import read_config, write_config
from server.protogen.inference import grpc_service_pb2 as pb
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
FLOOD = 4  # one in the slot, three waiting: within the queue's bound (4), so only the TTL refuses


@pytest.fixture(scope="module")
def overload_stack(demo_repository, tmp_path_factory):
    repository = tmp_path_factory.mktemp("overload") / "model_repository"
    repository.mkdir()
    paced = build_paced_model(repository, service_ms=1000, instances=1)
    config = read_config(paced)
    config.parameters["inferplane.queue_ttl_ms"].string_value = "30"
    write_config(config, paced)
    shutil.copytree(demo_repository / "fraud_xgboost", repository / "fraud_xgboost")
    s = start_stack(repository, tmp_path_factory.mktemp("overload_stack"))
    yield s
    stop_stack(s)


def _paced(rows: int = 1, id: str = "") -> bytes:
    req = pb.ModelInferRequest(model_name="paced", id=id)
    req.inputs.add(name="features", datatype="FP32", shape=[rows, FEATURES])
    req.raw_input_contents.append(sample_features(rows).tobytes())
    return req.SerializeToString()


def _fraud(id: str = "") -> bytes:
    req = pb.ModelInferRequest(model_name="fraud_xgboost", id=id)
    req.inputs.add(name="features", datatype="FP32", shape=[2, 32])
    req.raw_input_contents.append(np.zeros((2, 32), np.float32).tobytes())
    return req.SerializeToString()


def _retry_delay_ms(err: grpc.RpcError) -> int | None:
    details = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
    if not details:
        return None
    info = error_details_pb2.RetryInfo()
    for any_msg in status_pb2.Status.FromString(details).details:
        if any_msg.Unpack(info):
            return info.retry_delay.ToMilliseconds()
    return None


def test_a_saturated_model_refuses_with_a_hint_while_another_keeps_answering(overload_stack):
    with grpc.insecure_channel(overload_stack.grpc, options=[("grpc.enable_retries", 0)]) as channel:
        infer = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        flood = [infer.future(_paced(), timeout=30) for _ in range(FLOOD)]
        others = [pb.ModelInferResponse.FromString(infer(_fraud(), timeout=30)) for _ in range(5)]
        outcomes = []
        for future in flood:
            try:
                outcomes.append(("OK", pb.ModelInferResponse.FromString(future.result())))
            except grpc.RpcError as err:
                outcomes.append((err.code().name, err))
    assert all(o.model_name == "fraud_xgboost" and len(o.raw_output_contents[0]) == 8 for o in others)
    codes = [code for code, _ in outcomes]
    # the one in the slot is answered; the three behind it are refused at the TTL (30 ms), long before
    # the slot frees (without the TTL they would wait and be served: the queue's bound holds them)
    assert sorted(codes) == ["OK"] + ["RESOURCE_EXHAUSTED"] * (FLOOD - 1), codes
    for code, value in outcomes:
        if code == "OK":  # the answer is the paced model's (row sums), not a refusal's
            np.testing.assert_allclose(np.frombuffer(value.raw_output_contents[0], np.float32), sample_features(1).sum(axis=-1), rtol=1e-6)
        else:
            assert (_retry_delay_ms(value) or 0) > 0, value.details()
            assert float(dict(value.trailing_metadata())["retry-after"]) > 0
            assert "paced" in value.details()


def test_rest_refusal_is_429_with_retry_after(overload_stack):
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES], "data": [0.5] * FEATURES}]}).encode()
    url = f"http://{overload_stack.http}/v2/models/paced/infer"

    def post():
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), json.loads(err.read())

    with ThreadPoolExecutor(FLOOD) as pool:
        results = list(pool.map(lambda _: post(), range(FLOOD)))
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] + [429] * (FLOOD - 1), statuses
    for status, headers, doc in results:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1 and "paced" in json.dumps(doc)


# ---- the process's in-flight bound (INFERPLANE_MAX_INFLIGHT): refused before decode, on every transport ----

BOUND = 2
HELD = "held"


@pytest.fixture(scope="module")
def bounded_stack(demo_repository, tmp_path_factory):
    """A frontend holding at most ``BOUND`` inference requests at once; the paced model (one instance,
    2 s a request, no TTL of its own) keeps ``BOUND`` of them in flight for seconds, and ``held`` (two
    instances, 20 s a request) for as long as a test takes on a loaded machine — its requests are
    cancelled, not awaited."""
    repository = tmp_path_factory.mktemp("bounded") / "model_repository"
    repository.mkdir()
    build_paced_model(repository, service_ms=2000, instances=1)
    build_paced_model(repository, service_ms=20000, instances=2, name=HELD)
    shutil.copytree(demo_repository / "fraud_xgboost", repository / "fraud_xgboost")
    s = start_stack(repository, tmp_path_factory.mktemp("bounded_stack"), env={"INFERPLANE_MAX_INFLIGHT": str(BOUND)})
    yield s
    stop_stack(s)


def _post_fraud(http: str):
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 32], "data": [0.0] * 32}]}).encode()
    request = urllib.request.Request(f"http://{http}/v2/models/fraud_xgboost/infer", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def _paced_in_flight(stack, model: str = "paced") -> float:
    text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
    line = next((l for l in text.splitlines() if l.startswith(f'inferplane_inflight_requests{{model="{model}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_past_the_in_flight_bound_every_transport_refuses_with_a_hint_then_answers_again(bounded_stack):
    with grpc.insecure_channel(bounded_stack.grpc, options=[("grpc.enable_retries", 0)]) as channel:
        infer = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        held = [infer.future(_paced(), timeout=60) for _ in range(BOUND)]
        wait_until(lambda: _paced_in_flight(bounded_stack) == BOUND)  # both admitted before any probe can take a place
        refused = rest = None
        while refused is None and not all(f.done() for f in held):  # until the held pair is in flight
            try:
                infer(_fraud(), timeout=30)
            except grpc.RpcError as err:
                refused = err
        while refused is not None and not all(f.done() for f in held):  # the pair still holds the bound: REST is refused too
            rest = _post_fraud(bounded_stack.http)  # (asked until refused: the first held answer frees a place after 2 s)
            if rest[0] == 429:
                break
        answers = [pb.ModelInferResponse.FromString(f.result()) for f in held]  # the held requests are served, not dropped
        after = pb.ModelInferResponse.FromString(infer(_fraud(), timeout=30))  # below the bound again: answered
    assert refused is not None, "no request was refused while the bound was full"
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert "in flight" in refused.details() and (_retry_delay_ms(refused) or 0) > 0
    assert float(dict(refused.trailing_metadata())["retry-after"]) > 0
    status, headers, doc = rest
    assert status == 429 and int(headers["Retry-After"]) >= 1, (status, doc)
    assert doc["code"] == "RESOURCE_EXHAUSTED" and "in flight" in doc["error"], doc
    assert all(a.model_name == "paced" for a in answers) and after.model_name == "fraud_xgboost"


def test_stream_messages_and_the_openai_routes_take_places_in_the_same_bound(bounded_stack):
    """ModelStreamInfer takes a place per message (held until its final response or the stream's end)
    and the OpenAI routes one per request: with one stream message and one unary request of ``held``
    holding the bound, another stream message is refused in-stream (RESOURCE_EXHAUSTED, its id, a
    ``retry-after`` parameter) and the openai SDK's chat completion (stream or not), completion and
    embeddings are 429 with ``Retry-After`` and the OpenAI error body — before the stream's first byte,
    before the body names a model this stack does not serve. Once the holders are cancelled (the stream
    closed, the unary call cancelled) their places come back: a stream message is answered and the
    OpenAI routes answer what they answer here (NOT_FOUND: no such model)."""
    outbox: queue.Queue = queue.Queue()
    client = openai.OpenAI(base_url=f"http://{bounded_stack.http}/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "hi"}]
    probes = {
        "chat stream": lambda: client.chat.completions.create(model="tiny_llama", messages=messages, stream=True),
        "chat": lambda: client.chat.completions.create(model="tiny_llama", messages=messages),
        "completion": lambda: client.completions.create(model="tiny_llama", prompt="hi", stream=True),
        "embeddings": lambda: client.embeddings.create(model="minilm_embeddings", input="hi"),
    }

    def errors() -> dict:
        found = {}
        for name, probe in probes.items():
            try:
                probe()
            except openai.APIStatusError as err:
                found[name] = err
        return found

    held_message = pb.ModelInferRequest.FromString(_paced(id="held"))
    held_message.model_name = HELD
    with grpc.insecure_channel(bounded_stack.grpc, options=[("grpc.enable_retries", 0)]) as channel:
        infer = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        stream = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=pb.ModelStreamInferResponse.FromString)
        responses = stream(iter(outbox.get, None), timeout=120)
        outbox.put(held_message.SerializeToString())
        unary = pb.ModelInferRequest.FromString(_paced())
        unary.model_name = HELD
        held = infer.future(unary.SerializeToString(), timeout=120)
        wait_until(lambda: _paced_in_flight(bounded_stack, HELD) == BOUND)  # the message and the request both admitted
        outbox.put(_fraud(id="probe"))
        refused = next(responses)  # the held message's answer would come 20 s later
        refusals = errors()
        still_held = _paced_in_flight(bounded_stack, HELD)  # the premise: every probe ran while the pair held the bound
        responses.cancel()  # the holders go: the stream's message and the unary call give their places back
        held.cancel()
        wait_until(lambda: _paced_in_flight(bounded_stack, HELD) == 0, timeout=30)
        after = list(stream(iter([_fraud(id="after")]), timeout=30))
        admitted = errors()
    client.close()
    assert still_held == BOUND, still_held
    assert refused.error_message.startswith("RESOURCE_EXHAUSTED: ") and "in flight" in refused.error_message, refused.error_message
    assert refused.infer_response.id == "probe" and refused.infer_response.model_name == "fraud_xgboost"
    assert refused.infer_response.parameters["retry-after"].double_param > 0
    assert sorted(refusals) == sorted(probes), {name: repr(err) for name, err in refusals.items()}
    for name, err in refusals.items():
        assert isinstance(err, openai.RateLimitError) and err.status_code == 429, (name, err)
        assert err.code == "RESOURCE_EXHAUSTED" and "in flight" in err.message, (name, err.body)
        assert int(err.response.headers["retry-after"]) >= 1, name
    assert [(r.error_message, r.infer_response.id, r.infer_response.model_name) for r in after] == [("", "after", "fraud_xgboost")]
    assert {name: err.status_code for name, err in admitted.items()} == {name: 404 for name in probes}, admitted
