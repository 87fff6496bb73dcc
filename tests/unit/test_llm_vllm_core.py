"""The vLLM engine's own logic without vLLM, and the choice between the engines.

``_vllm_core`` talks to vLLM's OpenAI server over HTTP; here that server is a small aiohttp fake of the
part in use (``/health``, ``/version``, ``/v1/models``, ``/metrics``, ``/v1/completions`` streaming SSE
with ``continuous_usage_stats``, ``/v1/load_lora_adapter``) that plays a script per request. What is
tested is ours: deltas and one final response, finish reasons, aborts (a closed stream) on cancel and
deadline, the request body (priority, LoRA, sampling), the server's command line and environment, the
counts. That real vLLM behaves as the fake does is tests/integration/test_llm_vllm.py (every run).
"""

from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest

import transformers  # noqa: E402
from aiohttp import web  # noqa: E402

from model_repository.adapters._llm_common import (  # noqa: E402
    PRIORITY_LAST, PRIORITY_PARAMETER, RequestError, SamplingParams, request_priority,
)  # fmt: skip
from model_repository.adapters._lora import Adapter  # noqa: E402
from model_repository.adapters._vllm_core import (  # noqa: E402
    EngineUnavailable, VLLMConfig, VLLMEngine, choose_engine, cpu_list, find_vllm_python, merge_deltas, parse_metrics,
    request_body, server_command, server_environment, speculative_config, vllm_unavailable,
)  # fmt: skip
from tests.conftest import wait_until  # noqa: E402

MESSAGES = [{"role": "user", "content": "hello world"}]


# ---- a fake of vLLM's OpenAI server -------------------------------------------------------------


class FakeVLLM:
    """Plays ``script(body)`` per completion: (delta, completion_tokens, finish_reason) chunks, one
    every ``delay`` s after ``first_delay`` s; ``status``/``error`` refuse the request instead."""

    def __init__(self):
        self.script = lambda body: [("Hi", 1, "stop")]
        self.delay = 0.0
        self.first_delay = 0.0
        self.cached = 0
        self.refuse: tuple[int, str] | None = None
        self.bodies: list[dict] = []
        self.aborted: list[str] = []  # prompts (as str) whose stream the client closed before the end
        self.loras: list[dict] = []
        self.running = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        threading.Thread(target=self._serve, daemon=True).start()
        assert self.ready.wait(10)

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _health(self, request):
        return web.Response(text="")

    async def _version(self, request):
        return web.json_response({"version": "0.0-fake"})

    async def _models(self, request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 2048}]})

    async def _metrics(self, request):
        text = (
            "# HELP vllm:num_requests_running x\n"
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            'vllm:num_requests_waiting{model_name="m"} 0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:num_preemptions_total{model_name="m"} 2\n'
            'vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 5\n'
        )
        return web.Response(text=text)

    async def _load_lora(self, request):
        self.loras.append(await request.json())
        return web.Response(text="ok")

    async def _complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.refuse is not None:
            status, message = self.refuse
            return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running += 1
        tokens = 0
        try:
            await asyncio.sleep(self.first_delay)
            for delta, tokens, reason in self.script(body):
                await asyncio.sleep(self.delay)
                if request.transport is None or request.transport.is_closing():
                    self.aborted.append(str(body["prompt"]))
                    return resp
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens,
                         "prompt_tokens_details": {"cached_tokens": self.cached}}  # fmt: skip
                chunk = {"choices": [{"index": 0, "text": delta, "finish_reason": reason}], "usage": usage}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if reason is not None:
                    await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                    break
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted.append(str(body["prompt"]))
            raise
        finally:
            self.running -= 1
        return resp


class _Sink:
    def __init__(self, cancel_after: int | None = None):
        self.parts, self.infos, self.final, self.done = [], [], None, threading.Event()
        self.cancel_after = cancel_after
        self.cancel = False

    def send(self, text, info, final):
        assert not self.done.is_set(), "a response after the final one"
        self.parts.append(text)
        self.infos.append(info)
        if final:
            self.final = info
            self.done.set()
        elif self.cancel_after is not None and len(self.parts) >= self.cancel_after:
            self.cancel = True

    def cancelled(self):
        return self.cancel

    def wait(self):
        assert self.done.wait(10), "no final response"
        return "".join(self.parts), self.final


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from model_repository.llm import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture
def fake():
    f = FakeVLLM()
    yield f
    f.loop.call_soon_threadsafe(f.loop.stop)


