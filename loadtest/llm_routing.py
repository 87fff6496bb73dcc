"""LLM routing across replicas: prefix-aware against round robin on a shared-system-prompt workload.

``--start`` builds SmolLM2 twice, same weights (hard-linked), our CPU engine (``engine cpu``,
``threads 1``, prefix cache on): ``smollm2_rr`` configured ``inferplane.routing: round_robin`` and
``smollm2_pa`` configured ``prefix_aware`` (``batching.route_policy``), starts the stack with
``--replicas`` local Triton replicas (each hosting both), and sends the *same* requests, with the
same client and concurrency, to each endpoint in turn (each starts with its own cold prefix caches)::

    python -m loadtest.llm_routing --start                       # 2 replicas, ~3-5 minutes here
    python -m loadtest.llm_routing --start --replicas 3 --prompts 6 --users 12 --concurrency 12

The workload: ``--prompts`` distinct long system prompts (~``--system-chars`` characters each, an
app's instructions), ``--users`` users each with their own question, shuffled with a fixed seed;
``--concurrency`` closed-loop streams take the next request when theirs ends (the workload in
``--rounds`` parts, the policies in ABBA order, so drift on a shared machine hits both alike); ``--max-tokens``
tokens each (greedy, ``ignore_eos``: short answers, so time to first token is mostly prefill — what
a prefix-cache hit saves). Per endpoint it prints TTFT p50/p99, aggregate tokens/s, the prefix hit
rate (cached prompt tokens over prompt tokens, from each answer's ``usage.prompt_tokens_details``)
and how many requests each replica's engine took (its ``stats`` command on its own port), then the
prefix-aware figures over round robin's. The machine is shared: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from loadtest.sse import StreamResult, stream_chat

POLICIES = ("round_robin", "prefix_aware")
ENDPOINTS = {"round_robin": "smollm2_rr", "prefix_aware": "smollm2_pa"}
APPS = [
    ("a bicycle shop", "frames, gears, tyres, brakes and the workshop's opening hours"),
    ("a tax office", "deadlines, deductions, forms and appointment booking"),
    ("a hotel chain", "rooms, breakfast, late check-out, parking and loyalty points"),
    ("a mobile network", "tariffs, roaming, SIM swaps, coverage and billing disputes"),
    ("a public library", "loans, renewals, fines, e-books and the reading room"),
    ("an airline", "baggage, seat choice, delays, refunds and special assistance"),
    ("a pharmacy", "prescriptions, opening hours, vaccinations and delivery"),
    ("a car rental", "insurance, fuel policy, one-way fees and age limits"),
]
QUESTIONS = [
    "What are your opening hours on Sunday?", "How do I get a refund?", "Can I change my booking?",
    "Is there a student discount?", "Who do I call about a complaint?", "Do you deliver to my town?",
    "How long does it usually take?", "Can I pay by card?", "What documents do I need?",
    "Is there a waiting list?", "Can a friend pick it up for me?", "What happens if I am late?",
]  # fmt: skip


def system_prompt(index: int, chars: int) -> str:
    """An app's instructions: distinct from the first words on, about ``chars`` characters."""
    name, topics = APPS[index % len(APPS)]
    head = f"[app {index}] You are the customer assistant of {name}. You answer questions about {topics}. "
    rules = (
        "Be brief and friendly. Never invent prices or dates; when unsure, say so and offer to connect the customer with "
        "a person. Do not give legal or medical advice. Keep personal data private and never repeat card numbers. "
        f"Always answer as the assistant of {name}, in plain words, in the customer's language. "
    )
    text = head
    while len(text) < chars:
        text += rules
    return text[:chars]


def workload(prompts: int, users: int, chars: int, seed: int = 7) -> list[list[dict]]:
    """The requests (chat messages), shuffled: every prompt x every user's question."""
    systems = [system_prompt(i, chars) for i in range(prompts)]
    requests = [
        [{"role": "system", "content": systems[p]}, {"role": "user", "content": f"(user {u}) {QUESTIONS[u % len(QUESTIONS)]}"}]
        for p in range(prompts)
        for u in range(users)
    ]
    random.Random(seed).shuffle(requests)
    return requests


def _pct(values, q) -> float | None:
    return None if not values else round(float(np.percentile(np.asarray(values) * 1000.0, q)), 1)


