"""The vLLM engine end to end on a GPU: the tiny Llama written with ``engine vllm`` and served by
the real stack (frontend + embedded Triton + vLLM in the decoupled Python model).

Skipped, with the reason, wherever vLLM cannot run (no CUDA device, or vllm not importable) —
always on this project's CPU machines; the engine's own logic is covered there by
tests/unit/test_llm_vllm_core.py against a fake of vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

import aiohttp
import pytest

from model_repository.adapters._vllm_core import vllm_unavailable
from tests.conftest import start_stack, stop_stack, wait_until

_UNAVAILABLE = vllm_unavailable()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"vLLM cannot run here: {_UNAVAILABLE}"),
]
openai = pytest.importorskip("openai")

MODEL = "tiny_llama_vllm"
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    from model_repository.llm import SEED, TINY_SETTINGS, build_tiny_llama, write_llm_model

    # bfloat16: vLLM's GPU attention kernels do not all take float32; a fifth of the GPU leaves
    # room for another engine (SmolLM2 in the session's llm_stack runs on vLLM here too)
    settings = dataclasses.replace(TINY_SETTINGS, engine="vllm", dtype="bfloat16", gpu_memory_utilization=0.2)
    out = tmp_path_factory.mktemp("vllm") / "model_repository"
    with tempfile.TemporaryDirectory() as tmp:
        write_llm_model(out, MODEL, build_tiny_llama(Path(tmp) / MODEL), settings, f"random init, seed {SEED}")
    s = start_stack(out, tmp_path_factory.mktemp("vllm_stack"))
    yield s
    stop_stack(s)


@pytest.fixture(scope="module")
def client(vllm_stack):
    c = openai.OpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _stats(stack) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{stack.http}/v2/models/{MODEL}/engine_stats") as r:
                assert r.status == 200, await r.text()
                return await r.json()

    return asyncio.run(get())


def test_the_model_runs_on_vllm(vllm_stack):
    stats = _stats(vllm_stack)
    assert stats["engine"] == "vllm" and stats["vllm_version"] and stats["max_model_len"] == 2048
    assert stats["dtype"] == "bfloat16"


def test_a_seeded_chat_streams_the_unary_answer(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    unary = client.chat.completions.create(**kwargs)
    parts, reasons, usages = [], [], []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    assert "".join(parts) == unary.choices[0].message.content
    assert reasons == [unary.choices[0].finish_reason]
    assert len(usages) == 1 and usages[0].completion_tokens == unary.usage.completion_tokens
    assert client.chat.completions.create(**kwargs).choices[0].message.content == unary.choices[0].message.content


def test_max_tokens_is_a_hard_cap(client):
    for n in (1, 17):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_deadline_aborts_the_request(client, vllm_stack):
    before = _stats(vllm_stack)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2000, extra_body={"ignore_eos": True, "deadline_ms": 30}
        )
    assert info.value.status_code == 504
    stats = wait_until(lambda: (st := _stats(vllm_stack))["deadline_exceeded"] > before["deadline_exceeded"] and st)
    assert stats and stats["aborted"] > before["aborted"] and stats["running"] == 0


def test_client_disconnect_aborts_the_request(vllm_stack):
    async def read_then_leave() -> None:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True, "stream": True, "seed": 77}
        seen = 0
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{vllm_stack.http}/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    seen += line.startswith(b"data: ")
                    if seen >= 5:
                        r.close()
                        return

    before = _stats(vllm_stack)
    asyncio.run(read_then_leave())
    stats = wait_until(lambda: (st := _stats(vllm_stack))["cancelled"] > before["cancelled"] and st, timeout=10)
    assert stats, "the engine never saw the cancellation"
    assert stats["aborted"] > before["aborted"] and stats["running"] == 0
    record = [r for r in stats["records"] if r["finish_reason"] == "cancelled"][-1]
    assert record["completion_tokens"] < 1900
