"""The vLLM engine's own logic without vLLM or a GPU, and the choice between the engines.

vLLM is replaced by a small fake of the surface ``_vllm_core`` uses (``AsyncEngineArgs``,
``AsyncLLMEngine.from_engine_args``, ``generate`` yielding cumulative ``RequestOutput``s,
``abort``, ``shutdown``, ``SamplingParams``): what is tested is ours — deltas from cumulative
text, finish reasons, aborts on cancel and deadline, the parameter mapping, the counts. That vLLM
itself behaves as the fake does is checked on a GPU only (tests/integration/test_llm_vllm.py).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import types

import pytest

pytest.importorskip("transformers")

from model_repository.adapters._llm_common import RequestError, SamplingParams  # noqa: E402
from model_repository.adapters._vllm_core import (  # noqa: E402
    EngineUnavailable, VLLMConfig, VLLMEngine, choose_engine, vllm_unavailable,
)  # fmt: skip

MESSAGES = [{"role": "user", "content": "hello world"}]


# ---- a fake of the vLLM surface in use ------------------------------------------------------


class _Completion:
    def __init__(self, text, token_ids, finish_reason):
        self.text, self.token_ids, self.finish_reason = text, token_ids, finish_reason


class _Output:
    def __init__(self, request_id, completion, cached):
        self.request_id, self.outputs, self.finished = request_id, [completion], completion.finish_reason is not None
        self.num_cached_tokens = cached


class _FakeEngine:
    """Plays ``script(prompt_ids, params)``: an iterable of cumulative (text, tokens, finish_reason),
    one output every ``delay`` seconds; ``first_delay`` before the first (a queued request)."""

    def __init__(self, args):
        self.args = args
        self.script = lambda prompt, params: [("Hi", 1, "stop")]
        self.delay = 0.0
        self.first_delay = 0.0
        self.cached = 0
        self.calls, self.aborted, self.shut_down = [], [], False
        self.model_config = types.SimpleNamespace(max_model_len=2048, dtype="torch.bfloat16")
        self.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks=100, block_size=16))

    async def generate(self, prompt, params, request_id):
        self.calls.append((prompt, params, request_id))
        await asyncio.sleep(self.first_delay)
        for text, tokens, reason in self.script(prompt["prompt_token_ids"], params):
            if request_id in self.aborted:
                return
            await asyncio.sleep(self.delay)
            yield _Output(request_id, _Completion(text, list(range(tokens)), reason), self.cached)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def shutdown(self):
        self.shut_down = True


def _fake_vllm():
    module = types.ModuleType("vllm")
    module.__version__ = "0.0-fake"
    module.engines = []

    class AsyncEngineArgs:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class AsyncLLMEngine:
        @classmethod
        def from_engine_args(cls, args):
            assert asyncio.get_running_loop()  # built on the engine's loop thread
            module.engines.append(_FakeEngine(args))
            return module.engines[-1]

    class SamplingParamsFake:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    module.AsyncEngineArgs, module.AsyncLLMEngine, module.SamplingParams = AsyncEngineArgs, AsyncLLMEngine, SamplingParamsFake
    return module


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
def engine(tiny_dir):
    vllm = _fake_vllm()
    e = VLLMEngine(tiny_dir, VLLMConfig(default_max_tokens=32, gpu_memory_utilization=0.5, dtype="auto"), vllm=vllm)
    e.start()
    e.fake = vllm.engines[-1]
    yield e
    e.stop()


def _cumulative(text: str, reason: str | None = "stop"):
    """One output per character: cumulative text, one token per character."""
    steps = [(text[: i + 1], i + 1, None) for i in range(len(text))]
    steps[-1] = (text, len(text), reason)
    return steps


# ---- streaming -----------------------------------------------------------------------------------


def test_cumulative_text_becomes_deltas_and_one_final(engine):
    engine.fake.script = lambda prompt, params: [("He", 1, None), ("Hello", 2, None), ("Hello wor", 3, None), ("Hello world", 4, "stop")]
    engine.fake.cached = 3
    prompt = engine.encode_chat(MESSAGES)
    sink = _Sink()
    engine.submit("r1", prompt, SamplingParams(max_tokens=8, temperature=0), sink)
    text, final = sink.wait()
    assert text == "Hello world"
    assert sink.parts == ["He", "llo", " wor", "ld"]  # the final response carries the rest
    for info, tokens in zip(sink.infos[:-1], (1, 2, 3)):
        assert info["prompt_tokens"] == len(prompt) and info["completion_tokens"] == tokens and info["step"] >= 1
        assert "finish_reason" not in info
    assert final["finish_reason"] == "stop"
    assert (final["prompt_tokens"], final["completion_tokens"], final["cached_tokens"]) == (len(prompt), 4, 3)
    assert final["step"] >= sink.infos[-2]["step"]
    snap = engine.snapshot()
    assert snap["engine"] == "vllm" and snap["tokens_generated"] == 4 and snap["running"] == 0
    assert (snap["prefix_prompt_tokens"], snap["prefix_hit_tokens"]) == (len(prompt), 3)
    assert snap["records"][-1]["id"] == "r1" and snap["records"][-1]["finish_reason"] == "stop"
    # vLLM got our token ids, not text
    sent_prompt, _, request_id = engine.fake.calls[-1]
    assert sent_prompt == {"prompt_token_ids": prompt} and request_id == "r1"


def test_length_and_an_incomplete_utf8_character(engine):
    engine.fake.script = lambda prompt, params: [("a\ufffd", 1, None), ("aé", 2, None), ("aéb", 3, "length")]
    sink = _Sink()
    engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=3), sink)
    text, final = sink.wait()
    assert sink.parts == ["a", "é", "b"] and text == "aéb"
    assert final["finish_reason"] == "length" and final["completion_tokens"] == 3


def test_a_finish_vllm_chose_itself_is_an_error(engine):
    engine.fake.script = lambda prompt, params: [("x", 1, None), ("x", 1, "abort")]
    sink = _Sink()
    engine.submit("r", [1, 2], SamplingParams(), sink)
    text, final = sink.wait()
    assert final["finish_reason"] == "error" and "'abort'" in final["error"]
    assert text == "x"  # what was streamed stays; no tail after an error


def test_vllm_refusing_the_request_is_a_final_error(engine):
    def script(prompt, params):
        raise ValueError("prompt too long for this model")

    engine.fake.script = script
    sink = _Sink()
    engine.submit("r", [1], SamplingParams(), sink)
    _, final = sink.wait()
    assert final["finish_reason"] == "error" and "prompt too long" in final["error"]
    assert engine.snapshot()["errors"] == 1


# ---- the caller gone, the deadline ------------------------------------------------------------


def _endless(prompt, params):
    return (("x" * n, n, None) for n in itertools.count(1))


def test_cancel_aborts_in_vllm_and_finishes_cancelled(engine):
    engine.fake.script, engine.fake.delay = _endless, 0.002
    sink = _Sink(cancel_after=5)
    engine.submit("gone", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True), sink)
    text, final = sink.wait()
    assert engine.fake.aborted == ["gone"]
    assert final["finish_reason"] == "cancelled" and 5 <= final["completion_tokens"] < 100
    assert text == "x" * len(text) and len(text) >= 5  # no tail after a cancel
    snap = engine.snapshot()
    assert snap["cancelled"] == 1 and snap["aborted"] == 1 and snap["running"] == 0


def test_deadline_aborts_in_vllm_and_finishes_deadline(engine):
    engine.fake.script, engine.fake.delay = _endless, 0.002
    sink = _Sink()
    started = time.monotonic()
    engine.submit("late", [1, 2, 3], SamplingParams(max_tokens=1000, deadline_ms=80), sink)
    _, final = sink.wait()
    assert time.monotonic() - started < 2
    assert engine.fake.aborted == ["late"] and final["finish_reason"] == "deadline"
    assert engine.snapshot()["deadline_exceeded"] == 1


def test_a_queued_request_without_outputs_still_sees_cancel_and_deadline(engine):
    engine.fake.script, engine.fake.first_delay = _endless, 60  # vLLM sends nothing for a minute
    late = _Sink()
    engine.submit("late", [1], SamplingParams(deadline_ms=50), late)
    assert late.wait()[1]["finish_reason"] == "deadline"
    gone = _Sink()
    engine.submit("gone", [1], SamplingParams(), gone)
    gone.cancel = True
    _, final = gone.wait()
    assert final["finish_reason"] == "cancelled" and final["completion_tokens"] == 0 and final["queue_ms"] is None
    assert sorted(engine.fake.aborted) == ["gone", "late"]


def test_stop_ends_requests_in_flight_and_shuts_vllm_down(tiny_dir):
    vllm = _fake_vllm()
    e = VLLMEngine(tiny_dir, VLLMConfig(), vllm=vllm)
    e.start()
    vllm.engines[-1].script, vllm.engines[-1].delay = _endless, 0.01
    sink = _Sink()
    e.submit("r", [1], SamplingParams(max_tokens=1000), sink)
    time.sleep(0.05)
    e.stop()
    _, final = sink.wait()
    assert final["finish_reason"] == "error" and "stopped" in final["error"]
    assert vllm.engines[-1].shut_down


# ---- parameters, engine arguments, limits --------------------------------------------------------


def test_sampling_parameters_map_to_vllms(engine):
    greedy = engine.sampling_params(SamplingParams(max_tokens=7, temperature=0, top_p=0.5, seed=3)).kwargs
    assert greedy["temperature"] == 0 and greedy["top_p"] == 1.0 and greedy["seed"] is None
    assert greedy["max_tokens"] == 7 and greedy["n"] == 1 and greedy["stop"] is None and greedy["ignore_eos"] is False
    sampled = engine.sampling_params(
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=1234, stop=("\n\n", "END"), ignore_eos=True)
    ).kwargs
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 1234)
    assert sampled["stop"] == ["\n\n", "END"] and sampled["ignore_eos"] is True and sampled["max_tokens"] == 9
    # the same mapping reaches vLLM through submit
    engine.fake.script = lambda prompt, params: [("ok", 1, "stop")]
    sink = _Sink()
    engine.submit("p", [1, 2], SamplingParams.parse({"max_tokens": 5, "temperature": 0.5, "seed": 9, "stop": "x"}, 32), sink)
    sink.wait()
    assert engine.fake.calls[-1][1].kwargs == {
        "n": 1, "max_tokens": 5, "temperature": 0.5, "top_p": 1.0, "seed": 9, "stop": ["x"], "ignore_eos": False,
        "skip_special_tokens": True,
    }  # fmt: skip


def test_engine_arguments_and_what_vllm_reports(engine, tiny_dir):
    assert engine.fake.args.kwargs == {
        "model": str(tiny_dir), "dtype": "auto", "gpu_memory_utilization": 0.5, "enable_prefix_caching": True,
        "disable_log_stats": True,
    }  # fmt: skip
    snap = engine.snapshot()
    assert (snap["max_model_len"], snap["kv_capacity_tokens"], snap["dtype"], snap["vllm_version"]) == (2048, 1600, "bfloat16", "0.0-fake")
    assert engine.config.default_max_tokens == 32


def test_requests_that_could_never_fit_are_refused_at_once(engine):
    with pytest.raises(RequestError, match="context window of 2048"):
        engine.submit("big", [1] * 100, SamplingParams(max_tokens=1949), _Sink())
    with pytest.raises(RequestError, match="empty"):
        engine.submit("empty", [], SamplingParams(), _Sink())
    with pytest.raises(RequestError, match="non-empty list"):
        engine.encode_chat([])
    assert engine.fake.calls == []


def test_chat_encoding_is_the_cpu_engines(engine, tiny_dir):
    from transformers import AutoTokenizer

    from model_repository.adapters._llm_common import encode_chat

    assert engine.encode_chat(MESSAGES) == encode_chat(AutoTokenizer.from_pretrained(str(tiny_dir)), MESSAGES)


# ---- which engine -----------------------------------------------------------------------------------


def test_auto_takes_the_cpu_engine_where_vllm_cannot_run():
    assert vllm_unavailable() is not None  # this machine: no vllm, no CUDA
    assert choose_engine("auto") == "cpu"
    assert choose_engine("") == "cpu"
    assert choose_engine("auto", probe=lambda: "no CUDA device is visible") == "cpu"
    assert choose_engine("auto", probe=lambda: None) == "vllm"
    assert choose_engine("vllm", probe=lambda: None) == "vllm"


def test_vllm_asked_for_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(EngineUnavailable, match="engine 'vllm' was asked for, but vLLM cannot run here: vllm is not installed"):
        choose_engine("vllm")
    with pytest.raises(EngineUnavailable, match="no CUDA device"):
        choose_engine("vllm", probe=lambda: "no CUDA device is visible")


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
    import json
    import sys

    from google.protobuf.json_format import MessageToDict

    from model_repository.config_writer import read_config
    from model_repository.llm import TINY_SETTINGS, write_llm_model

    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    loaded = []

    def load(**settings):
        import dataclasses

        model_dir = write_llm_model(tmp_path, "m", tiny_dir, dataclasses.replace(TINY_SETTINGS, **settings), "test")
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


def test_the_adapter_refuses_to_load_with_vllm_where_it_cannot_run(load_adapter):
    with pytest.raises(_TritonModelException, match="engine 'vllm' was asked for, but vLLM cannot run here"):
        load_adapter(engine="vllm")
    with pytest.raises(_TritonModelException, match="one of auto, vllm, cpu"):
        load_adapter(engine="gpu")


def test_the_adapter_runs_the_cpu_engine_for_auto_here(load_adapter):
    model = load_adapter(engine="auto")
    assert type(model.engine).__name__ == "Engine" and model.engine.snapshot()["engine"] == "cpu"
