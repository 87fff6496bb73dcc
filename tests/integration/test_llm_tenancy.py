"""The LLM endpoints under tenancy, on the real stack with `--auth on`: chat completions, gRPC
``Generate`` and Triton's own ``ModelStreamInfer`` are admitted against request, token and
concurrency quotas (429 / RESOURCE_EXHAUSTED with retry hints the official openai SDK reads as
``RateLimitError``; in-stream errors on ModelStreamInfer), and every generation — answered or left
mid-stream — is metered with its input and output tokens; embeddings meter their input."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.rpc import error_details_pb2, status_pb2

from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc
from server.tenancy.quota_policy import Quota
from server.tenancy.store import TenancyStore
from tests.conftest import LLM_BUDGET_MODEL, LLM_BUDGET_TOKENS, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration
import openai  # noqa: E402

PEPPER = "llm-tenancy-pepper"
MODEL = "tiny_llama"
EMBEDDINGS = "minilm_embeddings"
MESSAGES = [{"role": "user", "content": "hello world"}]
RPM = 3  # tenant "rpm" on tiny_llama
FLUSH_WAIT_S = 30  # the meter flushes every 0.3 s; this only bounds a hang


@pytest.fixture(scope="module")
def llm_tenancy(llm_repository, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("llm_tenancy")
    url = f"sqlite:///{workdir}/tenancy.db"
    store = TenancyStore(url)
    pepper = PEPPER.encode()
    tenants = {
        "rpm": dict(model_quotas={MODEL: Quota(rpm=RPM)}),
        "tpm": dict(quota=Quota(tpm=10)),
        "metered": {},
        "embedder": {},
        "embed_tpm": dict(quota=Quota(tpm=5)),
        "quitter": dict(quota=Quota(tpm=5)),
        "grpc_quitter": dict(quota=Quota(tpm=5)),
        "streamer": {},
        "stream_tpm": dict(quota=Quota(tpm=10)),
        "stream_one": dict(model_quotas={MODEL: Quota(concurrency=1)}),
        "paying": dict(plan="premium"),
        "freeloader": dict(plan="free"),
        "keyed": {},
        "keyed_other": {},
    }
    models = [MODEL, EMBEDDINGS, LLM_BUDGET_MODEL]
    keys = {name: store.create_key(name, pepper, team=f"team-{name}", models=models, **fields)[1] for name, fields in tenants.items()}
    env = {
        "INFERPLANE_DATABASE_URL": url,
        "INFERPLANE_KEY_PEPPER": PEPPER,
        "INFERPLANE_AUTH_REFRESH_S": "0.3",
        "INFERPLANE_USAGE_FLUSH_S": "0.3",
    }
    stack = start_stack(llm_repository, workdir, "--auth", "on", "--model", MODEL, "--model", EMBEDDINGS, "--model", LLM_BUDGET_MODEL, env={**env, "INFERPLANE_AUTH": "on"})
    stack.env, stack.keys, stack.store = env, keys, store
    yield stack
    stop_stack(stack)
    store.close()


# ---- helpers ----------------------------------------------------------------------------------


def _client(stack, tenant: str):
    return openai.OpenAI(base_url=f"http://{stack.http}/v1", api_key=stack.keys[tenant], max_retries=0, timeout=60)


def _metadata(stack, tenant: str):
    return (("authorization", f"Bearer {stack.keys[tenant]}"),)


def _usage(stack, tenant: str, requests: int) -> dict:
    """The tenant's usage sums once ``requests`` requests of it are in the database."""

    def flushed():
        row = next((r for r in stack.store.usage("tenant") if r["tenant"] == tenant), None)
        return row if row is not None and row["requests"] >= requests else None

    row = wait_until(flushed, timeout=FLUSH_WAIT_S)
    assert row, f"no usage of {requests} requests for {tenant}: {stack.store.usage('tenant')}"
    return row


def _rate_limited(err) -> float:
    """Checks a RateLimitError is the quota's 429 with its retry headers; returns Retry-After."""
    assert err.status_code == 429
    headers = err.response.headers
    assert headers["x-should-retry"] == "true"
    assert err.response.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
    return float(headers["retry-after"])


