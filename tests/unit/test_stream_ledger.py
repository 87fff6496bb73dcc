"""The ModelStreamInfer ledger: tickets held until each request's final response, tokens from the
LLM's final info charged, one usage row per request however it ends."""

import json

import pytest

from dataclasses import replace

from server.dataplane import codecs
from server.dataplane.metrics import Metrics
from server.dataplane.pipeline import STREAM, Pipeline
from server.dataplane.routing import Router
from server.dataplane.signature import ModelSignature, TensorSpec
from server.dataplane.stream_ledger import StreamLedger
from server.errors import Overloaded
from server.protogen.inference import grpc_service_pb2 as pb
from server.tenancy.identity import CallContext, Gatekeeper, KeyEntry, KeyRing, Tenant, hash_key
from server.tenancy.metering import Meter
from server.tenancy.quota_policy import Quota, QuotaPolicy

TABULAR = ModelSignature(
    "gbm", 8, {"features": TensorSpec("features", "FP32", (16,))}, {"prediction": TensorSpec("prediction", "FP32", (1,))}, frozenset({"1", "2"})
)
LLM = ModelSignature(
    "llm", 0,
    {n: TensorSpec(n, "BYTES", (1,), optional=True) for n in ("text_input", "messages", "parameters")},
    {n: TensorSpec(n, "BYTES", (1,)) for n in ("text_output", "info")},
    frozenset({"1"}), decoupled=True,
)  # fmt: skip
TENANT = Tenant("acme", team="ml")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _request(signature, id=""):
    return pb.ModelInferRequest(model_name=signature.name, id=id)


def _response(model, id="", version="1", final=None, info=None, error=""):
    response = pb.ModelStreamInferResponse(error_message=error)
    answer = response.infer_response
    answer.model_name, answer.model_version, answer.id = model, version, id
    if final is not None:
        answer.parameters["triton_final_response"].bool_param = final
    if info is not None:
        answer.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        answer.raw_output_contents.append(codecs.serialize_bytes([b"hi"]))
        answer.outputs.add(name="info", datatype="BYTES", shape=[1])
        answer.raw_output_contents.append(codecs.serialize_bytes([json.dumps(info).encode()]))
    return response.SerializeToString()


KEY = "ipk_00000000_secret"


def _pipeline(policy, meter=None, metrics=None, quota=Quota()):
    """The real admission pipeline over an in-memory key ring and model table (no Triton)."""
    ring = KeyRing(b"pepper")
    ring.load([replace(TENANT, quota=quota)], [KeyEntry("00000000", hash_key(KEY, b"pepper"), TENANT.name)])
    table = {s.name: s for s in (TABULAR, LLM)}
    return Pipeline(
        gate=Gatekeeper(ring), quotas=policy, router=Router({}), metrics=metrics or Metrics(),
        resolve=lambda name, version: table[name], replica="test", meter=meter,
    )  # fmt: skip


async def _open(pipeline, signature):
    return await pipeline.admitted(CallContext(KEY), signature.name, kind=STREAM).open()


def _setup(quota=Quota()):
    policy = QuotaPolicy(Clock())
    meter = Meter(None)
    pipeline = _pipeline(policy, meter, quota=quota)
    ledger = StreamLedger(pipeline)

    async def send(signature, id=""):
        ledger.sent(_request(signature, id), await _open(pipeline, signature))

    return policy, meter, ledger, send


def _rows(meter):
    return {(r.model, r.version): (r.requests, r.input_tokens, r.output_tokens) for r in meter.drain()}


async def test_each_answered_request_is_metered_once_with_the_version_that_answered():
    policy, meter, ledger, send = _setup(Quota(concurrency=10))
    await send(TABULAR, "a")
    await send(TABULAR, "b")
    assert policy.inflight("acme") == 2
    await ledger.answered(_response("gbm", "b", version="2", final=True))
    await ledger.answered(_response("gbm", "a"))  # no final parameter (an older Triton): final for a non-decoupled model
    assert policy.inflight("acme") == 0 and len(ledger) == 0
    records = meter.drain()
    assert {(r.model, r.version, r.requests) for r in records} == {("gbm", "2", 1), ("gbm", "1", 1)}
    assert all(r.compute_us >= 0 for r in records)


