"""Desired state across processes (issue 27) on real SQLite and PostgreSQL: generations, the leader
lease (row lease and advisory lock), the watcher applying rows to a router, the publisher's diff."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from server import migrations
from server.control.service.desired_state import DesiredStateStore, changes, route_snapshot
from server.control.service.leader import Leadership, LeaderDirectory, PostgresLease, RowLease
from server.control.service.state_watch import StatePublisher, StateWatcher
from server.db import make_engine
from server.dataplane.routing import Router, Split
from server.dataplane.traffic_policy import Arm, sticky_arm
from tests.conftest import fresh_postgres_database

def _database(kind: str, tmp_path):
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/state.db"
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service("postgresql"))])
def db_url(request, tmp_path):
    yield from _database(request.param, tmp_path)


@pytest.fixture
def pg_url(tmp_path):
    yield from _database("postgresql", tmp_path)


@pytest.fixture
def engine(db_url):
    engine = make_engine(db_url)
    migrations.upgrade(engine)
    yield engine
    engine.dispose()


def test_generations_grow_per_change_and_since_returns_only_newer(engine):
    store = DesiredStateStore(engine)
    assert store.generation() == 0
    first = store.publish({"a": {"live": "1", "split": None}, "b": {"live": "3", "split": None}})
    assert first == 2 and store.generation() == 2
    store.publish({"a": {"live": "2", "split": None}})
    rows = store.since(first)
    assert [(r["endpoint"], r["generation"], r["live"]) for r in rows] == [("a", 3, "2")]
    assert store.all() == {"a": {"live": "2", "split": None}, "b": {"live": "3", "split": None}}


def test_changes_publish_differences_and_departures():
    published = {"a": {"live": "1", "split": None}, "b": {"live": "2", "split": None}}
    now = {"a": {"live": "1", "split": None}, "c": {"live": "5", "split": None}}
    assert changes(published, now) == {"c": {"live": "5", "split": None}, "b": {"live": None, "split": None}}
    assert changes(now, now) == {}


def test_row_lease_one_holder_until_it_lapses(engine):
    now = [1000.0]
    a = RowLease(engine, "a", "127.0.0.1:1", ttl_s=6.0, clock=lambda: now[0])
    b = RowLease(engine, "b", "127.0.0.1:2", ttl_s=6.0, clock=lambda: now[0])
    assert a._try() and not b._try()
    directory = LeaderDirectory(engine, clock=lambda: now[0])
    assert asyncio.run(directory.address()) == "127.0.0.1:1"
    now[0] += 5.0
    assert a._renew() and not b._try()  # renewed: b still waits
    now[0] += 7.0  # a died: its lease lapsed
    assert asyncio.run(directory.address(fresh=True)) is None
    assert b._try() and b.term == a.term + 1
    assert not a._renew()  # the old holder learns it lost
    assert asyncio.run(directory.address(fresh=True)) == "127.0.0.1:2"


@pytest.mark.service("postgresql")
def test_postgres_advisory_lock_lapses_with_its_session(pg_url):
    engine = make_engine(pg_url)
    migrations.upgrade(engine)
    db_url = pg_url

    async def scenario():
        a = PostgresLease(engine, db_url, "a", "127.0.0.1:1")
        b = PostgresLease(engine, db_url, "b", "127.0.0.1:2")
        assert await a.acquire()
        assert not await b.acquire()
        assert await a.renew()
        assert await LeaderDirectory(engine).address() == "127.0.0.1:1"
        await a._conn.close()  # what a kill -9 does to the session
        assert not await a.renew()
        for _ in range(200):  # the server ends the closed session (and drops its lock) a moment later
            if await b.acquire():
                break
            await asyncio.sleep(0.01)
        assert b._conn is not None and await b.renew()
        assert await LeaderDirectory(engine).address() == "127.0.0.1:2"
        await b.release()

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()


def test_leadership_hands_over_when_the_leader_stops_renewing(engine):
    async def scenario():
        events = []
        now = [1000.0]

        def lease(name):
            return RowLease(engine, name, name, ttl_s=0.4, clock=lambda: now[0])

        async def noop():
            return None

        a = Leadership(lease("a"), lambda: _note(events, "a leads"), lambda: _note(events, "a lost"), retry_s=0.01)
        b = Leadership(lease("b"), lambda: _note(events, "b leads"), noop, retry_s=0.01)
        assert await a.try_once()
        task_b = asyncio.create_task(b.run())
        await asyncio.sleep(0.2)  # b tries again and again
        assert not b.leading  # a's lease has not run out (its clock stands still)
        now[0] += 1.0  # a stopped renewing and its ttl passed
        for _ in range(500):
            if b.leading:
                break
            await asyncio.sleep(0.01)
        assert b.leading and events == ["a leads", "b leads"]
        task_b.cancel()

    asyncio.run(scenario())


async def _note(events, what):
    events.append(what)


class _FakeDataPlane:
    """The router and the model table a watcher touches (a unit test of the apply logic)."""

    def __init__(self, ready: dict[str, set[str]], triton: dict[str, set[str]]):
        self.router = Router({})
        self._ready = ready
        self._triton = triton  # what a refresh would read from Triton
        self.refreshed: list[str] = []

    def ready_versions(self, name):
        return frozenset(self._ready.get(name, ()))

    def is_loaded(self, name):
        return name in self._ready

    async def refresh(self, name):
        self.refreshed.append(name)
        self._ready[name] = set(self._triton.get(name, ()))

    adopt = refresh

    def set_live(self, name, version):
        self.router.routes[name] = version

    async def backend_infer(self, raw, timeout=None):  # where shadow copies go (none are offered here)
        raise AssertionError("no copy is offered in these tests")


def test_watcher_applies_live_and_split_and_waits_for_versions_triton_lacks(engine):
    store = DesiredStateStore(engine)
    split = {"kind": "canary", "arms": [["stable", "1", 90.0], ["canary", "2", 10.0]], "key_header": "", "salt": "canary:m:2", "window_s": 30.0}
    store.publish({"m": {"live": "1", "split": split}, "n": {"live": "7", "split": None}})
    dp = _FakeDataPlane({"m": {"1"}}, {"m": {"1", "2"}, "n": set()})
    watcher = StateWatcher(dp, store, str(engine.url))
    asyncio.run(watcher.sync())
    assert dp.router.routes == {"m": "1"} and dp.router.splits["m"].kind == "canary"
    assert [(a.name, a.version, a.weight) for a in dp.router.splits["m"].arms] == [("stable", "1", 90.0), ("canary", "2", 10.0)]
    assert "n" in watcher.pending  # version 7 is not ready on this process's Triton yet
    dp._triton["n"] = {"7"}
    asyncio.run(watcher.sync())
    assert dp.router.routes["n"] == "7" and not watcher.pending
    before = dp.router.splits["m"]
    store.publish({"m": {"live": "1", "split": dict(split, arms=[["stable", "1", 50.0], ["canary", "2", 50.0]])}})
    asyncio.run(watcher.sync())
    after = dp.router.splits["m"]
    assert after.windows is before.windows and [a.weight for a in after.arms] == [50.0, 50.0]  # reweighted, metrics kept
    store.publish({"m": {"live": "2", "split": None}})
    asyncio.run(watcher.sync())
    assert dp.router.routes["m"] == "2" and "m" not in dp.router.splits


def test_publisher_writes_what_the_router_switched(engine):
    store = DesiredStateStore(engine)
    router = Router({"m": "1"})

    async def scenario():
        publisher = StatePublisher(router, store)
        publisher._published = store.all()
        assert await publisher.publish_once() == 1
        assert await publisher.publish_once() == 0  # nothing changed
        router.splits["m"] = Split("ab", [Arm("a", "1", 1.0), Arm("b", "2", 1.0)], "x-user", "exp1")
        router.routes["m"] = "1"
        assert await publisher.publish_once() == 1
        row = store.all()["m"]
        assert row["live"] == "1" and row["split"]["salt"] == "exp1" and row["split"]["key_header"] == "x-user"
        del router.routes["m"], router.splits["m"]
        assert await publisher.publish_once() == 1
        assert store.all()["m"] == {"live": None, "split": None}

    asyncio.run(scenario())
    assert route_snapshot(Router({})) == {}


def test_sticky_arm_is_a_pure_function_of_key_and_experiment():
    arms = [Arm("a", "1", 1.0), Arm("b", "2", 1.0)]
    picks = {key: sticky_arm(key, arms, "exp1").name for key in (f"user-{i}" for i in range(200))}
    again = {key: sticky_arm(key, list(arms), "exp1").name for key in picks}  # another process, same inputs
    assert picks == again and set(picks.values()) == {"a", "b"}
    assert any(sticky_arm(k, arms, "exp2").name != v for k, v in picks.items())  # the experiment salts the hash


def test_arm_outcomes_of_other_processes_reach_the_leaders_windows(engine):
    """Two frontends observe a canary; the leader (who serves none of it) sees both in its windows."""
    from server.control.rollout.arm_reports import ArmCollector, ArmReporter

    def canary():
        return Split("canary", [Arm("stable", "1", 90.0), Arm("canary", "2", 10.0)], "", "canary:m:2", 60.0)

    leader, front_a, front_b = Router({"m": "1"}), Router({"m": "1"}), Router({"m": "1"})
    for router in (leader, front_a, front_b):
        router.splits["m"] = canary()
    collector = ArmCollector(leader, engine)
    assert collector._read() == []  # a new leader starts from now
    for router, errors in ((front_a, 3), (front_b, 5)):
        for i in range(10):
            router.splits["m"].windows["canary"].add(0.01, i < errors)
            router.splits["m"].totals["canary"].add(0.01, i < errors)
        reporter = ArmReporter(router, engine, f"front-{errors}")
        reporter.write(reporter.collect())
        assert reporter.collect() == []  # reported once
    assert collector.apply(collector._read()) == 2
    stats = leader.splits["m"].window("canary")
    assert (stats.requests, stats.errors) == (20, 8)
    leader.splits["m"] = Split("canary", [Arm("stable", "1", 90.0), Arm("canary", "3", 10.0)], "", "canary:m:3", 60.0)
    front_a.splits["m"].totals["canary"].add(0.02, True)
    reporter = ArmReporter(front_a, engine, "front-late")
    reporter.write(reporter.collect())
    assert collector.apply(collector._read()) == 0  # a report of the ended split is dropped


def _experiment(salt: str = "exp") -> Split:
    return Split("ab", [Arm("control", "1", 1.0), Arm("treatment", "2", 1.0)], "", salt, 60.0)


def _answered(router, ids_arms, code: str = "OK") -> None:
    for request_id, arm in ids_arms:
        router.observe("m", arm, code, 0.01, SimpleNamespace(id=request_id), None, None, None)


def test_request_ids_of_other_processes_reach_the_leaders_split_once_and_bounded(engine, monkeypatch):
    """A front's report carries the ids it answered since its last report (per arm, in order, each once); the
    leader's split learns them within its bound; a report of another experiment brings none."""
    from server.control.rollout.arm_reports import ArmCollector, ArmReporter
    from server.dataplane import routing

    leader, front = Router({"m": "1"}), Router({"m": "1"})
    leader.splits["m"], front.splits["m"] = _experiment(), _experiment()
    collector = ArmCollector(leader, engine)
    collector._read()  # a new leader starts from now
    reporter = ArmReporter(front, engine, "front-a")
    _answered(front, [("r0", "control"), ("r1", "treatment"), ("r2", "control")])
    _answered(front, [("r3", "treatment")], code="RESOURCE_EXHAUSTED")  # not an arm's outcome, still an answered id
    rows = reporter.collect()
    assert {r["arm"]: (r["outcomes"]["requests"], r["outcomes"]["request_ids"]) for r in rows} == {
        "control": (2, ["r0", "r2"]), "treatment": (1, ["r1", "r3"])}
    assert reporter.collect() == []  # each id once
    _answered(front, [("r4", "control")])
    assert [(r["arm"], r["outcomes"]["request_ids"]) for r in reporter.collect()] == [("control", ["r4"])]
    reporter.write(rows)
    assert leader.splits["m"].request_arms == {}
    assert collector.apply(collector._read()) == 2
    assert dict(leader.splits["m"].request_arms) == {"r0": "control", "r2": "control", "r1": "treatment", "r3": "treatment"}
    assert leader.splits["m"].totals["treatment"].requests == 1

    leader.splits["m"] = _experiment("exp2")  # the experiment ended, another began
    _answered(front, [("r5", "control")])
    reporter.write(reporter.collect())
    assert collector.apply(collector._read()) == 0 and leader.splits["m"].request_arms == {}

    monkeypatch.setattr(routing, "MAX_FEEDBACK_IDS", 3)
    leader.splits["m"], front.splits["m"] = _experiment("exp2"), _experiment("exp2")
    _answered(front, [(f"b{i}", "control") for i in range(5)])
    rows = reporter.collect()
    assert [r["outcomes"]["request_ids"] for r in rows] == [["b2", "b3", "b4"]]  # a report's bound: the newest kept
    leader.splits["m"].remember("old", "treatment")
    reporter.write(rows)
    asyncio.run(_read_twice_at_once(collector))
    assert list(leader.splits["m"].request_arms) == ["b2", "b3", "b4"]  # the leader's bound: its oldest id forgotten
    assert leader.splits["m"].totals["control"].requests == 5  # two reads at once absorb a report once