@pytest.fixture
def engine(tiny_dir, fake):
    e = VLLMEngine(tiny_dir, VLLMConfig(served_name="m", default_max_tokens=32, max_loras=2))
    e.attach(fake.port)
    yield e
    e.stop()


# ---- streaming -----------------------------------------------------------------------------------


def test_deltas_stream_and_one_final_carries_the_rest(engine, fake):
    fake.script = lambda body: [("He", 1, None), ("llo", 2, None), (" wor", 3, None), ("ld", 4, "stop")]
    fake.cached = 3
    prompt = engine.encode_chat(MESSAGES)
    sink = _Sink()
    engine.submit("r1", prompt, SamplingParams(max_tokens=8, temperature=0, priority=1), sink)
    text, final = sink.wait()
    assert text == "Hello world"
    # the last delta goes with the final response; deltas the sender had not caught up with go out joined
    # (test_merge_deltas_*), so the split is the sender's pace: each part ends where a delta of the script ends
    assert sink.parts[-1].endswith("ld") and all(p for p in sink.parts[:-1])
    ends = {len("He"), len("Hello"), len("Hello wor"), len("Hello world")}
    assert {len("".join(sink.parts[: i + 1])) for i in range(len(sink.parts))} <= ends
    tokens = [info["completion_tokens"] for info in sink.infos[:-1]]
    assert tokens == sorted(set(tokens)) and set(tokens) <= {1, 2, 3}
    for info in sink.infos[:-1]:
        assert info["prompt_tokens"] == len(prompt) and "finish_reason" not in info
    assert final["finish_reason"] == "stop" and final["priority"] == 1
    assert (final["prompt_tokens"], final["completion_tokens"], final["cached_tokens"]) == (len(prompt), 4, 3)
    snap = engine.snapshot()
    assert snap["engine"] == "vllm" and snap["tokens_generated"] == 4 and snap["running"] == 0
    assert (snap["prefix_prompt_tokens"], snap["prefix_hit_tokens"]) == (len(prompt), 3)
    assert snap["records"][-1]["id"] == "r1" and snap["vllm_version"] == "0.0-fake" and snap["max_model_len"] == 2048
    # vLLM's own gauges, summed over labels (histogram buckets left out)
    assert (snap["kv_utilization"], snap["preemptions"], snap["queue_depth"]) == (0.25, 2, 0)
    # vLLM got our token ids (not text), the served name and the priority
    body = fake.bodies[-1]
    assert body["prompt"] == prompt and body["model"] == "m" and body["priority"] == 1 and body["stream"] is True


def test_merge_deltas_joins_each_requests_queued_deltas_in_order():
    a, b = object(), object()
    items = [(a, "He", {"step": 1}, False), (b, "x", {"step": 2}, False), (a, "llo", {"step": 3}, False),
             (b, "y", {"step": 4}, False), (a, " wor", {"step": 5}, False)]  # fmt: skip
    assert merge_deltas(items) == [(a, "Hello wor", {"step": 5}, False), (b, "xy", {"step": 4}, False)]


def test_merge_deltas_puts_pending_text_in_front_of_a_normal_final():
    a = object()
    for reason in ("stop", "length"):
        done = {"finish_reason": reason, "completion_tokens": 4}
        assert merge_deltas([(a, "Hel", {"step": 1}, False), (a, "lo", {"step": 2}, False), (a, "!", done, True)]) == [
            (a, "Hello!", done, True)
        ]


def test_merge_deltas_never_hides_text_in_an_error_or_cancel_final():
    a = object()
    for reason in ("error", "cancelled", "deadline"):
        done = {"finish_reason": reason}
        assert merge_deltas([(a, "x", {"step": 1}, False), (a, "y", {"step": 2}, False), (a, "", done, True)]) == [
            (a, "xy", {"step": 2}, False), (a, "", done, True)
        ]


def test_merge_deltas_keeps_a_single_response_and_a_final_without_pending_text():
    a, b = object(), object()
    done = {"finish_reason": "stop"}
    assert merge_deltas([(a, "x", {"step": 1}, False)]) == [(a, "x", {"step": 1}, False)]
    assert merge_deltas([(a, "", done, True), (b, "z", {"step": 2}, False)]) == [(a, "", done, True), (b, "z", {"step": 2}, False)]