async def _read_then_leave(stack, tenant: str, chunks: int) -> int:
    """Stream a long chat completion, read ``chunks`` content deltas, close the connection; returns
    how many content deltas arrived."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True, "stream": True, "seed": 7}
    headers = {"Authorization": f"Bearer {stack.keys[tenant]}"}
    seen = 0
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{stack.http}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        seen += 1
                if seen >= chunks:
                    r.close()
                    break
    return seen


# ---- quotas -----------------------------------------------------------------------------------


def test_a_request_quota_answers_429_rate_limit_error_with_retry_headers(llm_tenancy):
    client = _client(llm_tenancy, "rpm")
    try:
        for _ in range(RPM):
            assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert 1 <= _rate_limited(info.value) <= 60 / RPM  # one request refills in 20 s
        assert f"{RPM} requests/min" in info.value.response.json()["error"]["message"]
        # streaming is refused the same way, before any event
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True)
        _rate_limited(info.value)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        # the quota is on tiny_llama only: the tenant's embeddings still answer
        assert client.embeddings.create(model=EMBEDDINGS, input="hello").data
    finally:
        client.close()


def test_a_token_quota_refuses_after_the_generated_tokens_on_both_transports(llm_tenancy):
    client = _client(llm_tenancy, "tpm")  # 10 tokens/min for the whole tenant
    try:
        first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, extra_body={"ignore_eos": True})
        assert first.usage.completion_tokens == 16 and first.usage.total_tokens > 10  # charged into debt
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert _rate_limited(info.value) > 0
        assert "10 tokens/min" in info.value.response.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):  # the tenant's quota covers every model
            client.embeddings.create(model=EMBEDDINGS, input="hello")
    finally:
        client.close()
    request = generate_pb2.GenerateRequest(model=MODEL, prompt="hello", max_tokens=2)
    with grpc.insecure_channel(llm_tenancy.grpc) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=_metadata(llm_tenancy, "tpm"), timeout=30))
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens/min" in err.details()
    trailing = dict(err.trailing_metadata())
    assert float(trailing["retry-after"]) > 0
    rich = status_pb2.Status.FromString(trailing["grpc-status-details-bin"])
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in rich.details) and retry.retry_delay.ToMilliseconds() > 0


def test_embedding_input_tokens_are_charged_to_the_token_quota(llm_tenancy):
    client = _client(llm_tenancy, "embed_tpm")  # 5 tokens/min
    try:
        answer = client.embeddings.create(model=EMBEDDINGS, input="a sentence of rather more than five tokens, surely")
        assert answer.usage.prompt_tokens > 5
        with pytest.raises(openai.RateLimitError) as info:
            client.embeddings.create(model=EMBEDDINGS, input="again")
        assert _rate_limited(info.value) > 0
    finally:
        client.close()
    row = _usage(llm_tenancy, "embed_tpm", 1)
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (1, answer.usage.prompt_tokens, 0)


# ---- metering ---------------------------------------------------------------------------------


def test_chat_and_generate_are_metered_with_input_and_output_tokens(llm_tenancy):
    client = _client(llm_tenancy, "metered")
    try:
        usages = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}).usage]
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=7, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
        usages += [chunk.usage for chunk in stream if chunk.usage is not None]
        usages.append(client.completions.create(model=MODEL, prompt="The capital of", max_tokens=3, extra_body={"ignore_eos": True}).usage)
    finally:
        client.close()
    request = generate_pb2.GenerateRequest(model=MODEL, prompt="once upon a time", max_tokens=4, ignore_eos=True)
    with grpc.insecure_channel(llm_tenancy.grpc) as channel:
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=_metadata(llm_tenancy, "metered"), timeout=30))
    usages.append(responses[-1].usage)
    assert len(usages) == 4 and [u.completion_tokens for u in usages] == [5, 7, 3, 4]

    row = _usage(llm_tenancy, "metered", 4)
    assert row["requests"] == 4
    assert row["input_tokens"] == sum(u.prompt_tokens for u in usages)
    assert row["output_tokens"] == sum(u.completion_tokens for u in usages) == 19
    assert row["tokens"] == row["input_tokens"] + row["output_tokens"] and row["compute_us"] > 0
    by_version = [r for r in llm_tenancy.store.usage("model_version") if r["model"] == MODEL]
    assert [r["version"] for r in by_version] == ["1"]
    # the operator's view: `inferplane usage`
    out = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "usage", "--by", "tenant", "--since", "1h", "--json"],
        env=dict(os.environ, **llm_tenancy.env), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = {r["tenant"]: r for r in json.loads(out.stdout)}
    assert (report["metered"]["input_tokens"], report["metered"]["output_tokens"]) == (row["input_tokens"], 19)


def test_a_generation_with_an_idempotency_key_answers_once_per_tenant(llm_tenancy):
    """Same key + same body: the same answer, no second generation (the tenant's metered output tokens
    are the first answer's); a streamed repeat replays it; another body under the key is refused;
    another tenant with the key gets an answer of its own."""
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    key = {"Idempotency-Key": "order-4711"}
    client, other = _client(llm_tenancy, "keyed"), _client(llm_tenancy, "keyed_other")
    try:
        first = client.chat.completions.create(**body, extra_headers=key)
        again = client.chat.completions.create(**body, extra_headers=key)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True, extra_headers=key) if c.choices)
        fresh = client.chat.completions.create(**body)  # no key: a generation of its own
        with pytest.raises(openai.APIStatusError) as reused:
            client.chat.completions.create(**{**body, "max_tokens": 23}, extra_headers=key)
        theirs = [other.chat.completions.create(**body, extra_headers=key).choices[0].message.content for _ in range(2)]
    finally:
        client.close()
        other.close()
    text = first.choices[0].message.content
    assert first.usage.completion_tokens == 24 and again.choices[0].message.content == text and streamed == text
    assert reused.value.status_code in (409, 422) and "idempotency key" in reused.value.message
    assert theirs[0] == theirs[1] and theirs[0] != text  # sampled at temperature 1: another generation, once
    assert fresh.choices[0].message.content != text
    # a replay is no generation: the tenants' metered output tokens are their generations' only
    assert _output_tokens(llm_tenancy, "keyed", 24 * 2) == 24 * 2  # the first answer and the unkeyed one
    assert _output_tokens(llm_tenancy, "keyed_other", 24) == 24


def _output_tokens(stack, tenant: str, at_least: int) -> int:
    """The tenant's metered output tokens once at least ``at_least`` are in the database."""

    def flushed():
        row = next((r for r in stack.store.usage("tenant") if r["tenant"] == tenant), None)
        return row["output_tokens"] if row is not None and row["output_tokens"] >= at_least else None

    tokens = wait_until(flushed, timeout=FLUSH_WAIT_S)
    assert tokens, f"fewer than {at_least} output tokens metered for {tenant}: {stack.store.usage('tenant')}"
    return tokens


def test_embeddings_are_metered_with_their_input_tokens(llm_tenancy):
    client = _client(llm_tenancy, "embedder")
    try:
        answer = client.embeddings.create(model=EMBEDDINGS, input=["hello world", "a second, longer text to embed"])
    finally:
        client.close()
    row = _usage(llm_tenancy, "embedder", 1)
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (1, answer.usage.prompt_tokens, 0)
    assert row["tokens"] == answer.usage.prompt_tokens > 0


def test_a_stream_the_client_leaves_is_charged_the_tokens_it_generated(llm_tenancy):
    seen = asyncio.run(_read_then_leave(llm_tenancy, "quitter", chunks=12))  # well past 5 tokens/min (see below)
    assert seen >= 12
    row = _usage(llm_tenancy, "quitter", 1)
    assert row["requests"] == 1 and row["input_tokens"] > 0
    assert seen <= row["output_tokens"] < 1900  # what was generated before the frontend saw it go
    # those tokens were charged: 5 tokens/min is deep in debt, the next request is refused
    client = _client(llm_tenancy, "quitter")
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert _rate_limited(info.value) > 0
    finally:
        client.close()


def test_a_cancelled_grpc_generate_is_charged_the_tokens_it_generated(llm_tenancy):
    request = generate_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=1900, ignore_eos=True)
    metadata = _metadata(llm_tenancy, "grpc_quitter")
    with grpc.insecure_channel(llm_tenancy.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request, metadata=metadata, timeout=60)
        texts = 0
        for response in call:
            texts += bool(response.text)
            # well past the 5 tokens a minute, so the bucket's refill while the usage row is flushed
            # (seconds on a loaded machine: 1 token per 12 s) cannot pay the debt back
            if texts >= 12:
                call.cancel()
                break
        row = _usage(llm_tenancy, "grpc_quitter", 1)
        assert row["input_tokens"] > 0 and texts <= row["output_tokens"] < 1900
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=2), metadata=metadata, timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert float(dict(info.value.trailing_metadata())["retry-after"]) > 0