async def _read_twice_at_once(collector) -> None:
    await asyncio.gather(collector.read_now(), collector.read_now())


def test_a_feedback_waits_for_the_report_of_its_request_then_refuses(engine):
    """The leader's feedback for an id a report brings in during the wait is recorded with its arm (once); an id
    no report brings is refused after the wait, once the reports were read again."""
    from server.control.rollout.arm_reports import ArmCollector, ArmReporter, after_reports
    from server.dataplane.routing import UnknownRequest
    from server.errors import ModelNotFound

    leader, front = Router({"m": "1"}), Router({"m": "1"})
    leader.splits["m"], front.splits["m"] = _experiment(), _experiment()
    collector = ArmCollector(leader, engine)
    collector._read()
    reads = []
    read = collector._read
    collector._read = lambda: reads.append(1) or read()
    reporter = ArmReporter(front, engine, "front-b")
    _answered(front, [("late", "treatment")])

    async def run():
        waiting = asyncio.create_task(after_reports(lambda: leader.feedback("m", "late", 1.0), collector, wait_s=60.0, poll_s=0.01))
        for _ in range(1000):  # until the feedback has read the reports once and not found its id
            if reads:
                break
            await asyncio.sleep(0.01)
        assert reads and not waiting.done()
        await asyncio.to_thread(reporter.write, reporter.collect())  # the front reports after the outcome was sent
        arm = await asyncio.wait_for(waiting, 30)
        before = len(reads)
        ticks = iter(range(100))
        with pytest.raises(UnknownRequest):  # one outcome per request
            await after_reports(lambda: leader.feedback("m", "late", 0.0), collector, wait_s=3.0, poll_s=0.0, clock=lambda: next(ticks))
        refused_after = len(reads)
        with pytest.raises(ModelNotFound):
            await after_reports(lambda: leader.feedback("m", "never", 1.0), None)  # nothing reports here: at once
        assert len(reads) == refused_after
        return arm, refused_after - before

    arm, reread = asyncio.run(run())
    assert arm == "treatment" and leader.splits["m"].totals["treatment"].outcomes == [1.0]
    assert reread >= 2  # the refused one read the reports again while it waited (clock: 3 ticks)