async def run_policy(url: str, model: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> tuple[list[StreamResult], list[str], float]:
    """The requests through ``concurrency`` closed-loop streams: (results, errors, wall seconds)."""
    results: list[StreamResult] = []
    errors: list[str] = []
    queue = list(reversed(requests))

    async def caller(session: aiohttp.ClientSession) -> None:
        while queue:
            messages = queue.pop()
            body = {
                "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            try:
                results.append(await stream_chat(session, url, body))
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(err).__name__}: {err}")

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        began = time.perf_counter()
        await asyncio.gather(*(caller(session) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return results, errors, wall


def summarize(model: str, results: list[StreamResult], errors: list[str], wall: float) -> dict:
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    hit = [r.ttft_s for r in results if r.ttft_s is not None and r.cached_tokens]
    miss = [r.ttft_s for r in results if r.ttft_s is not None and not r.cached_tokens]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    tokens = sum(r.tokens for r in results)
    return {
        "model": model,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2) if wall else None,
        "ttft_ms": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "ttft_ms_hit": {"n": len(hit), "p50": _pct(hit, 50)},  # requests the prefix cache served in part
        "ttft_ms_miss": {"n": len(miss), "p50": _pct(miss, 50)},
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
    }


# ---- the replicas' own engines ------------------------------------------------------------------


def replica_targets(grpc_target: str, model: str, replicas: int) -> list[str]:
    """Pin ``model`` to ``replicas`` copies (the autoscaler leaves it there) and return their targets."""
    import grpc

    from server.protogen.inferplane.v1 import autoscale_pb2 as apb
    from server.protogen.inferplane.v1 import autoscale_pb2_grpc

    with grpc.insecure_channel(grpc_target) as channel:
        autoscale = autoscale_pb2_grpc.AutoscaleStub(channel)
        autoscale.Configure(apb.ConfigureAutoscaleRequest(endpoint=model, config=apb.AutoscaleConfig(min_replicas=replicas, max_replicas=replicas)))
        answer = autoscale.Explain(apb.ExplainAutoscaleRequest(endpoint=model))
    return sorted(r["target"] for r in json.loads(answer.explain_json)["executor"]["replicas"] if model in r["models"])


def engine_stats(target: str, model: str) -> dict:
    """One replica's engine counters (the ``stats`` command, on that replica's own Triton)."""
    import grpc

    from server.protogen.inference import grpc_service_pb2 as pb
    from server.protogen.inference import grpc_service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name=model, id="stats")
    request.inputs.add(name="parameters", datatype="BYTES", shape=[1])
    doc = json.dumps({"command": "stats"}).encode()
    request.raw_input_contents.append(len(doc).to_bytes(4, "little") + doc)
    with grpc.insecure_channel(target) as channel:
        for response in pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=30):
            if response.error_message:
                raise RuntimeError(response.error_message)
            out = response.infer_response
            names = [t.name for t in out.outputs]
            if "info" in names:
                return json.loads(out.raw_output_contents[names.index("info")][4:])
    raise RuntimeError(f"no stats from {model} at {target}")


