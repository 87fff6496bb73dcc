"""What the transports accept in a caller's scalar fields, checked at the edge before any model sees them.

One table for the OpenAI REST handlers and the gRPC ``Generate`` servicer, so a value too large
for its field (``max_tokens`` = 2**65, ``seed`` with 400 digits, ``temperature`` = NaN) is an
INVALID_ARGUMENT / 400 naming the field on both, never an overflow deeper down. The bounds are
the LLM engine's own (``model_repository/adapters/_llm_common.py: SamplingParams.parse``), so a
request the edge lets through is one the engine takes. Text fields must be valid Unicode: a JSON
string may carry a lone surrogate (``"\\ud800"``), which no encoder, tokenizer or protobuf accepts.
"""

from __future__ import annotations

import math
import re
from typing import Any

from server.errors import InvalidRequest, Violation

MAX_TOKENS = 1 << 20
SEED = (-(1 << 63), (1 << 63) - 1)  # a 64-bit integer: the gRPC field, the engines' generators
DEADLINE_MS = (1.0, 86_400_000.0)  # up to a day
TEMPERATURE = (0.0, 2.0)
TOP_P = (0.0, 1.0)
DIMENSIONS = (1, 1 << 16)

_SURROGATE = re.compile("[\ud800-\udfff]")


def bad(field: str, description: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {description}", [Violation(field, description)])


def short(value: Any, limit: int = 40) -> str:
    """A caller's value for an error message, never long (a 400-digit integer is not echoed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def number(value: Any, field: str, kind: type = float, low: float | None = None, high: float | None = None):
    """``value`` as ``kind`` (``int`` or ``float``) within ``[low, high]``; None stays None.

    Compares before converting: Python compares any int with any float exactly, so a 400-digit
    integer is out of range here instead of an OverflowError in ``float()``.
    """
    if value is None:
        return None
    want = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(field, f"must be {want}, got {short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(field, f"must be a finite number, got {value!r}")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise bad(field, f"must be an integer, got {short(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(field, f"must be in [{_bound(low)}, {_bound(high)}], got {short(value)}")
    return kind(value)


def _bound(value: float | None) -> str:
    return "-inf" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def check_text(value: str, field: str) -> str:
    """``value`` unless it holds a lone surrogate."""
    found = _SURROGATE.search(value)
    if found is not None:
        raise bad(field, f"holds a lone surrogate (U+{ord(found.group()):04X}) at character {found.start()}: not valid Unicode text")
    return value


# a lone surrogate can only come from a JSON escape (UTF-8 cannot encode one): \ud800-\udfff
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_json(raw: bytes | memoryview, doc: Any) -> None:
    """:func:`check_document` for a document parsed from ``raw``, walked only when ``raw`` holds a
    surrogate escape at all (a regex over the bytes, at C speed): large tensor bodies cost nothing."""
    if _SURROGATE_ESCAPE.search(raw) is not None:
        check_document(doc)


def check_document(doc: Any, root: str = "") -> None:
    """Every string (keys included) of a parsed JSON document is valid Unicode; the first one that
    is not is named by its path (``messages[0].content``). Iterative: depth costs no recursion."""
    stack: list[tuple[Any, str]] = [(doc, root)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            check_text(value, path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                check_text(key, f"{path}.<key>" if path else "<key>")
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                stack.append((item, f"{path}[{i}]"))
