"""The Triton reconciler's pure planning (desired placements and observed index to actions), the
placement store on SQLite and PostgreSQL, and the loop against an in-memory Triton stand-in (the
real Tritons: tests/integration/test_reconciler_tritons.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from server import migrations
from server.control.scaling.placement_store import EVERY_TRITON, Placement, PlacementStore
from server.control.scaling.executors import ModelGroups
from server.control.service.reconciler import (
    LOAD, LOAD_CONCURRENCY, UNLOAD, Action, StaticSource, TritonReconciler, converger, desired_on, for_groups, from_settings, load_config,
    observed_versions, plan_triton,
)
from server.db import make_engine
from server.errors import BackendUnavailable
from server.protogen.inference import model_config_pb2
from server.settings import Settings
from tests.backend_fake import FakeBackend
from tests.unit.test_registry import db_url  # noqa: F401 - a fixture (SQLite and PostgreSQL)


def entry(name, version, state="READY"):
    return SimpleNamespace(name=name, version=str(version), state=state)


def test_desired_keeps_a_removed_version_through_its_drain_only():
    placements = [Placement("m", 1, EVERY_TRITON, None, 2, removed_at=100.0), Placement("m", 2, EVERY_TRITON, None, 2, None)]
    assert desired_on(placements, "t", now=110.0, drain_s=30.0)[0] == {"m": {1, 2}}
    assert desired_on(placements, "t", now=110.0, drain_s=30.0)[3] == {"m": {1}}
    assert desired_on(placements, "t", now=130.0, drain_s=30.0)[0] == {"m": {2}}


def test_desired_applies_a_placement_to_its_triton_or_to_every_one():
    placements = [Placement("a", 1, "t1", None, 1, None), Placement("b", 1, EVERY_TRITON, None, 1, None)]
    assert desired_on(placements, "t1", 0.0, 0.0)[0] == {"a": {1}, "b": {1}}
    assert desired_on(placements, "t2", 0.0, 0.0)[0] == {"b": {1}}
    assert desired_on(placements, "t2", 0.0, 0.0)[2] == {"b"}


def test_observed_reads_ready_versions_and_busy_models():
    ready, busy = observed_versions([entry("m", 1), entry("m", 2), entry("x", "", "UNAVAILABLE"), entry("y", 1, "LOADING")])
    assert ready == {"m": {1, 2}} and busy == {"y"}


def test_plan_loads_what_differs_and_unloads_what_no_longer_is_desired():
    actions = plan_triton({"a": {2}, "b": {1}}, {"a": '{"x": 1}'}, {"a", "b", "c"}, {"a": {1}, "b": {1}, "c": {3}, "other": {1}})
    assert actions == [Action(LOAD, "a", (2,), '{"x": 1}'), Action(UNLOAD, "c")]  # b in step; other: not ours


def test_plan_keeps_a_draining_version_where_it_is_loaded_and_never_loads_it_afresh():
    assert plan_triton({"m": {1, 2}}, {}, {"m"}, {"m": {1, 2}}, draining={"m": {1}}) == []
    assert plan_triton({"m": {1, 2}}, {}, {"m"}, {}, draining={"m": {1}}) == [Action(LOAD, "m", (2,))]  # a returning Triton
    assert plan_triton({"m": {1}}, {}, {"m"}, {}, draining={"m": {1}}) == []  # only a draining one: nothing to load


def test_plan_prunes_unnamed_models_only_when_asked_and_waits_for_busy_ones():
    assert plan_triton({}, {}, set(), {"other": {1}}, prune=True) == [Action(UNLOAD, "other")]
    assert plan_triton({"a": {1}}, {}, {"a"}, {}, busy={"a"}) == []


def test_load_config_names_exactly_the_desired_versions():
    base = model_config_pb2.ModelConfig(name="m", backend="python")
    base.version_policy.latest.num_versions = 1
    doc = json.loads(load_config(base, [3, 1]))
    assert [int(v) for v in doc["versionPolicy"]["specific"]["versions"]] == [1, 3] and doc["name"] == "m"  # int64: JSON strings


def test_store_places_removes_and_revives_with_generations(db_url):
    engine = make_engine(db_url)
    clock = iter(range(100, 200)).__next__
    try:
        migrations.upgrade(engine)
        store = PlacementStore(engine, clock=lambda: float(clock()))
        assert store.place("m", 1) == 1
        assert store.place("m", 2, config='{"name": "m"}') == 2
        assert store.remove("m", 1) == 1 and store.remove("m", 1) == 0
        rows = {(p.version, p.removed_at is not None, p.generation) for p in store.all()}
        assert rows == {(1, True, 3), (2, False, 2)}
        store.place("m", 1)
        assert all(p.removed_at is None for p in store.all())
        store.remove("m")
        assert store.forget_removed(before=1e9) == 2 and store.all() == []
        with pytest.raises(ValueError):
            store.place("m", 0)
    finally:
        engine.dispose()


def test_set_hosts_places_by_name_and_leaves_a_removed_row_on_every_other_triton(db_url):
    """The remote executor's placements: the endpoint on ``a`` alone, and every other Triton (the ``*``
    placement's too) names it removed, so the reconciler unloads it there, whoever loaded it."""
    engine = make_engine(db_url)
    now = [100.0]
    try:
        migrations.upgrade(engine)
        store = PlacementStore(engine, clock=lambda: now[0])
        store.place("m", 1)  # the deployer's: every Triton
        store.set_hosts("m", [1], ["a"], ["a", "b", "c"])
        assert {(p.triton, p.version) for p in store.all() if p.removed_at is None} == {("a", 1)} and store.hosts("m") == {"a"}
        now[0] += 31.0  # past the drain
        for triton in ("b", "c"):
            desired, configs, named, draining = desired_on(store.all(), triton, now[0], 30.0)
            assert plan_triton(desired, configs, named, {"m": {1}}, draining=draining) == [Action(UNLOAD, "m")]
        store.place_versions("m", [2])  # a deploy: where it is placed by name
        assert {(p.triton, p.version) for p in store.all() if p.removed_at is None} == {("a", 2)}
        store.set_hosts("m", [2], ["a", "b"], ["a", "b", "c"])
        assert store.hosts("m") == {"a", "b"}
        store.set_hosts("m", [2], [], ["a", "b", "c"])  # to zero
        assert store.hosts("m") == set() and all(p.removed_at is not None for p in store.all())
        store.place_versions("other", [1])  # placed nowhere by name: every Triton
        assert [(p.model, p.triton) for p in store.all() if p.model == "other"] == [("other", EVERY_TRITON)]
    finally:
        engine.dispose()


