"""The capacity planner against arithmetic done by hand in this file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from server.control.planning import capacity as cap

ROOT = Path(__file__).resolve().parents[2]


def test_70b_fp16_on_two_and_four_80gib_gpus():
    """An "80 GB" GPU holds 80 GiB = 80 x 2**30 = 85.9e9 bytes; everything below is in GiB.

    Llama-2/3-70B: 80 layers, 8 KV heads (GQA), head_dim 128; FP16 = 2 bytes.
    weights 70e9 x 2 = 140e9 B = 140e9 / 2**30 = 130.385 GiB; KV per token 2 x 80 x 8 x 128 x 2 =
    327,680 B; per 4k sequence 327,680 x 4096 = 1,342,177,280 B = 1.25 GiB exactly.
    2 GPUs, 10 % headroom: 2 x 80 x 0.9 = 144 GiB usable; 144 - 130.385 = 13.615 GiB of KV / 1.25 = 10.9 -> 10.
    4 GPUs: 288 usable; 157.615 / 1.25 = 126.09 -> 126 sequences; 130.385 / 4 = 32.60 GiB weights per GPU.
    1 GPU: 72 < 130.385: FP16 does not fit.
    INT4: 70e9 x (0.5 + 2/128) = 36.09375e9 B = 33.615 GiB; 72 - 33.615 = 38.385 / 1.25 = 30.7 -> 30.
    (In decimal GB the same GPUs held 2, 110 and 26 sequences: 7 % of every GPU was missing.)
    """
    weights = 70e9 * 2
    kv_per_token = 2 * 80 * 8 * 128 * 2
    per_sequence = kv_per_token * 4096
    gib = 2**30
    assert (weights, kv_per_token, per_sequence) == (140e9, 327_680, 1_342_177_280) and per_sequence / gib == 1.25
    two, four, one, int4, streams = cap.example_70b(context=4096, headroom=0.10)

    assert two.figures["weights_gib"] == pytest.approx(130.385160446)
    assert two.figures["kv_bytes_per_token"] == kv_per_token
    assert two.figures["kv_gib_per_sequence"] == pytest.approx(1.25)
    assert two.figures["usable_gib"] == pytest.approx(144.0)
    assert two.figures["kv_budget_gib"] == pytest.approx(144.0 - 130.385160446)
    assert two.figures["sequences"] == math.floor((2 * 80 * gib * 0.9 - weights) / per_sequence) == 10
    assert four.figures["sequences"] == math.floor((4 * 80 * gib * 0.9 - weights) / per_sequence) == 126
    assert "32.60 GiB weights and 2 KV heads per GPU" in four.text()
    assert one.figures["fits"] is False and one.figures["sequences"] == 0 and "does not fit" in one.text()
    int4_weights = 70e9 * (0.5 + 2 / 128)
    assert int4.figures["weights_gib"] == pytest.approx(36.09375e9 / gib)
    assert int4.figures["fits"] is True
    assert int4.figures["sequences"] == math.floor((80 * gib * 0.9 - int4_weights) / per_sequence) == 30
    assert two.figures["monthly_usd"] == pytest.approx(2 * 6.98 * 730)
    # 10,000 streams at 4k on 4-GPU replicas (126 each): ceil(10000 / 126) = 80 replicas; 3 zones N+1:
    # any 2 zones carry the 80: ceil(80 / 2) = 40 per zone x 3 = 120 replicas = 480 GPUs
    assert streams.figures["sequences_per_replica"] == 126 and streams.figures["needed"] == math.ceil(10_000 / 126) == 80
    assert (streams.figures["per_zone"], streams.figures["replicas"], streams.figures["gpus"]) == (40, 120, 480)
    assert streams.figures["monthly_usd"] == pytest.approx(480 * 6.98 * 730)


def test_kv_per_sequence_scales_with_context():
    """8k context: 327,680 x 8192 B = 2.5 GiB per sequence; 4 x 80 GiB x 0.9 = 288 - 130.385 = 157.615 / 2.5 = 63."""
    plan = cap.llm_memory(cap.LLMShape(), context=8192, gpus=4)
    assert plan.figures["kv_gib_per_sequence"] == pytest.approx(2.5)
    assert plan.figures["sequences"] == math.floor((4 * 80 * 2**30 * 0.9 - 140e9) / (327_680 * 8192)) == 63


def test_llm_streams_takes_the_larger_of_the_kv_and_the_decode_bound():
    """1,000 streams, 126 per replica by KV: ceil(1000 / 126) = 8; decode: 1000 x 20 tokens/s / 2,000
    tokens/s per replica = 10 -> 10 replicas (one zone: no spread)."""
    plan = cap.llm_streams(1000, tokens_per_s_per_stream=20, replica_tokens_per_s=2000)
    assert plan.figures["needed"] == 10 and plan.figures["replicas"] == 10 and plan.figures["gpus"] == 40
    assert "replicas by KV cache: ceil(1,000 / 126) = 8" in plan.text()
    with pytest.raises(ValueError, match="does not fit"):
        cap.llm_streams(10, gpus_per_replica=1)


def test_zone_spread_is_n_plus_one():
    """Any zones - 1 zones hold what is needed: 10 over 3 zones -> ceil(10 / 2) = 5 per zone, 15;
    over 2 zones -> 10 per zone, 20; one zone -> 10."""
    assert cap.zone_spread(10, 3) == (5, 15) and cap.zone_spread(10, 2) == (10, 20) and cap.zone_spread(10, 1) == (10, 10)
    for needed in range(0, 40):
        for zones in range(2, 6):
            per_zone, total = cap.zone_spread(needed, zones)
            assert per_zone * (zones - 1) >= needed and (per_zone - 1) * (zones - 1) < max(needed, 1)


def _profile_file(tmp_path, rps: float, model: str = "fraud_xgboost") -> Path:
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({"model": model, "throughput_rps": rps, "latency_ms": {"p99": 12.5}}))
    return path


def test_fleet_for_2m_qps_and_a_50k_tree_endpoint_across_3_zones(tmp_path):
    """Three measured models, 1,000 / 1,250 / 2,000 req/s per 2-core replica (p99 12.5 ms, within 20 ms).
    An even mix: a replica spends (1/1000 + 1/1250 + 1/2000)/3 s per request -> 1304.35 req/s.
    2,000,000 / 1304.35 = 1533.3 -> 1534 replicas needed; 3 zones N+1: any 2 zones carry them,
    ceil(1534 / 2) = 767 per zone x 3 = 2301 replicas, 4602 cores, 4602 x $0.04 x 730 h.
    The tree endpoint: 50,000 / 1000 = 50 needed -> 25 per zone x 3 = 75 replicas.
    """
    profiles = cap.load_profiles([
        _profile_file(tmp_path, 1000.0, "fraud_xgboost"),
        _profile_file(tmp_path, 1250.0, "lightgbm_regressor"),
        _profile_file(tmp_path, 2000.0, "mlp_classifier"),
    ], slo_p99_ms=20.0)  # fmt: skip
    fleet, tree, storage = cap.example_fleet(profiles)
    mix = 3 / (1 / 1000 + 1 / 1250 + 1 / 2000)
    assert mix == pytest.approx(1304.347826)
    assert fleet.figures["per_replica_rps"] == pytest.approx(mix)
    assert fleet.figures["needed"] == math.ceil(2_000_000 / mix) == 1534
    assert (fleet.figures["per_zone"], fleet.figures["replicas"]) == (767, 2301)
    assert fleet.figures["cores"] == 4602
    assert fleet.figures["monthly_usd"] == pytest.approx(4602 * 0.04 * 730)
    assert (tree.figures["needed"], tree.figures["per_zone"], tree.figures["replicas"]) == (50, 25, 75)
    # 500 versions x 0.1 GB + 500 x 2 variants x 0.1 GB x 0.5 = 50 + 50 = 100 GB
    assert storage.figures["total_gb"] == pytest.approx(100.0)
    assert "3 zones, N+1 (any 2 carry the load): ceil(1534 / 2) = 767 per zone x 3 = 2301" in fleet.text()
    # losing one zone leaves 2 x 767 = 1534 replicas x 1304.35 = 2.0008e6 req/s >= 2e6
    assert 2 * 767 * mix >= 2_000_000


def test_exactly_at_capacity_does_not_round_up():
    p = cap.Profile("m", 1000.0)
    assert cap.replicas_for(6000, p, utilization=0.6).figures["replicas"] == 10  # 6000 / 600 = 10 exactly


def test_the_slo_decides_which_measurement_sizes_the_fleet(tmp_path):
    """Two measurements of one model: 2,000 req/s at p99 51 ms, 400 req/s at p99 15 ms. Without an SLO
    the 2,000 sizes 10,000 req/s at 5 replicas; within 20 ms only the 400 counts: 25 replicas (5x)."""
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"model": "m", "summary": {"b": {"throughput_rps": {"median": 2000.0}, "p99_ms": {"median": 51.0}}}}))
    loose = cap.load_profiles([path])["m"]
    path2 = tmp_path / "two_slow.json"
    path2.write_text(json.dumps({"model": "m", "summary": {"b": {"throughput_rps": {"median": 400.0}, "p99_ms": {"median": 15.0}}}}))
    strict = cap.load_profiles([path, path2], slo_p99_ms=20.0)["m"]
    assert cap.replicas_for(10_000, loose).figures["replicas"] == 5
    assert strict.throughput_rps == 400.0 and cap.replicas_for(10_000, strict).figures["replicas"] == 25


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
        "weights: 70e9 params x 2 B = 130.39 GiB",
        "KV per token: 2 (K,V) x 80 layers x 8 KV heads x 128 head_dim x 2 B = 327,680 B (320 KiB)",
        "KV per sequence at 4096 tokens: 327,680 B x 4096 = 1.250 GiB",
        "KV budget: 144.0 - 130.39 = 13.61 GiB / 1.250 GiB = 10 sequences of 4096 tokens at once",
        "KV budget: 288.0 - 130.39 = 157.61 GiB / 1.250 GiB = 126 sequences of 4096 tokens at once",
        "weights: 70e9 params x (0.5 B + 2 B scale / 128) = 33.61 GiB",
        "KV budget: 72.0 - 33.61 = 38.39 GiB / 1.250 GiB = 30 sequences of 4096 tokens at once",
        "replicas by KV cache: ceil(10,000 / 126) = 80",
        "3 zones, N+1 (any 2 carry the load): ceil(80 / 2) = 40 per zone x 3 = 120",
    ):
        assert line in out.output


def test_cli_example_fleet_reads_the_measured_profiles(cli, tmp_path):
    out = cli("capacity", "--example", "fleet", "--profile", str(_profile_file(tmp_path, 1000.0)), "--json")
    assert out.exit_code == 0, out.output
    fleet, tree, storage = json.loads(out.output)
    # 2e6 / 1000 = 2000 needed; 3 zones N+1: 1000 per zone x 3; the tree: 50 -> 25 x 3
    assert fleet["needed"] == 2000 and fleet["replicas"] == 3000
    assert tree["replicas"] == 75 and storage["total_gb"] == pytest.approx(100.0)
    default = cli("capacity", "--example", "fleet")
    assert default.exit_code == 0 and "tree endpoint fraud_xgboost: 50,000 requests/s" in default.output
    assert "benchmarks/frontend/results.json" in default.output


def test_cli_errors_are_clear(cli, tmp_path):
    out = cli("capacity", "--example", "99b")
    assert out.exit_code == 2 and "--example takes 70b or fleet" in out.output
    out = cli("capacity", "--example", "fleet", "--profile", str(_profile_file(tmp_path, 10.0, "other")))
    assert out.exit_code == 2 and "no measured profile for fraud_xgboost" in out.output
    out = cli("capacity", "--model", "fraud_xgboost", "--target-rps", "1200", "--profile", str(_profile_file(tmp_path, 1000.0)))
    assert out.exit_code == 0 and "replicas: ceil(1,200 / 1,000.0) = 2" in out.output and "= 1 per zone x 3 = 3" in out.output


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
