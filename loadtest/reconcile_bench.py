"""How fast the Triton reconciler converges real ``tritonserver`` processes reading one repository folder.

    python -m loadtest.reconcile_bench [--tritons 3] [--trials 3] [--interval 0.5] [--models 1] [--json benchmarks/reconciler/results.json]

1. **change** — a placement changes (version 2 placed, version 1 removed, drain 0) while the loop runs:
   seconds from the store write to the last Triton serving exactly version 2.
2. **join** — a Triton started after the placement: seconds from it being live (and named to the
   loop's source) to the placed versions ready on it. Goal (issue 27): <= 5 s. ``--models N``: N
   models are placed on it (copies of the model under other names), which the loop loads concurrently.
3. **baseline** — the same models loaded on a fresh Triton with direct ``load_model`` calls one after
   another (what Triton itself takes, and with N > 1 what the one-at-a-time loop did), same run.

Times are medians and maxima over ``--trials``. Never part of the test run; the machine is shared,
so compare the ratios to the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from server import migrations
from server.control.scaling.placement_store import PlacementStore
from server.control.service.reconciler import StaticSource, TritonReconciler, load_config
from server.db import make_engine
from server.runtime.supervisor import TritonSupervisor

MODEL = "lightgbm_regressor"


async def _ready(sup: TritonSupervisor, client, versions: set[int], models: tuple[str, ...] = (MODEL,)) -> None:
    while True:
        index = await client.repository_index()
        if all({int(m.version) for m in index if m.name == name and m.state == "READY" and m.version} == versions for name in models):
            return
        await asyncio.sleep(0.02)


def _copy_model(repo: Path, name: str) -> None:
    shutil.copytree(repo / MODEL, repo / name)
    config = repo / name / "config.pbtxt"
    config.write_text(config.read_text().replace(f'name: "{MODEL}"', f'name: "{name}"', 1))


def _summary(values: list[float]) -> dict:
    return {"median_s": round(statistics.median(values), 3), "max_s": round(max(values), 3), "runs_s": [round(v, 3) for v in values]}


async def bench(tritons: int, trials: int, interval_s: float, work: Path, models: int = 1) -> dict:
    from model_repository.demo import build_demo_repository
    from server.dataplane.triton_client import TritonClient

    demo = work / "demo"
    build_demo_repository(demo)
    repo = work / "repository"
    shutil.copytree(demo / MODEL, repo / MODEL)
    shutil.copytree(repo / MODEL / "1", repo / MODEL / "2")
    extras = tuple(f"{MODEL}_copy{k}" for k in range(1, models))
    for name in extras:
        _copy_model(repo, name)
    engine = make_engine(f"sqlite:///{work}/control.db")
    migrations.upgrade(engine)
    store = PlacementStore(engine)
    sups = [TritonSupervisor(repo, work / f"triton{i}", tag=f"bench{i}", response_cache_bytes=0) for i in range(tritons)]
    source = StaticSource()
    rec = TritonReconciler(store, source, repository=repo, drain_s=0.0)
    stop = asyncio.Event()
    loop = asyncio.create_task(rec.run(stop, interval_s))
    clients = []
    result: dict = {"tritons": tritons, "trials": trials, "interval_s": interval_s, "model": MODEL, "models_on_join": models}
    try:
        for sup in sups:
            await sup.start()
            source.add(sup.grpc_target)
            c = TritonClient(sup.grpc_target)
            c.connect()
            clients.append(c)
        store.place(MODEL, 1)
        await asyncio.wait_for(asyncio.gather(*(_ready(s, c, {1}) for s, c in zip(sups, clients))), 300)

        change = []
        for trial in range(trials):
            old, new = (1, 2) if trial % 2 == 0 else (2, 1)
            began = time.perf_counter()
            store.place(MODEL, new)
            store.remove(MODEL, old)
            await asyncio.wait_for(asyncio.gather(*(_ready(s, c, {new}) for s, c in zip(sups, clients))), 300)
            change.append(time.perf_counter() - began)
        result["change"] = _summary(change)

        live = {p.version for p in store.all() if p.removed_at is None}
        join, direct = [], []
        late = TritonSupervisor(repo, work / "late", tag="benchlate", response_cache_bytes=0)
        for _ in range(trials):
            await late.start()
            c = TritonClient(late.grpc_target)
            c.connect()
            for name in extras:  # placed on the late Triton only (its address changes with each start)
                store.place(name, 1, triton=late.grpc_target)
            began = time.perf_counter()
            source.add(late.grpc_target)
            await asyncio.wait_for(asyncio.gather(_ready(late, c, live), _ready(late, c, {1}, extras)), 300)
            join.append(time.perf_counter() - began)
            source.discard(late.grpc_target)
            for name in (MODEL, *extras):
                await c.unload_model(name)
            await _ready(late, c, set(), (MODEL, *extras))
            began = time.perf_counter()  # baseline: direct load-with-config calls, one after another, on the same Triton
            await c.load_model(MODEL, config=load_config(rec.repository_config(MODEL), live))
            for name in extras:
                await c.load_model(name, config=load_config(rec.repository_config(name), {1}))
            direct.append(time.perf_counter() - began)
            await c.close()
            await late.stop()
        result["join"] = _summary(join)
        result["baseline_direct_load"] = _summary(direct)
        result["join_over_direct"] = round(statistics.median(join) / statistics.median(direct), 2)
        result["join_goal_met"] = max(join) <= 5.0
    finally:
        stop.set()
        await loop
        await rec.close()
        for c in clients:
            await c.close()
        for sup in sups:
            await sup.stop()
        engine.dispose()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.reconcile_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tritons", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.5, help="the reconciler's round, seconds")
    parser.add_argument("--models", type=int, default=1, help="models placed on the late Triton (join)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reconcile-bench-") as work:
        result = asyncio.run(bench(args.tritons, args.trials, args.interval, Path(work), args.models))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
