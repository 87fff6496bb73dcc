"""Multi-LoRA throughput: streams spread over two adapters and the base model in one batch, against
base-only traffic, per engine, with the same client in one run::

    python -m loadtest.llm_lora --engines cpu,vllm --concurrency 4,16 --max-tokens 32 --json benchmarks/llm_lora.json

For each engine it serves SmolLM2 twice from one repository (the same weights, hard-linked):
``smollm2_<engine>`` with LoRA on (``max_loras 4``, the demo adapters ``pirate`` and ``robot`` of
``inferplane demo build``) and ``smollm2_<engine>_nolora`` (``max_loras 0``). Three workloads per
concurrency, each closed-loop for ``--requests`` rounds per stream, every request exactly
``--max-tokens`` tokens (``ignore_eos``, greedy):

* ``nolora``: every stream on the LoRA-off copy (the baseline),
* ``base``: every stream on the LoRA-on model, no adapter named (what enabling LoRA costs),
* ``mixed``: the streams in turn on ``:pirate``, ``:robot`` and the base model (one batch of three).

It prints and writes tokens/s, TTFT and inter-token p50/p99 of each, and each workload's tokens/s
over ``nolora`` at the same concurrency.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

from loadtest.llm_bench import run_level

ADAPTERS = ("pirate", "robot")


def prepare(out: Path, registry, engines: list[str]) -> dict[str, dict[str, list[str] | str]]:
    """The repository: per engine a LoRA-on (with the demo adapters) and a LoRA-off SmolLM2, each
    registered and deployed from ``registry``; the workloads' model lists."""
    from model_repository.llm import SMOLLM2_NAME, SMOLLM2_SETTINGS
    from server.control.rollout.llm_install import install_smollm2

    plans = {}
    for engine in engines:
        on, off = f"{SMOLLM2_NAME}_{engine}", f"{SMOLLM2_NAME}_{engine}_nolora"
        for name, loras in ((on, 4), (off, 0)):
            install_smollm2(registry, out, name, dataclasses.replace(SMOLLM2_SETTINGS, engine=engine, max_loras=loras), adapters=bool(loras))
        plans[engine] = {"nolora": off, "base": on, "mixed": [f"{on}:{a}" for a in ADAPTERS] + [on]}
    return plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="cpu,vllm")
    parser.add_argument("--concurrency", default="4,16")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream at each level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from loadtest.stack import start_stack, stop_stack

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="llm_lora_"))
    stack = None
    try:
        from server.control.rollout.llm_install import scratch_env, scratch_registry

        registry = scratch_registry(workdir)  # the stack's registry (below): the models are deployed from it
        try:
            plans = prepare(workdir / "model_repository", registry, engines)
        finally:
            registry.close()
        stack = start_stack(workdir / "model_repository", workdir / "stack", env={"INFERPLANE_AUTH": "off", **scratch_env(workdir)}, timeout=900)
        url = f"http://{stack.http}/v1/chat/completions"
        report = {"max_tokens": args.max_tokens, "requests_per_stream": args.requests, "engines": {}}
        for engine, plan in plans.items():
            rows = report["engines"][engine] = []
            for c in levels:
                by = {}
                for workload, models in plan.items():
                    level = asyncio.run(run_level(url, models, c, args.requests, args.max_tokens))
                    level["workload"] = workload
                    by[workload] = level
                    rows.append(level)
                base = by["nolora"]["tokens_per_s"] or 0
                for workload, level in by.items():
                    level["over_nolora"] = round(level["tokens_per_s"] / base, 2) if base else None
                    print(
                        f"{engine:>5} {workload:>7} c={c:<3} tok/s={level['tokens_per_s']:>8} ({level['over_nolora']}x) "
                        f"ttft p50={level['ttft_ms']['p50']:.0f}ms p99={level['ttft_ms']['p99']:.0f}ms "
                        f"itl p50={level['itl_ms']['p50']:.1f}ms p99={level['itl_ms']['p99']:.1f}ms errors={level['error_count']}",
                        flush=True,
                    )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    finally:
        if stack is not None:
            stop_stack(stack)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
