"""The LLM engine without Triton: dtype choice, and the bfloat16 path end to end on the tiny Llama."""

from __future__ import annotations

import threading

import pytest

import torch  # noqa: E402

from model_repository.adapters._llm_core import Engine, EngineConfig, SamplingParams, resolve_dtype  # noqa: E402
from model_repository.llm import build_tiny_llama  # noqa: E402


def test_auto_dtype_follows_the_hardware():
    assert resolve_dtype("float32", cuda=False, flags=frozenset({"avx512_bf16"})) == "float32"
    assert resolve_dtype("auto", cuda=False, flags=frozenset({"avx2", "avx512f"})) == "float32"
    assert resolve_dtype("auto", cuda=False, flags=frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert resolve_dtype("auto", cuda=False, flags=frozenset({"amx_bf16"})) == "bfloat16"


class _Collect:
    def __init__(self):
        self.text, self.info, self.done = "", None, threading.Event()

    def send(self, text, info, final):
        self.text += text
        if final:
            self.info = info
            self.done.set()

    def cancelled(self):
        return False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_batches_and_finishes_in_each_dtype(tmp_path, dtype):
    engine = Engine(build_tiny_llama(tmp_path / "tiny"), EngineConfig(kv_cache_memory="16MiB", dtype=dtype))
    assert engine.dtype == dtype and next(engine.model.parameters()).dtype == getattr(torch, dtype)
    engine.start()
    try:
        sinks = [_Collect() for _ in range(3)]
        for i, sink in enumerate(sinks):  # different lengths share the batch
            prompt = engine.encode_prompt("hello " * (i + 1))
            engine.submit(f"r{i}", prompt, SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True), sink)
        for i, sink in enumerate(sinks):
            assert sink.done.wait(30)
            assert sink.info["finish_reason"] == "length" and sink.info["completion_tokens"] == 5 + i
            assert 0.0 <= sink.info["kv_utilization"] < 1.0  # the share of the KV budget still held (routers score it)
        assert sinks[-1].info["kv_utilization"] == 0.0  # the last to finish: nothing held any more
        assert engine.snapshot()["dtype"] == dtype
    finally:
        engine.stop()


def test_a_vanishing_temperature_samples_the_greedy_token(tmp_path):
    """temperature 5.8e-126 (found by the fuzz step): logits / t overflowed to inf and softmax gave NaN, a 500."""
    engine = Engine(build_tiny_llama(tmp_path / "tiny"), EngineConfig(kv_cache_memory="16MiB"))
    engine.start()
    try:
        sinks = {t: _Collect() for t in (0.0, 5.7953623333423295e-126)}
        prompt = engine.encode_prompt("hello hello")
        for t, sink in sinks.items():
            engine.submit(f"t{t}", prompt, SamplingParams(max_tokens=6, temperature=t, seed=0, ignore_eos=True), sink)
        for sink in sinks.values():
            assert sink.done.wait(30)
            assert sink.info["finish_reason"] == "length", sink.info
        assert sinks[5.7953623333423295e-126].text == sinks[0.0].text
    finally:
        engine.stop()
