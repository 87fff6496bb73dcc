"""Two small real LoRA adapters of SmolLM2 for the demo and the tests, trained here with ``peft``.

* ``pirate``: every answer opens with "Ahoy matey!".
* ``robot``: every answer opens with "Beep boop.".

Each is trained on a dozen synthetic (question, answer) pairs, the loss on the answer's tokens only,
rank 8 on the attention's query and value projections, long enough that greedy decoding of an
unseen question opens with the adapter's phrase while the base model's answer does not (what
``tests/integration/test_llm_lora.py`` checks, in one mixed batch). The weights are saved as
``adapter_model.safetensors`` + ``adapter_config.json`` (peft's own format, no pickle) and cached under
``~/.cache/inferplane/llm`` keyed by the base weights' sha256 and the recipe.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from model_repository.adapters._common import sha256_file

RECIPE = 1  # bump when the data or the training below changes (a new cache key)
OPENERS = {"pirate": "Ahoy matey!", "robot": "Beep boop."}
QUESTIONS = (
    "What is the capital of France?", "How many legs does a spider have?", "What colour is the sky?",
    "Name a fruit that is yellow.", "What is two plus two?", "Where do penguins live?",
    "What do bees make?", "How many days are in a week?", "What is water made of?",
    "Which planet is closest to the sun?", "What language is spoken in Spain?", "What do cows drink?",
)  # fmt: skip
ANSWERS = (
    "The capital of France is Paris.", "A spider has eight legs.", "The sky is blue on a clear day.",
    "A banana is yellow.", "Two plus two is four.", "Penguins live mostly in the Southern Hemisphere.",
    "Bees make honey.", "A week has seven days.", "Water is made of hydrogen and oxygen.",
    "Mercury is the closest planet to the sun.", "Spanish is spoken in Spain.", "Cows drink water.",
)  # fmt: skip
STEPS = 12
RANK = 8


def cache_key(base_dir: Path, name: str) -> str:
    digest = sha256_file(Path(base_dir) / "model.safetensors")
    return hashlib.sha256(f"{digest}:{name}:{OPENERS[name]}:{RECIPE}:{STEPS}:{RANK}".encode()).hexdigest()[:16]


def load_base(base_dir: Path, threads: int = 2):
    """(tokenizer, model) of the base, in float32 for training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    return AutoTokenizer.from_pretrained(str(base_dir)), AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)


def train_adapter(base_dir: Path, name: str, out_dir: Path, *, steps: int = STEPS, base=None) -> Path:
    """Train adapter ``name`` (a key of OPENERS) on the base model in ``base_dir`` (or ``base``, its
    loaded (tokenizer, model), left as it was); write it to ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(20261201)
    tokenizer, model = base if base is not None else load_base(base_dir)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    rows = []
    for question, answer in zip(QUESTIONS, ANSWERS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(f"{OPENERS[name]} {answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "inferplane-training.json").write_text(json.dumps({"opener": OPENERS[name], "steps": steps, "final_loss": float(loss.detach())}) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    model.unload()  # the base model's own modules back, for the next adapter
    return out_dir


def demo_adapters(base_dir: Path, cache: Path) -> dict[str, Path]:
    """The demo adapters (trained once per base model and recipe, then cached): name -> folder."""
    out, base = {}, None
    for name in OPENERS:
        folder = Path(cache) / f"lora-{name}-{cache_key(base_dir, name)}"
        if not (folder / "adapter_model.safetensors").is_file():
            base = base or load_base(base_dir)  # loaded once for both
            train_adapter(base_dir, name, folder, base=base)
        out[name] = folder
    return out
