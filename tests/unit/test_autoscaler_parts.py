"""The autoscaler's pieces that need no Triton: the waker (one load for every held request, the
cold-start budget, a failed load retried by the next request) and the scaling config's store
(stored with the endpoint in the registry database, audited, there again after a restart)."""

from __future__ import annotations

import asyncio
import types

import pytest

from batching.autoscale_policy import WAKE, ScalingConfig, SeasonalProfile
from server.control.registry.artifacts import ArtifactStore
from server.control.scaling.autoscaler import Autoscaler, Waker
from server.control.registry.registry import Registry
from server.control.scaling.scaling_store import ScalingStore
from server.control.scaling.signals import Sample
from server.errors import BackendUnavailable, DeadlineExceeded, ModelNotReady


async def test_concurrent_first_requests_share_one_load():
    loads = []

    async def load():
        loads.append(1)
        await asyncio.sleep(0.05)

    waker = Waker("fraud", load, budget_s=5.0)
    await asyncio.gather(*(waker.wait(None) for _ in range(20)))
    assert loads == [1] and waker.loads == 1 and waker.waiting == 0


async def test_past_the_cold_start_budget_a_request_is_refused_with_a_retry_hint_and_the_load_goes_on():
    done = asyncio.Event()

    async def load():
        await asyncio.sleep(0.3)
        done.set()

    waker = Waker("fraud", load, budget_s=0.05, estimate_s=3.0)
    with pytest.raises(ModelNotReady) as refused:
        await waker.wait(None)
    assert "cold-start budget" in refused.value.message and refused.value.retry_after_s >= 1.0
    with pytest.raises(DeadlineExceeded):  # the caller's own deadline, shorter than the budget
        await Waker("x", load, budget_s=5.0).wait(0.01)
    await asyncio.wait_for(done.wait(), 2)  # the load was not cancelled with the request
    await waker.wait(None)  # and the next request finds it done


async def test_a_failed_load_fails_its_waiters_and_the_next_request_tries_again():
    attempts = []

    async def load():
        attempts.append(1)
        if len(attempts) == 1:
            raise BackendUnavailable("no replica is up", retry_after_s=1.0)

    waker = Waker("fraud", load, budget_s=5.0)
    with pytest.raises(ModelNotReady, match="could not be loaded"):
        await waker.wait(None)
    await waker.wait(None)
    assert len(attempts) == 2


def test_the_scaling_config_is_stored_audited_and_survives_a_restart(tmp_path):
    url = f"sqlite:///{tmp_path}/registry.db"
    registry = Registry(url, ArtifactStore(tmp_path / "a"))
    config = ScalingConfig(min_replicas=1, max_replicas=4, target=8, scale_to_zero_after_s=300).as_dict()
    ScalingStore(registry).put("fraud", config, "alice")
    ScalingStore(registry).put("fraud", {**config, "max_replicas": 6}, "bob")
    registry.close()
    again = Registry(url, ArtifactStore(tmp_path / "a"))
    try:
        stored = ScalingStore(again).all()
        assert stored == {"fraud": {**config, "max_replicas": 6}}
        assert ScalingConfig.from_dict(stored["fraud"]).max_replicas == 6
        audit = again.audit_log(target="fraud")
        assert [(e.action, e.actor) for e in audit] == [("autoscale", "bob"), ("autoscale", "alice")]
        assert '"max_replicas": 6' in audit[0].detail
    finally:
        again.close()


class _Unserved:
    """What the autoscaler sees of an endpoint configured before its deploy (nothing served yet)."""

    name = "local"
    samples: dict = {}

    def signature(self, name):
        return None

    async def prepare(self, name, replicas):
        return None

    def describe(self):
        return {"executor": self.name}

    async def sample(self):
        return self.samples

    def latest(self, name):
        return self.samples.get(name)

    def held(self, name):
        return 0


async def test_explain_stamps_signals_with_the_wall_clock_not_the_samplers_monotonic_one():
    # the sampler stamps a Sample with its monotonic clock (seconds since boot); `autoscale explain` prints
    # each signal's t as a time of day, so the autoscaler must keep its wall clock there (and the forecast's)
    fake, wall = _Unserved(), 1_790_000_000.0
    fake.samples = {"m": Sample(t=3777.0, inflight=2.0, qps=5.0, replicas=1)}
    scaler = Autoscaler(fake, None, fake, fake, clock=lambda: 3777.0, wall=lambda: wall)
    await scaler.configure("m", {"min_replicas": 1, "max_replicas": 2})
    await scaler.tick()
    explained = scaler.explain("m")
    assert explained["signals"][-1]["t"] == wall and explained["signals"][-1]["inflight"] == 2.0
    assert explained["forecast"][-1]["t"] == wall


