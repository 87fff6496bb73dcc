"""The speculative-decoding benchmark's pure parts: its workloads copy the prompt (or do not), its
summaries count tokens per request and per output token, its ratios are to the same cell of "off"."""

from __future__ import annotations

from loadtest.llm_spec import OFF, code_prompt, extraction_prompt, median_ratios, prompts, ratios, summarize
from loadtest.sse import StreamResult


def test_the_repetitive_prompts_hold_what_the_answer_copies_and_differ_per_stream():
    assert "def total_alpha(items, limit=3):" in code_prompt(0) and "`count` renamed to `score`" in code_prompt(0)
    assert "Order 40227" in extraction_prompt(1) and "bravo.1@example.com" in extraction_prompt(1)
    assert prompts("repetitive", 0) == code_prompt(0) and prompts("repetitive", 1) == extraction_prompt(1)
    assert len({prompts("repetitive", i) for i in range(16)}) == 16 and len({prompts("free", i) for i in range(16)}) == 16
    assert "```" not in prompts("free", 3)


def test_a_summary_gives_time_per_output_token_from_the_first_token_on():
    a = StreamResult(started=0.0, ttft_s=0.1, gaps_s=[0.02, 0.06], tokens=9, finished=0.5)  # 8 tokens in 0.4 s
    b = StreamResult(started=0.0, ttft_s=0.3, gaps_s=[], tokens=1, finished=0.3)  # one token: no decode time
    s = summarize([a, b], wall_s=1.0)
    assert s["tokens"] == 10 and s["tokens_per_request"] == 5.0 and s["tokens_per_s"] == 10.0
    assert s["tpot_ms"]["p50"] == 50.0 and s["ttft_ms"]["p50"] == 200.0 and s["gap_ms"]["p99"] is not None


def test_ratios_are_to_the_same_workload_and_concurrency_of_the_baseline():
    cell = lambda config, c, tps: {"config": config, "workload": "free", "concurrency": c, "tokens_per_s": tps,  # noqa: E731
                                   "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 20.0}}  # fmt: skip
    cells = [cell(OFF, 1, 40.0), cell(OFF, 16, 300.0), cell("spec_ngram", 1, 60.0), cell("spec_ngram", 16, 240.0)]
    ratios(cells, lambda name: OFF)
    assert "vs_baseline" not in cells[0]
    assert cells[2]["vs_baseline"]["tokens_per_s"] == 1.5 and cells[3]["vs_baseline"]["tokens_per_s"] == 0.8
    assert cells[3]["vs_baseline"]["baseline"] == OFF and cells[3]["vs_baseline"]["ttft_p50"] == 1.0


def test_rounds_are_compared_within_themselves_and_summarized_by_their_median():
    def cell(config, round_, tps, acceptance=None):
        return {"config": config, "workload": "repetitive", "concurrency": 1, "round": round_, "tokens_per_s": tps,
                "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 20.0}, "acceptance": acceptance}  # fmt: skip

    cells = [cell(OFF, 0, 10.0), cell("spec_ngram", 0, 30.0, 0.5), cell(OFF, 1, 20.0), cell("spec_ngram", 1, 30.0, 0.7),
             cell(OFF, 2, 30.0), cell("spec_ngram", 2, 30.0, 0.6)]  # fmt: skip
    ratios(cells, lambda name: OFF)
    assert [c["vs_baseline"]["tokens_per_s"] for c in cells if "vs_baseline" in c] == [3.0, 1.5, 1.0]
    (row,) = median_ratios(cells)
    assert row["tokens_per_s"] == 1.5 and row["rounds"] == 3 and row["acceptance"] == 0.6 and row["baseline"] == OFF
