"""Speculative decoding on vLLM, measured: the same SmolLM2 with speculation off, with n-gram (prompt
lookup: no draft model) always on, and with n-gram switched off above ``--spec-max-batch`` running
sequences (the per-load switch), on a repetitive workload (rewrite this code with a name changed;
extract the fields of a record: the answer copies the prompt) and a free-form one, at 1 and 16
streams, with the same client in one run; every figure is also given as a ratio to "off".

``--start`` builds the repository (``spec_off``, ``spec_ngram``, ``spec_ngram_b<N>``: the same weights,
hard-linked; ``engine vllm``) and starts the stack itself::

    python -m loadtest.llm_spec --start --concurrency 1,16 --json out/spec.json

Measure compiled (the default; the stack starts in ~5 minutes on 2 cores): with ``--eager`` (no
torch.compile) vLLM's CPU build ran the speculation-off server 2-4x slower per token while the n-gram
servers lost little, which turns every ratio into a flattering one.

``--draft-layers K`` adds draft-model speculation: a draft cut from SmolLM2 itself (its first K decoder
layers, the embeddings and the tied head, saved as safetensors; no smaller SmolLM2 exists in the
package index), run by vLLM's own OpenAI server started as the adapter starts it (the adapter's
``speculative`` parameter knows only ``ngram``), next to a plain standalone server as its baseline.

Per cell: tokens/s (all streams), TTFT p50/p99, inter-chunk gap p50/p99 (a speculative step sends
several tokens in one chunk), time per output token p50/p99 (per request: decode time / (tokens - 1)),
tokens per request, and the draft acceptance rate from vLLM's counters (accepted / drafted tokens).
Greedy, ``ignore_eos`` off: the answers end where the model ends them (the same text with and
without speculation, up to bfloat16 rounding), at most ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from loadtest import vllm_server
from loadtest.sse import StreamResult, chat_body, stream_chat

OFF, NGRAM = "spec_off", "spec_ngram"
DRAFT_OFF, DRAFT = "standalone_off", "standalone_draft"

_NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")
_CITIES = ("Lisbon", "Osaka", "Quito", "Tromso", "Accra", "Perth", "Bergen", "Cusco")


def code_prompt(i: int) -> str:
    """A rewrite whose answer is the prompt's code with one name changed."""
    a, b = _NAMES[i % len(_NAMES)], _NAMES[(i + 5) % len(_NAMES)]
    code = (
        f"def total_{a}(items, limit={i + 3}):\n"
        f"    count = 0\n"
        f"    for item in items:\n"
        f"        if item.weight > limit:\n"
        f"            count += item.weight * {i + 2}\n"
        f"        else:\n"
        f"            count -= 1\n"
        f"    return count\n\n"
        f"def report_{b}(items):\n"
        f"    count = total_{a}(items)\n"
        f"    print('{b}', count)\n"
        f"    return count\n"
    )
    return f"Rewrite this Python code with the variable `count` renamed to `score`. Output only the code.\n\n```python\n{code}```"


def extraction_prompt(i: int) -> str:
    """An extraction whose answer copies the record's values."""
    name = f"{_NAMES[i % len(_NAMES)].title()} {_NAMES[(i + 3) % len(_NAMES)].title()}son"
    record = (
        f"Order {40210 + i * 17} was placed on 2024-03-{(i % 27) + 1:02d} by {name} "
        f"({_NAMES[i % len(_NAMES)]}.{i}@example.com), shipping to {_CITIES[i % len(_CITIES)]}, "
        f"12 Harbour Road, postcode {1000 + i * 37}; items: {i % 4 + 1} x blue kettle, 2 x paper filters; "
        f"total {19.5 + i:.2f} EUR; phone +351 21 {300 + i} {4400 + i}."
    )
    return (
        "Extract the order id, date, customer name, email, city, postcode, items, total and phone from "
        f"this record, as JSON with one key per field:\n\n{record}"
    )


FREE_FORM = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a river in spring.",
    "Give three tips for writing clear code, with a sentence on each.",
    "Describe how a bicycle works.",
    "What does a compiler do? Answer in a short paragraph.",
    "Tell a short story about a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Describe a busy market in the morning.",
)