# ---- Triton's ModelStreamInfer, passed through ----------------------------------------------------


class _Stream:
    """A tritonclient ModelStreamInfer call to the frontend as ``tenant``, sending tiny_llama prompts."""

    def __init__(self, stack, tenant: str):
        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(stack.grpc)
        headers = {"authorization": f"Bearer {stack.keys[tenant]}"}
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)), headers=headers)

    def send(self, request_id: str, max_tokens: int, **kwargs) -> None:
        inputs = []
        for name, value in (("text_input", "hello world"), ("parameters", json.dumps({"max_tokens": max_tokens, "ignore_eos": True}))):
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            inputs.append(tensor)
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, **kwargs)

    def next(self):
        """(request id, info or None, final, error) of the next response."""
        result, error = self.results.get(timeout=60)
        if error is not None:
            return None, None, True, str(error)
        response = result.get_response()
        info = result.as_numpy("info")
        info = json.loads(info.reshape(-1)[0]) if info is not None else None
        return response.id, info, response.parameters["triton_final_response"].bool_param, None

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def test_model_stream_infer_generations_are_metered_with_their_tokens(llm_tenancy):
    stream = _Stream(llm_tenancy, "streamer")
    finals: dict[str, dict] = {}
    try:
        stream.send("a", 5)
        stream.send("b", 3, enable_empty_final_response=True)
        last: dict[str, dict] = {}
        while len(finals) < 2:
            request_id, info, final, error = stream.next()
            assert error is None, error
            if info is not None:
                last[request_id] = info
            if final:
                finals[request_id] = last[request_id]
    finally:
        stream.close()
    assert [finals[r]["completion_tokens"] for r in "ab"] == [5, 3]
    row = _usage(llm_tenancy, "streamer", 2)
    assert row["requests"] == 2 and row["output_tokens"] == 8 and row["compute_us"] > 0
    assert row["input_tokens"] == sum(f["prompt_tokens"] for f in finals.values()) > 0


