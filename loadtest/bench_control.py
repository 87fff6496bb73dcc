"""Control plane across processes (issue 27): deploy convergence over N workers, and leader failover.

    python -m loadtest.bench_control convergence --out benchmarks/control [--workers 2,4,8] [--deploys 20]
    python -m loadtest.bench_control failover --out benchmarks/control [--kills 3]

``convergence``: one frontend ``--workers N`` (control plane in its parent, SQLite, its Triton) with two
versions of one endpoint registered and loaded; then ``--deploys`` switches alternating between them
(both stay loaded: the switch, not Triton's load, is what is timed). Before each deploy, 6·N persistent
channels are open (each pinned to the worker that accepted its connection; with 6·N connections every
worker holds some, unless one is very unlucky); after the Deploy RPC returns each channel is asked in
a loop until it answers the new version. Convergence = the last channel's first answer with the new
version, minus the Deploy's return (the requirement: no replica serves the old version for more than
30 s; the goal ≤ 1 s p99).

``failover``: a frontend (control plane external) and two ``control run`` replicas on PostgreSQL
(``--database-url``, default the test server) deploying into the frontend's Triton; closed-loop load on
the frontend from 4 threads; ``kill -9`` of the leading replica; reported: the time until the lease row
names the other replica (no leader meanwhile), the time until a Deploy through the frontend succeeds
again, and the failed data-plane requests (goal 0). The killed replica is started again before the next
kill.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from loadtest.stack import start_control, start_stack, stop_stack
from model_repository import demo
from server.control.service.leader import lease_row
from server.db import make_engine
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from server.runtime.supervisor import free_port

ENDPOINT = "scorer"
ACTOR = (("x-inferplane-actor", "bench-control"),)
ENV = {"INFERPLANE_AUTH": "off", "INFERPLANE_ROLLBACK_GRACE_S": "3600", "INFERPLANE_DEPLOY_TIMEOUT_S": "60"}


def _register(admin, bundle) -> int:
    signature = {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]}
    request = admin_pb2.RegisterModelRequest(name=ENDPOINT, artifact=bundle.artifact, filename=bundle.artifact_name, signature_json=json.dumps(signature))
    return admin.RegisterModel(request, metadata=ACTOR).version.version


def _request(bundle) -> bytes:
    features = np.ascontiguousarray(bundle.features[:1], dtype=np.float32)
    request = pb.ModelInferRequest(model_name=ENDPOINT)
    request.inputs.add(name="features", datatype="FP32", shape=list(features.shape))
    request.raw_input_contents.append(features.tobytes())
    return request.SerializeToString()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def deploy_retrying(address: str, ref: str, tries: int = 120):
    """Deploy through a frontend, retrying while no leader answers (UNAVAILABLE) — what a CLI user does."""
    with grpc.insecure_channel(address) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        for attempt in range(tries):
            try:
                return admin.Deploy(admin_pb2.DeployRequest(ref=ref), metadata=ACTOR, timeout=120).result
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or attempt == tries - 1:
                    raise
                time.sleep(0.1)


def _setup_endpoint(address: str, bundles) -> None:
    with grpc.insecure_channel(address) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        for bundle in bundles:
            _register(admin, bundle)
    deploy_retrying(address, f"{ENDPOINT}:1")
    deploy_retrying(address, f"{ENDPOINT}:2")  # both loaded now (the grace period outlasts the run)


def convergence(workers: int, deploys: int, root: Path, repository: Path, bundles) -> dict:
    port = free_port()
    env = {**ENV, "INFERPLANE_DATABASE_URL": f"sqlite:///{root}/registry-{workers}.db", "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts")}
    stack = start_stack(repository, root / f"w{workers}", "--workers", str(workers), "--grpc-port", str(port), "--http-port", str(free_port()), env=env)
    samples: list[float] = []
    try:
        _setup_endpoint(stack.grpc, bundles)
        raw = _request(bundles[0])
        for i in range(deploys):
            version = "1" if i % 2 == 0 else "2"
            channels = [grpc.insecure_channel(stack.grpc, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(6 * workers)]
            calls = [ch.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=pb.ModelInferResponse.FromString)
                     for ch in channels]  # fmt: skip
            for call in calls:
                call(raw, timeout=10)  # connected (and pinned to a worker) before the deploy
            deploy_retrying(stack.grpc, f"{ENDPOINT}:{version}")
            returned = time.perf_counter()
            last = returned
            for call in calls:
                while call(raw, timeout=10).model_version != version:
                    pass
                last = max(last, time.perf_counter())
            samples.append((last - returned) * 1000.0)
            for ch in channels:
                ch.close()
    finally:
        stop_stack(stack)
    return {"workers": workers, "deploys": deploys, "channels": 6 * workers, "p50_ms": _percentile(samples, 50), "p99_ms": _percentile(samples, 99),
            "max_ms": max(samples) if samples else 0.0, "samples_ms": samples}  # fmt: skip


def _leader_pid(url: str) -> int | None:
    engine = make_engine(url)
    try:
        row = lease_row(engine)
    finally:
        engine.dispose()
    return int(row["holder"].split("/")[1]) if row and row["expires_at"] > time.time() else None


def failover(kills: int, database_url: str, root: Path, repository: Path, bundles) -> dict:
    env = {**ENV, "INFERPLANE_DATABASE_URL": database_url, "INFERPLANE_ARTIFACT_STORE": str(root / "artifacts")}
    front = start_stack(repository, root / "front", env={**env, "INFERPLANE_CONTROL_PLANE": "external"})
    replicas = {}
    rounds = []
    try:
        for name in ("c1", "c2"):
            r = start_control(repository, root / name, database_url, front.triton, env=env)
            replicas[r.process.pid] = (name, r)
        _setup_endpoint(front.grpc, bundles)
        raw = _request(bundles[0])
        for k in range(kills):
            stop, outcomes = threading.Event(), {"ok": 0, "failed": 0}
            lock = threading.Lock()

            def load():
                with grpc.insecure_channel(front.grpc) as ch:
                    call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=None)
                    while not stop.is_set():
                        try:
                            call(raw, timeout=10)
                            key = "ok"
                        except grpc.RpcError:
                            key = "failed"
                        with lock:
                            outcomes[key] += 1

            threads = [threading.Thread(target=load) for _ in range(4)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            leader = _leader_pid(database_url)
            name, victim = replicas.pop(leader)
            killed = time.perf_counter()
            os.kill(leader, signal.SIGKILL)
            victim.process.wait(30)
            while (now := _leader_pid(database_url)) in (None, leader):
                time.sleep(0.02)
            led = time.perf_counter()
            deploy_retrying(front.grpc, f"{ENDPOINT}:{'1' if k % 2 == 0 else '2'}")
            deployed = time.perf_counter()
            time.sleep(1.0)
            stop.set()
            for t in threads:
                t.join(30)
            rounds.append({"no_leader_s": led - killed, "deploy_again_s": deployed - killed, "requests_ok": outcomes["ok"],
                           "requests_failed": outcomes["failed"], "new_leader_pid": now})  # fmt: skip
            print(json.dumps(rounds[-1]), flush=True)
            r = start_control(repository, root / f"{name}-{k}", database_url, front.triton, env=env)  # back as a standby
            replicas[r.process.pid] = (name, r)
    finally:
        for _name, r in replicas.values():
            if r.process.poll() is None:
                stop_stack(r)
        stop_stack(front)
    return {"kills": kills, "rounds": rounds, "no_leader_s_max": max(r["no_leader_s"] for r in rounds),
            "deploy_again_s_max": max(r["deploy_again_s"] for r in rounds), "requests_failed": sum(r["requests_failed"] for r in rounds),
            "requests_ok": sum(r["requests_ok"] for r in rounds)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["convergence", "failover"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/control"))
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--deploys", type=int, default=20)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--database-url", default=os.environ.get("INFERPLANE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-control-"))
    repository = root / "model_repository"
    repository.mkdir()
    bundles = (demo.lightgbm_regressor(rounds=40), demo.lightgbm_regressor(rounds=10))
    try:
        if args.mode == "convergence":
            results = [convergence(int(n), args.deploys, root, repository, bundles) for n in args.workers.split(",")]
            for r in results:
                print(f"workers={r['workers']}: convergence p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms max {r['max_ms']:.1f} ms ({r['deploys']} deploys)")
        else:
            database = _fresh_database(args.database_url, root)
            try:
                results = failover(args.kills, database, root, repository, bundles)
            finally:
                _drop_database(args.database_url, database)
            print(f"failover: no leader for at most {results['no_leader_s_max']:.2f} s; deploy through the frontend again after "
                  f"{results['deploy_again_s_max']:.2f} s; {results['requests_failed']} of {results['requests_ok'] + results['requests_failed']} requests failed")
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"command": " ".join(shlex.quote(a) for a in ["python", "-m", "loadtest.bench_control", *sys.argv[1:]]),
               "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": f"{platform.node()} {os.cpu_count()} cpus (shared, loaded)",
               "results": results}  # fmt: skip
        (args.out / f"{args.mode}.json").write_text(json.dumps(doc, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _fresh_database(base: str, root: Path) -> str:
    """A new database on the PostgreSQL server (dropped after the run), or SQLite when none answers."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from server.db import normalize_url

    url = make_url(normalize_url(base))
    name = f"bench_control_{int(time.time())}"
    try:
        admin = create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
    except Exception as err:  # no PostgreSQL here: the SQLite lease row
        print(f"PostgreSQL at {url.render_as_string(hide_password=True)} unavailable ({err}); using SQLite", file=sys.stderr)
        return f"sqlite:///{root}/failover.db"
    return url.set(database=name).render_as_string(hide_password=False)


def _drop_database(base: str, url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from server.db import normalize_url

    if not url.startswith("postgresql"):
        return
    admin = create_engine(make_url(normalize_url(base)), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


if __name__ == "__main__":
    main()
