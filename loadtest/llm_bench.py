"""LLM streaming benchmark: TTFT, inter-token latency and aggregate tokens/s at several concurrencies,
continuous batching against one-request-at-a-time in the same run.

``--start`` builds a repository with SmolLM2 twice — ``smollm2`` (continuous batching, up to 16
sequences per step) and ``smollm2_serial`` (the same engine with ``max_running 1``: requests
wait their turn, what a server without batching does) — and starts the stack itself::

    python -m loadtest.llm_bench --start --concurrency 1,4,16 --max-tokens 64 --json out/llm.json

``--start --engines cpu,vllm`` instead builds SmolLM2 once per engine (``smollm2_cpu``: ours,
``smollm2_vllm``: vLLM's CPU build from ``.venv-vllm``; both with LoRA off) and reports each engine's tokens/s over the
first one's, measured with the same client in the same run::

    python -m loadtest.llm_bench --start --engines cpu,vllm --concurrency 1,4,16 --max-tokens 64

Every model is registered in the stack's registry and deployed from it (``server.control.rollout.llm_install``),
as ``make serve`` deploys ``smollm2``; ``--engines vllm --vllm-standalone --rounds 3`` compares vLLM
through the platform with vLLM's own server, the models' order reversed in every other round.

Against a running stack: ``--url http://127.0.0.1:8000 --model smollm2 [--serial-model NAME]``.
Each of C concurrent streams sends requests back to back (closed loop) for ``--requests`` rounds;
every request asks for exactly ``--max-tokens`` tokens (``ignore_eos``), greedy, with a distinct prompt.
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
from pathlib import Path

import aiohttp
import numpy as np

from loadtest import vllm_server
from loadtest.sse import StreamResult, chat_body, stream_chat

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a river.",
    "What is the capital of France, and what is it famous for?",
    "Give three tips for writing clear code.",
    "Describe how a bicycle works.",
    "Summarize the plot of a detective story in a few lines.",
    "List some healthy breakfast ideas.",
    "What does a compiler do?",
]


def _pct(values, q) -> float | None:
    return None if not values else float(np.percentile(np.asarray(values) * 1000.0, q))


def summarize(results: list[StreamResult], wall_s: float, concurrency: int) -> dict:
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    gaps = [g for r in results for g in r.gaps_s]
    tokens = sum(r.tokens for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s else None,
        "ttft_ms": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "itl_ms": {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99)},
        "per_stream_tokens_per_s": round(float(np.mean([r.tokens / r.duration_s for r in results if r.duration_s])), 2),
    }


async def run_level(url: str, model: str | list[str], concurrency: int, requests: int, max_tokens: int) -> dict:
    """``model``: one name, or a list that the streams take in turn (stream i: ``model[i % len]``)."""
    results: list[StreamResult] = []
    errors: list[str] = []
    models = [model] if isinstance(model, str) else list(model)

    async def stream(index: int, session: aiohttp.ClientSession) -> None:
        for round_ in range(requests):
            prompt = PROMPTS[(index + round_) % len(PROMPTS)] + f" (stream {index}, round {round_})"
            body = chat_body(models[index % len(models)], prompt, max_tokens, temperature=0, ignore_eos=True)
            try:
                results.append(await stream_chat(session, url, body))
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(err).__name__}: {err}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # warm-up: one request, not measured
        for name in models:
            await stream_chat(session, url, chat_body(name, "Hello!", 4, temperature=0, ignore_eos=True))
        started = time.perf_counter()
        await asyncio.gather(*(stream(i, session) for i in range(concurrency)))
        wall = time.perf_counter() - started
    out = summarize(results, wall, concurrency)
    out["model"] = model if isinstance(model, str) else ",".join(models)
    out["errors"] = errors[:5]
    out["error_count"] = len(errors)
    return out


def _pooled_tokens_per_s(levels: list[dict]) -> dict[tuple[str, int], float]:
    """(model, concurrency) -> tokens over wall seconds, pooled over every round."""
    tokens: dict[tuple[str, int], float] = {}
    wall: dict[tuple[str, int], float] = {}
    for lv in levels:
        key = (lv["model"], lv["concurrency"])
        tokens[key] = tokens.get(key, 0) + lv["tokens"]
        wall[key] = wall.get(key, 0) + lv["wall_s"]
    return {k: round(tokens[k] / wall[k], 2) if wall[k] else 0.0 for k in tokens}


def prepare_repository(out: Path, registry, dtype: str | None = None) -> list[str]:
    """SmolLM2 batched and serial (the same registered weights, other engine settings) deployed from
    ``registry`` into a fresh repository; ``dtype`` overrides the engine's (``auto``)."""
    from model_repository.llm import SMOLLM2_NAME, SMOLLM2_SETTINGS
    from server.control.rollout.llm_install import install_smollm2

    batched = dataclasses.replace(SMOLLM2_SETTINGS, dtype=dtype or SMOLLM2_SETTINGS.dtype)
    serial = SMOLLM2_NAME + "_serial"
    install_smollm2(registry, out, SMOLLM2_NAME, batched)
    install_smollm2(registry, out, serial, dataclasses.replace(batched, max_running=1))
    return [SMOLLM2_NAME, serial]