def prepare_repository(out: Path, registry, threads: int = 1) -> list[str]:
    """SmolLM2 once per policy (the same weights registered under each name, deployed from
    ``registry``): engine cpu, ``threads``, prefix cache on; the policy in the endpoint's config."""
    from model_repository.config_writer import read_config, write_config
    from model_repository.llm import SMOLLM2_SETTINGS
    from server.control.rollout.llm_install import install_smollm2

    names = []
    for policy in POLICIES:
        name = ENDPOINTS[policy]
        install_smollm2(registry, out, name, dataclasses.replace(SMOLLM2_SETTINGS, engine="cpu", threads=threads))
        config = read_config(out / name)
        config.parameters["inferplane.routing"].string_value = policy  # the endpoint's routing policy (server.control.scaling.fleet)
        write_config(config, out / name)
        names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", action="store_true", help="build the two SmolLM2 endpoints and start a stack with local replicas")
    parser.add_argument("--url", help="http://HOST:PORT of a running stack's REST bridge serving smollm2_rr and smollm2_pa (not with --start)")
    parser.add_argument("--grpc", help="with --url: its gRPC HOST:PORT, for the per-replica engine counts")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="distinct system prompts (16 x ~280 tokens: more than one replica's 4096-token prefix cache)")
    parser.add_argument("--users", type=int, default=6, help="users (questions) per system prompt")
    parser.add_argument("--system-chars", type=int, default=1200, help="each system prompt's length (~280 SmolLM2 tokens)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="the workload in this many parts, policies in ABBA order")
    parser.add_argument("--threads", type=int, default=1, help="with --start: the engine's threads per replica")
    parser.add_argument("--load-factor", type=float, default=None, help="with --start: INFERPLANE_LLM_ROUTE_LOAD_FACTOR")
    parser.add_argument("--load-slack", type=float, default=None, help="with --start: INFERPLANE_LLM_ROUTE_LOAD_SLACK")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    stack = workdir = None
    try:
        if args.start:
            from loadtest.stack import start_stack

            workdir = Path(tempfile.mkdtemp(prefix="llm_routing_"))
            repo = workdir / "model_repository"
            from server.control.rollout.llm_install import scratch_env, scratch_registry

            registry = scratch_registry(workdir)  # the stack's registry (below): the models are deployed from it
            try:
                prepare_repository(repo, registry, args.threads)
            finally:
                registry.close()
            env = {
                "INFERPLANE_AUTH": "off",
                **scratch_env(workdir),
                "INFERPLANE_LOCAL_REPLICAS": str(args.replicas),
                "INFERPLANE_REPLICA_MEMORY_MB": "16384",
            }
            if args.load_factor is not None:
                env["INFERPLANE_LLM_ROUTE_LOAD_FACTOR"] = str(args.load_factor)
            if args.load_slack is not None:
                env["INFERPLANE_LLM_ROUTE_LOAD_SLACK"] = str(args.load_slack)
            began = time.perf_counter()
            stack = start_stack(repo, workdir / "stack", env=env, timeout=900)
            print(f"stack with {args.replicas} replicas up in {time.perf_counter() - began:.0f} s", flush=True)
            args.url, args.grpc = f"http://{stack.http}", stack.grpc
        if not args.url:
            parser.error("--url or --start")
        url = args.url.rstrip("/") + "/v1/chat/completions"
        requests = workload(args.prompts, args.users, args.system_chars)
        targets = {p: replica_targets(args.grpc, ENDPOINTS[p], args.replicas) if args.grpc else [] for p in POLICIES}
        report = {
            "replicas": args.replicas, "prompts": args.prompts, "users": args.users, "system_chars": args.system_chars,
            "requests": len(requests), "concurrency": args.concurrency, "max_tokens": args.max_tokens, "policies": {},
        }  # fmt: skip
        before = {p: [engine_stats(t, ENDPOINTS[p])["submitted"] for t in targets[p]] for p in POLICIES}
        runs = {p: ([], [], 0.0) for p in POLICIES}
        parts = max(1, args.rounds)
        for r in range(parts):  # ABBA: each policy runs first as often as second (drift on a shared machine)
            chunk = requests[r * len(requests) // parts : (r + 1) * len(requests) // parts]
            for policy in POLICIES if r % 2 == 0 else tuple(reversed(POLICIES)):
                results, errors, wall = asyncio.run(run_policy(url, ENDPOINTS[policy], chunk, args.concurrency, args.max_tokens))
                old = runs[policy]
                runs[policy] = (old[0] + results, old[1] + errors, old[2] + wall)
        for policy in POLICIES:
            model = ENDPOINTS[policy]
            result = summarize(model, *runs[policy])
            result["per_replica"] = [engine_stats(t, model)["submitted"] - b for t, b in zip(targets[policy], before[policy])]
            report["policies"][policy] = result
            print(
                f"{policy:>13}: {result['requests']} requests, errors={result['errors']}, ttft p50={result['ttft_ms']['p50']} ms "
                f"p99={result['ttft_ms']['p99']} ms, tok/s={result['tokens_per_s']}, prefix hit rate={result['prefix_hit_rate']:.1%}, "
                f"per replica={result['per_replica']}, wall={result['wall_s']} s; ttft p50 hit/miss="
                f"{result['ttft_ms_hit']['p50']}/{result['ttft_ms_miss']['p50']} ms (n={result['ttft_ms_hit']['n']}/{result['ttft_ms_miss']['n']})",
                flush=True,
            )
            if result["error_samples"]:
                print("  errors:", result["error_samples"], flush=True)
        rr, pa = report["policies"]["round_robin"], report["policies"]["prefix_aware"]

        def ratio(a, b):
            return round(a / b, 2) if a and b else None

        report["prefix_aware_over_round_robin"] = {
            "ttft_p50": ratio(pa["ttft_ms"]["p50"], rr["ttft_ms"]["p50"]),
            "ttft_p99": ratio(pa["ttft_ms"]["p99"], rr["ttft_ms"]["p99"]),
            "tokens_per_s": ratio(pa["tokens_per_s"], rr["tokens_per_s"]),
            "prefix_hit_rate": ratio(pa["prefix_hit_rate"], rr["prefix_hit_rate"]),
        }
        print("prefix_aware / round_robin:", report["prefix_aware_over_round_robin"], flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    finally:
        if stack is not None:
            from loadtest.stack import stop_stack

            stop_stack(stack)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
