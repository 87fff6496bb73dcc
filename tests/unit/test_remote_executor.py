"""The remote executor's choices and steps against in-memory Tritons (a real placement store on SQLite,
a real reconciler): which Tritons an endpoint goes to or leaves, its placements, the loads and unloads.
The real processes: tests/integration/test_local_cluster.py (a dev cluster's leader scaling, killed
mid-way)."""

from __future__ import annotations

import asyncio
import random

import pytest

from server import migrations
from server.control.scaling.placement_store import PlacementStore
from server.control.scaling.remote_executor import RemoteExecutor
from server.control.service.reconciler import StaticSource, TritonReconciler
from server.dataplane.replicas import DOWN, Member, ReplicaPolicy, ReplicaSet
from server.db import make_engine
from server.errors import InvalidRequest
from server.protogen.inference import grpc_service_pb2 as pb
from tests.backend_fake import FakeBackend


class Pool:
    """Three Tritons (t0, t1, t2; zones given), ``m`` loaded on those named, a reconciler over them."""

    def __init__(self, tmp_path, hosting=("t0", "t1", "t2"), zones=("", "", ""), others=()):
        (tmp_path / "repo" / "m").mkdir(parents=True)
        (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')
        self.engine = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
        migrations.upgrade(self.engine)
        self.store = PlacementStore(self.engine)
        self.tritons = {f"t{i}": FakeBackend(f"t{i}") for i in range(3)}
        for name in hosting:
            self.tritons[name].loaded["m"] = {1}
        for name in others:
            self.tritons[name].loaded["busy"] = {1}
        members = [Member(f"remote-{i}", t, zone=zones[i]) for i, t in enumerate(self.tritons.values())]
        for m in members:
            m.models = set(m.client.loaded)
        self.set = ReplicaSet(members, policy=ReplicaPolicy(), rng=random.Random(1))
        self.reconciler = TritonReconciler(self.store, StaticSource(self.tritons), repository=tmp_path / "repo", drain_s=0.0,
                                           client_factory=self.tritons.__getitem__)  # fmt: skip
        self.executor = RemoteExecutor(self.set, self.store, self.reconciler.reconcile_once)

    def serving(self) -> list[str]:
        return sorted(t for t, x in self.tritons.items() if "m" in x.loaded)


@pytest.fixture
def pool(tmp_path):
    made = []

    def make(**kwargs):
        made.append(Pool(tmp_path, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.engine.dispose()


def test_down_to_one_the_least_loaded_host_stays_and_up_to_three_the_others_load_it_again(pool):
    p = pool(others=("t0",))  # t0 hosts a second model: it goes first

    async def scenario():
        await p.executor.set_replicas("m", 1)
        assert p.serving() == ["t1"] and p.executor.replicas("m") == 1
        assert p.store.hosts("m") == {"t1"}
        await p.executor.set_replicas("m", 3)
        assert p.serving() == ["t0", "t1", "t2"] and p.executor.replicas("m") == 3
        assert p.tritons["t0"].configs[-1]["versionPolicy"]["specific"]["versions"] == ["1"]  # loaded by the reconciler, its version named
        assert p.store.hosts("m") == {"t0", "t1", "t2"}

    asyncio.run(scenario())


def test_a_scale_up_goes_to_the_zone_with_fewest_copies_first(pool):
    p = pool(hosting=("t0",), zones=("a", "a", "b"))
    asyncio.run(p.executor.set_replicas("m", 2))
    assert p.serving() == ["t0", "t2"]


def test_a_triton_that_is_down_is_neither_counted_nor_chosen_and_an_ask_beyond_the_pool_is_capped(pool):
    p = pool(hosting=("t0", "t1"))
    p.set.member("remote-1").state = DOWN
    assert p.executor.replicas("m") == 1

    async def scenario():
        await p.executor.set_replicas("m", 5)
        assert p.executor.describe()["capped"] == {"m": 5}
        assert p.store.hosts("m") == {"t0", "t2"}  # t1 is down: the reconciler loads it there when it returns

    asyncio.run(scenario())


def test_a_deploy_after_scaling_loads_only_where_the_endpoint_is_placed(pool):
    p = pool()

    async def scenario():
        await p.executor.set_replicas("m", 2)
        assert p.set.placer("m") == ["remote-0", "remote-1"]
        assert p.set.placer("unscaled") is None  # every Triton

    asyncio.run(scenario())


def test_replicas_are_never_negative():
    with pytest.raises(InvalidRequest):
        asyncio.run(RemoteExecutor(ReplicaSet([]), None, None).set_replicas("m", -1))


class _Unloading(FakeBackend):
    """A Triton still unloading ``m`` (Triton's UNLOADING) for its next ``reads`` index reads."""

    def __init__(self, target: str, reads: int):
        super().__init__(target)
        self.reads = reads

    async def repository_index(self, ready_only: bool = False) -> list:
        index = await super().repository_index(ready_only)
        if self.reads > 0:
            self.reads -= 1
            index.append(pb.RepositoryIndexResponse.ModelIndex(name="m", version="1", state="UNLOADING"))
        return index


def test_a_triton_still_unloading_the_endpoint_gets_it_in_another_round_at_once(pool):
    """Scaled down, then at once up again: a round finds the model busy on a Triton (unloading) and skips it;
    the executor asks for rounds until it loads there, rather than waiting for the reconciler's loop."""
    p = pool(hosting=("t0",))
    slow = _Unloading("t2", reads=3)
    p.tritons["t2"] = slow
    p.set.member("remote-2").client = slow

    async def scenario():
        await p.executor.set_replicas("m", 3)
        assert p.serving() == ["t0", "t1", "t2"] and p.executor.replicas("m") == 3 and slow.reads == 0

    asyncio.run(scenario())
