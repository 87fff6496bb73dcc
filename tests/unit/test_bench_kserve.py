"""The pure parts of the KServe comparison (loadtest.bench_kserve, loadtest.kserve_target): argument parsing, the
rounds' order, the ratios and the goals' verdict, the table, and reading a demo model's signature. Nothing here
needs KServe's environment (.venv-kserve): the benchmark itself is run by hand (BENCHMARKS.md)."""

from __future__ import annotations

import hashlib
import json

import pytest

from loadtest.bench_kserve import (
    figures,
    goal_verdict,
    kserve_label,
    parse_args,
    render,
    rotation,
    serving_cpu_ms,
    summarize_point,
)
from loadtest.kserve_target import read_model


def test_defaults_measure_both_kserve_variants_at_the_goals_concurrencies():
    args = parse_args([])
    assert args.concurrency == [1, 8, 32]
    assert args.rounds == 2
    assert args.kserve_variants == ["default", "quiet"]
    assert str(args.json) == "benchmarks/kserve/results.json"


def test_lists_and_bad_values():
    args = parse_args(["--concurrency", "1,4", "--kserve-variants", "quiet", "--rounds", "3", "--json", "x/r.json"])
    assert (args.concurrency, args.kserve_variants, args.rounds, str(args.json)) == ([1, 4], ["quiet"], 3, "x/r.json")
    for bad in (["--concurrency", "0,8"], ["--concurrency", ""], ["--rounds", "0"], ["--kserve-variants", "loud"],
                ["--kserve-variants", "quiet,quiet"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_each_round_starts_one_target_further():
    labels = ["triton", "inferplane", "kserve"]
    assert [rotation(labels, i) for i in range(4)] == [
        ["triton", "inferplane", "kserve"],
        ["inferplane", "kserve", "triton"],
        ["kserve", "triton", "inferplane"],
        ["triton", "inferplane", "kserve"],
    ]
    assert kserve_label("default") == "kserve" and kserve_label("quiet") == "kserve-quiet"


def _run(rps: float, p50: float, p99: float, pid: int = 7, cpu_s: float | None = 0.3, errors: int = 0) -> dict:
    requests = int(rps * 3)
    return {"requests": requests, "errors_total": errors, "throughput_rps": rps, "latency_ms": {"p50": p50, "p99": p99},
            "cpu": {"pids": {str(pid): {"cpu_s": cpu_s}}}}  # fmt: skip


def test_figures_and_the_serving_cpu_per_inference():
    f = figures(_run(100.0, 1.0, 3.0, cpu_s=0.3), 7)
    assert f["throughput_rps"] == 100.0 and f["p50_ms"] == 1.0 and f["p99_ms"] == 3.0 and f["error_rate"] == 0.0
    assert f["cpu_ms_per_inference"] == pytest.approx(1.0)  # 0.3 s over 300 calls
    assert serving_cpu_ms(_run(100.0, 1.0, 3.0, cpu_s=None), 7) is None
    assert serving_cpu_ms(_run(100.0, 1.0, 3.0), 8) is None  # another pid's figures
    assert figures(_run(100.0, 1.0, 3.0, errors=100), 7)["error_rate"] == pytest.approx(0.25)


def test_ratios_are_paired_per_round_and_the_goals_judge_their_median():
    per_round = {
        "triton": [figures(_run(800, 1.0, 2.0), 7), figures(_run(1000, 1.0, 2.0), 7)],
        "inferplane": [figures(_run(400, 2.0, 5.0), 7), figures(_run(600, 2.0, 4.0), 7)],
        "kserve": [figures(_run(500, 1.5, 3.0), 7), figures(_run(400, 1.5, 4.0), 7)],
    }
    point = summarize_point(per_round, ["kserve"])
    assert set(point["ratios"]) == {"inferplane/kserve", "inferplane/triton", "kserve/triton"}
    thr = point["ratios"]["inferplane/kserve"]["throughput_rps"]
    assert thr["rounds"] == [0.8, 1.5]  # 400/500, 600/400: the same round's runs, not the medians' ratio
    assert thr["median"] == pytest.approx(1.15) and (thr["min"], thr["max"]) == (0.8, 1.5)
    assert point["ratios"]["inferplane/kserve"]["p99_ms"]["rounds"] == [5.0 / 3.0, 1.0]
    assert point["targets"]["kserve"]["throughput_rps"]["median"] == 450
    assert goal_verdict(1, thr["median"]) == "met"
    assert goal_verdict(8, thr["median"]) == "not met" and goal_verdict(32, 2.0) == "met"
    assert goal_verdict(4, 9.0) == "no goal" and goal_verdict(1, None) == "n/a"


def test_render_names_every_target_ratio_and_verdict():
    per_round = {
        "triton": [figures(_run(800, 1.0, 2.0), 7)],
        "inferplane": [figures(_run(400, 2.0, 5.0), 7)],
        "kserve": [figures(_run(500, 1.5, 3.0), 7)],
    }
    results = {
        "command": "python -m loadtest.bench_kserve", "date": "2026-12-07", "machine": {"cpus": 2},
        "uptime_before": "load average: 1.00", "uptime_after": "load average: 2.00",
        "targets": ["triton", "inferplane", "kserve"], "points": {"1": summarize_point(per_round, ["kserve"])},
    }  # fmt: skip
    table = render(results)
    assert "load average: 1.00" in table and "`python -m loadtest.bench_kserve`" in table
    assert "| 1 | 800 · 1.00 · 2.00 | 400 · 2.00 · 5.00 | 500 · 1.50 · 3.00 | 0.80 (0.80–0.80) · not met (≥ 1.0) |" in table


def test_the_in_process_stack_gets_its_own_ratios_and_columns():
    per_round = {
        "triton": [figures(_run(800, 1.0, 2.0), 7)],
        "inferplane": [figures(_run(400, 2.0, 5.0), 7)],
        "inferplane-inprocess": [figures(_run(600, 1.5, 4.0), 7)],
        "kserve": [figures(_run(500, 1.5, 3.0), 7)],
    }
    point = summarize_point(per_round, ["kserve"])
    assert set(point["ratios"]) == {"inferplane/kserve", "inferplane/triton", "inferplane-inprocess/kserve",
                                    "inferplane-inprocess/triton", "kserve/triton"}  # fmt: skip
    assert point["ratios"]["inferplane-inprocess/kserve"]["throughput_rps"]["rounds"] == [1.2]
    results = {
        "command": "c", "date": "d", "machine": {"cpus": 2}, "uptime_before": "", "uptime_after": "",
        "targets": list(per_round), "points": {"1": point},
    }  # fmt: skip
    table = render(results)
    assert "inferplane-inprocess/kserve infer/s" in table
    assert table.splitlines()[4].endswith("| 0.80 (0.80–0.80) · not met (≥ 1.0) | 1.20 (1.20–1.20) · met (≥ 1.0) |")
    assert not parse_args([]).inprocess and parse_args(["--inprocess"]).inprocess


def _model_dir(tmp_path, fmt="xgboost-json", artifact=b'{"learner": {}}', sha=None, threads="2"):
    d = tmp_path / "fraud_xgboost"
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.json").write_bytes(artifact)
    doc = {
        "artifact": "1/model.json", "format": fmt, "max_batch_size": 64, "name": "fraud_xgboost",
        "sha256": sha or hashlib.sha256(artifact).hexdigest(),
        "signature": {"inputs": [{"name": "features", "datatype": "FP32", "dims": [32], "features": []}],
                      "outputs": [{"name": "probability", "datatype": "FP32", "dims": [1]}]},
    }  # fmt: skip
    (d / "inferplane.json").write_text(json.dumps(doc))
    (d / "config.pbtxt").write_text(f'name: "fraud_xgboost"\nparameters {{\n  key: "threads"\n  value {{\n    string_value: "{threads}"\n  }}\n}}\n')
    return d


def test_read_model_gives_the_oip_signature_and_the_threads(tmp_path):
    artifact, inputs, outputs, threads = read_model(_model_dir(tmp_path))
    assert artifact.name == "model.json" and threads == 2
    assert inputs == [{"name": "features", "datatype": "FP32", "shape": [-1, 32]}]
    assert outputs == [{"name": "probability", "datatype": "FP32", "shape": [-1, 1]}]


def test_read_model_refuses_other_formats_and_a_changed_artifact(tmp_path):
    with pytest.raises(ValueError, match="only XGBoost JSON"):
        read_model(_model_dir(tmp_path / "a", fmt="pickle"))
    with pytest.raises(ValueError, match="sha256"):
        read_model(_model_dir(tmp_path / "b", sha="0" * 64))
