"""LLM serving end to end: the official openai SDK and raw SSE against the REST bridge, the gRPC
``Generate`` RPC, and the engine's counters — all through a real Triton running the decoupled
continuous-batching engine on the tiny random Llama (SmolLM2 for one smoke test)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import grpc
import pytest

from tests.conftest import LLM_BUDGET_MODEL, LLM_BUDGET_TOKENS, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration
import openai  # noqa: E402

MODEL = "tiny_llama"
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def client(llm_stack):
    c = openai.OpenAI(base_url=f"http://{llm_stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _tokenizer(llm_repository: Path, model: str = MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llm_repository / model / "1" / "hf"))


def _stream(client, **kwargs):
    """(joined text, finish reasons, usage chunks, chunk count) of a streamed chat completion."""
    parts, reasons, usages, n = [], [], [], 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        n += 1
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return "".join(parts), reasons, usages, n


def _stats(llm_stack, model: str = MODEL) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{llm_stack.http}/v2/models/{model}/engine_stats") as r:
                assert r.status == 200, await r.text()
                return await r.json()

    return asyncio.run(get())


def test_models_lists_llms_and_embeddings(client):
    ids = {m.id for m in client.models.list().data}
    assert {MODEL, LLM_BUDGET_MODEL, "minilm_embeddings"} <= ids


def test_chat_stream_equals_unary_for_a_seeded_request(client, llm_repository):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    unary = client.chat.completions.create(**kwargs)
    text, reasons, usages, _ = _stream(client, stream_options={"include_usage": True}, **kwargs)
    assert text == unary.choices[0].message.content
    assert reasons == [unary.choices[0].finish_reason]  # exactly one finish reason
    assert len(usages) == 1 and usages[0].completion_tokens == unary.usage.completion_tokens
    # same seed, same text again; another seed, another text
    assert client.chat.completions.create(**kwargs).choices[0].message.content == text
    assert client.chat.completions.create(**{**kwargs, "seed": 99}).choices[0].message.content != text


def test_usage_counts(client, llm_repository):
    tok = _tokenizer(llm_repository)
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=17, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == expected_prompt
    assert r.usage.completion_tokens == 17
    assert r.usage.total_tokens == expected_prompt + 17
    _, reasons, usages, _ = _stream(
        client, model=MODEL, messages=MESSAGES, max_tokens=17, temperature=0, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reasons == ["length"]
    assert (usages[0].prompt_tokens, usages[0].completion_tokens, usages[0].total_tokens) == (expected_prompt, 17, expected_prompt + 17)


def test_max_tokens_is_a_hard_cap(client):
    for n in (1, 5, 33):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_stop_sequence_truncates_the_answer(client):
    greedy = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**greedy).choices[0].message.content
    text = full.replace("\ufffd", "")
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2])
    expected = full[: full.index(stop)]
    r = client.chat.completions.create(**greedy, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected
    streamed, reasons, _, _ = _stream(client, **greedy, stop=[stop])
    assert streamed == expected and reasons == ["stop"]


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL, prompt="The capital of", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    parts = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})]  # fmt: skip
    assert "".join(parts) == r.choices[0].text


def test_deadline_before_and_after_the_first_token(client, llm_stack):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2000, extra_body={"ignore_eos": True, "deadline_ms": 30}
        )
    assert info.value.status_code == 504

    async def streamed():
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "deadline_ms": 60, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{llm_stack.http}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                return (await r.text()).split("\n\n")

    events = [e.removeprefix("data: ") for e in asyncio.run(streamed()) if e.strip()]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "DEADLINE_EXCEEDED"
    assert not any('"finish_reason":"' in e for e in events[:-2])  # no finish reason: it failed


def test_client_disconnect_cancels_the_sequence_within_one_step(llm_stack):
    async def read_then_leave() -> int:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True, "stream": True, "seed": 77}
        seen = 0
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{llm_stack.http}/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        seen += 1
                    if seen >= 5:
                        r.close()
                        break
        return seen

    before = _stats(llm_stack)["cancelled"]
    asyncio.run(read_then_leave())
    stats = wait_until(lambda: (st := _stats(llm_stack))["cancelled"] > before and st, timeout=10)
    assert stats, "the engine never saw the cancellation"
    record = [r for r in stats["records"] if r["finish_reason"] == "cancelled"][-1]
    # the engine checks every running sequence before each decode step: after it noticed the
    # cancellation (at `step`) it computed no further token for it
    assert record["step"] - record["last_step"] <= 1
    assert record["completion_tokens"] < 1900
    assert stats["running"] == 0 and stats["reserved_tokens"] == 0


def test_over_budget_requests_queue_then_run(client, llm_stack):
    prompt_tokens = client.chat.completions.create(model=LLM_BUDGET_MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    max_tokens = LLM_BUDGET_TOKENS // 2 - prompt_tokens - 10  # two fit, the third waits
    with pytest.raises(openai.BadRequestError, match="KV-cache budget"):
        client.chat.completions.create(model=LLM_BUDGET_MODEL, messages=MESSAGES, max_tokens=LLM_BUDGET_TOKENS)

    async def three():
        aclient = openai.AsyncOpenAI(base_url=f"http://{llm_stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(
                aclient.chat.completions.create(model=LLM_BUDGET_MODEL, messages=MESSAGES, max_tokens=max_tokens, seed=i,
                                                temperature=0.5, extra_body={"ignore_eos": True})
                for i in range(3)
            ))  # fmt: skip
        finally:
            await aclient.close()

    answers = asyncio.run(three())
    assert [a.usage.completion_tokens for a in answers] == [max_tokens] * 3
    stats = _stats(llm_stack, LLM_BUDGET_MODEL)
    assert stats["max_running_seen"] == 2 and stats["max_waiting_seen"] >= 1
    last3 = stats["records"][-3:]
    queued = [r for r in last3 if r["admitted_step"] > r["submitted_step"]]
    assert queued, last3
    first_done = min(r["step"] for r in last3)
    assert all(r["admitted_step"] >= first_done for r in queued)  # it joined when a sequence left


def test_shared_system_prompt_hits_the_prefix_cache(client, llm_stack):
    system = {"role": "system", "content": "You are a terse assistant for the inferplane test suite. " * 4}
    before = _stats(llm_stack)["prefix_hit_tokens"]
    first = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "one"}], max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "two"}], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    stats = _stats(llm_stack)
    assert stats["prefix_hit_tokens"] - before == second.usage.prompt_tokens_details.cached_tokens
    assert 0 < stats["prefix_hit_rate"] <= 1


def test_errors_before_the_stream_are_statuses(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no_such_model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="minilm_embeddings", messages=MESSAGES)


def test_openapi_covers_the_openai_routes(llm_stack):
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{llm_stack.http}/openapi.json") as r:
                return await r.json()

    paths = asyncio.run(get())["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"} <= set(paths)


# ---- gRPC Generate ----------------------------------------------------------------------------


def test_grpc_generate_streams_the_same_answer(client, llm_stack):
    from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc

    unary = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.8, seed=5)
    request = generate_pb2.GenerateRequest(model=MODEL, max_tokens=12, temperature=0.8, seed=5)
    request.messages.add(role="user", content="hello world")
    with grpc.insecure_channel(llm_stack.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        responses = list(stub.Generate(request, timeout=30))
        assert "".join(r.text for r in responses) == unary.choices[0].message.content
        assert [r.finish_reason for r in responses if r.finish_reason] == [unary.choices[0].finish_reason]
        assert responses[-1].usage.completion_tokens == unary.usage.completion_tokens
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_pb2.GenerateRequest(model="nope", prompt="x"), timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # cancelling the call stops the sequence in the engine
        before = _stats(llm_stack)["cancelled"]
        call = stub.Generate(generate_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=1900, ignore_eos=True), timeout=30)
        for i, _ in enumerate(call):
            if i >= 3:
                call.cancel()
                break
    assert wait_until(lambda: _stats(llm_stack)["cancelled"] > before, timeout=10)


@pytest.fixture(scope="module")
def bounded_llm_stack(llm_repository, tmp_path_factory):
    """tiny_llama alone on a frontend holding one inference request at once (INFERPLANE_MAX_INFLIGHT=1)."""
    repository = tmp_path_factory.mktemp("bounded_llm") / "model_repository"
    shutil.copytree(llm_repository / MODEL, repository / MODEL)
    s = start_stack(repository, tmp_path_factory.mktemp("bounded_llm_stack"), env={"INFERPLANE_MAX_INFLIGHT": "1"})
    yield s
    stop_stack(s)


def test_grpc_generate_holds_its_place_in_the_in_flight_bound_until_its_end(bounded_llm_stack):
    """Generate takes a place in the process's in-flight bound (server.dataplane.loop_gate) like every
    other inference route: with a bound of one, a generation that is streaming holds it, so another
    Generate is RESOURCE_EXHAUSTED with a retry hint (RetryInfo, ``retry-after``) before its model is
    even looked up, and a chat completion is 429; the place comes back when the holder is cancelled,
    when a generation ends at its last chunk, and when one fails (NOT_FOUND)."""
    from google.rpc import error_details_pb2, status_pb2

    from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc

    short = generate_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, ignore_eos=True)

    def outcome(stub, request):
        try:
            return list(stub.Generate(request, timeout=60))
        except grpc.RpcError as err:
            return err

    client = openai.OpenAI(base_url=f"http://{bounded_llm_stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
    with grpc.insecure_channel(bounded_llm_stack.grpc, options=[("grpc.enable_retries", 0)]) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        holder = stub.Generate(generate_pb2.GenerateRequest(model=MODEL, prompt="x", max_tokens=1900, ignore_eos=True), timeout=120)
        first = next(holder)  # admitted and streaming: it holds the one place
        refused = outcome(stub, generate_pb2.GenerateRequest(model="nope", prompt="x"))  # refused before the lookup
        refused_llm = outcome(stub, short)
        try:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            chat = None
        except openai.APIStatusError as err:
            chat = err
        still_streaming = next(holder)  # the premise: the holder was mid-generation through every probe
        holder.cancel()
        after_cancel = wait_until(lambda: (o := outcome(stub, short)) and not isinstance(o, grpc.RpcError) and o, timeout=30)
        not_found = outcome(stub, generate_pb2.GenerateRequest(model="nope", prompt="x"))
        after_error = outcome(stub, short)  # the failed call gave its place back before its status was sent
        after_end = outcome(stub, short)  # and so did the one that ended at its last chunk
    client.close()
    assert first.error.code == "" and not first.finish_reason and not still_streaming.finish_reason
    for err in (refused, refused_llm):
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "in flight" in err.details(), err.details()
        trailing = dict(err.trailing_metadata())
        assert float(trailing["retry-after"]) > 0
        info = error_details_pb2.RetryInfo()
        assert any(a.Unpack(info) for a in status_pb2.Status.FromString(trailing["grpc-status-details-bin"]).details)
        assert info.retry_delay.ToMilliseconds() > 0
    assert isinstance(chat, openai.RateLimitError) and int(chat.response.headers["retry-after"]) >= 1, chat
    assert isinstance(not_found, grpc.RpcError) and not_found.code() == grpc.StatusCode.NOT_FOUND, not_found
    for answer in (after_cancel, after_error, after_end):
        assert isinstance(answer, list) and answer[-1].finish_reason == "length" and answer[-1].usage.completion_tokens == 2, answer


# ---- SmolLM2 (a real model) ------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_answers_a_real_question(client):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20, temperature=0
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_reader_that_stalls_blocks_neither_the_engine_nor_other_streams(client, llm_stack):
    """SSE flow control: the engine and other streams never wait for a client that does not read.
    (Its socket takes ~300 KB here before the kernel's send buffer, up to 4 MB, fills, so the
    merging of pending deltas that bounds memory past that point is tested on ``_Pending``.)"""
    import socket

    tokens = 1777  # recognisable in the engine's records
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    body = json.dumps({**request, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    host, port = llm_stack.http.rsplit(":", 1)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a tiny window: the server's writes back up
    stalled.connect((host, int(port)))
    # HTTP/1.0: no chunked framing, the server closes the connection after [DONE]
    head = f"POST /v1/chat/completions HTTP/1.0\r\nHost: {llm_stack.http}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    stalled.sendall(head.encode() + body)
    try:
        # another stream runs to the end while the first one is not read at all
        text, reasons, usages, _ = _stream(client, model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
        assert reasons == ["length"] and usages[-1].completion_tokens == 16
        # the engine finishes the stalled request without waiting for its reader
        assert wait_until(
            lambda: any(r["completion_tokens"] == tokens and r["finish_reason"] == "length" for r in _stats(llm_stack)["records"]),
            timeout=60,
        )
        received = b""
        stalled.settimeout(30)
        while part := stalled.recv(1 << 16):
            received += part
    finally:
        stalled.close()
    assert received.startswith(b"HTTP/1.0 200") and received.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in received.decode().splitlines() if line.startswith("data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == tokens
    content = [c["choices"][0]["delta"]["content"] for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]
    # the same greedy request read as it comes: the same answer
    read = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **request)
            if c.choices and c.choices[0].delta.content]  # fmt: skip
    assert "".join(content) == "".join(read)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]] == ["length"]


@pytest.mark.parametrize("model, artifact", [(MODEL, "hf/model.safetensors"), ("minilm_embeddings", "model.onnx")])
def test_a_tampered_llm_or_embedding_artifact_refuses_to_load(llm_stack, llm_repository, model, artifact):
    """The LLM and embedding adapters run the same digest check as the tabular ones (``_common``)."""
    import shutil

    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    from model_repository.config_writer import read_config, write_config

    name = f"tampered_{model}"
    shutil.copytree(llm_repository / model, llm_repository / name)
    config = read_config(llm_repository / name)
    config.name = name
    write_config(config, llm_repository / name)
    path = llm_repository / name / "1" / artifact
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.unlink()  # the LLM's weights may be a hard link to the original's
    path.write_bytes(bytes(data))
    client = tg.InferenceServerClient(llm_stack.triton)
    try:
        with pytest.raises(InferenceServerException, match="sha256.*refusing to load"):
            client.load_model(name)
        assert not client.is_model_ready(name)
    finally:
        client.close()
        shutil.rmtree(llm_repository / name, ignore_errors=True)

