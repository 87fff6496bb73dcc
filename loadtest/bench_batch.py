"""Batch jobs vs the same rows called one by one, and real-time latency while a batch runs.

    python -m loadtest.bench_batch [--out benchmarks/batch] [--rows 400] [--rounds 3] [--concurrency 8]
                                   [--models mlp_classifier,fraud_xgboost,lightgbm_regressor,minilm_embeddings]
                                   [--repository DIR] [--realtime-s 5]

Builds the demo models and MiniLM (unless ``--repository`` names a built repository), starts the
real stack with ``INFERPLANE_BATCH_CONCURRENCY`` = ``--concurrency``, then per model runs
interleaved rounds of

* A = **batch**: upload ``--rows`` requests as JSONL, ``POST /v1/batches``, wait until it ends
  (rows/s from create to completed),
* B = **row by row**: the same requests sent to the live endpoint (``/v2/models/NAME/infer``,
  ``/v1/embeddings``) by ``--concurrency`` concurrent HTTP clients (rows/s),

and reports A/B with its spread over the rounds. Then the real-time check: closed-loop live
requests (concurrency 2) for ``--realtime-s`` alone and again while a large batch runs; reports
the p50/p99 ratios (with / alone) — the batch class should leave real-time p99 about unchanged.
Figures are this machine's; the ratios are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from loadtest.stack import start_stack, stop_stack

EMBEDDINGS = "minilm_embeddings"


def _bodies(repository: Path, model: str, rows: int) -> tuple[str, list[dict]]:
    if model == EMBEDDINGS:
        return "/v1/embeddings", [{"model": model, "input": f"row {i}: a sentence for the embedding model"} for i in range(rows)]
    with np.load(repository / model / "validation.npz") as npz:
        x = np.asarray(npz["features"], dtype=np.float32)
    bodies = [{"inputs": [{"name": "features", "shape": [1, x.shape[1]], "datatype": "FP32", "data": x[i % len(x)].tolist()}]} for i in range(rows)]
    return f"/v2/models/{model}/infer", bodies


def _jsonl(url: str, bodies: list[dict]) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": b}).encode() + b"\n" for i, b in enumerate(bodies))


async def _batch(session: aiohttp.ClientSession, base: str, url: str, bodies: list[dict]) -> float:
    """Seconds from create to the end of one batch job over ``bodies`` (the upload not counted)."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO(_jsonl(url, bodies)), filename="rows.jsonl", content_type="application/jsonl")
    async with session.post(f"{base}/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    started = time.perf_counter()
    async with session.post(f"{base}/v1/batches", json={"input_file_id": file_id, "endpoint": url, "completion_window": "24h"}) as r:
        batch_id = (await r.json())["id"]
    while True:
        async with session.get(f"{base}/v1/batches/{batch_id}") as r:
            doc = await r.json()
        if doc["status"] in ("completed", "failed", "expired", "cancelled"):
            if doc["status"] != "completed" or doc["request_counts"]["failed"]:
                raise RuntimeError(f"batch ended {doc['status']}: {doc['request_counts']} {doc.get('errors')}")
            return time.perf_counter() - started
        await asyncio.sleep(0.02)


async def _row_by_row(session: aiohttp.ClientSession, base: str, url: str, bodies: list[dict], concurrency: int) -> float:
    queue = list(reversed(bodies))

    async def client():
        while queue:
            body = queue.pop()
            async with session.post(base + url, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status} {await r.text()}")
                await r.read()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started


async def _latencies(session: aiohttp.ClientSession, base: str, url: str, body: dict, seconds: float, concurrency: int = 2) -> list[float]:
    out: list[float] = []
    stop = time.perf_counter() + seconds

    async def client():
        while time.perf_counter() < stop:
            t = time.perf_counter()
            async with session.post(base + url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            out.append(time.perf_counter() - t)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


async def bench(base: str, repository: Path, models: list[str], rows: int, rounds: int, concurrency: int, realtime_s: float) -> dict:
    results = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for model in models:
            url, bodies = _bodies(repository, model, rows)
            await _row_by_row(session, base, url, bodies[: max(8, concurrency)], concurrency)  # warm-up
            per_round = []
            for _ in range(rounds):
                a = await _batch(session, base, url, bodies)
                b = await _row_by_row(session, base, url, bodies, concurrency)
                per_round.append({"batch_rows_per_s": rows / a, "row_by_row_rows_per_s": rows / b})
            ratios = [r["batch_rows_per_s"] / r["row_by_row_rows_per_s"] for r in per_round]
            results.append({
                "model": model, "endpoint": url, "rows": rows, "concurrency": concurrency, "rounds": per_round,
                "batch_over_row_by_row": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            })  # fmt: skip
        url, bodies = _bodies(repository, models[0], rows * 5)
        alone = await _latencies(session, base, url, bodies[0], realtime_s)
        batch = asyncio.create_task(_batch(session, base, url, bodies))
        await asyncio.sleep(0.2)
        during = await _latencies(session, base, url, bodies[0], realtime_s)
        await batch
        realtime = {
            "model": models[0], "alone_p50_ms": _p(alone, 0.5), "alone_p99_ms": _p(alone, 0.99),
            "during_batch_p50_ms": _p(during, 0.5), "during_batch_p99_ms": _p(during, 0.99),
        }  # fmt: skip
        realtime["p99_during_over_alone"] = realtime["during_batch_p99_ms"] / realtime["alone_p99_ms"]
        realtime["p50_during_over_alone"] = realtime["during_batch_p50_ms"] / realtime["alone_p50_ms"]
    return {"throughput": results, "realtime": realtime}


def build_repository(out: Path) -> Path:
    from model_repository.demo import build_demo_repository
    from model_repository.embeddings import build_embedding_model

    build_demo_repository(out)
    build_embedding_model(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/batch"))
    parser.add_argument("--repository", type=Path, help="a repository with the demo models and MiniLM (default: build one under --out)")
    parser.add_argument("--models", default=f"mlp_classifier,fraud_xgboost,lightgbm_regressor,{EMBEDDINGS}")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="the batch worker's rows in flight and the row-by-row clients")
    parser.add_argument("--realtime-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    repository = args.repository or build_repository(args.out / "model_repository")
    workdir = (args.out / "run").resolve()
    env = {"INFERPLANE_AUTH": "off", "INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db",
           "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts"), "INFERPLANE_BATCH_CONCURRENCY": str(args.concurrency),
           "INFERPLANE_BATCH_POLL_S": "0.05"}  # fmt: skip
    stack = start_stack(repository, workdir, "--workers", "1", env=env)
    try:
        doc = asyncio.run(bench(f"http://{stack.http}", repository, models, args.rows, args.rounds, args.concurrency, args.realtime_s))
    finally:
        stop_stack(stack)
    doc = {"command": "python -m loadtest.bench_batch " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])), **doc}
    (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    for r in doc["throughput"]:
        q = r["batch_over_row_by_row"]
        last = r["rounds"][-1]
        print(f"{r['model']:<20} batch {last['batch_rows_per_s']:.0f} rows/s, row by row (c={r['concurrency']}) {last['row_by_row_rows_per_s']:.0f} rows/s: "
              f"batch/row-by-row {q['median']:.2f}x (rounds {q['min']:.2f}-{q['max']:.2f})")  # fmt: skip
    rt = doc["realtime"]
    print(f"real-time {rt['model']}: p99 alone {rt['alone_p99_ms']:.2f} ms, during a batch {rt['during_batch_p99_ms']:.2f} ms "
          f"({rt['p99_during_over_alone']:.2f}x); p50 {rt['p50_during_over_alone']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