def test_loop_converges_a_late_and_a_returning_triton_and_drains_removed_versions(tmp_path):
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')
    engine = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    migrations.upgrade(engine)
    now = [1000.0]
    store = PlacementStore(engine, clock=lambda: now[0])
    tritons = {"a": FakeBackend(), "b": FakeBackend(), "c": FakeBackend()}
    source = StaticSource(["a", "b"])
    rec = TritonReconciler(store, source, repository=tmp_path / "repo", drain_s=30.0, client_factory=tritons.__getitem__, clock=lambda: now[0])

    async def scenario():
        store.place("m", 1)
        await rec.reconcile_once()
        assert tritons["a"].loaded == tritons["b"].loaded == {"m": {1}}
        assert tritons["a"].configs[0]["name"] == "m"  # the repository's config.pbtxt, versions set
        source.add("c")  # joins late
        tritons["b"].down = True  # down during the change
        store.place("m", 2)
        store.remove("m", 1)
        await rec.reconcile_once()
        assert tritons["a"].loaded == {"m": {1, 2}}  # 1 still draining where it was loaded
        assert tritons["c"].loaded == {"m": {2}}  # never loaded afresh
        assert tritons["b"].loaded == {"m": {1}} and rec.state["b"].error.startswith("unreachable")
        now[0] += 31.0  # past the drain
        tritons["b"].down = False
        await rec.reconcile_once()
        assert {t: x.loaded for t, x in tritons.items()} == {"a": {"m": {2}}, "b": {"m": {2}}, "c": {"m": {2}}}
        store.remove("m")
        now[0] += 31.0
        await rec.reconcile_once()
        assert all(x.loaded == {} for x in tritons.values())
        assert await rec.reconcile_once() == {"a": [], "b": [], "c": []}  # level-triggered: nothing left to do

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()


class _SlowLoads(FakeBackend):
    """Loads that wait for each other: the most that were in flight at once is recorded."""

    def __init__(self, release_at: int):
        super().__init__()
        self.in_flight = self.most = 0
        self.release_at = release_at
        self.all_in = asyncio.Event()

    async def load_model(self, name: str, timeout: float = 300.0, *, config: str | None = None) -> None:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.release_at:
            self.all_in.set()
        await self.all_in.wait()  # a one-at-a-time loop would wait here forever (bounded by wait_for below)
        await asyncio.sleep(0)
        self.in_flight -= 1
        await super().load_model(name, timeout, config=config)