def test_the_shadow_is_published_and_applied_like_a_split(engine):
    """The leader's shadow reaches a follower's router (copies start there); the same key keeps its counts,
    a new key starts afresh, none stops the copies."""
    from server.dataplane.routing import Shadow

    store = DesiredStateStore(engine)
    leader = Router({"m": "1"})
    leader.shadows["m"] = Shadow("2", 25.0, key="shadow:m:7")
    assert route_snapshot(leader)["m"]["shadow"] == {"version": "2", "percent": 25.0, "key": "shadow:m:7"}
    dp = _FakeDataPlane({"m": {"1"}}, {"m": {"1", "2"}})

    async def scenario():
        publisher = StatePublisher(leader, store)
        assert await publisher.publish_once() == 1
        watcher = StateWatcher(dp, store, str(engine.url))
        await watcher.sync()
        copy = dp.router.shadows["m"]
        tasks = list(copy.tasks)
        assert (copy.version, copy.percent, copy.key, len(copy.tasks)) == ("2", 25.0, "shadow:m:7", 2)
        assert "2" in dp.ready_versions("m")  # the shadow's version was read from Triton before it was applied
        copy.stats.compared = 4
        leader.shadows["m"].percent = 50.0
        await publisher.publish_once()
        await watcher.sync()
        assert dp.router.shadows["m"] is copy and copy.percent == 50.0 and copy.stats.compared == 4
        leader.shadows["m"] = Shadow("2", 50.0, key="shadow:m:8")  # a new shadow policy of the same version
        await publisher.publish_once()
        await watcher.sync()
        assert dp.router.shadows["m"].key == "shadow:m:8" and dp.router.shadows["m"].stats.compared == 0
        assert tasks and all(t.done() for t in tasks)  # the old copies stopped
        del leader.shadows["m"]
        await publisher.publish_once()
        assert "shadow" not in store.all()["m"]
        await watcher.sync()
        assert "m" not in dp.router.shadows and dp.router.routes == {"m": "1"}

    asyncio.run(scenario())


