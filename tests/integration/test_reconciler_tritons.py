"""The Triton reconciler against three real ``tritonserver`` processes reading one repository folder
(explicit model control, as Triton pods on a cluster read one bucket): the desired set is loaded on
every placed Triton; a Triton started after a placement gets it from the running loop; a Triton down
during a change gets the change when it returns; a version removed from the desired state is unloaded
after its drain ("no stale model"), and one inference checks the late Triton really serves.

Waits are bounded waits for the behaviour (the loop runs every 0.2 s), never timed assertions; the
drain runs on an injected clock, so "after its drain" is exact."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server import migrations
from server.control.scaling.placement_store import PlacementStore
from server.control.service.reconciler import StaticSource, TritonReconciler
from server.db import make_engine
from server.runtime.supervisor import TritonSupervisor, free_port, remove_shm_regions

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "lightgbm_regressor"


class Triton:
    """One tritonserver process on its own loopback port (kept across a stop and start: "it returns")."""

    def __init__(self, repository, workdir, tag: str):
        self.supervisor = TritonSupervisor(repository, workdir, tag=tag, response_cache_bytes=0)
        self.supervisor.grpc_port, self.supervisor.metrics_port = free_port(), free_port()
        self.target = self.supervisor.grpc_target
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.supervisor._generation += 1  # a fresh shared-memory prefix per start
        self.proc = subprocess.Popen(self.supervisor._args(), env=self.supervisor.install.environment(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        assert wait_for(lambda: self.live(), 90), f"tritonserver at {self.target} did not come up"

    def live(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"tritonserver at {self.target} exited with {self.proc.returncode}")
        with contextlib.closing(grpcclient.InferenceServerClient(self.target)) as c:
            with contextlib.suppress(Exception):
                return c.is_server_live()
        return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its Python-backend stubs
        prefix = f"inferplane_{os.getpid()}_{self.supervisor.tag}"
        remove_shm_regions(lambda pid: pid == os.getpid(), match=lambda name: name.startswith(prefix))

    def ready_versions(self) -> set[int]:
        with contextlib.closing(grpcclient.InferenceServerClient(self.target)) as c:
            index = c.get_model_repository_index().models
        return {int(m.version) for m in index if m.name == MODEL and m.state == "READY" and m.version}


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


async def wait_async(predicate, timeout: float = 60.0) -> bool:
    return await asyncio.to_thread(wait_for, predicate, timeout)


@pytest.fixture(scope="module")
def repository(demo_repository, tmp_path_factory):
    """One folder every Triton reads: the demo model with a second version (the same artifact)."""
    out = tmp_path_factory.mktemp("shared") / "model_repository"
    shutil.copytree(demo_repository / MODEL, out / MODEL)
    shutil.copytree(out / MODEL / "1", out / MODEL / "2")
    return out


@pytest.fixture(scope="module")
def tritons(repository, tmp_path_factory):
    started = [Triton(repository, tmp_path_factory.mktemp(f"triton{i}"), tag=f"rec{i}") for i in range(3)]
    try:
        for t in started[:2]:
            t.start()
        yield started
    finally:
        for t in started:
            t.stop()


def infer(target: str, version: int) -> np.ndarray:
    with contextlib.closing(grpcclient.InferenceServerClient(target)) as c:
        meta = c.get_model_metadata(MODEL, str(version))
        spec = meta.inputs[0]
        rows = np.ones((1, *[d if d > 0 else 1 for d in spec.shape[1:]]), dtype=np.float32)
        x = grpcclient.InferInput(spec.name, list(rows.shape), spec.datatype)
        x.set_data_from_numpy(rows)
        return c.infer(MODEL, [x], model_version=str(version)).as_numpy(meta.outputs[0].name)


async def test_reconciler_converges_every_triton_late_down_and_drained(tritons, repository, tmp_path):
    a, b, c = tritons
    engine = make_engine(f"sqlite:///{tmp_path}/control.db")
    migrations.upgrade(engine)
    now = [1_000_000.0]  # the drain's clock (wall time in production), moved by hand here
    store = PlacementStore(engine, clock=lambda: now[0])
    source = StaticSource([a.target, b.target])
    rec = TritonReconciler(store, source, repository=repository, drain_s=30.0, clock=lambda: now[0])
    stop = asyncio.Event()
    loop = asyncio.create_task(rec.run(stop, interval_s=0.2))
    try:
        # the desired set lands on every placed Triton
        store.place(MODEL, 1)
        assert await wait_async(lambda: a.ready_versions() == {1} and b.ready_versions() == {1})

        # a Triton started after the placement gets it from the running loop, and serves it
        await asyncio.to_thread(c.start)
        assert c.ready_versions() == set()
        source.add(c.target)
        assert await wait_async(lambda: c.ready_versions() == {1})
        assert (await asyncio.to_thread(infer, c.target, 1)).shape[0] == 1

        # b is down while version 2 replaces version 1; the others load 2 and keep 1 through its drain
        await asyncio.to_thread(b.stop)
        store.place(MODEL, 2)
        store.remove(MODEL, 1)
        assert await wait_async(lambda: a.ready_versions() == {1, 2} and c.ready_versions() == {1, 2})
        assert rec.state[b.target].error.startswith("unreachable")

        # b returns with nothing loaded: the loop gives it the placed version only (1 is draining:
        # kept where it is loaded, never loaded afresh)
        await asyncio.to_thread(b.start)
        assert await wait_async(lambda: b.ready_versions() == {2})
        assert a.ready_versions() == {1, 2}

        # past the drain: no Triton keeps serving version 1
        now[0] += 31.0
        assert await wait_async(lambda: all(t.ready_versions() == {2} for t in tritons))
        with pytest.raises(grpcclient.InferenceServerException, match="version 1 is not at ready state"):
            await asyncio.to_thread(infer, a.target, 1)
        assert (await asyncio.to_thread(infer, a.target, 2)).shape[0] == 1

        # the endpoint removed altogether: unloaded everywhere after the drain
        store.remove(MODEL)
        now[0] += 31.0
        assert await wait_async(lambda: all(t.ready_versions() == set() for t in tritons))
    finally:
        stop.set()
        await asyncio.wait_for(loop, 60)
        await rec.close()
        engine.dispose()