def prompts(workload: str, index: int) -> str:
    if workload == "repetitive":
        return code_prompt(index) if index % 2 == 0 else extraction_prompt(index)
    return FREE_FORM[index % len(FREE_FORM)] + f" ({index})"


def _pct(values, q) -> float | None:
    return None if not values else round(float(np.percentile(np.asarray(values) * 1000.0, q)), 2)


def summarize(results: list[StreamResult], wall_s: float) -> dict:
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    gaps = [g for r in results for g in r.gaps_s]
    tpot = [(r.finished - r.started - r.ttft_s) / (r.tokens - 1) for r in results if r.ttft_s is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "tokens_per_request": round(tokens / len(results), 1) if results else None,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s else None,
        "ttft_ms": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "gap_ms": {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99)},
        "tpot_ms": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
    }


class Target:
    """Where one configuration is served: its chat URL, the model name, its speculation counters."""

    def __init__(self, name: str, chat_url: str, counters):
        self.name, self.chat_url, self.counters = name, chat_url, counters


def platform_counters(base: str, model: str):
    def read() -> tuple[int, int]:
        with urllib.request.urlopen(f"{base}/v2/models/{model}/engine_stats", timeout=10) as r:
            stats = json.loads(r.read())
        return int(stats.get("spec_draft_tokens", 0)), int(stats.get("spec_accepted_tokens", 0))

    return read


def vllm_counters(base: str):
    from model_repository.adapters._vllm_core import parse_metrics

    def read() -> tuple[int, int]:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            m = parse_metrics(r.read().decode("utf-8", "replace"))
        return int(m.get("vllm:spec_decode_num_draft_tokens_total", 0)), int(m.get("vllm:spec_decode_num_accepted_tokens_total", 0))

    return read


