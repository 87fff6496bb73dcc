"""The capacity planner against arithmetic done by hand in this file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from server.control import capacity as cap

ROOT = Path(__file__).resolve().parents[2]


def test_70b_fp16_on_two_and_four_80gb_gpus():
    # Llama-2/3-70B: 80 layers, 8 KV heads (GQA), head_dim 128; FP16 = 2 bytes
    weights = 70e9 * 2  # 140 GB
    kv_per_token = 2 * 80 * 8 * 128 * 2  # K and V: 327,680 bytes = 320 KiB
    per_sequence = kv_per_token * 4096  # 1,342,177,280 bytes = 1.342 GB at 4k context
    assert (weights, kv_per_token, per_sequence) == (140e9, 327_680, 1_342_177_280)
    two, four, one, int4 = cap.example_70b(context=4096, headroom=0.10)

    # 2 x 80 GB, 10% kept for activations: 144 GB usable, 4 GB of KV: 2 sequences of 4k
    usable2 = 2 * 80e9 * 0.9
    assert two.figures["weights_gb"] == pytest.approx(140.0)
    assert two.figures["kv_bytes_per_token"] == kv_per_token
    assert two.figures["kv_gb_per_sequence"] == pytest.approx(1.34217728)
    assert two.figures["usable_gb"] == pytest.approx(144.0)
    assert two.figures["kv_budget_gb"] == pytest.approx(4.0)
    assert two.figures["sequences"] == math.floor((usable2 - weights) / per_sequence) == 2
    # 4 x 80 GB: 288 usable, 148 GB of KV: 110 sequences (35 GB weights, 2 KV heads per GPU)
    usable4 = 4 * 80e9 * 0.9
    assert four.figures["sequences"] == math.floor((usable4 - weights) / per_sequence) == 110
    assert "35.00 GB weights and 2 KV heads per GPU" in four.text()
    # one 80 GB GPU: 72 usable < 140: does not fit in FP16
    assert one.figures["fits"] is False and one.figures["sequences"] == 0 and "does not fit" in one.text()
    # INT4: 0.5 B per weight + one FP16 scale per 128 weights = 36.09 GB; fits one GPU with 26 sequences
    int4_weights = 70e9 * (0.5 + 2 / 128)
    assert int4.figures["weights_gb"] == pytest.approx(36.09375)
    assert int4.figures["fits"] is True
    assert int4.figures["sequences"] == math.floor((80e9 * 0.9 - int4_weights) / per_sequence) == 26
    # monthly: GPUs x $/h x 730 h
    assert two.figures["monthly_usd"] == pytest.approx(2 * 6.98 * 730)


def test_kv_per_sequence_scales_with_context():
    plan = cap.llm_memory(cap.LLMShape(), context=8192, gpus=4)
    assert plan.figures["kv_gb_per_sequence"] == pytest.approx(327_680 * 8192 / 1e9)
    assert plan.figures["sequences"] == math.floor((4 * 80e9 * 0.9 - 140e9) / (327_680 * 8192)) == 55


def _profile_file(tmp_path, rps: float, model: str = "fraud_xgboost") -> Path:
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({"model": model, "throughput_rps": rps, "latency_ms": {"p99": 12.5}}))
    return path


def test_fleet_for_2m_qps_and_a_50k_tree_endpoint(tmp_path):
    # three measured models, 1,000 / 1,250 / 2,000 req/s per 2-core replica
    profiles = cap.load_profiles([
        _profile_file(tmp_path, 1000.0, "fraud_xgboost"),
        _profile_file(tmp_path, 1250.0, "lightgbm_regressor"),
        _profile_file(tmp_path, 2000.0, "mlp_classifier"),
    ])  # fmt: skip
    fleet, tree, storage = cap.example_fleet(profiles, utilization=0.6)
    # an even mix: a replica spends (1/1000 + 1/1250 + 1/2000)/3 s per request -> 1304.35 req/s
    mix = 3 / (1 / 1000 + 1 / 1250 + 1 / 2000)
    assert mix == pytest.approx(1304.347826)
    # at 60% utilization: 782.6 req/s per replica; 2,000,000 / 782.6 = 2555.6 -> 2556 replicas, 5112 cores
    assert fleet.figures["per_replica_rps"] == pytest.approx(mix * 0.6)
    assert fleet.figures["replicas"] == math.ceil(2_000_000 / (mix * 0.6)) == 2556
    assert fleet.figures["cores"] == 5112
    assert fleet.figures["monthly_usd"] == pytest.approx(5112 * 0.04 * 730)
    # the tree endpoint: 50,000 / (1000 x 0.6) = 83.3 -> 84 replicas
    assert tree.figures["replicas"] == math.ceil(50_000 / 600) == 84
    # 500 versions x 0.1 GB + 500 x 2 variants x 0.1 GB x 0.5 = 50 + 50 = 100 GB
    assert storage.figures["total_gb"] == pytest.approx(100.0)
    assert "ceil(2,000,000 / 782.6) = 2556" in fleet.text()


def test_exactly_at_capacity_does_not_round_up():
    p = cap.Profile("m", 1000.0)
    assert cap.replicas_for(6000, p, utilization=0.6).figures["replicas"] == 10  # 6000 / 600 = 10 exactly


def test_profiles_from_the_committed_frontend_benchmark():
    profiles = cap.load_profiles([ROOT / "benchmarks" / "frontend" / "results.json"])
    data = json.loads((ROOT / "benchmarks" / "frontend" / "results.json").read_text())
    for model, entry in data["models"].items():
        best = max(c["summary"]["b"]["throughput_rps"]["median"] for c in entry["compare"].values())
        assert profiles[model].throughput_rps == best
    # an SLO keeps only the measurements that meet it
    strict = cap.load_profiles([ROOT / "benchmarks" / "frontend" / "results.json"], slo_p99_ms=5.0)
    for model, p in strict.items():
        assert p.p99_ms <= 5.0 and p.throughput_rps <= profiles[model].throughput_rps


def test_llm_bench_results_give_tokens_per_second():
    profiles = cap.load_profiles([ROOT / "benchmarks" / "llm.json"])
    assert profiles["smollm2"].tokens_per_s == max(
        level["tokens_per_s"] for level in json.loads((ROOT / "benchmarks" / "llm.json").read_text())["levels"] if level["model"] == "smollm2"
    )


def test_not_a_result_is_a_clear_error():
    with pytest.raises(ValueError, match="not a loadtest result"):
        cap.profiles_from_result({"hello": 1}, "x.json")


def test_costs_by_endpoint_and_team_with_spot_savings():
    rows = [
        {"team": "risk", "model": "fraud", "compute_us": 7_200 * 10**6},  # 2 h
        {"team": "search", "model": "embed", "compute_us": 3_600 * 10**6},  # 1 h
        {"team": "risk", "model": "embed", "compute_us": 1_800 * 10**6},  # 0.5 h
        {"team": "risk", "model": "batch_scoring", "compute_us": 36_000 * 10**6},  # 10 h
    ]
    plan = cap.endpoint_costs(
        rows, hardware={"embed": "a100", "batch_scoring": "a100"}, prices={"cpu": 0.04, "a100": 3.67},
        spot_discount={"a100": 0.6}, interruptible={"batch_scoring"},
    )  # fmt: skip
    endpoints = {e["model"]: e for e in plan.figures["endpoints"]}
    assert endpoints["fraud"]["usd"] == pytest.approx(2 * 0.04)
    assert endpoints["embed"]["device_hours"] == pytest.approx(1.5)
    assert endpoints["embed"]["usd"] == pytest.approx(1.5 * 3.67)
    assert endpoints["batch_scoring"]["spot_usd"] == pytest.approx(10 * 3.67 * 0.4)
    teams = {t["team"]: t for t in plan.figures["teams"]}
    assert teams["risk"]["usd"] == pytest.approx(2 * 0.04 + 0.5 * 3.67 + 10 * 3.67)
    assert teams["search"]["usd"] == pytest.approx(3.67)
    assert plan.figures["spot_savings_usd"] == pytest.approx(10 * 3.67 * 0.6)
    with pytest.raises(ValueError, match="no price for hardware 'tpu'"):
        cap.endpoint_costs(rows, hardware={"fraud": "tpu"}, prices={"cpu": 1.0})


# ---- the CLI ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli():
    from server.cli import plan

    app = typer.Typer()
    plan.mount(app)

    @app.callback()
    def _root():
        pass

    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["plan", *args])


def test_cli_example_70b_prints_the_arithmetic(cli):
    out = cli("capacity", "--example", "70b")
    assert out.exit_code == 0, out.output
    for line in (
        "weights: 70e9 params x 2 B = 140.00 GB",
        "KV per token: 2 (K,V) x 80 layers x 8 KV heads x 128 head_dim x 2 B = 327,680 B (320 KiB)",
        "KV per sequence at 4096 tokens: 327,680 B x 4096 = 1.342 GB",
        "KV budget: 144.0 - 140.00 = 4.00 GB / 1.342 GB = 2 sequences of 4096 tokens at once",
        "KV budget: 288.0 - 140.00 = 148.00 GB / 1.342 GB = 110 sequences of 4096 tokens at once",
        "weights: 70e9 params x (0.5 B + 2 B scale / 128) = 36.09 GB",
        "KV budget: 72.0 - 36.09 = 35.91 GB / 1.342 GB = 26 sequences of 4096 tokens at once",
    ):
        assert line in out.output


def test_cli_example_fleet_reads_the_measured_profiles(cli, tmp_path):
    out = cli("capacity", "--example", "fleet", "--profile", str(_profile_file(tmp_path, 1000.0)), "--json")
    assert out.exit_code == 0, out.output
    fleet, tree, storage = json.loads(out.output)
    assert fleet["replicas"] == math.ceil(2_000_000 / 600) == 3334
    assert tree["replicas"] == 84 and storage["total_gb"] == pytest.approx(100.0)
    default = cli("capacity", "--example", "fleet")
    assert default.exit_code == 0 and "tree endpoint fraud_xgboost: 50,000 requests/s" in default.output
    assert "benchmarks/frontend/results.json" in default.output


def test_cli_errors_are_clear(cli, tmp_path):
    out = cli("capacity", "--example", "99b")
    assert out.exit_code == 2 and "--example takes 70b or fleet" in out.output
    out = cli("capacity", "--example", "fleet", "--profile", str(_profile_file(tmp_path, 10.0, "other")))
    assert out.exit_code == 2 and "no measured profile for fraud_xgboost" in out.output
    out = cli("capacity", "--model", "fraud_xgboost", "--target-rps", "1200", "--profile", str(_profile_file(tmp_path, 1000.0)))
    assert out.exit_code == 0 and "replicas: ceil(1,200 / 600.0) = 2" in out.output


def test_cli_cost_reads_metered_usage_from_a_real_database(cli, tmp_path):
    import time

    from server.tenancy.store import TenancyStore, UsageRecord

    url = f"sqlite:///{tmp_path / 'tenancy.db'}"
    store = TenancyStore(url)
    now = time.time()
    store.write_usage([
        UsageRecord(now - 60, "acme", "risk", "fraud", "1", 1000, 0, 3_600 * 10**6),  # 1 h on cpu
        UsageRecord(now - 60, "acme", "risk", "shadow_llm", "2", 10, 500, 7_200 * 10**6),  # 2 h on a100, interruptible
        UsageRecord(now - 60, "globex", "search", "shadow_llm", "2", 10, 500, 3_600 * 10**6),  # 1 h on a100
    ])  # fmt: skip
    store.close()
    config = tmp_path / "pricing.json"
    config.write_text(json.dumps({"prices": {"cpu": 0.04, "a100": 3.67}, "hardware": {"shadow_llm": "a100"},
                                  "spot_discount": {"a100": 0.6}, "interruptible": ["shadow_llm"]}))  # fmt: skip
    out = cli("cost", "--since", "1h", "--config", str(config), "--database-url", url, "--json")
    assert out.exit_code == 0, out.output
    (plan,) = json.loads(out.output)
    teams = {t["team"]: t["usd"] for t in plan["teams"]}
    assert teams == {"risk": pytest.approx(0.04 + 2 * 3.67), "search": pytest.approx(3.67)}
    endpoints = {e["model"]: e for e in plan["endpoints"]}
    assert endpoints["shadow_llm"]["device_hours"] == pytest.approx(3.0)
    assert plan["spot_savings_usd"] == pytest.approx(3 * 3.67 * 0.6)
    assert cli("cost", "--since", "1h", "--config", str(ROOT / "deploy" / "pricing.json"), "--database-url", url).exit_code == 0
