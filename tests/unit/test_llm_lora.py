"""LoRA adapters without Triton: the check against the base model, installed versions and their
digests, and our engine's per-row bank against peft's own forward pass, in one mixed batch."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

import torch  # noqa: E402
import peft  # noqa: E402

from model_repository.adapters._llm_core import Engine, EngineConfig, SamplingParams  # noqa: E402
from model_repository.adapters._lora import (  # noqa: E402
    AdapterError, AdapterIndex, AdapterNotFound, check_adapter,
)  # fmt: skip
from model_repository.llm import TINY_SETTINGS, build_tiny_llama  # noqa: E402
from model_repository.lora import base_dir, install_adapter, remove_adapter  # noqa: E402
from server.control.rollout.llm_install import install_llm, scratch_registry  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


def _deployed(tiny, repo) -> tuple:
    """``tiny`` registered as ``m`` in a scratch registry beside ``repo`` and deployed into it: (model dir, weights sha256)."""
    registry = scratch_registry(repo.with_name(repo.name + ".registry"))
    try:
        record = install_llm(registry, repo, "m", tiny, TINY_SETTINGS)
    finally:
        registry.close()
    return repo / "m", record.sha256


def _random_adapter(base, out, seed, targets=("q_proj", "v_proj"), rank=4):
    """A real peft adapter with random A and B (not the zero-B init), saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)  # big enough that the greedy tokens change
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": _random_adapter(tiny, root / "alpha", 1),
        "beta": _random_adapter(tiny, root / "beta", 2, targets=("k_proj", "o_proj", "down_proj"), rank=8),
    }


def _peft_greedy(base, adapter_dir, prompt, n):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = torch.tensor([prompt])
    out = []
    with torch.inference_mode():
        for _ in range(n):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


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


def test_the_engine_applies_each_rows_adapter_in_one_batch_as_peft_does(tiny, adapters, tmp_path):
    model_dir, sha = _deployed(tiny, tmp_path / "repo")
    index = AdapterIndex(model_dir, sha)
    for name, folder in adapters.items():
        install_adapter(model_dir, name, folder)
    engine = Engine(tiny, EngineConfig(kv_cache_memory="16MiB", max_loras=2, prefix_cache_tokens=256, prefix_block=4))
    engine.start()
    try:
        prompt = engine.encode_prompt("hello world the model")
        want = {name: _peft_greedy(tiny, folder, prompt, 6) for name, folder in {**adapters, "": None}.items()}
        assert len({tuple(v) for v in want.values()}) == 3, "the adapters must change the greedy tokens"
        # alpha, beta and the base model interleaved, twice each: one running batch of mixed adapters
        order = ["alpha", "", "beta", "alpha", "beta", ""]
        sinks = []
        for i, name in enumerate(order):
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            params.adapter = index.lookup(name) if name else None
            sink = _Collect()
            engine.submit(f"r{i}", prompt, params, sink)
            sinks.append((name, sink))
        for name, sink in sinks:
            assert sink.done.wait(60)
            assert sink.info["finish_reason"] == "length", sink.info
            assert sink.info.get("adapter", "") == name
        for name, sink in sinks:  # each row got its own adapter's tokens (the base rows none)
            assert sink.text == engine.tokenizer.decode(want[name], skip_special_tokens=True), name
        assert sorted(engine.snapshot()["loras"]) == ["alpha-v1", "beta-v1"]
    finally:
        engine.stop()


def test_adapter_check_refuses_what_does_not_fit_the_base(tiny, adapters, tmp_path):
    spec = check_adapter(adapters["beta"], tiny)
    assert spec.rank == 8 and spec.targets == ("down_proj", "k_proj", "o_proj") and spec.scale == 2.0
    # made for another model: a base with a different hidden size
    other = build_tiny_llama(tmp_path / "other", vocab_size=300)
    cfg = json.loads((other / "config.json").read_text())
    from transformers import LlamaConfig, LlamaForCausalLM

    bigger = LlamaForCausalLM(LlamaConfig(**{**cfg, "hidden_size": 64, "intermediate_size": 128}))
    bigger.save_pretrained(tmp_path / "bigger")
    with pytest.raises(AdapterError, match="made for another model"):
        check_adapter(adapters["alpha"], tmp_path / "bigger")
    # a pickled adapter is never read
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapters["alpha"] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(AdapterError, match="is a pickle"):
        check_adapter(pickled, tiny)
    # DoRA / modules_to_save / another peft type: refused by name
    for key, value in (("use_dora", True), ("modules_to_save", ["lm_head"]), ("peft_type", "IA3")):
        folder = tmp_path / f"bad-{key}"
        shutil.copytree(adapters["alpha"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config[key] = value
        (folder / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(AdapterError, match=key):
            check_adapter(folder, tiny)
    # a file that only claims to be safetensors
    broken = tmp_path / "broken"
    shutil.copytree(adapters["alpha"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        check_adapter(broken, tiny)


def test_installed_versions_and_their_digests(tiny, adapters, tmp_path):
    model_dir, sha = _deployed(tiny, tmp_path / "repo")
    assert base_dir(model_dir).is_dir()
    first = install_adapter(model_dir, "tone", adapters["alpha"])
    assert first["version"] == 1 and install_adapter(model_dir, "tone", adapters["alpha"])["version"] == 1
    assert install_adapter(model_dir, "tone", adapters["beta"])["version"] == 2  # new bytes: the next version
    index = AdapterIndex(model_dir, sha)
    found = index.lookup("tone")
    assert found.version == 2 and found.key == "tone-v2" and found.rank == 8
    with pytest.raises(AdapterNotFound, match="unknown adapter 'nope'"):
        index.lookup("nope")
    with pytest.raises(AdapterNotFound):
        index.lookup("../tone")
    with pytest.raises(AdapterError, match="adapter name"):
        install_adapter(model_dir, "Bad:Name", adapters["alpha"])
    # weights changed on disk after the install: refused at load
    install_adapter(model_dir, "other", adapters["alpha"])
    weights = model_dir / "adapters" / "other" / "1" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="sha256"):
        AdapterIndex(model_dir, sha).lookup("other")
    # checked against other base weights: refused
    with pytest.raises(AdapterError, match="other base weights"):
        AdapterIndex(model_dir, "0" * 64).lookup("tone")
    assert remove_adapter(model_dir, "tone") and not remove_adapter(model_dir, "tone")
    with pytest.raises(AdapterNotFound):
        index.lookup("tone")


def test_the_cli_adds_lists_and_removes_adapters(tiny, adapters, tmp_path):
    from typer.testing import CliRunner

    from server.cli.main import app

    repo = tmp_path / "repo"
    _deployed(tiny, repo)
    run = CliRunner().invoke
    added = run(app, ["llm", "adapter", "add", "m", "tone", str(adapters["beta"]), "--model-repository", str(repo)])
    assert added.exit_code == 0, added.output
    assert "m:tone v1 rank 8 on down_proj, k_proj, o_proj" in added.output
    listed = run(app, ["llm", "adapter", "list", "m", "--model-repository", str(repo), "--json"])
    assert json.loads(listed.output)["tone"]["version"] == 1
    refused = run(app, ["llm", "adapter", "add", "m", "bad", str(tmp_path), "--model-repository", str(repo)])
    assert refused.exit_code == 1 and "no adapter_model.safetensors" in refused.output
    assert run(app, ["llm", "adapter", "remove", "m", "tone", "--model-repository", str(repo)]).exit_code == 0
    assert run(app, ["llm", "adapter", "remove", "m", "tone", "--model-repository", str(repo)]).exit_code == 1