async def test_an_llm_request_is_final_on_its_flagged_response_and_charges_its_last_tokens():
    policy, meter, ledger, send = _setup(Quota(tpm=10))
    await send(LLM, "g")
    await ledger.answered(_response("llm", "g", final=False, info={"prompt_tokens": 4, "completion_tokens": 1}))
    await ledger.answered(_response("llm", "g", final=False, info={"prompt_tokens": 4, "completion_tokens": 6}))
    assert len(ledger) == 1 and _rows(meter) == {}
    await ledger.answered(_response("llm", "g", final=True, info={"prompt_tokens": 4, "completion_tokens": 9, "finish_reason": "length"}))
    assert _rows(meter) == {("llm", "1"): (1, 4, 9)}
    with pytest.raises(Overloaded, match="10 tokens/min"):  # 13 tokens charged: in debt
        await policy.admit(TENANT.name, "llm", Quota(tpm=10))


async def test_an_empty_final_response_ends_the_request_with_the_tokens_reported_before():
    policy, meter, ledger, send = _setup()
    await send(LLM, "g")
    await ledger.answered(_response("llm", "g", final=False, info={"prompt_tokens": 3, "completion_tokens": 2}))
    await ledger.answered(_response("llm", "g", final=True))  # enable_empty_final_response: no outputs
    assert _rows(meter) == {("llm", "1"): (1, 3, 2)}