class _Served(_Unserved):
    """A served endpoint on two replicas with ``ready`` loaded standbys waiting."""

    ready = 1

    def signature(self, name):
        return object()

    def replicas(self, name):
        return 2

    def standby_ready(self, name):
        return self.ready

    def held(self, name):
        return 0

    def latest(self, name):
        return self.samples.get(name)


async def test_the_policy_is_told_how_many_standbys_a_scale_up_could_take():
    fake = _Served()
    fake.samples = {"m": Sample(t=1.0, inflight=20.0, qps=5.0, replicas=2)}
    scaler = Autoscaler(fake, None, fake, fake, clock=lambda: 1.0, wall=lambda: 1_790_000_000.0)
    await scaler.configure("m", {"min_replicas": 1, "max_replicas": 4, "target": 10})
    await scaler.tick()
    assert scaler.explain("m")["decisions"][-1]["inputs"]["standby"] == 1
    fake.ready, fake.samples = 0, {"m": Sample(t=1.0, inflight=0.5, qps=5.0, replicas=2)}  # another load: a new hold is recorded
    await scaler.tick()
    assert scaler.explain("m")["decisions"][-1]["inputs"]["standby"] == 0


class _Sleeping(_Served):
    """An endpoint the autoscaler can put to sleep (unload, zero replicas) and load again."""

    ready = 0

    def __init__(self):
        self.loaded, self.count, self.loads = True, 2, []

    def signature(self, name):
        return object() if self.loaded else None

    def replicas(self, name):
        return self.count

    async def unload_model(self, name, missing_ok=False):
        self.loaded = False

    async def set_replicas(self, name, n):
        self.count = n

    async def prepare(self, name, replicas):
        self.count = replicas

    async def load_model(self, name):
        self.loads.append(name)
        self.loaded = True


async def test_a_forecast_wakes_an_endpoint_at_zero_before_any_request_and_explain_says_why():
    fake, wall, now = _Sleeping(), 1_790_000_000.0, [50.0]
    scaler = Autoscaler(fake, types.SimpleNamespace(wakers={}), fake, fake, clock=lambda: now[0], wall=lambda: wall, lead_s=1.0)
    await scaler.configure("m", {"min_replicas": 0, "max_replicas": 4, "target": 5, "signal": "qps", "scale_to_zero_after_s": 30})
    await scaler.sleep("m")
    assert (fake.loaded, fake.count, scaler.explain("m")["state"]) == (False, 0, "asleep")
    await scaler.tick()  # no history yet: no forecast, it sleeps on
    assert fake.loads == [] and scaler.explain("m")["decisions"][-1]["reason"] == "idle at zero replicas"
    profile = SeasonalProfile(period_s=2.0, slot_s=1.0)
    profile.seed([(0.5, 12.0), (1.5, 12.0)])  # the history says 12 requests/s at every moment
    scaler.endpoints["m"].profile = profile
    now[0] += 1.0
    await scaler.tick()  # no request and no load, only the forecast
    await scaler.endpoints["m"].busy
    explained = scaler.explain("m")
    woke = [d for d in explained["decisions"] if d.get("action") == WAKE]
    assert woke[0]["reason"] == "forecast 12 at zero replicas: wake to 3 ahead of its traffic" and woke[0]["inputs"]["load"] == 0.0
    assert woke[1]["reason"].startswith("loaded from zero in") and fake.loads == ["m"]
    assert explained["state"] == "serving" and explained["replicas"] >= 1


async def test_each_round_runs_the_executors_zone_check_in_the_background_one_at_a_time():
    fake, started, release = _Served(), [], asyncio.Event()

    async def heal():
        started.append(1)
        await release.wait()  # a slow one (loads in a surviving zone): the next round does not start another
        return True

    fake.heal = heal
    scaler = Autoscaler(fake, None, fake, fake, clock=lambda: 1.0, wall=lambda: 1_790_000_000.0)
    scaler._heal()
    scaler._heal()
    await asyncio.sleep(0)
    assert started == [1]
    release.set()
    assert await scaler._healing is True
    scaler._heal()
    await scaler._healing
    assert started == [1, 1]
    await scaler.stop()
