"""The load tool's REST and SSE drivers against the real stack: 1-second closed loops over the
REST bridge (binary tensor extension and JSON tensors) and over OpenAI chat-completion token
streams, with zero errors and sane figures (no timing assertions), plus `compare` across
protocols (gRPC vs REST on the same frontend)."""

from __future__ import annotations

import json

import pytest

from loadtest.compare import compare
from loadtest.engine import LoadSpec
from loadtest.runner import RunConfig, prepare_pool, run

pytestmark = pytest.mark.integration

MODEL = "fraud_xgboost"  # features FP32[32]
LLM_MODEL = "tiny_llama"


def _spec(concurrency: int = 2, duration: float = 1.0, warmup: float = 0.3) -> LoadSpec:
    return LoadSpec(concurrency=concurrency, warmup=warmup, duration=duration)


def _sane(r: dict) -> None:
    assert r["errors_total"] == 0, r["errors"]
    assert r["requests"] > 0
    lat = r["latency_ms"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert r["throughput_rps"] == pytest.approx(r["requests"] / r["duration_s"])


@pytest.mark.parametrize("rest_json", [False, True], ids=["binary", "json"])
def test_rest_closed_loop(stack, rest_json):
    target = f"http://{stack.http}"
    pool = prepare_pool(target, MODEL, batch=4, size=16, rest_json=rest_json)  # GET /v2/models/fraud_xgboost
    body, headers = pool[0]
    assert (b'"binary_data_size":512' in body) != rest_json  # 4 x 32 FP32 as raw bytes
    r = run(RunConfig(target=target, model=MODEL, spec=_spec(), batch=4, rest_json=rest_json), pool)
    _sane(r)
    assert r["protocol"] == ("rest-json" if rest_json else "rest")
    assert r["inferences_per_s"] == pytest.approx(4 * r["throughput_rps"])


def test_sse_closed_loop(llm_stack):
    target = f"sse://{llm_stack.http}"
    pool = prepare_pool(target, LLM_MODEL, max_tokens=8, ignore_eos=True)
    r = run(RunConfig(target=target, model=LLM_MODEL, spec=_spec(), timeout=60.0), pool)
    _sane(r)
    assert r["protocol"] == "sse"
    assert r["streams"] == r["requests"] and r["streams_without_content"] == 0
    assert r["tokens_per_stream"] == 8  # ignore_eos: exactly max_tokens each
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["duration_s"])
    assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["latency_ms"]["max"]
    assert 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
    json.dumps(r)


def test_compare_grpc_against_rest(stack):
    grpc_t, http_t = f"grpc://{stack.grpc}", f"http://{stack.http}"
    spec = _spec(concurrency=1, duration=0.5, warmup=0.1)
    cfg_a = RunConfig(target=grpc_t, model=MODEL, spec=spec, label="grpc")
    cfg_b = RunConfig(target=http_t, model=MODEL, spec=spec, label="rest")
    res = compare(cfg_a, cfg_b, prepare_pool(grpc_t, MODEL, size=8), prepare_pool(http_t, MODEL, size=8), rounds=1)
    assert [r["protocol"] for r in res["runs_a"] + res["runs_b"]] == ["grpc", "rest"]
    for r in res["runs_a"] + res["runs_b"]:
        _sane(r)
    assert res["summary"]["ratio_b_over_a"]["p50_ms"]["median"] > 0