def test_a_late_triton_loads_its_models_concurrently_within_the_bound(tmp_path):
    bound = 3  # explicit: the default follows this host's cores (1 on 2 cores)
    names = [f"m{i}" for i in range(bound + 2)]
    for name in names:
        (tmp_path / "repo" / name).mkdir(parents=True)
        (tmp_path / "repo" / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n')
    engine = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    migrations.upgrade(engine)
    store = PlacementStore(engine)
    triton = _SlowLoads(release_at=bound)
    rec = TritonReconciler(store, StaticSource(["late"]), repository=tmp_path / "repo", client_factory=lambda target: triton, load_concurrency=bound)

    async def scenario():
        for name in names:
            store.place(name, 1)
        applied = (await asyncio.wait_for(rec.reconcile_once(), 30))["late"]
        assert sorted(a.model for a in applied) == names
        assert triton.most == bound  # loads overlap, never more than the bound
        assert triton.loaded == {name: {1} for name in names}

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()


def test_the_load_concurrency_is_a_setting_not_the_leaders_cores(tmp_path, monkeypatch):
    """INFERPLANE_LOAD_CONCURRENCY bounds every reconciler from_settings builds (a group's too); unset: the host's default."""
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"cpu": {"service": "triton-cpu", "models": ["*"]}, "gpu": {"service": "triton-gpu", "models": ["llm"]}}))
    monkeypatch.setenv("INFERPLANE_LOAD_CONCURRENCY", "7")
    assert Settings().load_concurrency == 7
    assert [r.load_concurrency for r in from_settings(Settings(triton_url="a:8001,b:8001"), store=None)] == [7]
    assert [r.load_concurrency for r in from_settings(Settings(model_groups_file=groups), store=None)] == [7, 7]
    monkeypatch.delenv("INFERPLANE_LOAD_CONCURRENCY")
    assert [r.load_concurrency for r in from_settings(Settings(triton_url="a:8001"), store=None)] == [LOAD_CONCURRENCY]
    with pytest.raises(ValueError):
        Settings(load_concurrency=0)


def test_run_reconciles_until_stopped(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\n')
    engine = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    migrations.upgrade(engine)
    store = PlacementStore(engine)
    store.place("m", 1)
    triton = FakeBackend()
    rec = TritonReconciler(store, StaticSource(["a"]), repository=tmp_path, client_factory=lambda t: triton)

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(rec.run(stop, interval_s=0.01))
        while not triton.loaded:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(scenario())
        assert triton.loaded == {"m": {1}}
    finally:
        engine.dispose()


def _placed(tmp_path, versions: dict[str, int]):
    """A repository folder (each model's config.pbtxt) and a SQLite placement store with ``versions`` placed on every Triton."""
    engine = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    migrations.upgrade(engine)
    store = PlacementStore(engine)
    for name, version in versions.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"\n')
        store.place(name, version)
    return engine, store


def test_one_reconciler_per_group_loads_a_star_placement_only_on_the_group_serving_the_model(tmp_path):
    """The GPU overlay's groups: the general (``*``) group's Tritons never get a GPU group's model."""
    groups = ModelGroups({"general": {"service": "triton-general", "models": ["*"]}, "gpu-01": {"service": "triton-gpu-01", "models": ["resnet50_trt"]}})
    engine, store = _placed(tmp_path, {"trees": 1, "resnet50_trt": 1})
    tritons = {"10.0.0.1:8001": FakeBackend(), "10.0.0.2:8001": FakeBackend()}
    addresses = {"triton-general": ["10.0.0.1"], "triton-gpu-01": ["10.0.0.2"]}
    reconcilers = for_groups(groups, store, repository=tmp_path, client_factory=tritons.__getitem__)
    for rec in reconcilers:
        rec.source.resolver = addresses.__getitem__

    async def scenario():
        for rec in reconcilers:
            await rec.reconcile_once()

    try:
        asyncio.run(scenario())
        assert tritons["10.0.0.1:8001"].loaded == {"trees": {1}} and tritons["10.0.0.2:8001"].loaded == {"resnet50_trt": {1}}
    finally:
        engine.dispose()


def test_from_settings_builds_one_reconciler_per_group_else_one_over_the_triton_urls(tmp_path):
    from server.control.service.reconciler import from_settings
    from server.settings import Settings

    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"general": {"service": "triton-general", "models": ["*"]}, "gpu": {"service": "triton-gpu", "models": ["big"]}}))
    store = object()
    by_group = from_settings(Settings(model_groups_file=groups, model_repository_url="s3://b/repo"), store)
    assert [r.source.name for r in by_group] == ["triton-general", "triton-gpu"] and by_group[0].repository == "s3://b/repo"
    assert [r.owns("big") for r in by_group] == [False, True] and [r.owns("trees") for r in by_group] == [True, False]
    (remote,) = from_settings(Settings(triton_url="10.0.0.1:8001,10.0.0.2:8001", reconcile_drain_s=5), store)
    assert asyncio.run(remote.source.targets()) == {"10.0.0.1:8001", "10.0.0.2:8001"} and remote.drain_s == 5
    assert from_settings(Settings(), store) == []  # the embedded Triton is the deployer's own


