"""The deployer's planning and state machine, with the DataPlane (Triton) replaced by a fake."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from model_repository.config_writer import read_config
from server.control.registry.artifacts import ArtifactStore
from server.control.rollout.deployer import Deployer, build_config, check_warmup, same_tensors, serving_from, warmup_request
from server.errors import BackendUnavailable, Conflict, DeployFailed, InferplaneError
from server.protogen.inference import grpc_service_pb2 as pb
from server.control.registry.registry import Registry
from tests.backend_fake import FakeBackend
from tests.unit.test_registry import SIGNATURE, lightgbm


class FakeSignature:
    def __init__(self, versions, max_batch_size=64):
        self.versions = frozenset(str(v) for v in versions)
        self.max_batch_size = max_batch_size


class FakeDataPlane:
    """Loads what config.pbtxt lists; a version whose directory holds FAIL refuses to load."""

    def __init__(self, repository):
        self.repository = repository
        self.models, self.routes, self.loaded = {}, {}, set()
        self.composites = SimpleNamespace(serves=lambda name: False, plans={})  # no composite endpoints here
        self.triton = FakeBackend()
        self.loads = 0
        self.generated = []  # (model, version) of each LLM warm-up generation

    async def load_model(self, name):
        self.loads += 1
        versions = list(read_config(self.repository / name).version_policy.specific.versions)
        if any((self.repository / name / str(v) / "SLOW").exists() for v in versions):
            await asyncio.sleep(60)
        if any((self.repository / name / str(v) / "FAIL").exists() for v in versions):
            raise InferplaneError(f"load failed for model '{name}': adapter crashed")
        self.loaded.add(name)
        self.models[name] = FakeSignature(versions)
        self.triton.loaded[name] = set(versions)
        return self.models[name]

    async def refresh(self, name):
        return self.models[name]

    # the rest of DataPlane's surface the deployer uses
    def ready_versions(self, name):
        return self.models[name].versions if name in self.models else frozenset()

    def signature(self, name):
        return self.models.get(name)

    def live_version(self, name):
        return self.routes.get(name)

    def set_live(self, name, version):
        self.routes[name] = version

    def is_loaded(self, name):
        return name in self.loaded

    async def unload_model(self, name, *, missing_ok=False):
        self.loaded.discard(name)
        self.models.pop(name, None)
        await self.triton.unload_model(name)

    async def backend_infer(self, raw, timeout=None):
        return await self.triton.infer_raw(raw, timeout)

    async def backend_generate(self, name, version, prompt, max_tokens, timeout=None):
        self.generated.append((name, version))
        if (self.repository / name / version / "FAIL_WARMUP").exists():
            raise InferplaneError("the engine failed the warm-up")
        return "ok"


@pytest.fixture
def setup(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "store"))
    for rounds in (2, 3, 4):
        registry.register("m", lightgbm(rounds), signature=SIGNATURE)
    dp = FakeDataPlane(tmp_path / "repo")
    yield registry, dp, Deployer(registry, dp, tmp_path / "repo", grace_s=3600)
    registry.close()


async def test_deploy_rollback_and_grace_expiry(setup, tmp_path):
    registry, dp, deployer = setup
    r1 = await deployer.deploy("m:1", {"instances": 2, "max_batch": 8}, actor="alice")
    assert dp.routes["m"] == "1" and r1.reloaded and r1.previous is None
    version_dir = tmp_path / "repo" / "m" / "1"
    assert {p.name for p in version_dir.iterdir()} == {"model.py", "_adapter.py", "_common.py", "model.txt", "inferplane_version.json"}
    assert dp.triton.infers[-1].model_version == "1"  # warmed up, pinned to the new version

    r2 = await deployer.deploy("m:2", actor="alice")
    config = read_config(tmp_path / "repo" / "m")
    assert list(config.version_policy.specific.versions) == [1, 2]  # the old version stays loaded
    assert config.instance_group[0].count == 2 and config.max_batch_size == 8  # serving options are kept
    assert dp.routes["m"] == "2" and r2.previous == 1

    loads = dp.loads
    ticks = iter([10.0, 10.004])  # the deployer's clock at the rollback's start and at the switch
    deployer.clock = lambda: next(ticks)
    back = await deployer.rollback("m", actor="bob")
    deployer.clock = time.perf_counter
    assert dp.routes["m"] == "1" and not back.reloaded and dp.loads == loads  # no reload: only traffic moved
    assert back.switch_ms == pytest.approx(4.0) and back.total_ms == back.switch_ms  # reported from its clock, in ms

    await deployer.expire("m")  # the grace period ends: only the live version stays
    assert list(read_config(tmp_path / "repo" / "m").version_policy.specific.versions) == [1]
    assert not (tmp_path / "repo" / "m" / "2").exists()
    with pytest.raises(Conflict, match="no previous version"):
        await deployer.rollback("m")
    actions = [(e.action, e.target, e.outcome) for e in registry.audit_log(3)]
    assert actions == [("rollback", "m", "failed"), ("rollback", "m:1", "ok"), ("deploy", "m:2", "ok")]
    await deployer.stop()


async def test_the_versions_loaded_become_every_tritons_placements(setup, tmp_path):
    """What the deployer loads is what the reconciler places on the other Tritons; expiry removes it."""
    from server.control.scaling.placement_store import PlacementStore

    registry, dp, deployer = setup
    deployer.placements = store = PlacementStore(registry.engine)
    live = lambda: sorted((p.version, p.triton) for p in store.all() if p.removed_at is None)  # noqa: E731
    await deployer.deploy("m:1")
    await deployer.deploy("m:2")
    assert live() == [(1, "*"), (2, "*")]
    await deployer.expire("m")
    assert live() == [(2, "*")] and [p.version for p in store.all() if p.removed_at is not None] == [1]
    await deployer.stop()


async def test_a_failed_load_puts_the_placements_back(setup, tmp_path, monkeypatch):
    """The placements go out before the deployer's own load (the other Tritons load meanwhile); a load
    that fails takes them back, so the reconciler unloads the failed version everywhere."""
    from server.control.scaling.placement_store import PlacementStore

    registry, dp, deployer = setup
    deployer.placements = store = PlacementStore(registry.engine)
    await deployer.deploy("m:1")
    seen = []

    async def failing_load(name):
        seen.append(sorted(p.version for p in store.all() if p.removed_at is None))
        raise BackendUnavailable("triton is restarting")

    monkeypatch.setattr(dp, "load_model", failing_load)
    with pytest.raises(DeployFailed):
        await deployer.deploy("m:2")
    assert seen[0] == [1, 2]  # published before the load
    assert sorted(p.version for p in store.all() if p.removed_at is None) == [1]
    await deployer.stop()


async def test_a_failed_load_leaves_the_live_version_serving(setup, tmp_path, monkeypatch):
    registry, dp, deployer = setup
    await deployer.deploy("m:1")
    real = deployer._materialize

    def crashing(record, version_dir):
        real(record, version_dir)
        (version_dir / "FAIL").write_text("")

    monkeypatch.setattr(deployer, "_materialize", crashing)
    with pytest.raises(DeployFailed, match="adapter crashed; m:1 keeps serving"):
        await deployer.deploy("m:3")
    assert dp.routes["m"] == "1"
    assert list(read_config(tmp_path / "repo" / "m").version_policy.specific.versions) == [1]
    assert not (tmp_path / "repo" / "m" / "3").exists()
    assert registry.endpoint("m").live == 1
    await deployer.stop()


async def test_a_first_deploy_that_fails_leaves_nothing_behind(setup, tmp_path, monkeypatch):
    _, dp, deployer = setup
    monkeypatch.setattr(deployer, "_materialize", lambda record, d: (d.mkdir(parents=True), (d / "FAIL").write_text("")))
    with pytest.raises(DeployFailed, match="nothing was serving"):
        await deployer.deploy("m:1")
    assert not (tmp_path / "repo" / "m").exists() and "m" not in dp.routes and dp.triton.unloads == ["m"]


async def test_a_tampered_blob_is_refused_before_triton(setup, tmp_path):
    registry, dp, deployer = setup
    record = registry.get("m", 2)
    blob = tmp_path / "store" / "sha256" / record.sha256[:2] / record.sha256
    blob.write_bytes(blob.read_bytes().replace(b"tree", b"TREE", 1))
    with pytest.raises(DeployFailed, match="tampered"):
        await deployer.deploy("m:2")
    assert dp.loads == 0 and not (tmp_path / "repo" / "m").exists()


async def test_endpoints_are_independent(setup):
    registry, dp, deployer = setup
    registry.register("other", lightgbm(5), signature=SIGNATURE)
    await asyncio.gather(deployer.deploy("m:1"), deployer.deploy("other:1"))
    assert dp.routes == {"m": "1", "other": "1"}


def test_planning_helpers():
    serving = serving_from({"max_batch": 8, "instances": 3, "cache": True})
    assert serving.preferred_batch_sizes == () and serving.instances == 3 and serving.response_cache
    config = build_config("m", SIGNATURE, serving, [3, 1])
    assert list(config.version_policy.specific.versions) == [1, 3] and config.input[0].dims == [3]
    assert serving_from(None, {"max_batch": 32}).max_batch_size == 32
    assert same_tensors(SIGNATURE, {**SIGNATURE, "max_batch_size": 4})
    assert not same_tensors(SIGNATURE, {**SIGNATURE, "inputs": [{"name": "features", "datatype": "FP32", "dims": [4]}]})

    rows = np.arange(30, dtype=np.float32).reshape(10, 3)
    request = warmup_request("m", 2, SIGNATURE, {"features": rows}, 4)
    assert request.model_version == "2" and list(request.inputs[0].shape) == [4, 3]
    assert np.frombuffer(request.raw_input_contents[0], np.float32).tolist() == rows[:4].ravel().tolist()
    zeros = warmup_request("m", 2, SIGNATURE, {}, 4)
    assert list(zeros.inputs[0].shape) == [1, 3]

    expected = np.ones((4, 1), np.float32)
    response = pb.ModelInferResponse()
    response.outputs.add(name="prediction", datatype="FP32", shape=[4, 1])
    response.raw_output_contents.append(expected.tobytes())
    assert check_warmup(response, SIGNATURE, {"expected": expected}, 4) == ""
    assert "differs" in check_warmup(response, SIGNATURE, {"expected": expected * 2}, 4)


async def test_a_restarted_frontend_routes_to_the_live_version_again(setup, tmp_path):
    registry, dp, deployer = setup
    await deployer.deploy("m:1")
    await deployer.deploy("m:2")
    await deployer.rollback("m")
    await deployer.stop()
    fresh = FakeDataPlane(tmp_path / "repo")  # what Frontend._load_models leaves: every listed version loaded
    await fresh.load_model("m")
    restarted = Deployer(registry, fresh, tmp_path / "repo", grace_s=3600)
    await restarted.start()
    assert fresh.routes == {"m": "1"} and restarted._st("m").loaded == {1, 2}
    await restarted.stop()


class StandbyDataPlane(FakeDataPlane):
    """A standby's model table: the versions read when the desired state last named them; a refresh reads Triton's."""

    async def refresh(self, name):
        self.models[name] = FakeSignature(read_config(self.repository / name).version_policy.specific.versions)
        return self.models[name]


async def test_a_new_leader_routes_to_a_deploy_its_predecessor_recorded_but_never_published(setup, tmp_path):
    """The leader recorded m:2 live and was killed before publishing it: the standby still routes m:1 and knows only
    m:1 ready. Taking the lead, it reads Triton again and routes m:2, as the registry says (else the two disagree
    for good: a half-applied deploy)."""
    registry, dp, deployer = setup
    await deployer.deploy("m:1")
    await deployer.deploy("m:2")  # the registry says m:2; the kill took the publication
    standby = StandbyDataPlane(tmp_path / "repo")
    standby.loaded, standby.models, standby.routes = {"m"}, {"m": FakeSignature([1])}, {"m": "1"}
    leader = Deployer(registry, standby, tmp_path / "repo", grace_s=3600)
    await leader.start()
    assert standby.routes == {"m": "2"} and standby.ready_versions("m") == {"1", "2"}
    await leader.stop()
    await deployer.stop()


async def test_a_readiness_timeout_restores_the_config_and_reports_it(setup, tmp_path, monkeypatch):
    _, dp, deployer = setup
    await deployer.deploy("m:1")
    deployer.load_timeout_s = 0.2
    real = deployer._materialize
    monkeypatch.setattr(deployer, "_materialize", lambda record, d: (real(record, d), (d / "SLOW").write_text("")))
    loads = dp.loads
    with pytest.raises(DeployFailed, match="readiness timeout after 0.2s; m:1 keeps serving"):
        await deployer.deploy("m:2")
    assert dp.loads == loads + 2  # the timed-out load, then one with the restored config that supersedes it
    assert list(read_config(tmp_path / "repo" / "m").version_policy.specific.versions) == [1]
    assert dp.routes["m"] == "1" and not (tmp_path / "repo" / "m" / "2").exists()