def test_shadow_comparisons_of_other_processes_are_summed_by_shadow_key(engine):
    from server.control.rollout.shadow_reports import ShadowPeers, ShadowReporter, summed
    from server.dataplane.routing import Shadow, ShadowStats

    peers = ShadowPeers(engine)
    for reporter, compared in (("front-a", 3), ("front-b", 5)):
        router = Router({"m": "1"})
        router.shadows["m"] = shadow = Shadow("2", 100.0, key="shadow:m:1")
        shadow.stats = ShadowStats(sent=compared, compared=compared, agreed=compared - 1, abs_diff_sum=0.5, abs_diff_count=compared,
                                   latency_deltas=[0.001] * compared)  # fmt: skip
        reporter = ShadowReporter(router, engine, reporter)
        reporter.write(reporter.collect())
        assert reporter.collect() == []  # nothing moved since
        reporter._failed()  # a write that failed: the same cumulative counts go again
        assert [r["stats"]["compared"] for r in reporter.collect()] == [compared]
        shadow.stats.sent += 1
        shadow.stats.compared += 1
        reporter.write(reporter.collect())  # replaces this process's row: counts are cumulative, never added twice
    old = Router({"m": "1"})
    old.shadows["m"] = Shadow("2", 100.0, key="shadow:m:0")  # an earlier shadow of the same endpoint
    old.shadows["m"].stats.compared = 100
    ShadowReporter(old, engine, "front-a").write(ShadowReporter(old, engine, "front-a").collect())
    leader_own = ShadowStats(sent=2, compared=2, agreed=2)
    total = summed(leader_own, peers.reported("m", "shadow:m:1"))
    assert (total.sent, total.compared, total.agreed, total.abs_diff_count, len(total.latency_deltas)) == (12, 12, 8, 8, 8)
    assert total.as_dict()["mean_abs_diff"] == pytest.approx(1.0 / 8)
    assert leader_own.compared == 2  # the leader's own counts are not changed by a report
    assert peers.reported("m", "shadow:m:9") == []
