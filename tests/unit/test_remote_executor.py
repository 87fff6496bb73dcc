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


# ---- what the mutation pass of remote_executor.py found unpinned --------------------------------------


def test_to_zero_every_placement_is_removed_and_prepare_places_without_loading(pool):
    p = pool()

    async def scenario():
        p.set.everywhere.add("m")  # loaded on every Triton at start (ReplicaSet.load_model without a placement)
        await p.executor.set_replicas("m", 0)
        assert p.serving() == [] and p.executor.replicas("m") == 0 and p.store.hosts("m") == set()
        assert all(x.removed_at is not None for x in p.store.all())
        await p.executor.prepare("m", 2)  # a wake: placed where the next load goes, nothing loaded yet
        assert p.serving() == [] and p.store.hosts("m") == {"t0", "t1"}
        assert p.set.placement["m"] == ["remote-0", "remote-1"] and "m" not in p.set.everywhere
        assert p.executor.describe()["copies"] == {"m": 2}

    asyncio.run(scenario())


def test_a_model_never_placed_and_ready_nowhere_is_loaded_with_the_repositorys_own_config(pool):
    p = pool(hosting=())
    asyncio.run(p.executor.set_replicas("fresh", 1))
    assert p.tritons["t0"].loads == ["fresh"] and p.tritons["t0"].configs == []  # no placement to name its versions
    assert [x for x in p.store.all() if x.model == "fresh"] == [] and p.executor.replicas("fresh") == 1


def test_versions_come_from_the_placements_then_what_is_ready_then_the_last_removed(pool):
    p = pool(hosting=())
    now = [100.0]
    p.store._clock = lambda: now[0]

    async def scenario():
        for version in (1, 2):  # removed one after the other: the last removal names 2
            p.store.place("m", version, "t0")
            now[0] += 1
            p.store.remove("m", version, "t0")
            now[0] += 1
        await p.executor.set_replicas("m", 1)
        assert p.tritons["t0"].loaded == {"m": {2}}
        p.store.place("m", 3, "t1")  # the live placements, of every Triton, win over what is ready (2 on t0)
        assert await p.executor._versions("m") == [2, 3]

    asyncio.run(scenario())


def test_a_failed_unload_is_logged_and_left_to_the_reconciler(pool, caplog):
    p = pool()

    async def refuse(name, timeout=60.0):
        raise OSError("gone")

    p.tritons["t2"].unload_model = refuse
    p.executor.settle_s = 0.3  # t2 keeps serving it: the change never settles
    asyncio.run(p.executor.set_replicas("m", 2))
    assert [r.getMessage() for r in caplog.records if r.name == "server.control.scaling.remote_executor"] == ["unloading m from t2 failed: gone"]
    assert p.store.hosts("m") == {"t0", "t1"}


def test_a_capped_ask_is_logged_and_forgotten_once_the_pool_covers_it(pool, caplog):
    p = pool(hosting=("t0",))

    async def scenario():
        await p.executor.set_replicas("m", 4)
        said = [r.getMessage() for r in caplog.records if r.name == "server.control.scaling.remote_executor"]
        assert said == ["endpoint m: 4 replica(s) asked for, 3 Triton(s) up: placed on all of them"]
        await p.executor.set_replicas("m", 2)
        assert p.executor.describe() == {
            "executor": "remote",
            "tritons": [{"id": f"remote-{i}", "target": f"t{i}", "zone": "", "state": "up", "models": ["m"] if i < 2 else []} for i in range(3)],
            "copies": {"m": 2},
            "hosts": {"m": ["t0", "t1"]},
            "capped": {},
        }

    asyncio.run(scenario())


def test_zero_is_a_valid_count_and_the_error_names_a_negative_one(pool):
    p = pool()
    with pytest.raises(InvalidRequest, match=r"replicas must be >= 0, got -1"):
        asyncio.run(p.executor.set_replicas("m", -1))
    asyncio.run(p.executor.set_replicas("m", 0))
    assert p.serving() == []
    assert p.executor.standby_ready("m") == 0 and asyncio.run(p.executor.heal()) is False


def test_rounds_go_on_while_no_chosen_triton_has_the_endpoint_yet(pool):
    """Placed, and on no Triton yet: the only chosen one is still unloading it; rounds follow until it loads."""
    p = pool(hosting=())
    p.store.place("m", 1, "t0")
    slow = _Unloading("t0", reads=3)
    p.tritons["t0"] = slow
    p.set.member("remote-0").client = slow
    p.executor.settle_s = 2.0

    async def scenario():
        await p.executor.set_replicas("m", 1)
        assert p.serving() == ["t0"] and slow.reads == 0

    asyncio.run(scenario())


def test_the_versions_ready_are_the_endpoints_own_and_ready_ones_and_only_its_hosts_unload_it(pool):
    """Versions read from the Tritons: only the endpoint's (another model's 7 is not), only READY (an unloading 5
    is not); a scale-down unloads it from the Tritons that had it, never from one that did not (t2)."""
    p = pool(hosting=("t0", "t1"), others=("t0",))
    p.tritons["t0"].loaded["busy"] = {7}

    class _Leaving(FakeBackend):
        async def repository_index(self, ready_only: bool = False) -> list:
            return [*await super().repository_index(ready_only), pb.RepositoryIndexResponse.ModelIndex(name="m", version="5", state="UNLOADING")]

    leaving = _Leaving("t2")
    p.tritons["t2"] = leaving
    p.set.member("remote-2").client = leaving

    async def scenario():
        await p.executor.set_replicas("m", 1)
        assert {(x.triton, x.version) for x in p.store.all() if x.removed_at is None} == {("t1", 1)}
        assert p.tritons["t0"].unloads == ["m"] and leaving.unloads == []

    asyncio.run(scenario())