async def run_cell(target: Target, workload: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """``concurrency`` closed-loop streams share ``requests`` requests (at least one each)."""
    results: list[StreamResult] = []
    errors: list[str] = []
    rounds = max(1, -(-requests // concurrency))

    async def stream(index: int, session: aiohttp.ClientSession) -> None:
        for round_ in range(rounds):
            body = chat_body(target.name, prompts(workload, index + round_ * concurrency), max_tokens, temperature=0)
            try:
                results.append(await stream_chat(session, target.chat_url, body))
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(err).__name__}: {err}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await stream_chat(session, target.chat_url, chat_body(target.name, prompts(workload, 999), 8, temperature=0))  # warm-up
        drafted0, accepted0 = await asyncio.to_thread(target.counters)
        started = time.perf_counter()
        await asyncio.gather(*(stream(i, session) for i in range(concurrency)))
        wall = time.perf_counter() - started
        drafted, accepted = await asyncio.to_thread(target.counters)
    out = {"config": target.name, "workload": workload, "concurrency": concurrency, **summarize(results, wall)}
    out["drafted"], out["accepted"] = drafted - drafted0, accepted - accepted0
    out["acceptance"] = round(out["accepted"] / out["drafted"], 3) if out["drafted"] else None
    out["error_count"], out["errors"] = len(errors), errors[:3]
    return out


def median_ratios(cells: list[dict]) -> list[dict]:
    """Over the rounds: each configuration's median ratio to its baseline per workload and streams."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        if "vs_baseline" in c:
            groups.setdefault((c["config"], c["workload"], c["concurrency"]), []).append(c)
    out = []
    for (config, workload, concurrency), group in groups.items():
        row = {"config": config, "baseline": group[0]["vs_baseline"]["baseline"], "workload": workload,
               "concurrency": concurrency, "rounds": len(group)}  # fmt: skip
        for key in ("tokens_per_s", "ttft_p50", "tpot_p50"):
            values = [g["vs_baseline"][key] for g in group if g["vs_baseline"][key] is not None]
            row[key] = round(float(np.median(values)), 2) if values else None
        accepted = [g["acceptance"] for g in group if g["acceptance"] is not None]
        row["acceptance"] = round(float(np.median(accepted)), 3) if accepted else None
        out.append(row)
    return out


def ratios(cells: list[dict], baseline_of) -> None:
    """Each cell's tokens/s, TTFT p50 and time per token p50 over its baseline's (same workload, streams
    and round)."""
    by = {(c["config"], c["workload"], c["concurrency"], c.get("round", 0)): c for c in cells}
    for c in cells:
        base = by.get((baseline_of(c["config"]), c["workload"], c["concurrency"], c.get("round", 0)))
        if base is None or base is c:
            continue

        def over(key, sub=None):
            a = c[key] if sub is None else c[key][sub]
            b = base[key] if sub is None else base[key][sub]
            return round(a / b, 2) if a and b else None

        c["vs_baseline"] = {"baseline": base["config"], "tokens_per_s": over("tokens_per_s"),
                            "ttft_p50": over("ttft_ms", "p50"), "tpot_p50": over("tpot_ms", "p50")}  # fmt: skip


# ---- the repository and the servers ---------------------------------------------------------------


def prepare_repository(out: Path, registry, spec_tokens: int, spec_max_batch: int, eager: bool) -> list[str]:
    """SmolLM2 once per speculation setting, registered in ``registry`` and deployed from it (no LoRA adapters)."""
    from model_repository.llm import SMOLLM2_SETTINGS
    from server.control.rollout.llm_install import install_smollm2

    base = dataclasses.replace(SMOLLM2_SETTINGS, engine="vllm", vllm_enforce_eager=eager, max_model_len=2048)
    configs = {
        OFF: base,
        NGRAM: dataclasses.replace(base, speculative="ngram", spec_tokens=spec_tokens),
        f"{NGRAM}_b{spec_max_batch}": dataclasses.replace(base, speculative="ngram", spec_tokens=spec_tokens, spec_max_batch=spec_max_batch),
    }
    for name, settings in configs.items():
        install_smollm2(registry, out, name, settings, adapters=False)
    return list(configs)


def build_draft(out: Path, layers: int) -> Path:
    """SmolLM2 cut to its first ``layers`` decoder layers (embeddings, final norm and the tied head
    kept): a draft with the target's tokenizer, written as safetensors."""
    from safetensors.torch import load_file, save_file

    from model_repository.llm import convert_smollm2

    hf = convert_smollm2()
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be 1..{config['num_hidden_layers'] - 1}")
    tensors = load_file(str(hf / "model.safetensors"))
    kept = {}
    for key, value in tensors.items():
        if key.startswith("model.layers."):
            if int(key.split(".")[2]) >= layers:
                continue
        kept[key] = value.contiguous()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in hf.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(f, out / f.name)
    return out


def start_vllm(model_dir: Path, name: str, workdir: Path, eager: bool, speculative: dict | None = None):
    """vLLM's OpenAI server with the adapter's command line and environment (plus ``speculative``)."""
    from batching.kv_budget import parse_memory
    from model_repository.adapters._llm_common import native_cpu_dtype
    from model_repository.adapters._vllm_core import VLLMConfig
    from model_repository.llm import SMOLLM2_SETTINGS
    from server.runtime.triton_install import default_vllm_python

    config = VLLMConfig(python=str(default_vllm_python()), served_name=name, dtype=native_cpu_dtype(),
                        kv_cache_bytes=parse_memory(SMOLLM2_SETTINGS.kv_cache_memory), max_model_len=2048,
                        enforce_eager=eager)  # fmt: skip
    log_path = workdir / f"{name}.log"
    extra = ["--speculative-config", json.dumps(speculative)] if speculative is not None else []
    proc, base = vllm_server.start(config, model_dir, log_path, extra)
    return proc, base, log_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", action="store_true", help="build the repository and start the stack (else --url)")
    parser.add_argument("--url", help="http://HOST:PORT of a running stack serving --configs")
    parser.add_argument("--configs", default=None, help="with --url: the models, the first one speculation off")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--workloads", default="repetitive,free")
    parser.add_argument("--requests", type=int, default=6, help="requests per cell (at least one per stream)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--spec-max-batch", type=int, default=4, help="the per-load copy: n-gram off above this many running")
    parser.add_argument("--eager", action="store_true",
                        help="vLLM --enforce-eager (starts sooner; slows speculation-off far more than n-gram: ratios flatter)")
    parser.add_argument("--draft-layers", type=int, default=0, help="also a draft model: SmolLM2's first K layers (0: none)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every cell, the configurations in alternating order (a shared machine drifts); medians reported")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    stack, workdir, procs = None, None, []
    try:
        workdir = Path(tempfile.mkdtemp(prefix="llm_spec_"))
        targets: list[Target] = []
        standalone = []
        if args.draft_layers:  # started first: they warm up while the stack does
            from model_repository.llm import convert_smollm2

            draft = build_draft(workdir / "draft", args.draft_layers)
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.spec_tokens}
            for name, speculative in ((DRAFT_OFF, None), (DRAFT, spec)):
                proc, base, log_path = start_vllm(convert_smollm2(), name, workdir, args.eager, speculative)
                procs.append(proc)
                standalone.append((name, proc, base, log_path))
        if args.start:
            from loadtest.stack import start_stack

            repo = workdir / "model_repository"
            from server.control.rollout.llm_install import scratch_env, scratch_registry

            registry = scratch_registry(workdir)  # the stack's registry (below): the models are deployed from it
            try:
                names = prepare_repository(repo, registry, args.spec_tokens, args.spec_max_batch, args.eager)
            finally:
                registry.close()
            stack = start_stack(repo, workdir / "stack", env={"INFERPLANE_AUTH": "off", **scratch_env(workdir)}, timeout=900)
            args.url = f"http://{stack.http}"
        elif args.url:
            names = [c.strip() for c in (args.configs or "").split(",") if c.strip()]
            if not names:
                parser.error("--url needs --configs (the first one with speculation off)")
        else:
            names = []
        if args.url:
            base = args.url.rstrip("/")
            targets += [Target(n, base + "/v1/chat/completions", platform_counters(base, n)) for n in names]
        for name, proc, base, log_path in standalone:
            try:
                vllm_server.wait_healthy(proc, base, log_path)
                targets.append(Target(name, base + "/v1/chat/completions", vllm_counters(base)))
            except RuntimeError as err:
                print(f"{name}: not measured: {err}", flush=True)
        if not targets:
            parser.error("nothing to measure: --start, --url or --draft-layers")
        baseline = {t.name: (OFF if t.name not in (DRAFT, DRAFT_OFF) else DRAFT_OFF) for t in targets}
        if names:
            baseline.update({n: names[0] for n in names})
        cells = []
        plan = [(r, w, c) for r in range(args.repeat) for w in workloads for c in levels]
        for round_, workload, c in plan:
            for target in targets if round_ % 2 == 0 else targets[::-1]:
                cell = asyncio.run(run_cell(target, workload, c, max(args.requests, c), args.max_tokens))
                cell["round"] = round_
                cells.append(cell)
                print(
                    f"r{round_} {target.name:>18} {workload:>10} c={c:<3} tok/s={cell['tokens_per_s']:>7} "
                    f"ttft p50={cell['ttft_ms']['p50']}ms p99={cell['ttft_ms']['p99']}ms "
                    f"gap p50={cell['gap_ms']['p50']}ms p99={cell['gap_ms']['p99']}ms "
                    f"tpot p50={cell['tpot_ms']['p50']}ms p99={cell['tpot_ms']['p99']}ms "
                    f"tok/req={cell['tokens_per_request']} accept={cell['acceptance']} errors={cell['error_count']}",
                    flush=True,
                )
        ratios(cells, lambda name: baseline.get(name, OFF))
        print("ratio to the baseline (tokens/s, TTFT p50, time per token p50; >1 tokens/s is faster, <1 latency is faster):")
        for cell in cells:
            if "vs_baseline" in cell:
                r = cell["vs_baseline"]
                print(f"  r{cell['round']} {cell['config']:>18} / {r['baseline']:<15} {cell['workload']:>10} c={cell['concurrency']:<3} "
                      f"tok/s x{r['tokens_per_s']}  ttft x{r['ttft_p50']}  tpot x{r['tpot_p50']}  accept={cell['acceptance']}")  # fmt: skip
        medians = median_ratios(cells)
        if args.repeat > 1:
            print(f"median over {args.repeat} rounds:")
            for m in medians:
                print(f"  {m['config']:>18} / {m['baseline']:<15} {m['workload']:>10} c={m['concurrency']:<3} "
                      f"tok/s x{m['tokens_per_s']}  ttft x{m['ttft_p50']}  tpot x{m['tpot_p50']}  accept={m['acceptance']}")  # fmt: skip
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cells": cells, "medians": medians}, indent=2) + "\n")
        return 0
    finally:
        vllm_server.stop(procs)
        if stack is not None:
            from loadtest.stack import stop_stack

            stop_stack(stack)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