def test_length_is_a_length_finish(engine, fake):
    fake.script = lambda body: [("a", 1, None), ("é", 2, None), ("b", 3, "length")]
    sink = _Sink()
    engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=3), sink)
    text, final = sink.wait()
    assert text == "aéb" and final["finish_reason"] == "length" and final["completion_tokens"] == 3


def test_a_finish_vllm_chose_itself_is_an_error(engine, fake):
    fake.script = lambda body: [("x", 1, None), ("", 1, "abort")]
    sink = _Sink()
    engine.submit("r", [1, 2], SamplingParams(), sink)
    text, final = sink.wait()
    assert final["finish_reason"] == "error" and "'abort'" in final["error"]
    assert text == "x"  # what was streamed stays; no tail after an error


def test_vllm_refusing_the_request_is_an_invalid_request_final(engine, fake):
    fake.refuse = (400, "This model's maximum context length is 2048 tokens")
    sink = _Sink()
    engine.submit("r", [1], SamplingParams(), sink)
    _, final = sink.wait()
    assert final["finish_reason"] == "error" and final["error"].startswith("invalid request: ")
    assert "maximum context length" in final["error"]
    fake.refuse = (500, "engine dead")
    sink = _Sink()
    engine.submit("r2", [1], SamplingParams(), sink)
    _, final = sink.wait()
    assert final["finish_reason"] == "error" and "vLLM answered 500: engine dead" in final["error"]
    assert engine.snapshot()["errors"] == 2


# ---- the caller gone, the deadline ------------------------------------------------------------


def _endless(body):
    n = 0
    while True:
        n += 1
        yield ("x", n, None)


def test_cancel_closes_the_stream_and_finishes_cancelled(engine, fake):
    fake.script, fake.delay = _endless, 0.005
    sink = _Sink(cancel_after=5)
    engine.submit("gone", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True), sink)
    text, final = sink.wait()
    assert final["finish_reason"] == "cancelled" and 5 <= final["completion_tokens"] < 1000
    assert text == "x" * len(text) and len(text) >= 5  # no tail after a cancel
    wait_until(lambda: fake.aborted == ["[1, 2, 3]"], interval=0.01, explain=lambda: "vLLM's stream stayed open (it would keep generating)")
    snap = engine.snapshot()
    assert snap["cancelled"] == 1 and snap["aborted"] == 1 and snap["running"] == 0


def test_deadline_closes_the_stream_and_finishes_deadline(engine, fake):
    fake.script, fake.delay = _endless, 0.005
    sink = _Sink()
    engine.submit("late", [4, 5], SamplingParams(max_tokens=1000, deadline_ms=80), sink)
    _, final = sink.wait()
    assert final["finish_reason"] == "deadline" and engine.snapshot()["deadline_exceeded"] == 1
    wait_until(lambda: fake.aborted == ["[4, 5]"], interval=0.01)


def test_a_queued_request_without_outputs_still_sees_cancel_and_deadline(engine, fake):
    fake.script, fake.first_delay = _endless, 60  # vLLM sends nothing for a minute
    late = _Sink()
    engine.submit("late", [1], SamplingParams(deadline_ms=50), late)
    assert late.wait()[1]["finish_reason"] == "deadline"
    gone = _Sink()
    engine.submit("gone", [2], SamplingParams(), gone)
    gone.cancel = True
    _, final = gone.wait()
    assert final["finish_reason"] == "cancelled" and final["completion_tokens"] == 0 and final["queue_ms"] is None


def test_stop_ends_requests_in_flight(tiny_dir, fake):
    e = VLLMEngine(tiny_dir, VLLMConfig(served_name="m"))
    e.attach(fake.port)
    fake.script, fake.delay = _endless, 0.01
    sink = _Sink()
    e.submit("r", [1], SamplingParams(max_tokens=1000), sink)
    wait_until(lambda: len(sink.parts) >= 1, interval=0.01)
    e.stop()
    _, final = sink.wait()
    assert final["finish_reason"] == "error" and "stopped" in final["error"]


# ---- LoRA, limits ----------------------------------------------------------------------------------


