"""KV-cache budget arithmetic: how many tokens of KV cache fit in a memory budget.

Pure and standard-library only: it is also copied beside the LLM engine adapter in the Triton
model directory (which imports it as ``kv_budget``), so it must not import the ``batching``
package or anything outside the standard library.

One token of KV cache holds a key and a value vector per layer per KV head:
``2 * layers * kv_heads * head_dim * dtype_bytes`` bytes. Admission reserves a sequence's
worst case, ``prompt_tokens + max_tokens``, so an admitted sequence never runs out of cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "int8": 1, "uint8": 1,
}  # fmt: skip

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str | int | float) -> int:
    """``"8GiB"`` -> 8589934592, ``"512MB"`` -> 512000000, ``1024`` -> 1024 (bytes)."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"memory must be >= 0, got {text}")
        return int(text)
    m = _MEMORY.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r} (examples: 8GiB, 512MiB, 2GB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KVSpec:
    """The shape of one token's KV cache for a decoder-only transformer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_positions: int = 0  # the model's context window (0: unknown)

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes) < 1:
            raise ValueError(f"invalid KV spec {self}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype: str | None = None) -> "KVSpec":
        """From a Hugging Face ``config.json`` (llama-style field names); ``dtype`` overrides the config's."""
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        name = str(dtype or config.get("dtype") or config.get("torch_dtype") or "float32").lower().removeprefix("torch.")
        if name not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {name!r} (known: {sorted(DTYPE_BYTES)})")
        return cls(
            layers=int(config["num_hidden_layers"]),
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=DTYPE_BYTES[name],
            max_positions=int(config.get("max_position_embeddings") or 0),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str | None = None) -> "KVSpec":
        """From ``model_dir/config.json`` (or the first one found below ``model_dir``)."""
        path = Path(model_dir)
        if path.is_dir():
            found = path / "config.json"
            if not found.is_file():
                found = next(iter(sorted(path.rglob("config.json"))), found)
            path = found
        return cls.from_config(json.loads(path.read_text(encoding="utf-8")), dtype)

    def tokens_that_fit(self, memory_bytes: int) -> int:
        """How many tokens of KV (summed over all sequences) fit in ``memory_bytes``."""
        return max(0, int(memory_bytes) // self.bytes_per_token)

    def memory_for(self, tokens: int) -> int:
        return int(tokens) * self.bytes_per_token


@dataclass(frozen=True)
class KVBudget:
    """A fixed number of KV tokens shared by all running sequences."""

    spec: KVSpec
    total_tokens: int

    @classmethod
    def for_memory(cls, spec: KVSpec, memory: str | int) -> "KVBudget":
        return cls(spec, spec.tokens_that_fit(parse_memory(memory)))

    @staticmethod
    def need(prompt_tokens: int, max_tokens: int) -> int:
        """Tokens a sequence may hold at its end: what admission reserves for it."""
        return int(prompt_tokens) + int(max_tokens)

    def fits_alone(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Could this sequence ever run (with the whole budget to itself)?"""
        need = self.need(prompt_tokens, max_tokens)
        if self.spec.max_positions and need > self.spec.max_positions:
            return False
        return need <= self.total_tokens

    def admits(self, reserved_tokens: int, prompt_tokens: int, max_tokens: int) -> bool:
        """Does it fit next to sequences already holding ``reserved_tokens``?"""
        return reserved_tokens + self.need(prompt_tokens, max_tokens) <= self.total_tokens

    def max_sequences(self, tokens_per_sequence: int) -> int:
        """Sequences of ``tokens_per_sequence`` (prompt + completion) that fit at once."""
        return self.total_tokens // max(1, int(tokens_per_sequence))

    def report(self, sequence_lengths: tuple[int, ...] = (512, 2048, 8192)) -> dict[str, Any]:
        s = self.spec
        return {
            "layers": s.layers,
            "kv_heads": s.kv_heads,
            "head_dim": s.head_dim,
            "dtype_bytes": s.dtype_bytes,
            "bytes_per_token": s.bytes_per_token,
            "total_tokens": self.total_tokens,
            "memory_bytes": s.memory_for(self.total_tokens),
            "max_positions": s.max_positions,
            "sequences_at_length": {
                str(n): self.max_sequences(n) for n in sequence_lengths if not s.max_positions or n <= s.max_positions
            },
        }