def test_model_stream_infer_is_refused_in_stream_once_its_tokens_are_used(llm_tenancy):
    stream = _Stream(llm_tenancy, "stream_tpm")  # 10 tokens/min for the whole tenant
    try:
        stream.send("first", 16)
        while not (response := stream.next())[2]:
            assert response[3] is None, response[3]
        assert response[1]["completion_tokens"] == 16  # charged before this final response came: in debt
        stream.send("second", 2)
        _, _, _, error = stream.next()
        assert error is not None and "RESOURCE_EXHAUSTED" in error and "10 tokens/min" in error
        stream.send("third", 2)  # the stream goes on, and still refuses
        assert "RESOURCE_EXHAUSTED" in stream.next()[3]
    finally:
        stream.close()
    row = _usage(llm_tenancy, "stream_tpm", 1)
    assert (row["requests"], row["output_tokens"]) == (1, 16)


def test_model_stream_infer_requests_count_against_concurrency_until_they_end(llm_tenancy):
    stream = _Stream(llm_tenancy, "stream_one")  # one tiny_llama request at a time
    try:
        stream.send("long", 1900)
        request_id, _, final, error = stream.next()  # it is generating: in flight
        assert (request_id, final, error) == ("long", False, None)
        stream.send("second", 2)
        while (response := stream.next())[0] == "long":
            pass
        assert "RESOURCE_EXHAUSTED" in response[3] and "1 concurrent" in response[3]
    finally:
        stream.close(cancel=True)  # the caller leaves: its request ends with the stream

    def answered_on_a_new_stream():
        again = _Stream(llm_tenancy, "stream_one")
        try:
            again.send("after", 2)
            while True:
                _, _, final, error = again.next()
                if error is not None or final:
                    return error is None
        finally:
            again.close()

    assert wait_until(answered_on_a_new_stream, timeout=30, interval=0.2)
    row = _usage(llm_tenancy, "stream_one", 2)  # the cancelled generation is metered with what it generated
    assert row["requests"] == 2 and 2 < row["output_tokens"] < 1900 + 2


