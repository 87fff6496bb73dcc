"""Load signals across processes (issue 27) on real SQLite and PostgreSQL: each serving process reports its
samples, the leader's sampler sums the other processes' fresh reports into what its autoscaler reads
(not into its own gauges), and a scaled-to-zero endpoint in the desired state holds the requests of a
frontend that does not lead until the leader has loaded it again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from sqlalchemy import func, select

from server.control.scaling.autoscaler import Waker
from server.control.service.desired_state import DesiredStateStore
from server.control.scaling.signal_reports import SignalPeers, SignalReporter, signal_reports
from server.control.scaling.signals import Sample, SignalSampler
from server.control.service.state_watch import StatePublisher, StateWatcher
from server.dataplane.fleet_hooks import FleetHooks
from server.dataplane.metrics import Metrics
from server.dataplane.routing import Router
from server.errors import ModelNotReady
from tests.unit.test_desired_state import _FakeDataPlane, db_url, engine  # noqa: F401 - fixtures


class _Queue:
    """What the sampler reads of a model's fair queue."""

    def __init__(self, inflight: int, size: int, admitted: int):
        self.inflight, self.size, self.admitted = inflight, size, admitted
        self.service_s = None
        self.policy = SimpleNamespace(slots=1)


class _Sampler:
    """A process's own sampler as its reporter reads it."""

    def __init__(self, latest: dict[str, Sample], held: dict[str, int]):
        self._latest, self._held = latest, held

    def models(self):
        return sorted(set(self._latest) | set(self._held))

    def latest(self, model):
        return self._latest.get(model)

    def own_held(self, model):
        return self._held.get(model, 0)


def test_the_leader_reads_the_fresh_reports_of_every_other_process_summed(engine):
    now = [1000.0]
    for name, inflight, held in (("worker-1", 3.0, 0), ("worker-2", 4.0, 2), ("leader", 50.0, 0)):
        sampler = _Sampler({"m": Sample(t=1.0, inflight=inflight, queue=1.0, qps=10.0)}, {"m": held})
        SignalReporter(sampler, engine, name, clock=lambda: now[0]).write(SignalReporter(sampler, engine, name, clock=lambda: now[0]).collect())
    peers = SignalPeers(engine, own="leader", stale_s=3.0, clock=lambda: now[0])
    load = peers.read()["m"]
    assert (load.inflight, load.held, load.qps, load.reporters) == (7.0, 2.0, 20.0, 2)  # its own rows are not a peer's
    assert load.queue == 1.0 + 2.0  # a report's queue counts its held requests
    reporter = SignalReporter(_Sampler({"m": Sample(t=2.0, inflight=1.0)}, {}), engine, "worker-1", clock=lambda: now[0])
    reporter.write(reporter.collect())  # replaces worker-1's rows
    assert peers.read()["m"].inflight == 5.0
    now[0] += 5.0  # nobody reported since: stale, not load
    assert peers.read() == {}
    now[0] += 60.0  # past keep_s: the rows of processes gone are deleted
    peers.read()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(signal_reports)).scalar_one() == 0


def test_the_leaders_sampler_adds_the_peers_to_what_the_autoscaler_reads_not_to_its_gauges(engine):
    now = [1000.0]
    worker = _Sampler({"m": Sample(t=1.0, inflight=6.0, queue=2.0, qps=30.0)}, {"m": 2})
    reporter = SignalReporter(worker, engine, "worker-1", clock=lambda: now[0])
    reporter.write(reporter.collect())
    metrics = Metrics()
    hooks = FleetHooks()
    hooks.queues["m"] = _Queue(inflight=1, size=0, admitted=0)
    sampler = SignalSampler(hooks, None, registry=metrics.registry)
    sampler.peers = SignalPeers(engine, own="leader", clock=lambda: now[0])
    sample = asyncio.run(sampler.sample())["m"]
    assert (sample.inflight, sample.queue) == (7.0, 2.0) and sampler.latest("m") is sample
    assert sampler.held("m") == 2 and sampler.own_held("m") == 0  # the worker's held request is the leader's demand
    assert sample.signal("inflight") == 9.0
    assert metrics.registry.get_sample_value("inferplane_autoscale_signal", {"model": "m", "signal": "inflight"}) == 1.0  # its own
    reporter.write([])  # the worker serves nothing now
    assert asyncio.run(sampler.sample())["m"].inflight == 1.0


class _TableDataPlane(_FakeDataPlane):
    """The fake data plane with a model table: released models have no signature until adopted again."""

    def __init__(self, ready, triton):
        super().__init__(ready, triton)
        self.released: list[str] = []

    def signature(self, name):
        return object() if name in self._ready else None

    def release(self, name):
        self.released.append(name)
        self._ready.pop(name, None)


