"""What both LLM engines share: the request's parameters and their validation, the finish reasons,
the sink a sequence streams to, and prompt encoding (the model-file check is ``_common.py``'s).

Copied beside ``model.py`` with the engines. Standard library only (the tokenizer is passed in),
so the adapter can read a request and pick an engine before importing torch, transformers or
vLLM, and the vLLM path does not depend on the transformers internals the CPU engine uses.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_DEADLINE = "deadline"
FINISH_ERROR = "error"


class RequestError(ValueError):
    """The request cannot be served as asked (bad parameters, too long for the KV budget)."""


# The engine's priority of a request (lower runs first and is preempted last) comes only from this
# Triton request parameter, which the frontend sets from the caller's plan on its generation path and
# refuses from callers (server/dataplane/validation.py); a request without it (raw OIP) runs last.
PRIORITY_PARAMETER = "inferplane_priority"
PRIORITY_LAST = 1000
# the LoRA adapter of a request (``model="base:adapter"``), set by the frontend after its grant check
ADAPTER_PARAMETER = "inferplane_adapter"
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # what a generator takes (and the gRPC field holds)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _short(value: Any, limit: int = 40) -> str:
    big = isinstance(value, int) and value.bit_length() > 128
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_text(text: str, field: str) -> str:
    """``text`` unless it holds a lone surrogate (JSON's ``"\\ud800"``), which no tokenizer can encode."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise RequestError(f"{field} holds a lone surrogate (U+{ord(found.group()):04X}) at character {found.start()}: not valid Unicode text")
    return text


class Sink(Protocol):
    """Where one sequence's output goes (a Triton response sender in the adapter)."""

    def send(self, text: str, info: dict[str, Any], final: bool) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    deadline_ms: float | None = None  # relative to submission
    priority: int = 0  # lower runs first and is preempted last: see PRIORITY_PARAMETER (not from the JSON)
    adapter: Any = None  # the LoRA adapter (_lora.Adapter) the frontend named (ADAPTER_PARAMETER), not the JSON

    @classmethod
    def parse(cls, doc: dict[str, Any], default_max_tokens: int) -> "SamplingParams":
        def number(key, kind, default, low, high):
            value = doc.get(key)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{key} must be a number, got {_short(value)}")
            if not (isinstance(value, int) or math.isfinite(value)) or not low <= value <= high:
                raise RequestError(f"{key} must be in [{low}, {high}], got {_short(value)}")
            return kind(value)

        stop = doc.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise RequestError("stop must be a non-empty string or a list of at most 16 non-empty strings")
        for i, s in enumerate(stop):
            check_text(s, f"stop[{i}]")
        seed = doc.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"seed must be an integer, got {_short(seed)}")
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            raise RequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), got {_short(seed)}")
        deadline = number("deadline_ms", float, None, 0, 86_400_000)
        return cls(
            max_tokens=number("max_tokens", int, default_max_tokens, 1, 1 << 20),
            temperature=number("temperature", float, 1.0, 0.0, 2.0),
            top_p=number("top_p", float, 1.0, 1e-6, 1.0),
            seed=seed,
            stop=tuple(stop),
            ignore_eos=bool(doc.get("ignore_eos", False)),
            deadline_ms=deadline,
        )


def request_priority(parameters_json: str) -> int:
    """The priority the frontend set on a Triton request (its ``parameters()`` JSON), else PRIORITY_LAST."""
    try:
        value = json.loads(parameters_json or "{}").get(PRIORITY_PARAMETER)
    except (ValueError, AttributeError):
        return PRIORITY_LAST
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= PRIORITY_LAST:
        return PRIORITY_LAST
    return value


def request_adapter(parameters_json: str) -> str:
    """The adapter name the frontend set on a Triton request ('' for the base model)."""
    try:
        value = json.loads(parameters_json or "{}").get(ADAPTER_PARAMETER, "")
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template, ready for the answer."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
            raise RequestError("each message needs a string role and string content")
        check_text(m["role"], f"messages[{i}].role")
        check_text(m.get("content", ""), f"messages[{i}].content")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(check_text(prompt, "text_input"))["input_ids"])


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_cpu_dtype(flags: frozenset[str] | None = None) -> str:
    """bfloat16 on a CPU with native bf16 dot products (AVX512-BF16 / AMX), float32 otherwise."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"