async def test_without_the_final_parameter_an_llm_response_is_final_on_its_finish_reason():
    _, meter, ledger, send = _setup()
    await send(LLM, "g")
    await ledger.answered(_response("llm", "g", info={"prompt_tokens": 3, "completion_tokens": 1}))
    assert len(ledger) == 1
    await ledger.answered(_response("llm", "g", info={"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "stop"}))
    assert len(ledger) == 0 and _rows(meter) == {("llm", "1"): (1, 3, 2)}


async def test_an_error_naming_only_the_id_ends_its_request():
    policy, meter, ledger, send = _setup(Quota(concurrency=5))
    await send(TABULAR, "x")
    await ledger.answered(_response("", "x", version="", error="[request id: x] unexpected shape"))
    assert policy.inflight("acme") == 0 and _rows(meter) == {("gbm", "2"): (1, 0, 0)}  # the model's latest version


async def test_requests_without_ids_are_matched_by_model_then_oldest_first():
    _, meter, ledger, send = _setup()
    await send(LLM)
    await send(TABULAR)
    await send(TABULAR)
    await ledger.answered(_response("gbm", final=True))
    assert len(ledger) == 2
    await ledger.answered(_response("llm", final=True, info={"prompt_tokens": 2, "completion_tokens": 5, "finish_reason": "length"}))
    await ledger.answered(_response("gbm", final=True))
    assert len(ledger) == 0
    assert _rows(meter) == {("gbm", "1"): (2, 0, 0), ("llm", "1"): (1, 2, 5)}


async def test_a_response_the_ledger_did_not_write_changes_nothing():
    policy, meter, ledger, send = _setup(Quota(concurrency=5))
    await send(TABULAR, "a")
    await ledger.answered(_response("gbm", "zzz", final=True))
    await ledger.answered(pb.ModelStreamInferResponse(error_message="INVALID_ARGUMENT: shape").SerializeToString())
    assert policy.inflight("acme") == 1 and len(ledger) == 1 and _rows(meter) == {}


async def test_concurrency_counts_streamed_requests_until_their_final_response():
    policy, _, ledger, send = _setup(Quota(concurrency=1))
    await send(LLM, "one")
    with pytest.raises(Overloaded, match="1 concurrent"):
        await send(LLM, "two")
    await ledger.answered(_response("llm", "one", final=True, info={"prompt_tokens": 1, "completion_tokens": 1, "finish_reason": "stop"}))
    await send(LLM, "three")
    assert policy.inflight("acme") == 1


async def test_closing_the_stream_releases_and_meters_every_open_request():
    policy, meter, ledger, send = _setup(Quota(concurrency=5, tpm=100))
    await send(LLM, "g")
    await send(TABULAR, "t")
    await ledger.answered(_response("llm", "g", final=False, info={"prompt_tokens": 5, "completion_tokens": 7}))
    await ledger.close()
    assert policy.inflight("acme") == 0 and len(ledger) == 0
    assert _rows(meter) == {("llm", "1"): (1, 5, 7), ("gbm", "2"): (1, 0, 0)}
    await ledger.close()  # idempotent
    assert _rows(meter) == {}


async def test_an_unreadable_info_counts_nothing_and_keeps_the_request_open():
    _, meter, ledger, send = _setup()
    await send(LLM, "g")
    response = pb.ModelStreamInferResponse()
    answer = response.infer_response
    answer.model_name, answer.id = "llm", "g"
    answer.parameters["triton_final_response"].bool_param = False
    answer.outputs.add(name="info", datatype="BYTES", shape=[1])
    answer.raw_output_contents.append(codecs.serialize_bytes([b"{not json"]))
    await ledger.answered(response.SerializeToString())
    assert len(ledger) == 1
    await ledger.answered(_response("llm", "g", final=True))
    assert _rows(meter) == {("llm", "1"): (1, 0, 0)}


async def test_every_ended_request_is_counted_in_the_request_metrics_with_its_outcome():
    metrics = Metrics()
    pipeline = _pipeline(QuotaPolicy(Clock()), metrics=metrics)
    ledger = StreamLedger(pipeline)
    for id in ("ok", "bad", "open"):
        ledger.sent(_request(TABULAR, id), await _open(pipeline, TABULAR))
    await ledger.answered(_response("gbm", "ok", version="2", final=True))
    await ledger.answered(_response("gbm", "bad", final=True, error="boom"))
    await ledger.close()  # "open" never got its answer: the caller left
    counted = {
        (s.labels["model"], s.labels["version"], s.labels["code"]): s.value
        for s in metrics.requests.collect()[0].samples
        if s.name == "inferplane_requests_total"
    }
    assert counted == {("gbm", "2", "OK"): 1, ("gbm", "1", "INTERNAL"): 1, ("gbm", "2", "CANCELLED"): 1}


async def test_tritons_own_in_stream_errors_get_the_code_they_mean():
    _, _, ledger, send = _setup()
    await send(TABULAR, "x")
    await send(LLM, "y")
    relayed = await ledger.answered(_response("gbm", "x", final=True, error="[request id: x] unexpected shape"))
    assert pb.ModelStreamInferResponse.FromString(relayed).error_message == "INTERNAL: [request id: x] unexpected shape"
    relayed = await ledger.answered(_response("llm", "y", final=True, error="invalid request: max_tokens must be > 0"))
    assert pb.ModelStreamInferResponse.FromString(relayed).error_message == "INVALID_ARGUMENT: invalid request: max_tokens must be > 0"
    ours = pb.ModelStreamInferResponse(error_message="NOT_FOUND: unknown model 'z'").SerializeToString()
    assert await ledger.answered(ours) == ours  # already coded: relayed untouched


async def test_each_request_gives_its_place_back_once_when_it_ends_answered_or_closed():
    """``release`` (the process's in-flight bound, server.dataplane.loop_gate): once per request, at
    its final response or at the stream's end — not at a partial response nor at one it did not write."""
    policy = QuotaPolicy(Clock())
    pipeline = _pipeline(policy)
    released = []
    ledger = StreamLedger(pipeline, release=lambda: released.append(1))
    for signature, id in ((LLM, "g"), (TABULAR, "t"), (TABULAR, "u")):
        ledger.sent(_request(signature, id), await _open(pipeline, signature))
    await ledger.answered(_response("llm", "g", final=False, info={"prompt_tokens": 1, "completion_tokens": 1}))
    await ledger.answered(_response("gbm", "zzz", final=True))  # not a request it wrote
    assert released == []
    await ledger.answered(_response("gbm", "t", final=True))
    assert len(released) == 1
    await ledger.close()  # g and u end with the stream
    await ledger.close()
    assert len(released) == 3 and len(ledger) == 0