def prepare_engines_repository(out: Path, registry, engines: list[str], dtype: str | None = None, eager: bool = False) -> list[str]:
    """SmolLM2 once per engine (``smollm2_<engine>``: the same weights registered under each name,
    ``engine`` in the version's hardware metadata), deployed from ``registry``; LoRA off; ``eager``:
    vLLM without torch.compile (it loads in a minute where the compile warm-up on a loaded machine
    outlasts Triton's load deadline)."""
    from model_repository.llm import SMOLLM2_NAME, SMOLLM2_SETTINGS
    from server.control.rollout.llm_install import install_smollm2

    names = []
    for engine in engines:
        name = f"{SMOLLM2_NAME}_{engine}"
        # base-model traffic: no engine in LoRA mode (loadtest.llm_lora measures that)
        settings = dataclasses.replace(SMOLLM2_SETTINGS, engine=engine, max_loras=0, dtype=dtype or SMOLLM2_SETTINGS.dtype, vllm_enforce_eager=eager)
        install_smollm2(registry, out, name, settings, adapters=False)
        names.append(name)
    return names


STANDALONE = "vllm_standalone"


def _start_standalone_vllm(model_dir: Path, workdir: Path):
    """vLLM's OpenAI server on ``model_dir/1/hf`` with the command line and environment the adapter
    uses for that model's parameters, outside Triton; returns (process, base URL) once it is healthy."""
    from model_repository.adapters._vllm_core import VLLMConfig
    from model_repository.adapters._llm_common import native_cpu_dtype
    from batching.kv_budget import parse_memory
    from model_repository.config_writer import read_config
    from server.runtime.triton_install import default_vllm_python

    params = {k: v.string_value for k, v in read_config(model_dir).parameters.items()}
    config = VLLMConfig(
        python=str(default_vllm_python()), served_name=STANDALONE, dtype=native_cpu_dtype(),
        kv_cache_bytes=parse_memory(params.get("kv_cache_memory") or "1GiB"),
        max_num_seqs=int(params.get("max_running") or 16), max_num_batched_tokens=int(params.get("max_prefill_tokens") or 4096),
        max_model_len=int(params.get("max_model_len") or 0),
        max_loras=int(params.get("max_loras") or 0), max_lora_rank=int(params.get("max_lora_rank") or 16),
        enforce_eager=(params.get("vllm_enforce_eager") or "").lower() in ("1", "true", "yes"),
    )  # fmt: skip
    log_path = workdir / "vllm_standalone.log"
    proc, base = vllm_server.start(config, model_dir / "1" / "hf", log_path)
    try:
        vllm_server.wait_healthy(proc, base, log_path)
    except RuntimeError:
        vllm_server.stop([proc])
        raise
    return proc, base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="http://HOST:PORT of the REST bridge (not with --start)")
    parser.add_argument("--start", action="store_true", help="build the SmolLM2 bench repository and start a stack")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--serial-model", default=None, help="a max_running=1 copy to compare with (default with --start)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream at each level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="run every level this many times, the models' order reversed in odd rounds")
    parser.add_argument("--dtype", default=None, help="with --start: the engine's dtype (default: the model's, auto)")
    parser.add_argument("--engines", default=None, help="with --start: compare engines (e.g. cpu,vllm) instead of batching")
    parser.add_argument("--vllm-standalone", action="store_true",
                        help="with --engines: also vLLM's own OpenAI server, started as the adapter starts it (the raw engine)")
    parser.add_argument("--vllm-eager", action="store_true", help="with --engines: vLLM without torch.compile, through the platform and standalone alike")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    stack = None
    workdir = None
    procs: list = []
    try:
        if args.start:
            from loadtest.stack import start_stack

            workdir = Path(tempfile.mkdtemp(prefix="llm_bench_"))
            repo = workdir / "model_repository"
            from server.control.rollout.llm_install import scratch_env, scratch_registry

            registry = scratch_registry(workdir)  # the stack's registry: the models are deployed from it
            try:
                if args.engines:
                    models = prepare_engines_repository(repo, registry, [e.strip() for e in args.engines.split(",") if e.strip()], args.dtype, args.vllm_eager)
                else:
                    names = prepare_repository(repo, registry, args.dtype)
                    args.serial_model = args.serial_model or names[1]
                    models = [args.model, args.serial_model]
                deployed = {e.name: f"{e.name}:{e.live}" for e in registry.endpoints() if e.name in models}
            finally:
                registry.close()
            stack = start_stack(repo, workdir / "stack", env={"INFERPLANE_AUTH": "off", **scratch_env(workdir)}, timeout=900)  # vLLM warms up for minutes
            args.url = f"http://{stack.http}"
        else:
            models = [args.model] + ([args.serial_model] if args.serial_model else [])
        if not args.url:
            parser.error("--url or --start")
        url = args.url.rstrip("/") + "/v1/chat/completions"
        urls = {m: url for m in models}
        if args.vllm_standalone and args.start and args.engines:
            standalone = _start_standalone_vllm(repo / models[-1], workdir)
            procs.append(standalone[0])
            models.append(STANDALONE)
            urls[STANDALONE] = standalone[1] + "/v1/chat/completions"
        report = {"max_tokens": args.max_tokens, "requests_per_stream": args.requests, "levels": []}
        if args.start:
            report["deployed_from_registry"] = deployed  # endpoint -> the registered version it serves
        for round_ in range(args.rounds):
            for c in levels:
                # odd rounds take the models in reverse order: a drift of the (shared) machine's load
                # during a level weighs on each side alike
                for model in models if round_ % 2 == 0 else models[::-1]:
                    level = asyncio.run(run_level(urls[model], model, c, args.requests, args.max_tokens))
                    level["round"] = round_
                    report["levels"].append(level)
                    print(
                        f"{model:>16} c={c:<3} tok/s={level['tokens_per_s']:>8} ttft p50={level['ttft_ms']['p50']:.0f}ms "
                        f"p99={level['ttft_ms']['p99']:.0f}ms itl p50={level['itl_ms']['p50']:.1f}ms p99={level['itl_ms']['p99']:.1f}ms "
                        f"errors={level['error_count']}",
                        flush=True,
                    )
        if len(models) > 1 and not args.serial_model:
            tps = _pooled_tokens_per_s(report["levels"])
            report["tokens_per_s"] = {m: {str(c): tps[(m, c)] for c in levels} for m in models}  # over every round
            report["ratio_to_" + models[0]] = {
                m: {str(c): round(tps[(m, c)] / tps[(models[0], c)], 2) for c in levels if tps[(models[0], c)]} for m in models[1:]
            }
            print(f"tokens/s over {models[0]}:", report["ratio_to_" + models[0]])
            if STANDALONE in models:
                platform = models[-2]  # the engine the standalone server mirrors
                report["platform_over_standalone"] = {
                    str(c): round(tps[(platform, c)] / tps[(STANDALONE, c)], 2) for c in levels if tps[(STANDALONE, c)]
                }  # fmt: skip
                by_round = {(lv["model"], lv["concurrency"], lv["round"]): lv["tokens_per_s"] for lv in report["levels"]}
                report["platform_over_standalone_by_round"] = {
                    str(c): [round(by_round[(platform, c, r)] / by_round[(STANDALONE, c, r)], 2) for r in range(args.rounds) if by_round[(STANDALONE, c, r)]]
                    for c in levels
                }  # fmt: skip
                print(f"tokens/s of {platform} (through the platform) over vLLM standalone:", report["platform_over_standalone"])
        if args.serial_model:
            tps = _pooled_tokens_per_s(report["levels"])
            report["speedup"] = {
                str(c): round(tps[(args.model, c)] / tps[(args.serial_model, c)], 2) for c in levels if tps[(args.serial_model, c)]
            }
            print("continuous batching / one-at-a-time tokens/s:", report["speedup"])
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
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