def test_cli_reconcile_once_names_an_unreachable_triton_and_migrates_the_database(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from server.cli.main import app
    from server.runtime.supervisor import free_port

    monkeypatch.setenv("INFERPLANE_DATABASE_URL", f"sqlite:///{tmp_path}/cli.db")
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(app, ["control", "reconcile", "--triton-url", target, "--repository", str(tmp_path), "--once"])
    assert result.exit_code == 0, result.output
    assert f"{target}: in step (unreachable:" in result.output
    engine = make_engine(f"sqlite:///{tmp_path}/cli.db")
    try:
        assert migrations.current(engine) == migrations.head()
    finally:
        engine.dispose()
    monkeypatch.delenv("INFERPLANE_TRITON_URL", raising=False)
    monkeypatch.delenv("INFERPLANE_MODEL_GROUPS_FILE", raising=False)
    missing = CliRunner().invoke(app, ["control", "reconcile", "--once"])
    assert missing.exit_code == 2 and "name the Tritons" in missing.output
    # --triton-service takes the same settings (drain, load concurrency) as from_settings: a name that resolves to none
    service = CliRunner().invoke(app, ["control", "reconcile", "--triton-service", "nothing.invalid:8001", "--repository", str(tmp_path), "--once"])
    assert service.exit_code == 0 and service.output == "", service.output


def test_a_spot_group_loads_what_the_on_demand_group_it_mirrors_loads(tmp_path):
    """The base's spot pool (``*``, capacity spot): the general group's models, never a GPU group's."""
    groups = ModelGroups({
        "general": {"service": "triton-general", "models": ["*"]},
        "general-spot": {"service": "triton-general-spot", "models": ["*"], "capacity": "spot"},
        "gpu-01": {"service": "triton-gpu-01", "models": ["resnet50_trt"]},
    })  # fmt: skip
    engine, store = _placed(tmp_path, {"trees": 1, "resnet50_trt": 1})
    tritons = {"10.0.0.1:8001": FakeBackend(), "10.0.0.2:8001": FakeBackend(), "10.0.0.3:8001": FakeBackend()}
    addresses = {"triton-general": ["10.0.0.1"], "triton-gpu-01": ["10.0.0.2"], "triton-general-spot": ["10.0.0.3"]}
    reconcilers = for_groups(groups, store, repository=tmp_path, client_factory=tritons.__getitem__)
    for rec in reconcilers:
        rec.source.resolver = addresses.__getitem__

    async def scenario():
        for rec in reconcilers:
            await rec.reconcile_once()

    try:
        asyncio.run(scenario())
        assert tritons["10.0.0.3:8001"].loaded == {"trees": {1}} == tritons["10.0.0.1:8001"].loaded
        assert tritons["10.0.0.2:8001"].loaded == {"resnet50_trt": {1}}
    finally:
        engine.dispose()


def test_converge_loads_a_groups_placements_on_a_triton_outside_its_source_and_refuses_a_half_load(tmp_path):
    """A warm pod a scale-up takes (server.control.scaling.kube_warm_pool): the group's reconciler loads there
    what the group's Tritons have, before the pod joins the group's Service; unreachable or a failed load raises."""
    groups = ModelGroups({"general": {"service": "triton-general", "models": ["*"]}, "gpu-01": {"service": "triton-gpu-01", "models": ["resnet50_trt"]}})
    engine, store = _placed(tmp_path, {"trees": 2, "resnet50_trt": 1})
    tritons = {"10.0.0.1:8001": FakeBackend(), "10.0.0.9:8001": FakeBackend(), "10.0.0.8:8001": FakeBackend()}
    reconcilers = for_groups(groups, store, repository=tmp_path, client_factory=tritons.__getitem__)
    assert [r.group for r in reconcilers] == ["general", "gpu-01"]
    for rec in reconcilers:
        rec.source.resolver = {"triton-general": ["10.0.0.1"], "triton-gpu-01": []}.__getitem__
    converge = converger(reconcilers)

    async def scenario():
        assert [str(a) for a in await converge("general", "10.0.0.9:8001")] == ["load trees versions [2]"]
        assert tritons["10.0.0.1:8001"].loaded == {}  # only the taken pod: no round of the group's Service
        tritons["10.0.0.8:8001"].down = True
        with pytest.raises(BackendUnavailable, match="10.0.0.8:8001: unreachable"):
            await converge("general", "10.0.0.8:8001")
        tritons["10.0.0.8:8001"].down = False
        store.place("missing", 1)  # no config.pbtxt in the repository: its load fails
        with pytest.raises(BackendUnavailable, match="load missing"):
            await converge("general", "10.0.0.8:8001")

    try:
        asyncio.run(scenario())
        assert tritons["10.0.0.9:8001"].loaded == {"trees": {2}}  # never the GPU group's model
        assert tritons["10.0.0.8:8001"].loaded == {"trees": {2}}
    finally:
        engine.dispose()
