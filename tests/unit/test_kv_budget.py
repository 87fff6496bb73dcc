"""KV-cache budget arithmetic."""

import json

import pytest

from batching.kv_budget import KVBudget, KVSpec, format_bytes, parse_memory

SMOLLM2 = {  # SmolLM2-135M config.json (the fields that matter)
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
    "head_dim": 64, "max_position_embeddings": 8192, "dtype": "float32",
}  # fmt: skip


@pytest.mark.parametrize(
    "text, expected",
    [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("2GB", 2_000_000_000), ("1.5KiB", 1536), ("1024", 1024), (4096, 4096), ("16 mib", 16 << 20)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "8XB", "-1GiB", -5])
def test_parse_memory_rejects(text):
    with pytest.raises(ValueError):
        parse_memory(text)


def test_bytes_per_token_from_config():
    spec = KVSpec.from_config(SMOLLM2)
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert KVSpec.from_config(SMOLLM2, dtype="bfloat16").bytes_per_token == 23040
    # no num_key_value_heads (MHA) and no head_dim: derived from hidden_size / heads
    mha = KVSpec.from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128, "torch_dtype": "float16"})
    assert (mha.kv_heads, mha.head_dim, mha.dtype_bytes) == (4, 32, 2)
    with pytest.raises(ValueError):
        KVSpec.from_config(SMOLLM2, dtype="float13")


def test_tokens_that_fit_and_admission():
    spec = KVSpec.from_config(SMOLLM2)
    budget = KVBudget.for_memory(spec, "1GiB")
    assert budget.total_tokens == (1 << 30) // 46080 == 23301
    assert budget.max_sequences(2048) == 11
    assert budget.fits_alone(1000, 1000)
    assert not budget.fits_alone(8000, 1000)  # past the 8192-token context window
    assert budget.admits(20000, 1000, 2000)
    assert not budget.admits(21000, 1000, 2000)
    assert spec.memory_for(budget.total_tokens) <= 1 << 30 < spec.memory_for(budget.total_tokens + 1)


def test_from_model_dir_and_report(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(SMOLLM2))
    spec = KVSpec.from_model_dir(tmp_path)  # finds hf/config.json below
    report = KVBudget.for_memory(spec, "8GiB").report()
    assert report["bytes_per_token"] == 46080 and report["total_tokens"] == (8 << 30) // 46080
    assert report["sequences_at_length"]["2048"] == report["total_tokens"] // 2048
    assert format_bytes(8 << 30) == "8.00 GiB"


def test_budget_cli(tmp_path):
    from typer.testing import CliRunner

    from server.cli.llm import app

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    result = CliRunner().invoke(app, ["budget", str(tmp_path), "--memory", "8GiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["total_tokens"] == (8 << 30) // 46080
    text = CliRunner().invoke(app, ["budget", str(tmp_path), "--memory", "1GiB", "--max-tokens", "512", "--prompt-tokens", "1536"])
    assert text.exit_code == 0 and "23301" in text.output and "11 sequences" in text.output