def test_a_frontend_holds_a_scaled_to_zero_endpoint_until_the_leader_loads_it_again(engine):
    store = DesiredStateStore(engine)
    router = Router({"m": "1"})
    leader_wakers: dict = {}
    publisher = StatePublisher(router, store, asleep=lambda: {n: w.budget_s for n, w in leader_wakers.items()})

    async def scenario():
        assert await publisher.publish_once() == 1
        dp = _TableDataPlane({"m": {"1"}}, {"m": {"1"}})
        wakers: dict = {}
        asked = []
        watcher = StateWatcher(dp, store, str(engine.url), poll_s=0.01, wakers=wakers, on_held=lambda: asked.append(1))
        await watcher.sync()
        assert dp.router.routes == {"m": "1"} and not wakers
        leader_wakers["m"] = Waker("m", asyncio.sleep, 30.0)  # the leader's autoscaler scaled it to zero
        assert await publisher.publish_once() == 1 and store.all()["m"]["wake_budget_s"] == 30.0
        await watcher.sync()
        assert dp.released == ["m"] and dp.signature("m") is None and wakers["m"].budget_s == 30.0
        assert watcher.applied_generation == store.generation() and asked == [1]  # the sleep applied: reported at once
        held = asyncio.create_task(wakers["m"].wait(None))  # what the pipeline does with the Asleep error
        await asyncio.sleep(0.05)
        assert not held.done() and asked == [1, 1] and wakers["m"].waiting == 1  # the demand, reported at once
        del leader_wakers["m"]  # the leader loaded it again
        assert await publisher.publish_once() == 1 and "wake_budget_s" not in store.all()["m"]
        await watcher.sync()
        await asyncio.wait_for(held, 5)  # the held request goes on
        assert dp.signature("m") is not None and "m" not in wakers and dp.router.routes == {"m": "1"}

    asyncio.run(scenario())


def test_a_held_request_past_the_budget_gets_model_not_ready(engine):
    store = DesiredStateStore(engine)
    store.publish({"m": {"live": "1", "split": None, "wake_budget_s": 0.05}})

    async def scenario():
        dp = _TableDataPlane({"m": {"1"}}, {"m": {"1"}})
        wakers: dict = {}
        watcher = StateWatcher(dp, store, str(engine.url), poll_s=0.01, wakers=wakers)
        await watcher.sync()
        with pytest.raises(ModelNotReady) as refused:
            await wakers["m"].wait(None)
        assert refused.value.retry_after_s >= 1.0
        assert watcher.wanted == {"m"}  # the refused caller's wake still stands: the leader sees the demand
        reporter = SignalReporter(_Sampler({}, {}), engine, "frontend-b", wanted=watcher.wanted)
        assert [(r["model"], r["held"]) for r in reporter.collect()] == [("", 0.0), ("m", 1.0)]  # "": the process's own row

    asyncio.run(scenario())


def test_the_leader_knows_which_processes_have_not_applied_a_generation(engine):
    now = [1000.0]
    applied = {"worker-1": 7, "worker-2": 5, "idle": 7}
    for name, generation in applied.items():  # "idle" serves no model: its process row still says what it applied
        sampler = _Sampler({"m": Sample(t=1.0)} if name != "idle" else {}, {})
        reporter = SignalReporter(sampler, engine, name, clock=lambda: now[0], applied=lambda g=generation: g)
        reporter.write(reporter.collect())
    peers = SignalPeers(engine, own="leader", clock=lambda: now[0])
    assert peers.lagging(7) == ["worker-2"] and peers.lagging(5) == []
    assert peers.lagging(8) == ["idle", "worker-1", "worker-2"]
    assert set(peers.read()) == {"m"}  # the process rows are no model's load
    now[0] += 5.0
    assert peers.lagging(8) == []  # gone quiet: not waited for


async def test_a_nudge_reports_at_once_and_a_failed_write_only_waits_for_the_next_report(engine, caplog):
    """The reporters' one loop (ProcessReporter.run): the hour-long interval never passes here."""
    reporter = SignalReporter(_Sampler({}, {"m": 1}), engine, "worker-9", every_s=3600.0)
    peers = SignalPeers(engine, own="leader", stale_s=1e9)
    written, loop = asyncio.Event(), asyncio.get_running_loop()
    failing = [True]
    real_write = reporter.write

    def write(rows):  # runs in a worker thread: the event is set on the loop
        try:
            if failing[0]:
                failing[0] = False
                raise ConnectionError("the database is away")
            real_write(rows)
        finally:
            loop.call_soon_threadsafe(written.set)

    reporter.write = write
    task = asyncio.create_task(reporter.run())
    try:
        for _ in range(2):  # the first write fails, the second lands
            written.clear()
            reporter.nudge()
            await asyncio.wait_for(written.wait(), 30)
        assert "reporting load signals failed: the database is away" in caplog.text
        assert peers.read()["m"].held == 1.0
    finally:
        task.cancel()