def test_the_callers_plan_is_the_engines_priority(llm_tenancy):
    """The fair queue's plans reach the engine as priorities (premium 1 before free 3: the CPU engine
    admits by it, vLLM schedules and preempts by it), from the frontend's request parameter; a caller
    that names that parameter itself on the raw OIP path is refused."""

    def last_record(tenant: str) -> dict:
        _client(llm_tenancy, tenant).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
        return asyncio.run(_engine_stats(llm_tenancy, tenant))["records"][-1]

    assert last_record("paying")["priority"] == 1
    assert last_record("freeloader")["priority"] == 3
    stream = _Stream(llm_tenancy, "freeloader")
    try:
        stream.send("claims-premium", 2, parameters={"inferplane_priority": 0})
        _, _, final, error = stream.next()
        assert final and "inferplane_priority" in error and "set by the frontend" in error, error
    finally:
        stream.close()


async def _engine_stats(stack, tenant: str, model: str = MODEL) -> dict:
    headers = {"Authorization": f"Bearer {stack.keys[tenant]}"}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{stack.http}/v2/models/{model}/engine_stats", headers=headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()


# ---- priority under KV pressure -------------------------------------------------------------------


async def _chat_stream(stack, tenant: str, model: str, content: str, max_tokens: int) -> str:
    """One streamed chat completion to its end; returns its finish reason."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    headers = {"Authorization": f"Bearer {stack.keys[tenant]}"}
    reason = None
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{stack.http}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        reason = choice.get("finish_reason") or reason
    return reason


def test_a_premium_stream_is_admitted_before_a_waiting_free_flood(llm_tenancy):
    """Our engine under KV pressure: tiny_llama_budget's 400 KV tokens hold two of a free tenant's
    streams (each reserves exactly half); the other free streams wait in the engine's queue. A
    premium stream sent then is admitted at the next turnover, before every free stream that was
    waiting when it arrived (arrival order would put it behind all of them). By engine steps, not time."""
    model, premium, free = LLM_BUDGET_MODEL, "paying", "freeloader"
    asyncio.run(_chat_stream(llm_tenancy, premium, model, "probe", 1))
    prompt = asyncio.run(_engine_stats(llm_tenancy, premium, model))["records"][-1]["prompt_tokens"]
    free_tokens = LLM_BUDGET_TOKENS // 2 - prompt  # two free streams fill the budget
    premium_tokens = 8  # it needs room a running free stream leaves when it ends
    floods = 6
    before = {r["id"] for r in asyncio.run(_engine_stats(llm_tenancy, premium, model))["records"]}

    async def scenario() -> tuple[dict, list[str]]:
        flood = [asyncio.ensure_future(_chat_stream(llm_tenancy, free, model, "probe", free_tokens)) for _ in range(floods)]
        queued = None
        for _ in range(600):  # until the engine holds two and queues the rest (bounded, not timed)
            stats = await _engine_stats(llm_tenancy, premium, model)
            if stats["running"] == 2 and stats["waiting"] >= floods - 3:
                queued = stats
                break
            await asyncio.sleep(0.02)
        assert queued, f"the free flood never queued in the engine: {stats}"
        reasons = [await _chat_stream(llm_tenancy, premium, model, "probe", premium_tokens)]
        reasons += await asyncio.gather(*flood)
        return queued, reasons

    queued, reasons = asyncio.run(scenario())
    assert reasons == ["length"] * (floods + 1)
    records = [r for r in asyncio.run(_engine_stats(llm_tenancy, premium, model))["records"] if r["id"] not in before]
    (paid,) = [r for r in records if r["priority"] == 1]
    frees = [r for r in records if r["priority"] == 3]
    assert len(frees) == floods and all(r["finish_reason"] == "length" for r in records)
    # the free streams that were in the engine's queue when the premium one arrived
    waited = [r for r in frees if r["submitted_step"] <= paid["submitted_step"] < r["admitted_step"]]
    assert len(waited) >= 2, (paid, frees)
    assert all(paid["admitted_step"] <= r["admitted_step"] for r in waited), (paid, waited)
    # its wait is bounded by one batch turnover: a running free stream's max_tokens steps
    assert 0 <= paid["admitted_step"] - paid["submitted_step"] <= free_tokens + 1, paid