def test_an_adapter_is_loaded_once_and_named_in_the_request(engine, fake, tmp_path):
    fake.script = lambda body: [("ok", 1, "stop")]
    for i in range(2):
        sink = _Sink()
        params = SamplingParams()
        params.adapter = Adapter("tone", 3, tmp_path, "0" * 64, 8, 2.0, "1" * 64)
        engine.submit(f"l{i}", [1, 2], params, sink)
        assert sink.wait()[1]["adapter"] == "tone"
    # vLLM's name for it is the version's (a new version is a new adapter there)
    assert fake.loras == [{"lora_name": "tone-v3", "lora_path": str(tmp_path)}]
    assert [b["model"] for b in fake.bodies] == ["tone-v3", "tone-v3"] and engine.snapshot()["loras"] == ["tone-v3"]


def test_a_long_request_reports_vllms_kv_use_for_replica_routing(engine, fake):
    fake.first_delay = 1.5  # past one KV_POLL_S: the poll ran while it was running
    fake.script = lambda body: [("ok", 1, "stop")]
    sink = _Sink()
    engine.submit("kv", [1, 2], SamplingParams(), sink)
    assert sink.wait()[1]["kv_utilization"] == 0.25


def test_requests_that_could_never_fit_are_refused_at_once(engine, fake):
    with pytest.raises(RequestError, match="context window of 2048"):
        engine.submit("big", [1] * 100, SamplingParams(max_tokens=1949), _Sink())
    with pytest.raises(RequestError, match="empty"):
        engine.submit("empty", [], SamplingParams(), _Sink())
    with pytest.raises(RequestError, match="non-empty list"):
        engine.encode_chat([])
    assert fake.bodies == []


def test_chat_encoding_is_the_cpu_engines(engine, tiny_dir):
    from transformers import AutoTokenizer

    from model_repository.adapters._llm_common import encode_chat

    assert engine.encode_chat(MESSAGES) == encode_chat(AutoTokenizer.from_pretrained(str(tiny_dir)), MESSAGES)


# ---- the request body, the command line, the environment ----------------------------------------


def test_sampling_parameters_map_to_vllms_request():
    greedy = request_body("m", [1, 2], SamplingParams(max_tokens=7, temperature=0, top_p=0.5, seed=3))
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "seed" not in greedy and "stop" not in greedy
    assert greedy["max_tokens"] == 7 and greedy["prompt"] == [1, 2] and greedy["priority"] == 0
    parsed = SamplingParams.parse({"max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "seed": 12, "stop": ["\n\n", "END"],
                                   "ignore_eos": True, "priority": 0, "adapter": "x", "adapter_path": "/etc"}, 32)  # fmt: skip
    assert (parsed.priority, parsed.adapter) == (0, None)  # neither comes from the caller's JSON
    parsed.priority = 3  # the adapter sets it from the frontend's request parameter
    sampled = request_body("m", [1], parsed)
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"], sampled["priority"]) == (0.7, 0.9, 12, 3)
    assert sampled["stop"] == ["\n\n", "END"] and sampled["ignore_eos"] is True
    assert sampled["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_the_priority_comes_from_the_frontends_request_parameter():
    assert request_priority('{"inferplane_priority": 1}') == 1
    assert request_priority('{"inferplane_priority": "2"}') == 2
    for untrusted in ("", "{}", "not json", "[]", '{"inferplane_priority": -1}', '{"inferplane_priority": true}',
                      '{"inferplane_priority": 5000}', '{"priority": 0}'):  # fmt: skip
        assert request_priority(untrusted) == PRIORITY_LAST, untrusted


def test_the_frontend_and_the_engine_name_the_same_parameter():
    from server.dataplane.validation import PRIORITY_PARAMETER as FRONTEND

    assert FRONTEND == PRIORITY_PARAMETER


def test_the_server_command_line(tmp_path):
    config = VLLMConfig(python="/x/bin/python", served_name="chat", dtype="bfloat16", max_model_len=2048, enforce_eager=True,
                        max_num_seqs=8, max_num_batched_tokens=1024, max_loras=4, max_lora_rank=8)  # fmt: skip
    argv = server_command(config, "/models/chat/hf", 18123)
    assert argv[:3] == ["/x/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert (value("--model"), value("--served-model-name"), value("--port"), value("--host")) == ("/models/chat/hf", "chat", "18123", "127.0.0.1")
    assert (value("--dtype"), value("--max-model-len"), value("--max-num-seqs"), value("--max-num-batched-tokens")) == ("bfloat16", "2048", "8", "1024")
    assert value("--scheduling-policy") == "priority"  # the plans' priorities order vLLM's queue and preemption
    assert "--enforce-eager" in argv and "--enable-prefix-caching" in argv
    assert (value("--max-loras"), value("--max-lora-rank")) == ("4", "8") and "--enable-lora" in argv
    assert "--speculative-config" not in argv
    off = server_command(VLLMConfig(python="p", prefix_caching=False), "d", 1)
    assert "--no-enable-prefix-caching" in off and "--enable-lora" not in off and "--enforce-eager" not in off
    assert "--tensor-parallel-size" not in argv  # one GPU (or the CPU): vLLM's default
    tp = server_command(VLLMConfig(python="p", tensor_parallel=2), "d", 1)
    assert tp[tp.index("--tensor-parallel-size") + 1] == "2"  # a version registered with gpus=2 spans two GPUs


def test_ngram_speculation_turns_off_above_the_configured_batch():
    assert speculative_config(VLLMConfig()) is None
    spec = speculative_config(VLLMConfig(speculative="ngram", spec_tokens=3, spec_max_batch=4, max_num_seqs=16))
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 16, 0]]
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(VLLMConfig(speculative="ngram"))
    argv = server_command(VLLMConfig(python="p", speculative="ngram"), "d", 1)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "ngram"
    with pytest.raises(ValueError, match="'' or 'ngram'"):
        speculative_config(VLLMConfig(speculative="eagle"))


