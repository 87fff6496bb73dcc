"""A composite as one Triton ensemble vs the same chain called hop by hop by the client.

    python -m loadtest.bench_compose [--out benchmarks/compose] [--rounds 6] [--duration 3] [--concurrency 1,8]
                                     [--pipelines topic_pipeline,fraud_ensemble] [--repository DIR]

Builds the demo composites (``inferplane demo build`` minus the LLMs; MiniLM is built for the text
pipeline) unless ``--repository`` names a built one, starts the real stack, then per pipeline and
concurrency runs closed-loop rounds alternating

* A = **ensemble**: one ``ModelInfer`` to the composite (Triton runs every step),
* B = **hop by hop**: the same steps as separate ``ModelInfer`` calls through the frontend, each
  waiting for the previous answer and building the next request from it in the client
  (``topic_pipeline``: embed -> classify -> softmax -> argmax; ``fraud_ensemble``: the three members
  one after another -> average -> threshold),

both over raw ``grpc.aio`` with the same protobuf/numpy work per hop. Reports per round the
median and p99 latency of each arm, the B/A ratios with their spread over the rounds, and
checks that both arms answer the same. Figures are this machine's; the ratio is the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from loadtest.stack import start_stack, stop_stack
from server.dataplane import codecs
from server.protogen.inference import grpc_service_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
SENTENCES = [b"The striker scored twice in the final.", b"Heavy rain flooded several streets.", b"The central bank raised interest rates again."]


def _request(model: str, **tensors: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    for name, array in tensors.items():
        datatype, shape, data = codecs.from_numpy(array)
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


def _outputs(raw: bytes) -> dict[str, np.ndarray]:
    r = pb.ModelInferResponse.FromString(raw)
    return {t.name: codecs.to_numpy(r.raw_output_contents[i], t.datatype, list(t.shape)) for i, t in enumerate(r.outputs)}


class Pipeline:
    """One composite and the hop-by-hop chain of its steps."""

    def __init__(self, name: str, rows: int, repository: Path):
        self.name = name
        if name == "topic_pipeline":
            text = np.array([[SENTENCES[i % len(SENTENCES)]] for i in range(rows)], dtype=object)
            self.first = {"text": text}
        else:
            with np.load(repository / "fraud_xgb" / "validation.npz") as npz:
                self.first = {"features": np.ascontiguousarray(npz["features"][:rows])}
        self.raw = _request(name, **self.first).SerializeToString()

    async def ensemble(self, call) -> dict[str, np.ndarray]:
        return _outputs(await call(self.raw))

    async def hops(self, call) -> dict[str, np.ndarray]:
        async def hop(model, **tensors):
            return _outputs(await call(_request(model, **tensors).SerializeToString()))

        v = f"{self.name}__v1__"
        if self.name == "topic_pipeline":
            embedding = (await hop("minilm_embeddings", **self.first))["embedding"]
            logits = (await hop("topic_classifier", embedding=embedding))["logits"]
            probabilities = (await hop(v + "probs", in0=logits))["output"]
            topic = (await hop(v + "topic", in0=logits))["output"]
            return {"probabilities": probabilities, "topic": topic}
        members = [(await hop(m, **self.first))["probability"] for m in ("fraud_xgb", "fraud_lgbm", "fraud_mlp")]
        mean = (await hop(v + "mean", in0=members[0], in1=members[1], in2=members[2]))["output"]
        flag = (await hop(v + "flag", in0=mean))["output"]
        return {"probability": mean, "is_fraud": flag}


async def _arm(fn, call, concurrency: int, duration: float) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + duration

    async def worker():
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await fn(call)
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


async def bench(target: str, pipelines: list[Pipeline], concurrencies: list[int], rounds: int, duration: float) -> list[dict]:
    channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
    method = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)

    async def call(raw: bytes) -> bytes:
        return await method(raw, timeout=30)

    results = []
    try:
        for p in pipelines:
            a, b = await p.ensemble(call), await p.hops(call)
            same = all(np.allclose(a[k], b[k], atol=1e-5) for k in a)
            for c in concurrencies:
                await _arm(p.ensemble, call, c, 1.0)  # warm-up
                await _arm(p.hops, call, c, 1.0)
                per_round = []
                for _ in range(rounds):
                    ens = await _arm(p.ensemble, call, c, duration)
                    hop = await _arm(p.hops, call, c, duration)
                    per_round.append({
                        "ensemble_p50_ms": _p(ens, 0.5), "ensemble_p99_ms": _p(ens, 0.99), "ensemble_rps": len(ens) / duration,
                        "hops_p50_ms": _p(hop, 0.5), "hops_p99_ms": _p(hop, 0.99), "hops_rps": len(hop) / duration,
                    })  # fmt: skip
                ratios = [r["hops_p50_ms"] / r["ensemble_p50_ms"] for r in per_round]
                ratios99 = [r["hops_p99_ms"] / r["ensemble_p99_ms"] for r in per_round]
                results.append({
                    "pipeline": p.name, "concurrency": c, "rounds": per_round, "same_answer": same,
                    "hops_over_ensemble_p50": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
                    "hops_over_ensemble_p99": {"median": statistics.median(ratios99), "min": min(ratios99), "max": max(ratios99)},
                    "ensemble_p50_ms": statistics.median(r["ensemble_p50_ms"] for r in per_round),
                    "hops_p50_ms": statistics.median(r["hops_p50_ms"] for r in per_round),
                })  # fmt: skip
    finally:
        await channel.close()
    return results


def build_repository(out: Path, text: bool) -> Path:
    from model_repository.demo import build_demo_repository
    from server.cli.compose import build_demo_composites

    build_demo_repository(out)
    if text:
        from model_repository.embeddings import build_embedding_model

        build_embedding_model(out)
    build_demo_composites(out, text=text)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/compose"))
    parser.add_argument("--repository", type=Path, help="a repository with the demo composites (default: build one under --out)")
    parser.add_argument("--pipelines", default="topic_pipeline,fraud_ensemble")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per arm per round")
    args = parser.parse_args(argv)
    names = [n for n in args.pipelines.split(",") if n]
    args.out.mkdir(parents=True, exist_ok=True)
    repository = args.repository or build_repository(args.out / "model_repository", text="topic_pipeline" in names)
    workdir = args.out / "run"
    env = {"INFERPLANE_AUTH": "off", "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir.resolve()}/registry.db",
           "INFERPLANE_ARTIFACT_STORE": str(workdir.resolve() / "artifacts")}  # fmt: skip
    stack = start_stack(repository, workdir, "--workers", "1", env=env)
    try:
        pipelines = [Pipeline(n, args.rows, repository) for n in names]
        results = asyncio.run(bench(stack.grpc, pipelines, [int(c) for c in args.concurrency.split(",")], args.rounds, args.duration))
    finally:
        stop_stack(stack)
    doc = {"command": "python -m loadtest.bench_compose " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])), "results": results}
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        q = r["hops_over_ensemble_p50"]
        print(f"{r['pipeline']:<16} c={r['concurrency']:<3} ensemble p50 {r['ensemble_p50_ms']:.2f} ms, hop by hop p50 {r['hops_p50_ms']:.2f} ms: "
              f"hops/ensemble {q['median']:.2f}x (rounds {q['min']:.2f}-{q['max']:.2f}), same answer: {r['same_answer']}")  # fmt: skip


if __name__ == "__main__":
    main()