def test_the_server_environment_gives_the_engine_every_core():
    env = server_environment(VLLMConfig(python="/v/bin/python", kv_cache_bytes=3 << 29), {"PATH": "/usr/bin", "VIRTUAL_ENV": "/p", "OMP_NUM_THREADS": "1"})
    import os

    cores = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(cores) and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert (cpu_list([0, 1]), cpu_list([3, 0, 1, 2, 7]), cpu_list([4])) == ("0-1", "0-3,7", "4")
    assert env["OMP_NUM_THREADS"] == str(len(cores))  # not Triton's 1
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # 1.5 GiB: exact, on the command line (the variable would override it)
    exact = server_command(VLLMConfig(python="p", kv_cache_bytes=3 << 29), "d", 1)
    if "--gpu-memory-utilization" not in exact:  # CPU
        assert exact[exact.index("--kv-cache-memory-bytes") + 1] == str(3 << 29)
    assert server_environment(VLLMConfig(python="p", kv_cache_bytes=2 << 30), {})["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "--kv-cache-memory-bytes" not in server_command(VLLMConfig(python="p", kv_cache_bytes=2 << 30), "d", 1)
    assert env["PATH"].split(os.pathsep)[0] == "/v/bin" and "VIRTUAL_ENV" not in env
    one = server_environment(VLLMConfig(python="p", threads=1), {})
    assert one["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[0]) and one["OMP_NUM_THREADS"] == "1"


def test_metrics_are_summed_over_labels():
    text = 'vllm:num_requests_running{model_name="a"} 2\nvllm:num_requests_running{model_name="b"} 1\n' \
           'vllm:x_bucket{le="1"} 9\nother 5\nvllm:bad{} nan-ish\n'  # fmt: skip
    assert parse_metrics(text) == {"vllm:num_requests_running": 3.0}


# ---- which engine -----------------------------------------------------------------------------------


def _fake_env(root):
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


def test_vllm_is_found_by_its_environment_on_disk(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERPLANE_VLLM_PYTHON", raising=False)
    assert "no vLLM environment is configured" in vllm_unavailable("")
    assert "does not exist" in vllm_unavailable(str(tmp_path / "none" / "python"))
    python = _fake_env(tmp_path / "env")
    assert "vllm is not installed" in vllm_unavailable(str(python))
    package = tmp_path / "env" / "lib" / "python3.11" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert vllm_unavailable(str(python)) is None
    assert find_vllm_python("", {"INFERPLANE_VLLM_PYTHON": " /e/python "}) == "/e/python"
    assert find_vllm_python("/mine", {"INFERPLANE_VLLM_PYTHON": "/e/python"}) == "/mine"


def test_auto_takes_vllm_where_it_can_run_and_the_cpu_engine_elsewhere():
    assert choose_engine("auto", probe=lambda: "no vLLM environment") == "cpu"
    assert choose_engine("", probe=lambda: "no vLLM environment") == "cpu"
    assert choose_engine("auto", probe=lambda: None) == "vllm"
    assert choose_engine("vllm", probe=lambda: None) == "vllm"
    # a model serving LoRA adapters on a CPU: ours under auto (measured faster there), vLLM when forced
    assert choose_engine("auto", probe=lambda: None, lora_on_cpu=True) == "cpu"
    assert choose_engine("vllm", probe=lambda: None, lora_on_cpu=True) == "vllm"
    with pytest.raises(EngineUnavailable, match="engine 'vllm' was asked for, but vLLM cannot run here: gone"):
        choose_engine("vllm", probe=lambda: "gone")


def test_cpu_never_probes_and_unknown_names_are_refused():
    def probe():
        raise AssertionError("probed")

    assert choose_engine("cpu", probe=probe) == "cpu"
    assert choose_engine(" CPU ", probe=probe) == "cpu"
    with pytest.raises(ValueError, match="one of auto, vllm, cpu"):
        choose_engine("tensorrt", probe=probe)


# ---- the adapter's choice, on the model directory llm.py writes ------------------------------------


class _TritonModelException(Exception):
    pass


def _fake_pb_utils():
    """The few names ``llm_engine.py`` touches while it loads (no MetricFamily: metrics are optional)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.TritonModelException = _TritonModelException
    pb.using_decoupled_model_transaction_policy = lambda config: config["model_transaction_policy"]["decoupled"]
    return pb


@pytest.fixture
def load_adapter(monkeypatch, tmp_path, tiny_dir):
    """Write a model with llm.py, import its model.py as the Python backend would, initialize it."""
    import importlib.util
    import sys

    from google.protobuf.json_format import MessageToDict

    from model_repository.config_writer import read_config
    from model_repository.llm import TINY_SETTINGS
    from server.control.rollout.llm_install import install_llm, scratch_registry

    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    monkeypatch.delenv("INFERPLANE_VLLM_PYTHON", raising=False)
    loaded = []

    def load(raw: dict[str, str] | None = None, **settings):
        """``settings`` as the version's engine settings; ``raw``: config parameters written over the
        deployed config (values the registry refuses, to reach the adapter's own check)."""
        import dataclasses

        from model_repository.config_writer import write_config

        n = len(list(tmp_path.glob("repo*")))  # each load its own registry: the same files with other settings are another deploy
        repo = tmp_path / f"repo{n}"
        registry = scratch_registry(tmp_path / f"registry{n}")
        try:
            install_llm(registry, repo, "m", tiny_dir, dataclasses.replace(TINY_SETTINGS, **settings))
        finally:
            registry.close()
        model_dir = repo / "m"
        if raw:
            edited = read_config(model_dir)
            for key, value in raw.items():
                edited.parameters[key].string_value = value
            write_config(edited, model_dir)
        monkeypatch.syspath_prepend(str(model_dir / "1"))
        spec = importlib.util.spec_from_file_location("inferplane_llm_adapter", model_dir / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = MessageToDict(read_config(model_dir), preserving_proto_field_name=True)
        model = module.TritonPythonModel()
        args = {"model_config": json.dumps(config), "model_repository": str(model_dir), "model_version": "1", "model_name": "m"}
        model.initialize(args)
        loaded.append(model)
        return model

    yield load
    for model in loaded:
        model.finalize()
    for name in set(sys.modules) - before:  # the adapter's top-level modules (_llm_core, _vllm_core, ...)
        del sys.modules[name]


def test_the_adapter_refuses_to_load_with_vllm_where_it_has_no_environment(load_adapter, tmp_path):
    with pytest.raises(_TritonModelException, match="engine 'vllm' was asked for, but vLLM cannot run here: no vLLM environment"):
        load_adapter(engine="vllm")
    with pytest.raises(_TritonModelException, match="does not exist"):
        load_adapter(engine="vllm", vllm_python=str(tmp_path / "nowhere" / "python"))
    with pytest.raises(_TritonModelException, match="one of auto, vllm, cpu"):
        load_adapter(raw={"engine": "gpu"})  # the registry refuses it (unknown LLM engine): a hand-edited config


def test_the_adapter_runs_the_cpu_engine_for_auto_without_vllms_environment(load_adapter):
    model = load_adapter(engine="auto")
    assert type(model.engine).__name__ == "Engine" and model.engine.snapshot()["engine"] == "cpu"
